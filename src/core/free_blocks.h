// The bookkeeping of dtrain's caching allocators, apart from the calls that map and unmap memory,
// so that tests drive it on fake address ranges: FreeBlocks (free ranges, best fit, cut and
// joined), used by the host allocator (src/core/allocator.cc) for its mapped blocks, and
// SegmentCache (segments from a backend, small and large blocks), used by the CUDA allocator
// (src/devices/cuda/cuda_allocator.cc) over cudaMalloc, and SegmentPool, the CUDA allocator's
// per-GPU pool: a SegmentCache behind a lock, with the device calls (allocate, synchronise, free)
// behind an interface, so that its out-of-memory paths and its locking run in CPU tests.
//
// FreeBlocks and SegmentCache are not thread-safe (SegmentPool's lock guards its cache);
// SegmentPool is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

// Free ranges of memory. take() hands out the smallest free range that holds the request (the
// lowest address among equals); what that range has beyond the request stays free as a range of
// its own when it is `min_rest` bytes or more, and is handed out with the request otherwise.
// put() joins a freed range with the free ranges that touch it on either side, when they belong to
// the same segment (one cudaMalloc must be freed whole; the host passes one segment for all its
// pages, which any munmap can split).
class FreeBlocks {
 public:
  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    uintptr_t segment = 0;
  };

  // A free range of at least n bytes (n > 0), cut as described above; {nullptr, 0} when none holds
  // n.
  Block take(size_t n, size_t min_rest);
  // Frees [ptr, ptr + size) of `segment`. The range must not overlap a free one.
  void put(char* ptr, size_t size, uintptr_t segment = 0);
  // Removes the free range that starts at ptr and is exactly `size` bytes long; false when there
  // is none (it is in use, in part or whole, or joined into a larger range).
  bool remove_exact(char* ptr, size_t size);
  // Removes and returns every free range.
  std::vector<Block> clear();

  size_t bytes() const { return bytes_; }
  size_t count() const { return by_addr_.size(); }
  // The largest free range, 0 when none.
  size_t largest() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }

 private:
  struct Range {
    size_t size;
    uintptr_t segment;
  };
  void insert(char* ptr, size_t size, uintptr_t segment);
  void erase(std::map<char*, Range>::iterator it);

  std::set<std::pair<size_t, char*>> by_size_;  // (size, address): the best fit
  std::map<char*, Range> by_addr_;              // address: the neighbours
  size_t bytes_ = 0;
};

// A device memory cache: blocks cut from segments the backend allocates, best fit, joined again
// within a segment. Requests of up to kSmallRequest (1 MiB) are served from segments of
// kSmallSegment (2 MiB) shared by small blocks; a larger request that no free block holds gets a
// segment of at least kMinRegion (64 MiB) and of twice the largest request so far, shared by the
// large blocks that follow. Block sizes are multiples of kAlignment (512 bytes); a block is cut
// when at least kAlignment (small) or kSmallRequest (large) bytes would be left; a freed block
// joins the free blocks next to it in its own segment.
//
// Why regions: tensors made together (a layer's outputs, a step's activations) share a segment
// and, once freed, join into blocks that serve other and larger requests; per-size buckets (the
// CUDA allocator until 2026-11-27) kept each block for requests of its own size. PyTorch's policy
// (2 MiB segments to 1 MiB, 20 MiB to 10 MiB, then each large request a segment of its own size)
// was this class's first version. Replayed on the requests of CPU training runs (`dtrain-bench
// alloc-replay`; docs/gpu-performance.md), device memory reserved over the bytes in use at the
// peak: ResNet-50 at batch 32 / 64 / 128 1.41 / 1.40 / 1.39x with buckets, 1.22 / 1.19 / 1.18x with
// PyTorch's policy, 1.06 / 1.07 / 1.06x with regions of twice the largest request (once, 1.06 /
// 1.06 / 1.04x; four times, 1.12 / 1.11 / 1.10x); GPT-2 small 1.61x, 1.12x and 1.09x. Regions
// lose where a small model has one large tensor: the reference CNN with its 188 MB training set
// 1.43x against PyTorch's policy's 1.10x (each later region 376 MB).
//
// The caller does the memory calls: when take() finds no block it asks the backend for
// segment_size(n) bytes (exact_segment_size(n) when that fails) and calls add_segment(), then
// take() again; to give memory back (a failed device allocation, empty_cache) it calls
// take_free_segments() and frees what that returns, after the device has finished using it.
// Requests above kMaxRequest are the caller's to refuse.
class SegmentCache {
 public:
  static constexpr size_t kAlignment = 512;
  static constexpr size_t kSmallRequest = size_t{1} << 20;
  static constexpr size_t kSmallSegment = size_t{2} << 20;
  static constexpr size_t kMinRegion = size_t{64} << 20;
  static constexpr size_t kSegmentGranularity = size_t{2} << 20;
  static constexpr size_t kMaxRequest = size_t{1} << 50;

