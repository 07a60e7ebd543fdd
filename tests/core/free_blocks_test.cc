// The caching allocators' bookkeeping (src/core/free_blocks.h) on fake address ranges: FreeBlocks'
// best fit, cuts and joins; SegmentCache, the CUDA allocator's policy, with a fake backend that
// hands out segments back to back (so that a join across segments would show); and SegmentPool,
// the CUDA allocator's per-GPU pool, on a fake device of limited memory: its out-of-memory paths,
// its error, and that the device calls run without its lock while other threads use the pool.
#include "core/free_blocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain::detail {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Addresses that are never dereferenced.
char* at(uintptr_t offset) { return reinterpret_cast<char*>((uintptr_t{1} << 40) + offset); }

TEST(FreeBlocks, TakesTheSmallestRangeThatHoldsTheRequest) {
  FreeBlocks f;
  f.put(at(0), 100);
  f.put(at(1000), 300);
  f.put(at(2000), 200);
  f.put(at(3000), 200);
  EXPECT_EQ(f.count(), 4u);
  EXPECT_EQ(f.bytes(), 800u);
  EXPECT_EQ(f.largest(), 300u);
  FreeBlocks::Block b = f.take(150, 1000);  // 200 at 2000 and 3000: the lower address
  EXPECT_EQ(b.ptr, at(2000));
  EXPECT_EQ(b.size, 200u);  // the 50 left is under min_rest: handed out with the request
  b = f.take(250, 1000);
  EXPECT_EQ(b.ptr, at(1000));
  EXPECT_EQ(f.take(301, 0).ptr, nullptr);  // none holds it
  EXPECT_EQ(f.take(0, 0).ptr, nullptr);
  EXPECT_EQ(f.bytes(), 300u);
}

TEST(FreeBlocks, ACutLeavesTheRestFreeAndTheRangeJoinsAgainInAnyOrder) {
  for (int order = 0; order < 6; ++order) {
    FreeBlocks f;
    f.put(at(0), 100);
    std::vector<FreeBlocks::Block> parts;
    for (size_t n : {30, 45}) {
      parts.push_back(f.take(n, 10));
      EXPECT_EQ(parts.back().size, n);
    }
    EXPECT_EQ(parts[0].ptr, at(0));
    EXPECT_EQ(parts[1].ptr, at(30));
    EXPECT_EQ(f.bytes(), 25u);  // the rest, at 75
    parts.push_back(f.take(25, 10));
    EXPECT_EQ(parts.back().ptr, at(75));
    EXPECT_EQ(f.count(), 0u);
    std::vector<int> idx = {0, 1, 2};
    for (int k = 0; k < order; ++k) std::next_permutation(idx.begin(), idx.end());
    for (int i : idx) f.put(parts[static_cast<size_t>(i)].ptr, parts[static_cast<size_t>(i)].size);
    EXPECT_EQ(f.count(), 1u) << "order " << order;
    EXPECT_EQ(f.largest(), 100u);
    EXPECT_EQ(f.take(100, 0).ptr, at(0));
  }
}

TEST(FreeBlocks, RangesOfTwoSegmentsNeverJoin) {
  FreeBlocks f;
  f.put(at(0), 50, 1);
  f.put(at(50), 50, 2);  // touches the first, another segment
  f.put(at(100), 50, 2);
  EXPECT_EQ(f.count(), 2u);
  EXPECT_EQ(f.largest(), 100u);
  EXPECT_EQ(f.take(100, 0).ptr, at(50));
  EXPECT_EQ(f.take(60, 0).ptr, nullptr);
  FreeBlocks h;  // freed right before a range of another segment
  h.put(at(100), 50, 2);
  h.put(at(50), 50, 1);
  EXPECT_EQ(h.count(), 2u);
  EXPECT_EQ(h.largest(), 50u);
  // A cut keeps the segment: the rest does not join the other segment's range either.
  FreeBlocks g;
  g.put(at(0), 100, 1);
  const FreeBlocks::Block b = g.take(40, 1);
  EXPECT_EQ(b.segment, 1u);
  g.put(at(100), 100, 2);
  EXPECT_EQ(g.count(), 2u);
  g.put(b.ptr, b.size, b.segment);
  EXPECT_EQ(g.count(), 2u);
  EXPECT_EQ(g.largest(), 100u);
}

