#include "devices/cuda/cuda_allocator.h"

#include <cstring>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_guard.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {

CudaAllocator& CudaAllocator::instance() {
  static auto* a = new CudaAllocator();  // leaked on purpose, like host_allocator()
  return *a;
}

CudaAllocator::Pool& CudaAllocator::pool(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index < 0) throw InvalidArgument(detail::str_cat("negative GPU index ", index));
  while (static_cast<int>(pools_.size()) <= index)
    pools_.push_back(std::make_unique<Pool>(static_cast<int>(pools_.size())));
  return *pools_[static_cast<size_t>(index)];
}

void* CudaAllocator::Backend::allocate(size_t bytes) {
  DeviceGuard guard(index_);
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clears the error: the pool tries a smaller segment or frees some
    return nullptr;
  }
  if (err != cudaSuccess) throw_cuda_error(err, "cudaMalloc", __FILE__, __LINE__);
  return ptr;
}

void CudaAllocator::Backend::synchronize() {
  DeviceGuard guard(index_);
  DTRAIN_CUDA_CALL(cudaDeviceSynchronize());
}

void CudaAllocator::Backend::free(void* ptr) {
  DeviceGuard guard(index_);
  DTRAIN_CUDA_CALL(cudaFree(ptr));
}

std::pair<size_t, size_t> CudaAllocator::Backend::memory_info() {
  DeviceGuard guard(index_);
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    (void)cudaGetLastError();
    return {0, 0};
  }
  return {free_b, total_b};
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
  Pool& p = pool(device.index);
  const detail::SegmentCache::Block b = p.pool.allocate(nbytes);
  try {
    return std::make_shared<Storage>(b.ptr, b.size, device, &CudaAllocator::release, &p);
  } catch (...) {
    p.pool.release(b.ptr, b.size);
    throw;
  }
}

void CudaAllocator::release(void* ctx, void* ptr, size_t nbytes) {
  static_cast<Pool*>(ctx)->pool.release(ptr, nbytes);
}

size_t CudaAllocator::cached_bytes(int index) { return pool(index).pool.cached(); }

size_t CudaAllocator::reserved_bytes(int index) { return pool(index).pool.reserved(); }

void CudaAllocator::empty_cache(int index) { pool(index).pool.free_segments(); }

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