  struct Block {
    void* ptr = nullptr;
    size_t size = 0;     // what the block holds: the request rounded up, or more when cut short
    bool small = false;  // take_free_segments(): a segment of small blocks
  };
  // How large requests get segments: kRegions (above), or kPyTorch, PyTorch's policy (a request
  // under 10 MiB a 20 MiB segment, a larger one its own), kept for `dtrain-bench alloc-replay`.
  enum class Policy { kRegions, kPyTorch };
  explicit SegmentCache(Policy policy = Policy::kRegions) : policy_(policy) {}

  // The bytes of a request of n, rounded to kAlignment (a request of 0 takes kAlignment).
  static size_t round(size_t n);
  // The size of the segment to ask the backend for when take(n) finds no block (a region for a
  // large request), and the least that serves n (when the region cannot be had).
  size_t segment_size(size_t n) const;
  static size_t exact_segment_size(size_t n);

  // A cached block for a request of n bytes; {nullptr, 0} when none fits.
  Block take(size_t n);
  // Adds a segment the backend returned for a request of n (size: at least exact_segment_size(n)).
  void add_segment(void* ptr, size_t size, size_t n);
  // Returns a block take() handed out (ptr and size as take() returned them).
  void put(void* ptr, size_t size);
  // Removes every segment that is wholly free from the books and returns them (ptr, size, small)
  // for the caller to free; put_back_segments() returns what could not be freed to the books.
  std::vector<Block> take_free_segments();
  void put_back_segments(const std::vector<Block>& segments);

  size_t reserved() const { return reserved_; }                      // bytes in segments
  size_t peak_reserved() const { return peak_reserved_; }            // the most reserved() has been
  size_t cached() const { return small_.bytes() + large_.bytes(); }  // bytes in free blocks
  size_t segments() const { return segments_.size(); }

 private:
  struct Segment {
    size_t size;
    bool small;
  };
  const std::pair<char* const, Segment>& segment_of(char* p) const;

  FreeBlocks small_, large_;
  std::map<char*, Segment> segments_;  // by base address
  size_t reserved_ = 0, peak_reserved_ = 0;
  size_t largest_request_ = 0;  // rounded, of those take() was asked for
  Policy policy_;
};

// One device's memory: a SegmentCache behind a lock over a Backend that makes the device calls.
// allocate() takes a cached block, else asks the backend for segment_size(n) bytes, then for
// exact_segment_size(n) when that fails, then frees the wholly free segments (after the backend's
// synchronize(), since queued work may still use a cached block) and asks once more; when that
// fails too it throws Unavailable naming the device, the bytes held and how to fix it.
//
// The backend is called without the lock held: a thread that frees or allocates on this device
// must not wait for a device synchronisation (which may wait for a collective that thread is part
// of).
class SegmentPool {
 public:
  class Backend {
   public:
    virtual ~Backend() = default;
    // bytes of device memory; nullptr when the device is out of memory (other failures throw).
    virtual void* allocate(size_t bytes) = 0;
    // Waits until no queued work can still use memory of this device.
    virtual void synchronize() = 0;
    virtual void free(void* ptr) = 0;
    // The device's free and total bytes, for the out-of-memory message ({0, 0} when unknown).
    virtual std::pair<size_t, size_t> memory_info() = 0;
  };

  // `device` names the device in messages ("cuda:0"). The backend must outlive the pool.
  SegmentPool(Backend& backend, std::string device);
  SegmentPool(const SegmentPool&) = delete;
  SegmentPool& operator=(const SegmentPool&) = delete;

  // A block of at least n bytes (n <= SegmentCache::kMaxRequest, else Unavailable).
  SegmentCache::Block allocate(size_t n);
  // Returns a block allocate() handed out (ptr and size as it returned them).
  void release(void* ptr, size_t size);
  // Gives the wholly free segments back to the backend (after synchronize()); returns their
  // bytes. A segment of which any part is in use stays. When synchronize() throws, the segments
  // stay cached and the error propagates; when a free() throws, the others are still freed and
  // the first error propagates (that segment is lost to the books).
  size_t free_segments();

  size_t reserved();
  size_t cached();
  size_t peak_reserved();

 private:
  Backend& backend_;
  const std::string device_;
  std::mutex mu_;
  SegmentCache cache_;
};

}  // namespace dtrain::detail
