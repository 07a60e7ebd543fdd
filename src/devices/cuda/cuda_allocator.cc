#include "devices/cuda/cuda_allocator.h"

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
  if (nbytes > detail::SegmentCache::kMaxRequest)
    throw Unavailable(detail::str_cat(device.to_string(), " cannot hold ", nbytes,
                                      " bytes; reduce the batch size or the model"));
  Pool& p = pool(device.index);
  std::unique_lock<std::mutex> lock(p.mu);
  detail::SegmentCache::Block b = p.cache.take(nbytes);
  if (!b.ptr) {
    // The device calls run without the pool's lock: a thread that frees or allocates on this GPU
    // must not wait for a device synchronisation (which may wait for a collective that thread
    // is part of).
    size_t size = p.cache.segment_size(nbytes);
    lock.unlock();
    DeviceGuard guard(device.index);
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, size);
    if (err == cudaErrorMemoryAllocation &&
        size > detail::SegmentCache::exact_segment_size(nbytes)) {
      (void)cudaGetLastError();  // no room for a region: a segment of the request's own size
      size = detail::SegmentCache::exact_segment_size(nbytes);
      err = cudaMalloc(&ptr, size);
    }
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      if (const size_t freed = free_segments(p); freed > 0) {
        DTRAIN_LOG(WARNING) << device.to_string() << ": cudaMalloc of " << size
                            << " bytes failed; freed " << freed
                            << " bytes of cached segments and retrying";
        err = cudaMalloc(&ptr, size);
      }
    }
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      (void)cudaGetLastError();
      lock.lock();
      throw Unavailable(detail::str_cat(
          device.to_string(), " is out of memory: cudaMalloc(", size, " bytes) failed with ",
          free_b >> 20, " MiB free of ", total_b >> 20, " MiB (dtrain holds ",
          p.cache.reserved() >> 20, " MiB, ", p.cache.cached() >> 20,
          " MiB of it free in pieces); reduce the batch size or the model, or use more GPUs"));
    }
    if (err != cudaSuccess) throw_cuda_error(err, "cudaMalloc", __FILE__, __LINE__);
    lock.lock();
    // Another thread may have freed a block that fits meanwhile; the new segment is cached
    // either way.
    p.cache.add_segment(ptr, size, nbytes);
    b = p.cache.take(nbytes);
    DTRAIN_CHECK(b.ptr, "CudaAllocator: a new segment did not serve its request");
  }
  return std::make_shared<Storage>(b.ptr, b.size, device, &CudaAllocator::release, &p);
}

void CudaAllocator::release(void* ctx, void* ptr, size_t nbytes) {
  auto* p = static_cast<Pool*>(ctx);
  std::lock_guard<std::mutex> lock(p->mu);
  p->cache.put(ptr, nbytes);
}

size_t CudaAllocator::free_segments(Pool& p) {
  std::vector<detail::SegmentCache::Block> segments;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    segments = p.cache.take_free_segments();  // out of the books: nobody can take them now
  }
  if (segments.empty()) return 0;
  DeviceGuard guard(p.index);
  // Queued kernels may still use a cached block (see the stream-ordering contract).
  DTRAIN_CUDA_CALL(cudaDeviceSynchronize());
  size_t bytes = 0;
  for (const auto& s : segments) {
    DTRAIN_CUDA_CALL(cudaFree(s.ptr));
    bytes += s.size;
  }
  return bytes;
}

size_t CudaAllocator::cached_bytes(int index) {
  Pool& p = pool(index);
  std::lock_guard<std::mutex> lock(p.mu);
  return p.cache.cached();
}

size_t CudaAllocator::reserved_bytes(int index) {
  Pool& p = pool(index);
  std::lock_guard<std::mutex> lock(p.mu);
  return p.cache.reserved();
}

void CudaAllocator::empty_cache(int index) { free_segments(pool(index)); }

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
