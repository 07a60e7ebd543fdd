#include "dtrain/core/allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/free_blocks.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

// Free lists (exact sizes below 1 MiB, best fit above), one set per logical CPU device. Training
// allocates the same sizes every step, so after the first steps every allocation is a cache hit
// and no page is faulted in again.
// A block goes back to the pool of the device it was allocated for: each replica thread of
// Mirrored cpu:N is pinned to its own core, and a block it freed is still in that core's cache,
// while handing it to another replica would move every line of it across cores (and the two
// replicas would contend on one lock). Measured with the timeline, Mirrored cpu:2 at 64 images per
// replica: replica 0's forward pass took 2,742 us with one shared pool and 2,140 us with a pool per
// device (one device alone: 1,850 us).
//
// Blocks of 1 MiB and more are mapped from the kernel (mmap) and unmapped when freed, not taken
// from malloc: glibc raises its mmap threshold each time it frees a mapped block (up to 32 MiB),
// after which large blocks come from its heap and stay in the process when freed. Measured with
// DTRAIN_HOST_CACHE_MB=0, GPT (gpt2 width, 8 layers, context 128) under 2-worker ZeRO-3 with
// recompute: peak RSS 2,210 MB through malloc, 1,633 MB with large blocks mapped (allocator peak
// 1,387 MB both).
//
// Mapped blocks are cached best-fit, cut and joined again (as TensorFlow's BFC allocator and
// PyTorch's CUDA caching allocator do within their segments): a request takes the smallest cached
// block that holds it; what that block has beyond the request (1 MiB or more) stays cached as a
// block of its own; a freed block joins the free blocks on either side of it. The backward pass
// asks for other sizes than the forward pass freed, and a step's requests take the same memory
// step after step: in the runs measured, after the first steps no page was mapped again (not a
// guarantee: a full cache unmaps what is freed, and free memory in pieces smaller than a request
// does not serve it). Unlike BFC, blocks mapped apart join too when their pages are adjacent.
// Before (sessions 19-24), a miss took a cached block of up to twice its size, whole, or cut one of
// 1.5x or more to size and unmapped the tail: blocks were cut down step after step, and requests
// of the size they had had mapped and faulted in new pages (ResNet-50 at batch 32, Mirrored cpu:2:
// ~75 k page faults a step, in 98 MiB blocks, in the first stage's backward pass; now 0-2 k).
// ResNet-50, batch 32, `--num-warmup-batches=1 --num-iters=2`, /usr/bin/time, two alternating
// rounds, before -> after: one thread float32 peak RSS 3,666 -> 3,152 MB (page faults 1.01 M ->
// 0.77 M), mixed_bfloat16 2,477 -> 2,046 MB, Mirrored cpu:2 7,063 -> 6,151..6,394 MB (system time
// 20-21 -> 8-9 s); speed the same within the rounds' spread (3.87/3.89 against 3.74/3.94
// images/sec; Mirrored 7.05/7.21 against 6.24/7.20).
class CachingHostAllocator final : public Allocator {
 public:
  // `max_cached_bytes`: a fixed bound on the cache; nullopt: the larger of kDefaultCache and twice
  // the most memory the program has held at once.
  // `trace`: where to write every allocation and release (DTRAIN_ALLOC_TRACE), or null.
  CachingHostAllocator(std::optional<size_t> max_cached_bytes, std::FILE* trace)
      : max_cached_bytes_(max_cached_bytes), trace_(trace) {
    for (Pool& pool : pools_) pool.owner = this;
  }
  ~CachingHostAllocator() override {
    for (Pool& pool : pools_) {
      for (auto& [size, blocks] : pool.small)
        for (void* p : blocks) give_back(p, size);
      for (const detail::FreeBlocks::Block& b : pool.large.clear()) give_back(b.ptr, b.size);
    }
  }

