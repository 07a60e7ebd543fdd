// CudaAllocator: device memory for every GPU, with a per-GPU cache of freed blocks.
//
// Memory comes from cudaMalloc (never managed memory) in segments, and freed blocks stay in the
// GPU's cache instead of going back to cudaFree, which synchronises the whole device. Each GPU's
// cache is a detail::SegmentPool (src/core/free_blocks.h) over cudaMalloc, cudaDeviceSynchronize
// and cudaFree: requests of up to 1 MiB share 2 MiB segments; a larger request that no free block
// holds gets a region of at least 64 MiB and twice the largest request so far, which the large
// requests after it share; a request takes the best-fitting free block and cuts it, and a freed
// block joins its free neighbours within its own cudaMalloc. When a region does not fit, a segment
// of the request's own size is tried; when cudaMalloc still runs out, the GPU's wholly free
// segments are freed and the allocation retried once (a segment of which any part is in use
// stays). Until 2026-11-27 freed blocks went to per-size buckets (four per power of two) and served
// only requests of their own bucket; ResNet-50 at batch 256 on an H200 then held 40 GB where
// PyTorch holds 29; with the new policy it held 22.9 GB there (2026-11-27). `dtrain-bench
// alloc-replay` replays a CPU run's requests against both (docs/gpu-performance.md), and
// free_blocks_test runs the pool's out-of-memory paths and locking on a fake device.
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
#include <utility>
#include <vector>

#include "core/free_blocks.h"
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
  // Returns GPU `index`'s wholly free segments to the driver (a segment part of which is in use
  // stays). Waits for the GPU to go idle first.
  void empty_cache(int index);
  // Bytes in GPU `index`'s free blocks, including pieces of segments in use, which empty_cache
  // cannot give back.
  size_t cached_bytes(int index);
  // Bytes of all GPU `index`'s segments (cudaMalloc'd), in use or not.
  size_t reserved_bytes(int index);

 private:
  // SegmentPool's device calls on GPU `index`.
  class Backend final : public detail::SegmentPool::Backend {
   public:
    explicit Backend(int index) : index_(index) {}
    void* allocate(size_t bytes) override;
    void synchronize() override;
    void free(void* ptr) override;
    std::pair<size_t, size_t> memory_info() override;

   private:
    int index_;
  };
  struct Pool {
    explicit Pool(int index) : backend(index), pool(backend, DeviceSpec::gpu(index).to_string()) {}
    Backend backend;
    detail::SegmentPool pool;
  };

  CudaAllocator() = default;
  Pool& pool(int index);
  cudaStream_t stream_for(int index);
  static void release(void* ctx, void* ptr, size_t nbytes);

  std::mutex mu_;                             // guards pools_ and streams_
  std::vector<std::unique_ptr<Pool>> pools_;  // by GPU index; never shrinks, so Pool& stays valid
  std::vector<cudaStream_t> streams_;         // by GPU index
};

}  // namespace dtrain::cuda
