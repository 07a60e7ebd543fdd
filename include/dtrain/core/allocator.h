// Memory for tensors. Each memory space (host RAM, one GPU) has an Allocator; devices register
// theirs at start-up so that the core layer can allocate and copy without knowing device types.
// Thread-safety: allocate/copy may be called from any thread concurrently.
#pragma once

#include <cstddef>
#include <memory>

#include "dtrain/core/device_spec.h"
#include "dtrain/core/export.h"

namespace dtrain {

// A block of device memory. The deleter returns it to its allocator.
class DTRAIN_API Storage {
 public:
  Storage(void* ptr, size_t nbytes, DeviceSpec device,
          void (*release)(void* ctx, void* ptr, size_t), void* ctx)
      : ptr_(ptr), nbytes_(nbytes), device_(device), release_(release), ctx_(ctx) {}
  ~Storage() {
    if (release_) release_(ctx_, ptr_, nbytes_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t nbytes() const { return nbytes_; }
  DeviceSpec device() const { return device_; }

 private:
  void* ptr_;
  size_t nbytes_;
  DeviceSpec device_;
  void (*release_)(void*, void*, size_t);
  void* ctx_;
};

class DTRAIN_API Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns at least nbytes of memory on `device`, 64-byte aligned. Throws Unavailable when out of
  // memory.
  virtual std::shared_ptr<Storage> allocate(size_t nbytes, DeviceSpec device) = 0;
  // Copies nbytes between any two memory spaces this allocator can reach (one side is its own).
  virtual void copy(void* dst, DeviceSpec dst_dev, const void* src, DeviceSpec src_dev,
                    size_t nbytes) = 0;
  // Sets nbytes at dst to zero.
  virtual void zero(void* dst, size_t nbytes) = 0;
  // Bytes of tensor storage allocated and not yet released, and the most there has been since
  // the start or the last reset_memory_stats() (TF's tf.config.experimental.get_memory_info;
  // PyTorch's memory_allocated / max_memory_allocated). Freed blocks the allocator keeps cached
  // for reuse are not counted. Zero for allocators that do not count.
  struct MemoryInfo {
    size_t current = 0, peak = 0;
  };
  virtual MemoryInfo get_memory_info() const { return {}; }
  // Sets the peak to the current value (TF's reset_memory_stats).
  virtual void reset_memory_stats() {}
};

// The host allocator: caches freed blocks (below 1 MiB by exact size; larger ones best-fit, cut for
// smaller requests and joined again when freed, like TF's BFC allocator) so that training steps
// do not page-fault, up to DTRAIN_HOST_CACHE_MB megabytes (default: the larger of 2048 and twice
// the most memory the program has held at once; 0 turns the cache off, for tight memory limits).
DTRAIN_API Allocator& host_allocator();
// Registers the allocator for non-host memory of `type` (called by the CUDA device).
DTRAIN_API void register_allocator(DeviceType type, Allocator* allocator);
// The allocator serving `device`. Throws Unavailable when that device type is not compiled in.
DTRAIN_API Allocator& allocator_for(DeviceSpec device);

}  // namespace dtrain