  std::shared_ptr<Storage> allocate(size_t nbytes, DeviceSpec device) override {
    size_t rounded = round_up(nbytes == 0 ? 64 : nbytes);
    Pool& pool = pool_for(device);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(pool.mu);
      if (rounded < kMapped) {
        auto it = pool.small.find(rounded);
        if (it != pool.small.end() && !it->second.empty()) {
          p = it->second.back();
          it->second.pop_back();
          cached_bytes_.fetch_sub(rounded, std::memory_order_relaxed);
        }
      } else if (const auto b = pool.large.take(rounded, kMapped); b.ptr) {
        // The smallest cached block that holds the request; what it has beyond the request stays
        // cached as a block of its own (a tail under 1 MiB goes with the request).
        cached_bytes_.fetch_sub(b.size, std::memory_order_relaxed);
        p = b.ptr;
        rounded = b.size;
      }
    }
    if (!p) {
      p = take(rounded);
      if (!p)
        throw Unavailable(detail::str_cat("out of host memory allocating ", rounded,
                                          " bytes; reduce the batch size"));
    }
    if (trace_) std::fprintf(trace_, "+ %p %zu\n", p, nbytes);  // one locked call: whole lines
    const size_t now = in_use_.fetch_add(rounded, std::memory_order_relaxed) + rounded;
    for (std::atomic<size_t>* mark : {&peak_, &high_water_})
      for (size_t peak = mark->load(std::memory_order_relaxed);
           now > peak && !mark->compare_exchange_weak(peak, now, std::memory_order_relaxed);) {
      }
    return std::make_shared<Storage>(p, rounded, device, &CachingHostAllocator::release, &pool);
  }

  MemoryInfo get_memory_info() const override {
    return {in_use_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed)};
  }
  void reset_memory_stats() override {
    peak_.store(in_use_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }

  void copy(void* dst, DeviceSpec, const void* src, DeviceSpec, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }
  void zero(void* dst, size_t nbytes) override {
    if (nbytes) std::memset(dst, 0, nbytes);
  }

 private:
  static constexpr size_t kPools = 64;  // cpu:63 and above share the last
  static constexpr size_t kDefaultCache = size_t{2} << 30;
  struct Pool {
    CachingHostAllocator* owner = nullptr;
    std::mutex mu;
    std::map<size_t, std::vector<void*>> small;  // below kMapped: by exact size
    // Mapped blocks, each page range free (one segment: any adjacent pages join, whichever
    // mmap they came from, as munmap may unmap any page range).
    detail::FreeBlocks large;
  };

  static constexpr size_t kMapped = size_t{1} << 20;  // blocks this large or larger: mmap
  static size_t page_size() {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return page;
  }
  // Mapped blocks are whole pages, so that a cached one can be cut to another mapped size.
  static size_t round_up(size_t n) {
    return n >= kMapped ? (n + page_size() - 1) / page_size() * page_size()
                        : (n + 63) & ~size_t{63};
  }
  static void* take(size_t rounded) {
    if (rounded < kMapped) return std::aligned_alloc(64, rounded);
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;  // page-aligned
  }
  static void give_back(void* p, size_t rounded) {
    if (rounded < kMapped)
      std::free(p);
    else
      munmap(p, rounded);
  }
  Pool& pool_for(DeviceSpec device) {
    const size_t i = device.type == DeviceType::kCPU && device.index > 0
                         ? std::min(static_cast<size_t>(device.index), kPools - 1)
                         : 0;
    return pools_[i];
  }
  static void release(void* ctx, void* ptr, size_t nbytes) {
    auto* pool = static_cast<Pool*>(ctx);
    CachingHostAllocator* self = pool->owner;
    if (self->trace_) std::fprintf(self->trace_, "- %p\n", ptr);
    self->in_use_.fetch_sub(nbytes, std::memory_order_relaxed);
    const size_t limit =
        self->max_cached_bytes_
            ? *self->max_cached_bytes_
            : std::max(kDefaultCache, 2 * self->high_water_.load(std::memory_order_relaxed));
    if (self->cached_bytes_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes <= limit) {
      std::lock_guard<std::mutex> lock(pool->mu);
      if (nbytes < kMapped) {
        pool->small[nbytes].push_back(ptr);
        return;
      }
      // A mapped block joins the free blocks on either side of it (pages of this pool, mapped
      // apart or cut from one block), so that a block cut for a smaller request is whole again
      // once both parts are free.
      pool->large.put(static_cast<char*>(ptr), nbytes);
      return;
    }
    self->cached_bytes_.fetch_sub(nbytes, std::memory_order_relaxed);
    give_back(ptr, nbytes);
  }

  const std::optional<size_t> max_cached_bytes_;  // freed bytes kept for reuse, over all pools
  std::array<Pool, kPools> pools_;
  std::atomic<size_t> cached_bytes_{0};
  std::atomic<size_t> in_use_{0}, peak_{0};  // tensor storage handed out and not released
  std::atomic<size_t> high_water_{0};        // the peak since the start (never reset)
  std::FILE* const trace_;
};

