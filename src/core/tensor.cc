#include "dtrain/core/tensor.h"

#include <atomic>
#include <cstring>

namespace dtrain {

uint64_t Tensor::next_id() {
  static std::atomic<uint64_t> counter{1};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

const Tensor::Impl& Tensor::impl() const {
  if (!impl_)
    throw FailedPrecondition("use of an undefined Tensor (default-constructed or moved-from)");
  return *impl_;
}

const Shape& Tensor::shape() const { return impl().shape; }
DType Tensor::dtype() const { return impl().dtype; }
DeviceSpec Tensor::device() const { return impl().storage->device(); }
uint64_t Tensor::id() const { return impl().id; }
void* Tensor::raw_data() const {
  const Impl& i = impl();
  if (i.storage->data() == nullptr && i.storage->nbytes() == 0 && i.shape.numel() > 0)
    throw FailedPrecondition(
        "use of a tensor whose memory was released (MirroredOptions::sharding): a gradient "
        "tape.gradient() returned, whose values went into the reduce-scatter (kGradients, "
        "kParameters: pass it to apply_gradients unchanged), or a variable's whole value outside "
        "the layer that gathers it (kParameters: read it inside that layer's call, or save a "
        "checkpoint and restore it unsharded)");
  return static_cast<char*>(i.storage->data()) + i.offset;
}
void Tensor::release_memory() {
  Impl& i = const_cast<Impl&>(impl());
  i.storage = std::make_shared<Storage>(nullptr, 0, i.storage->device(), nullptr, nullptr);
  i.keep_alive.reset();
  i.offset = 0;
}
void Tensor::adopt_memory(const Tensor& src) {
  Impl& i = const_cast<Impl&>(impl());
  const Impl& s = src.impl();
  if (s.shape.numel() != i.shape.numel() || s.dtype != i.dtype ||
      s.storage->device() != i.storage->device())
    throw InvalidArgument("adopt_memory: " + src.to_string() + " for " + to_string());
  i.storage = s.storage;
  i.keep_alive = s.keep_alive;
  i.offset = s.offset;
}
bool Tensor::has_memory() const {
  const Impl& i = impl();
  return i.storage->data() != nullptr || i.storage->nbytes() != 0 || i.shape.numel() == 0;
}
bool Tensor::is_trainable_variable() const { return impl().trainable_variable; }
void Tensor::set_trainable_variable(bool v) {
  impl();
  impl_->trainable_variable = v;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, DeviceSpec device) {
  for (int64_t d : shape.dims())
    if (d < 0) throw InvalidArgument("negative dimension in shape " + shape.to_string());
  auto impl = std::make_shared<Impl>();
  impl->storage = allocator_for(device).allocate(
      static_cast<size_t>(shape.numel()) * dtype_size(dtype), device);
  impl->shape = shape;
  impl->dtype = dtype;
  impl->id = next_id();
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, DeviceSpec device) {
  Tensor t = empty(shape, dtype, device);
  allocator_for(device).zero(t.raw_data(), t.nbytes());
  return t;
}

Tensor Tensor::full(const Shape& shape, float v, DeviceSpec device) {
  std::vector<float> values(static_cast<size_t>(shape.numel()), v);
  return from_vector(values, shape, device);
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape, DeviceSpec device) {
  if (static_cast<int64_t>(values.size()) != shape.numel())
    throw InvalidArgument(detail::str_cat("from_vector: ", values.size(), " values for shape ",
                                          shape.to_string(), " which holds ", shape.numel()));
  Tensor t = empty(shape, dtype_of<T>(), device);
  allocator_for(device).copy(t.raw_data(), device, values.data(), DeviceSpec::cpu(),
                             values.size() * sizeof(T));
  return t;
}

template <typename T>
T* Tensor::data() const {
  if (!device().host_accessible())
    throw FailedPrecondition("data<T>() on a tensor in " + device().to_string() +
                             " memory; call .to(DeviceSpec::cpu()) first");
  if (dtype() != dtype_of<T>())
    throw InvalidArgument(std::string("data<T>() type mismatch: tensor holds ") +
                          dtype_name(dtype()));
  return static_cast<T*>(raw_data());
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  Tensor h = to(DeviceSpec::cpu());
  const int64_t n = numel();
  std::vector<T> out(static_cast<size_t>(n));
  const void* p = h.raw_data();
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype()) {
      case DType::kFloat32:
        out[i] = static_cast<T>(static_cast<const float*>(p)[i]);
        break;
      case DType::kFloat64:
        out[i] = static_cast<T>(static_cast<const double*>(p)[i]);
        break;
      case DType::kInt32:
        out[i] = static_cast<T>(static_cast<const int32_t*>(p)[i]);
        break;
      case DType::kInt64:
        out[i] = static_cast<T>(static_cast<const int64_t*>(p)[i]);
        break;
      case DType::kBFloat16:
        out[i] = static_cast<T>(bf16_to_float(static_cast<const uint16_t*>(p)[i]));
        break;
      case DType::kFloat16:
        out[i] = static_cast<T>(f16_to_float(static_cast<const uint16_t*>(p)[i]));
        break;
    }
  }
  return out;
}