TEST(FreeBlocks, FreeingAFreeRangeIsCaught) {
  FreeBlocks f;
  f.put(at(100), 100);
  EXPECT_THROW(f.put(at(100), 10), Internal);
  EXPECT_THROW(f.put(at(150), 10), Internal);
  EXPECT_THROW(f.put(at(90), 20), Internal);
  f.put(at(300), 100);
  EXPECT_THROW(f.put(at(150), 150), Internal);  // touches the next, overlaps the one before
  EXPECT_EQ(f.largest(), 100u);                 // neither was touched
  EXPECT_EQ(f.count(), 2u);
  EXPECT_EQ(f.bytes(), 200u);
  f.clear();
  f.put(at(100), 100);
  EXPECT_EQ(f.count(), 1u);
  EXPECT_EQ(f.bytes(), 100u);
}

// Random takes and puts on one arena against a map of what is in use: blocks handed out never
// overlap each other, the free bytes add up, and once all is returned the arena is one range.
TEST(FreeBlocks, RandomTakesAndPutsKeepTheArenaWhole) {
  constexpr size_t kArena = 1 << 20;
  std::mt19937 rng(7);
  FreeBlocks f;
  f.put(at(0), kArena);
  std::map<char*, size_t> used;
  size_t used_bytes = 0;
  for (int step = 0; step < 20000; ++step) {
    if (used.empty() || rng() % 2) {
      const size_t n = 1 + rng() % 20000;
      const FreeBlocks::Block b = f.take(n, 64);
      if (!b.ptr) {
        EXPECT_LT(f.largest(), n);
        continue;
      }
      EXPECT_GE(b.size, n);
      EXPECT_LT(b.size, n + 64);
      auto next = used.lower_bound(b.ptr);
      if (next != used.end()) {
        EXPECT_LE(b.ptr + b.size, next->first);
      }
      if (next != used.begin()) {
        EXPECT_LE(std::prev(next)->first + std::prev(next)->second, b.ptr);
      }
      used.emplace(b.ptr, b.size);
      used_bytes += b.size;
    } else {
      auto it = used.begin();
      std::advance(it, static_cast<long>(rng() % used.size()));
      f.put(it->first, it->second);
      used_bytes -= it->second;
      used.erase(it);
    }
    ASSERT_EQ(f.bytes() + used_bytes, kArena);
  }
  for (const auto& [p, n] : used) f.put(p, n);
  EXPECT_EQ(f.count(), 1u);
  EXPECT_EQ(f.largest(), kArena);
}

// A backend that places each segment right after the one before.
struct FakeDevice {
  uintptr_t next = 0;
  char* malloc(size_t n) {
    char* p = at(next);
    next += n;
    return p;
  }
  // take(), and on a miss a new segment, as the CUDA allocator does.
  SegmentCache::Block allocate(SegmentCache& cache, size_t n) {
    SegmentCache::Block b = cache.take(n);
    if (b.ptr) return b;
    const size_t size = cache.segment_size(n);
    cache.add_segment(malloc(size), size, n);
    return cache.take(n);
  }
};

TEST(SegmentCache, SmallRequestsShareTwoMiBSegmentsAndLargeOnesRegions) {
  FakeDevice dev;
  SegmentCache cache;
  EXPECT_EQ(SegmentCache::round(0), 512u);
  EXPECT_EQ(SegmentCache::round(513), 1024u);
  EXPECT_EQ(cache.segment_size(1000), 2 * kMiB);
  EXPECT_EQ(cache.segment_size(kMiB), 2 * kMiB);
  EXPECT_EQ(cache.segment_size(kMiB + 1), 64 * kMiB);       // the least region
  EXPECT_EQ(cache.segment_size(40 * kMiB + 1), 82 * kMiB);  // twice, rounded up to 2 MiB
  EXPECT_EQ(SegmentCache::exact_segment_size(kMiB + 1), 2 * kMiB);
  EXPECT_EQ(SegmentCache::exact_segment_size(10 * kMiB + 1), 12 * kMiB);
  std::vector<SegmentCache::Block> small;
  for (int i = 0; i < 8; ++i) small.push_back(dev.allocate(cache, 512000));  // 4 to a segment
  EXPECT_EQ(cache.segments(), 2u);
  EXPECT_EQ(cache.reserved(), 4 * kMiB);
  for (const auto& b : small) {
    EXPECT_EQ(b.size, 512000u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.ptr) % 512, 0u);
  }
  EXPECT_EQ(cache.cached(), 2 * (2 * kMiB - 4 * 512000));  // each segment's tail
  // 2.5 MiB: a 64 MiB region, cut; the 61.5 MiB left serves large requests, not small ones.
  const SegmentCache::Block big = dev.allocate(cache, 5 * kMiB / 2);
  EXPECT_EQ(big.size, 5 * kMiB / 2);
  EXPECT_EQ(cache.reserved(), 68 * kMiB);
  EXPECT_EQ(cache.take(900 * 1024).ptr, nullptr);
  const SegmentCache::Block next = cache.take(1200 * 1024);
  EXPECT_EQ(static_cast<char*>(next.ptr), static_cast<char*>(big.ptr) + big.size);
  EXPECT_EQ(next.size, 1200u * 1024);
  // Under 1 MiB is never cut off a large block: the 61,776 KiB left goes whole to a request of
  // 61,264 KiB.
  const SegmentCache::Block rest = cache.take(61264 * 1024);
  EXPECT_EQ(static_cast<char*>(rest.ptr), static_cast<char*>(next.ptr) + next.size);
  EXPECT_EQ(rest.size, 61776u * 1024);
  EXPECT_EQ(cache.reserved(), 68 * kMiB);
  // The next region: twice the largest request so far (61,264 KiB), rounded up to 2 MiB.
  EXPECT_EQ(cache.segment_size(5 * kMiB), 120 * kMiB);
  const SegmentCache::Block more = dev.allocate(cache, 5 * kMiB + 1);
  EXPECT_EQ(more.size, 5 * kMiB + 512);
  EXPECT_EQ(cache.reserved(), 188 * kMiB);
  EXPECT_EQ(cache.peak_reserved(), 188 * kMiB);
}

