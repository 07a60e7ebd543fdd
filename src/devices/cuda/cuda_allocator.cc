#include "devices/cuda/cuda_allocator.h"

#include <bit>
#include <cstring>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_guard.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::cuda {

CudaAllocator& CudaAllocator::instance() {
  static auto* a = new CudaAllocator();  // leaked on purpose, like host_allocator()
  return *a;
}

size_t CudaAllocator::bucket_size(size_t nbytes) {
  constexpr size_t kSmall = size_t{1} << 20;
  if (nbytes == 0) nbytes = 1;
  if (nbytes <= kSmall) return (nbytes + 511) & ~size_t{511};
  // Four buckets per power of two: at most 25% waste, and few distinct sizes, so that a training
  // step's allocations hit the cache from the second step on.
  const int msb = std::bit_width(nbytes - 1) - 1;  // floor(log2(nbytes - 1))
  const size_t step = (size_t{1} << msb) / 4;
  return (nbytes + step - 1) / step * step;
}

CudaAllocator::Pool& CudaAllocator::pool(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index < 0) throw InvalidArgument(detail::str_cat("negative GPU index ", index));
  while (static_cast<int>(pools_.size()) <= index) {
    pools_.push_back(std::make_unique<Pool>());
    pools_.back()->index = static_cast<int>(pools_.size()) - 1;
  }
  return *pools_[static_cast<size_t>(index)];
}

cudaStream_t CudaAllocator::stream_for(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index < 0 || index >= static_cast<int>(streams_.size())) return nullptr;
  return streams_[static_cast<size_t>(index)];
}

void CudaAllocator::set_stream(int index, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index < 0) throw InvalidArgument(detail::str_cat("negative GPU index ", index));
  if (static_cast<int>(streams_.size()) <= index) streams_.resize(static_cast<size_t>(index) + 1);
  streams_[static_cast<size_t>(index)] = stream;
}

std::shared_ptr<Storage> CudaAllocator::allocate(size_t nbytes, DeviceSpec device) {
  if (device.type != DeviceType::kCUDA)
    throw InvalidArgument("CudaAllocator asked for memory on " + device.to_string());
  const size_t size = bucket_size(nbytes);
  Pool& p = pool(device.index);
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    auto it = p.free.find(size);
    if (it != p.free.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      p.cached_bytes -= size;
    }
  }
  if (!ptr) {
    DeviceGuard guard(device.index);
    cudaError_t err = cudaMalloc(&ptr, size);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      const size_t cached = cached_bytes(device.index);
      if (cached > 0) {
        DTRAIN_LOG(WARNING) << device.to_string() << ": cudaMalloc of " << size
                            << " bytes failed; releasing " << cached
                            << " cached bytes and retrying";
        empty_cache(device.index);
        err = cudaMalloc(&ptr, size);
      }
    }
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      (void)cudaGetLastError();
      throw Unavailable(
          detail::str_cat(device.to_string(), " is out of memory: cudaMalloc(", size,
                          " bytes) failed with ", free_b >> 20, " MiB free of ", total_b >> 20,
                          " MiB; reduce the batch size or the model, or use more GPUs"));
    }
    if (err != cudaSuccess) throw_cuda_error(err, "cudaMalloc", __FILE__, __LINE__);
  }
  return std::make_shared<Storage>(ptr, size, device, &CudaAllocator::release, &p);
}

void CudaAllocator::release(void* ctx, void* ptr, size_t nbytes) {
  auto* p = static_cast<Pool*>(ctx);
  std::lock_guard<std::mutex> lock(p->mu);
  p->free[nbytes].push_back(ptr);
  p->cached_bytes += nbytes;
}

size_t CudaAllocator::cached_bytes(int index) {
  Pool& p = pool(index);
  std::lock_guard<std::mutex> lock(p.mu);
  return p.cached_bytes;
}

void CudaAllocator::empty_cache(int index) {
  Pool& p = pool(index);
  std::unordered_map<size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    blocks.swap(p.free);
    p.cached_bytes = 0;
  }
  DeviceGuard guard(index);
  // Queued kernels may still use a cached block (see the stream-ordering contract).
  DTRAIN_CUDA_CALL(cudaDeviceSynchronize());
  for (auto& [size, list] : blocks)
    for (void* ptr : list) DTRAIN_CUDA_CALL(cudaFree(ptr));
}

void CudaAllocator::copy(void* dst, DeviceSpec dst_dev, const void* src, DeviceSpec src_dev,
                         size_t nbytes) {
  if (nbytes == 0) return;
  const bool dst_gpu = dst_dev.type == DeviceType::kCUDA;
  const bool src_gpu = src_dev.type == DeviceType::kCUDA;
  if (!dst_gpu && !src_gpu) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  if (dst_gpu && src_gpu && dst_dev.index != src_dev.index) {
    // The source must be complete before the destination's stream reads it, and the copy must be
    // complete before we return, because the source GPU may hand the block out again at once.
    if (cudaStream_t s = stream_for(src_dev.index)) {
      DeviceGuard guard(src_dev.index);
      DTRAIN_CUDA_CALL(cudaStreamSynchronize(s));
    }
    DeviceGuard guard(dst_dev.index);
    cudaStream_t s = stream_for(dst_dev.index);
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
    DTRAIN_CUDA_CALL(cudaStreamSynchronize(s));
    return;
  }
  const int gpu = dst_gpu ? dst_dev.index : src_dev.index;
  DeviceGuard guard(gpu);
  cudaStream_t s = stream_for(gpu);
  DTRAIN_CUDA_CALL(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
  // Host memory is pageable and may be reused by the caller as soon as we return. Without a
  // device stream nothing orders later kernels after the copy, so it must be complete too.
  if (!(dst_gpu && src_gpu) || !s) DTRAIN_CUDA_CALL(cudaStreamSynchronize(s));
}

void CudaAllocator::zero(void* dst, size_t nbytes) {
  if (nbytes == 0) return;
  cudaPointerAttributes attr{};
  DTRAIN_CUDA_CALL(cudaPointerGetAttributes(&attr, dst));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    std::memset(dst, 0, nbytes);
    return;
  }
  DeviceGuard guard(attr.device);
  cudaStream_t s = stream_for(attr.device);
  DTRAIN_CUDA_CALL(cudaMemsetAsync(dst, 0, nbytes, s));
  // Without a device stream (no CudaDevice made yet) later kernels are not ordered after this.
  if (!s) DTRAIN_CUDA_CALL(cudaStreamSynchronize(s));
}

}  // namespace dtrain::cuda
