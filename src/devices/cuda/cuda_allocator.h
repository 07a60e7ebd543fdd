// CudaAllocator: device memory for every GPU, with a per-GPU cache of freed blocks.
//
// Blocks come from cudaMalloc (never managed memory) in size buckets, and freed blocks go back to
// their bucket's free list instead of to cudaFree, which synchronises the whole device. When
// cudaMalloc runs out, the GPU's cache is released and the allocation retried once.
//
// Stream-ordering contract (the same as PyTorch's caching allocator): a block may be handed out
// again as soon as its Storage is released, while kernels that used it may still be queued. That is
// safe because every kernel, copy and memset that touches a GPU's memory is issued on that GPU's
// device stream (registered with set_stream), which runs them in order. Code that uses another
// stream (NCCL, for instance) must synchronise with the device stream before and after.
//
// Thread-safety: all methods may be called from any thread concurrently.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "dtrain/core/allocator.h"

namespace dtrain::cuda {

class CudaAllocator final : public Allocator {
 public:
  // The process-wide instance (never destroyed: tensors may be released after main returns).
  static CudaAllocator& instance();

  // Returns a block of at least nbytes on GPU device.index. Throws Unavailable when the GPU is out
  // of memory even after its cache was emptied, InvalidArgument for a non-GPU device.
  std::shared_ptr<Storage> allocate(size_t nbytes, DeviceSpec device) override;
  // Host<->GPU and GPU<->GPU copies (cudaMemcpyDefault, relying on unified addressing). Copies that
  // involve host memory or two GPUs return once the data has arrived; a copy within one GPU is
  // ordered on its stream and returns at once.
  void copy(void* dst, DeviceSpec dst_dev, const void* src, DeviceSpec src_dev,
            size_t nbytes) override;
  // Asynchronous cudaMemsetAsync on the owning GPU's stream (the GPU is found from the pointer).
  void zero(void* dst, size_t nbytes) override;

  // The stream on which GPU `index`'s copies and memsets are ordered (its device stream); nullptr
  // unregisters it, after which the legacy default stream is used.
  void set_stream(int index, cudaStream_t stream);
  // Returns GPU `index`'s cached blocks to the driver. Waits for the GPU to go idle first.
  void empty_cache(int index);
  // Bytes held in GPU `index`'s cache.
  size_t cached_bytes(int index);

 private:
  struct Pool {
    int index = 0;
    std::mutex mu;
    std::unordered_map<size_t, std::vector<void*>> free;  // bucket size -> blocks
    size_t cached_bytes = 0;
  };

  CudaAllocator() = default;
  Pool& pool(int index);
  cudaStream_t stream_for(int index);
  static size_t bucket_size(size_t nbytes);
  static void release(void* ctx, void* ptr, size_t nbytes);

  std::mutex mu_;                             // guards pools_ and streams_
  std::vector<std::unique_ptr<Pool>> pools_;  // by GPU index; never shrinks, so Pool& stays valid
  std::vector<cudaStream_t> streams_;         // by GPU index
};

}  // namespace dtrain::cuda