TEST(SegmentCache, PyTorchsPolicyGivesLargeRequestsSegmentsOfTheirOwn) {
  const SegmentCache torch(SegmentCache::Policy::kPyTorch);
  EXPECT_EQ(torch.segment_size(kMiB), 2 * kMiB);
  EXPECT_EQ(torch.segment_size(kMiB + 1), 20 * kMiB);
  EXPECT_EQ(torch.segment_size(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(torch.segment_size(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(torch.segment_size(10 * kMiB + 1), 12 * kMiB);
}

// What the change is for: blocks freed by one pass serve the next pass's requests of other
// (smaller) sizes, where per-size buckets asked the device for new memory for every new size.
TEST(SegmentCache, BlocksFreedByOnePassServeTheNextPassesOtherSizes) {
  FakeDevice dev;
  SegmentCache cache;
  std::vector<SegmentCache::Block> forward;
  for (size_t mb : {96, 96, 48, 48, 24, 24, 12}) forward.push_back(dev.allocate(cache, mb * kMiB));
  // A 192 MiB region (twice 96) holds both 96s; the next, 192 MiB again, the rest (156 MiB).
  EXPECT_EQ(cache.segments(), 2u);
  const size_t reserved = cache.reserved();
  EXPECT_EQ(reserved, 384 * kMiB);
  for (const auto& b : forward) cache.put(b.ptr, b.size);
  EXPECT_EQ(cache.cached(), reserved);
  std::vector<SegmentCache::Block> backward;  // other sizes, the largest larger than any freed
  for (size_t kb : {150000, 90000, 70000, 45000, 11000, 9000, 5000})
    backward.push_back(dev.allocate(cache, kb * 1024));
  EXPECT_EQ(cache.reserved(), reserved);  // no new segment: the freed blocks joined
  for (const auto& b : backward) cache.put(b.ptr, b.size);
  EXPECT_EQ(cache.take_free_segments().size(), 2u);  // each whole again
  EXPECT_EQ(cache.reserved(), 0u);
  EXPECT_EQ(cache.cached(), 0u);
  EXPECT_EQ(cache.peak_reserved(), reserved);
}

// Segments placed back to back by the backend are still freed one by one: a request larger than
// each is never served by two of them joined, and only wholly free segments are given back.
TEST(SegmentCache, SegmentsNeverJoinAndOnlyWhollyFreeOnesAreGivenBack) {
  FakeDevice dev;
  SegmentCache cache;
  const SegmentCache::Block a = dev.allocate(cache, 100 * kMiB);  // a 200 MiB region
  const SegmentCache::Block b = dev.allocate(cache, 150 * kMiB);  // no room: a 300 MiB one
  ASSERT_EQ(cache.segments(), 2u);
  ASSERT_EQ(static_cast<char*>(a.ptr) + 200 * kMiB, b.ptr);  // adjacent
  cache.put(a.ptr, a.size);
  cache.put(b.ptr, b.size);
  EXPECT_EQ(cache.take(400 * kMiB).ptr, nullptr);
  const SegmentCache::Block c = cache.take(150 * kMiB);  // cuts the 200 MiB one: the best fit
  EXPECT_EQ(c.ptr, a.ptr);
  std::vector<SegmentCache::Block> freed = cache.take_free_segments();
  ASSERT_EQ(freed.size(), 1u);  // b's; a's is in part in use
  EXPECT_EQ(freed[0].ptr, b.ptr);
  EXPECT_EQ(freed[0].size, 300 * kMiB);
  EXPECT_EQ(cache.reserved(), 200 * kMiB);
  cache.put(c.ptr, c.size);
  freed = cache.take_free_segments();
  ASSERT_EQ(freed.size(), 1u);
  EXPECT_EQ(freed[0].ptr, a.ptr);
  EXPECT_EQ(cache.segments(), 0u);
  // A block outside every segment is a bug, caught.
  EXPECT_THROW(cache.put(a.ptr, 512), Internal);
}

// --- SegmentPool on a fake device ---

// A device of `capacity` bytes whose addresses are never dereferenced: segments are placed back to
// back, and every call is logged ("malloc N", "malloc N failed", "sync", "free N"). `during_call`,
// when set, runs inside each device call (as another thread would while the call blocks).
class FakeGpu final : public SegmentPool::Backend {
 public:
  explicit FakeGpu(size_t capacity) : capacity_(capacity) {}

  void* allocate(size_t bytes) override {
    hook();
    synced() = false;
    std::lock_guard<std::mutex> lock(mu_);
    if (throw_next_) {
      throw_next_ = false;
      throw Internal("the fake device failed");
    }
    if (used_ + bytes > capacity_) {
      log_.push_back("malloc " + std::to_string(bytes) + " failed");
      return nullptr;
    }
    char* p = at(next_);
    next_ += bytes;
    used_ += bytes;
    live_[p] = bytes;
    log_.push_back("malloc " + std::to_string(bytes));
    return p;
  }
  void synchronize() override {
    hook();
    synced() = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_sync_) {
      fail_sync_ = false;
      throw Internal("the fake device's synchronize failed");
    }
    log_.push_back("sync");
  }
  void free(void* ptr) override {
    hook();
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_free_) {
      fail_free_ = false;
      throw Internal("the fake device's free failed");
    }
    auto it = live_.find(static_cast<char*>(ptr));
    if (it == live_.end()) {
      ADD_FAILURE() << "free of a pointer the device did not hand out";
      return;
    }
    if (!synced()) ADD_FAILURE() << "free without a synchronize before it";
    used_ -= it->second;
    log_.push_back("free " + std::to_string(it->second));
    live_.erase(it);
  }
  std::pair<size_t, size_t> memory_info() override {
    std::lock_guard<std::mutex> lock(mu_);
    return {capacity_ - used_, capacity_};
  }

  std::vector<std::string> log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  void clear_log() {
    std::lock_guard<std::mutex> lock(mu_);
    log_.clear();
  }
  size_t used() {
    std::lock_guard<std::mutex> lock(mu_);
    return used_;
  }
  void throw_next() {
    std::lock_guard<std::mutex> lock(mu_);
    throw_next_ = true;
  }
  void fail_next_sync() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_sync_ = true;
  }
  void fail_next_free() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_free_ = true;
  }
  std::function<void()> during_call;

 private:
  void hook() {
    if (during_call) during_call();
  }
  // Whether this thread's last device call before a free was a synchronize.
  static bool& synced() {
    thread_local bool s = false;
    return s;
  }
  std::mutex mu_;
  const size_t capacity_;
  size_t used_ = 0;
  uintptr_t next_ = 0;
  bool throw_next_ = false, fail_sync_ = false, fail_free_ = false;
  std::map<char*, size_t> live_;
  std::vector<std::string> log_;
};

