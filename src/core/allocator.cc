#include "dtrain/core/allocator.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain {
namespace {

// Size-exact free lists. Training allocates the same sizes every step, so after the first step
// every allocation is a cache hit and no page is faulted in again.
class CachingHostAllocator final : public Allocator {
 public:
  ~CachingHostAllocator() override {
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) std::free(p);
  }

  std::shared_ptr<Storage> allocate(size_t nbytes, DeviceSpec device) override {
    const size_t rounded = round_up(nbytes == 0 ? 64 : nbytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(rounded);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= rounded;
      }
    }
    if (!p) {
      p = std::aligned_alloc(64, rounded);
      if (!p)
        throw Unavailable(detail::str_cat("out of host memory allocating ", rounded,
                                          " bytes; reduce the batch size"));
    }
    return std::make_shared<Storage>(p, rounded, device, &CachingHostAllocator::release, this);
  }

  void copy(void* dst, DeviceSpec, const void* src, DeviceSpec, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }
  void zero(void* dst, size_t nbytes) override {
    if (nbytes) std::memset(dst, 0, nbytes);
  }

 private:
  static constexpr size_t kMaxCachedBytes = size_t{2} << 30;
  static size_t round_up(size_t n) { return (n + 63) & ~size_t{63}; }
  static void release(void* ctx, void* ptr, size_t nbytes) {
    auto* self = static_cast<CachingHostAllocator*>(ctx);
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (self->cached_bytes_ + nbytes <= kMaxCachedBytes) {
        self->free_[nbytes].push_back(ptr);
        self->cached_bytes_ += nbytes;
        return;
      }
    }
    std::free(ptr);
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_bytes_ = 0;
};

std::mutex g_registry_mu;
Allocator* g_cuda_allocator = nullptr;

}  // namespace

Allocator& host_allocator() {
  // Leaked on purpose: tensors held by static objects may be released after main returns.
  static auto* a = new CachingHostAllocator();
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