float Tensor::item() const {
  if (numel() != 1)
    throw InvalidArgument("item() needs a one-element tensor, got shape " + shape().to_string());
  return to_vector<float>()[0];
}

Tensor Tensor::to(DeviceSpec dst) const {
  if (device() == dst) return *this;
  // Logical CPU devices share host RAM, but a view with a new device tag would alias memory that
  // another replica writes, so even CPU:0 -> CPU:1 copies.
  Tensor out = empty(shape(), dtype(), dst);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::share_to(DeviceSpec dst) const {
  if (device() == dst || !device().host_accessible() || !dst.host_accessible()) return to(dst);
  auto impl = std::make_shared<Impl>(this->impl());
  // A storage handle that keeps the original alive but reports the new device.
  auto owner = impl->storage;
  impl->storage = std::make_shared<Storage>(owner->data(), owner->nbytes(), dst, nullptr, nullptr);
  impl->keep_alive = owner;
  impl->id = next_id();
  impl->trainable_variable = false;
  return Tensor(std::move(impl));
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype(), device());
  out.copy_from(*this);
  return out;
}

void Tensor::copy_from(const Tensor& src) {
  if (src.shape() != shape() || src.dtype() != dtype())
    throw InvalidArgument("copy_from: " + src.to_string() + " into " + to_string());
  DeviceSpec via = device().host_accessible() ? src.device() : device();
  allocator_for(via).copy(raw_data(), device(), src.raw_data(), src.device(), nbytes());
}

Tensor Tensor::view(const Shape& s) const {
  if (s.numel() != numel())
    throw InvalidArgument("cannot view " + to_string() + " as shape " + s.to_string() +
                          ": element counts differ");
  auto impl = std::make_shared<Impl>(this->impl());
  impl->shape = s;
  impl->id = next_id();
  impl->trainable_variable = false;
  return Tensor(std::move(impl));
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  const Shape& s = shape();
  if (s.rank() == 0 || begin < 0 || end < begin || end > s[0])
    throw InvalidArgument(
        detail::str_cat("slice_rows(", begin, ", ", end, ") out of range for ", to_string()));
  auto impl = std::make_shared<Impl>(this->impl());
  const int64_t row = s[0] == 0 ? 0 : numel() / s[0];
  impl->offset += static_cast<size_t>(begin * row) * dtype_size(dtype());
  impl->shape.mutable_dims()[0] = end - begin;
  impl->id = next_id();
  impl->trainable_variable = false;
  return Tensor(std::move(impl));
}

std::string Tensor::to_string() const {
  if (!impl_) return "Tensor(undefined)";
  return std::string("Tensor(") + dtype_name(dtype()) + ", " + shape().to_string() + ", " +
         device().to_string() + ")";
}

#define DTRAIN_INSTANTIATE(T)                                                              \
  template Tensor Tensor::from_vector<T>(const std::vector<T>&, const Shape&, DeviceSpec); \
  template T* Tensor::data<T>() const;                                                     \
  template std::vector<T> Tensor::to_vector<T>() const;
DTRAIN_INSTANTIATE(float)
DTRAIN_INSTANTIATE(double)
DTRAIN_INSTANTIATE(int32_t)
DTRAIN_INSTANTIATE(int64_t)
#undef DTRAIN_INSTANTIATE

}  // namespace dtrain