std::mutex g_registry_mu;
Allocator* g_cuda_allocator = nullptr;

}  // namespace

// DTRAIN_HOST_CACHE_MB: the most freed host memory kept for reuse (0 = none, every block goes back
// to the system). Unset: the larger of 2,048 MB and twice the most the program has held at once,
// so that a step whose working set is larger than 2 GB still finds the blocks of the step before
// in the cache (twice: measured when the cache kept exact sizes, whose freed blocks of one pass
// were of other sizes than the next pass asked for; the cache keeps only what the program itself
// allocated, so its RSS is what its steps touch). A
// fixed 2 GB made ResNet-50 at batch 32 (4.6 GB at its peak) unmap and fault in ~2.5 GB a
// step: 14.2 s of system time in 40 s, 2.9 against 4.0 images/sec on one thread. Under a tight
// memory limit the cache's blocks of sizes no longer asked for count against it: set it low there.
static std::optional<size_t> host_cache_bytes() {
  const char* v = std::getenv("DTRAIN_HOST_CACHE_MB");
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  const long long mb = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || mb < 0) {
    DTRAIN_LOG(WARNING) << "DTRAIN_HOST_CACHE_MB='" << v
                        << "' is not a number of megabytes >= 0; keeping the default (the larger "
                           "of 2048 and twice the most memory held at once)";
    return std::nullopt;
  }
  return static_cast<size_t>(mb) << 20;
}

// DTRAIN_ALLOC_TRACE=FILE: every host allocation ("+ address bytes", the bytes asked for) and
// release ("- address") in order, line-buffered, for `dtrain-bench alloc-replay`, which replays
// them against the CUDA allocator's policies. "%p" in FILE becomes the process id (one file per
// worker under dtrain-run). A file that cannot be opened is a warning, not an error.
static std::FILE* alloc_trace() {
  const char* env = std::getenv("DTRAIN_ALLOC_TRACE");
  if (!env || !*env) return nullptr;
  std::string path = env;
  for (size_t at = path.find("%p"); at != std::string::npos; at = path.find("%p", at)) {
    const std::string pid = std::to_string(getpid());
    path.replace(at, 2, pid);
    at += pid.size();
  }
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    DTRAIN_LOG(WARNING) << "DTRAIN_ALLOC_TRACE='" << path << "' cannot be written ("
                        << std::strerror(errno) << "); not tracing allocations";
    return nullptr;
  }
  std::setvbuf(f, nullptr, _IOLBF, 0);
  return f;
}

Allocator& host_allocator() {
  // Leaked on purpose: tensors held by static objects may be released after main returns.
  static auto* a = new CachingHostAllocator(host_cache_bytes(), alloc_trace());
  return *a;
}

void register_allocator(DeviceType type, Allocator* allocator) {
  DTRAIN_CHECK(type == DeviceType::kCUDA, "only CUDA allocators are registered");
  std::lock_guard<std::mutex> lock(g_registry_mu);
  g_cuda_allocator = allocator;
}

Allocator& allocator_for(DeviceSpec device) {
  if (device.host_accessible()) return host_allocator();
  std::lock_guard<std::mutex> lock(g_registry_mu);
  if (!g_cuda_allocator)
    throw Unavailable("no CUDA allocator: " + device.to_string() +
                      " is not available in this build or on this machine; use --devices=cpu");
  return *g_cuda_allocator;
}

}  // namespace dtrain