std::string mib(size_t n) { return std::to_string(n * kMiB); }

TEST(SegmentPool, ARegionThatDoesNotFitFallsBackToTheRequestsOwnSize) {
  FakeGpu gpu(70 * kMiB);
  SegmentPool pool(gpu, "fake:0");
  const SegmentCache::Block b = pool.allocate(40 * kMiB);
  EXPECT_EQ(b.size, 40 * kMiB);
  EXPECT_EQ(gpu.log(),
            (std::vector<std::string>{"malloc " + mib(80) + " failed", "malloc " + mib(40)}));
  EXPECT_EQ(pool.reserved(), 40 * kMiB);
  pool.release(b.ptr, b.size);
  EXPECT_EQ(pool.cached(), 40 * kMiB);
}

TEST(SegmentPool, OutOfMemoryFreesWhollyFreeSegmentsAfterASynchronizeAndRetries) {
  FakeGpu gpu(128 * kMiB);
  SegmentPool pool(gpu, "fake:0");
  const SegmentCache::Block a = pool.allocate(30 * kMiB);  // a 64 MiB region
  const SegmentCache::Block small = pool.allocate(1000);   // a 2 MiB segment, kept in use
  pool.release(a.ptr, a.size);
  gpu.clear_log();
  const SegmentCache::Block b = pool.allocate(100 * kMiB);
  EXPECT_EQ(b.size, 100 * kMiB);
  EXPECT_EQ(gpu.log(), (std::vector<std::string>{"malloc " + mib(200) + " failed",
                                                 "malloc " + mib(100) + " failed", "sync",
                                                 "free " + mib(64), "malloc " + mib(100)}));
  EXPECT_EQ(pool.reserved(), 102 * kMiB);
  EXPECT_EQ(gpu.used(), 102 * kMiB);
  pool.release(b.ptr, b.size);
  pool.release(small.ptr, small.size);
  EXPECT_EQ(pool.free_segments(), 102 * kMiB);
  EXPECT_EQ(gpu.used(), 0u);
  EXPECT_EQ(pool.reserved(), 0u);
  EXPECT_EQ(pool.peak_reserved(), 102 * kMiB);
}

TEST(SegmentPool, OutOfMemoryIsUnavailableNamingTheDeviceAndTheFix) {
  FakeGpu gpu(10 * kMiB);
  SegmentPool pool(gpu, "fake:0");
  const SegmentCache::Block held = pool.allocate(1000);  // 2 MiB held, in use
  try {
    pool.allocate(20 * kMiB);
    FAIL() << "20 MiB on a 10 MiB device";
  } catch (const Unavailable& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("fake:0 is out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("8 MiB free of 10 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("dtrain holds 2 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("reduce the batch size"), std::string::npos) << what;
  }
  EXPECT_EQ(pool.reserved(), 2 * kMiB);  // nothing lost, and the pool goes on serving
  const SegmentCache::Block next = pool.allocate(1000);
  EXPECT_NE(next.ptr, held.ptr);
  EXPECT_EQ(pool.reserved(), 2 * kMiB);
  // A request no device holds is refused before any device call.
  gpu.clear_log();
  EXPECT_THROW(pool.allocate(SegmentCache::kMaxRequest + 1), Unavailable);
  EXPECT_TRUE(gpu.log().empty());
  // Another failure of the device is the device's error, and the pool stays usable.
  gpu.throw_next();
  EXPECT_THROW(pool.allocate(5 * kMiB), Internal);
  EXPECT_EQ(pool.reserved(), 2 * kMiB);
  EXPECT_EQ(pool.allocate(5 * kMiB).size, 5 * kMiB);
}

// A failed synchronize leaves the free segments cached (nothing is freed that queued work may still
// use); a failed free still frees the other segments.
TEST(SegmentPool, AFailedSynchronizeKeepsTheSegmentsAndAFailedFreeTheOthersGo) {
  FakeGpu gpu(size_t{1} << 30);
  SegmentPool pool(gpu, "fake:0");
  const SegmentCache::Block small = pool.allocate(1000);      // a 2 MiB segment
  const SegmentCache::Block large = pool.allocate(3 * kMiB);  // a 64 MiB region
  pool.release(small.ptr, small.size);
  pool.release(large.ptr, large.size);
  gpu.fail_next_sync();
  EXPECT_THROW(pool.free_segments(), Internal);
  EXPECT_EQ(pool.reserved(), 66 * kMiB);
  EXPECT_EQ(pool.cached(), 66 * kMiB);
  EXPECT_EQ(gpu.used(), 66 * kMiB);
  // Both segments are back in their classes: a small and a large request are served from them.
  const SegmentCache::Block s2 = pool.allocate(1000), l2 = pool.allocate(3 * kMiB);
  EXPECT_EQ(s2.ptr, small.ptr);
  EXPECT_EQ(l2.ptr, large.ptr);
  EXPECT_EQ(pool.reserved(), 66 * kMiB);
  pool.release(s2.ptr, s2.size);
  pool.release(l2.ptr, l2.size);
  gpu.fail_next_free();
  EXPECT_THROW(pool.free_segments(), Internal);
  EXPECT_EQ(pool.reserved(), 0u);
  EXPECT_EQ(gpu.used(), 2 * kMiB);  // the first free (the small segment's) failed, the region went
}

// A device call may block for long (cudaDeviceSynchronize waits for queued work, which may be a
// collective that needs another thread of this process to allocate or free). Other threads must be
// able to use the pool meanwhile: here, inside each device call, another thread frees and asks.
TEST(SegmentPool, DeviceCallsRunWithoutThePoolsLock) {
  // On the heap, and leaked when a thread is left blocked on the pool's lock (a failure): that
  // thread may still use them after the test returns.
  auto* gpu_p = new FakeGpu(size_t{1} << 30);
  auto* pool_p = new SegmentPool(*gpu_p, "fake:0");
  FakeGpu& gpu = *gpu_p;
  SegmentPool& pool = *pool_p;
  std::vector<SegmentCache::Block> held;
  for (int i = 0; i < 8; ++i) held.push_back(pool.allocate(1000));
  std::atomic<int> calls{0}, stuck{0};
  gpu.during_call = [&] {
    if (held.empty()) return;
    const SegmentCache::Block b = held.back();
    held.pop_back();
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread other([&pool, b, done] {
      pool.release(b.ptr, b.size);
      (void)pool.cached();
      *done = true;
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!*done && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (*done) {
      other.join();
    } else {
      other.detach();  // blocked on the pool's lock, which this thread holds: the bug
      ++stuck;
    }
    ++calls;
  };
  const SegmentCache::Block big = pool.allocate(100 * kMiB);  // malloc
  if (stuck.load() != 0) {
    ADD_FAILURE() << "another thread waited for the pool's lock during cudaMalloc";
    return;  // pool and gpu leaked: the blocked thread may still use them
  }
  pool.release(big.ptr, big.size);
  pool.free_segments();  // sync and frees
  EXPECT_EQ(stuck.load(), 0) << "another thread waited for the pool's lock during a sync or free";
  EXPECT_GE(calls.load(), 3);
  gpu.during_call = nullptr;
  if (stuck.load() == 0) {
    delete pool_p;
    delete gpu_p;
  }
}

// Threads allocate and release at once, with device calls that take time; no two live blocks
// may overlap, and once everything is released every segment goes back to the device.
TEST(SegmentPool, ConcurrentThreadsNeverShareABlockAndAllMemoryComesBack) {
  FakeGpu gpu(size_t{4} << 30);
  SegmentPool pool(gpu, "fake:0");
  gpu.during_call = [] { std::this_thread::sleep_for(std::chrono::microseconds(200)); };
  std::mutex mu;
  std::map<char*, size_t> live;  // every block handed out and not yet released
  std::atomic<int> overlaps{0};
  auto work = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<SegmentCache::Block> mine;
    for (int i = 0; i < 1500; ++i) {
      if (mine.size() < 8 && (mine.empty() || rng() % 2)) {
        const size_t n = rng() % 4 ? 1 + rng() % (2 * kMiB) : 1 + rng() % (24 * kMiB);
        const SegmentCache::Block b = pool.allocate(n);
        if (b.size < n) ++overlaps;
        std::lock_guard<std::mutex> lock(mu);
        char* p = static_cast<char*>(b.ptr);
        auto next = live.lower_bound(p);
        if (next != live.end() && next->first < p + b.size) ++overlaps;
        if (next != live.begin() && std::prev(next)->first + std::prev(next)->second > p)
          ++overlaps;
        live.emplace(p, b.size);
        mine.push_back(b);
      } else {
        const size_t k = rng() % mine.size();
        {
          std::lock_guard<std::mutex> lock(mu);
          live.erase(static_cast<char*>(mine[k].ptr));
        }
        pool.release(mine[k].ptr, mine[k].size);
        mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
      }
      if (i % 500 == 499) pool.free_segments();
    }
    for (const auto& b : mine) {
      {
        std::lock_guard<std::mutex> lock(mu);
        live.erase(static_cast<char*>(b.ptr));
      }
      pool.release(b.ptr, b.size);
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) threads.emplace_back(work, 17 + t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(pool.cached(), pool.reserved());
  const size_t used = gpu.used();
  EXPECT_EQ(pool.free_segments(), used);
  EXPECT_EQ(pool.reserved(), 0u);
  EXPECT_EQ(gpu.used(), 0u);
}

}  // namespace
}  // namespace dtrain::detail
