// Tensor: a handle to a dense, row-major block of typed memory on one device.
//
// Copying a Tensor copies the handle, not the data (like torch.Tensor / tf.Tensor). Each distinct
// tensor value has an id() that GradientTape uses to follow it; views made by reshape() or
// slice_rows() share memory but get a new id. Thread-safety: handles may be copied across threads;
// writing the same memory from two threads is the caller's race.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/allocator.h"
#include "dtrain/core/device_spec.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"
#include "dtrain/core/export.h"
#include "dtrain/core/shape.h"

namespace dtrain {

class DTRAIN_API Tensor {
 public:
  Tensor() = default;  // an undefined tensor; defined() is false

  // Uninitialised memory.
  static Tensor empty(const Shape& shape, DType dtype = DType::kFloat32,
                      DeviceSpec device = DeviceSpec::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::kFloat32,
                      DeviceSpec device = DeviceSpec::cpu());
  // Host data copied into a new tensor on `device`. Throws InvalidArgument if sizes differ.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape,
                            DeviceSpec device = DeviceSpec::cpu());
  static Tensor scalar(float v, DeviceSpec device = DeviceSpec::cpu()) {
    return from_vector<float>({v}, Shape{}, device);
  }
  // A tensor of `shape` with every element `v` (float32).
  static Tensor full(const Shape& shape, float v, DeviceSpec device = DeviceSpec::cpu());

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  DType dtype() const;
  DeviceSpec device() const;
  int64_t numel() const { return shape().numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  int rank() const { return shape().rank(); }
  uint64_t id() const;

  // Raw device pointer (valid on the tensor's device only).
  void* raw_data() const;
  // Host pointer of element type T. Throws FailedPrecondition for device memory and
  // InvalidArgument when T does not match dtype().
  template <typename T>
  T* data() const;

  // Values copied to the host, converted to T (float16/bfloat16 are widened).
  template <typename T>
  std::vector<T> to_vector() const;
  // The only element of a one-element tensor, as float.
  float item() const;

  // A copy on `device` (the same handle when already there).
  Tensor to(DeviceSpec device) const;
  // For host-memory devices (logical CPUs), a view of the same memory tagged with `device`; for
  // anything else the same as to(). Use for read-only inputs handed to another logical CPU device.
  Tensor share_to(DeviceSpec device) const;
  // A deep copy on the same device.
  Tensor clone() const;
  // A view with a new shape of equal numel. Throws InvalidArgument otherwise.
  Tensor view(const Shape& shape) const;
  // Rows [begin, end) of the leading dimension, sharing memory.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // Copies src's contents into this tensor (same shape and dtype; any devices).
  void copy_from(const Tensor& src);
  // "Tensor(float32, [2, 3], CPU:0)"
  std::string to_string() const;

  // Parameter sharding (ZeRO-3; dtrain/model/variable.h's ParameterGatherer), PyTorch FSDP's
  // storage resizing: release_memory() drops the memory of every handle of this tensor (views and
  // slices made earlier keep theirs), keeping its id, shape, dtype and device, so that a tape that
  // follows it still knows it; reading or writing its data then throws FailedPrecondition until
  // adopt_memory(src) makes every handle use src's memory (same shape, dtype and device).
  void release_memory();
  void adopt_memory(const Tensor& src);
  bool has_memory() const;

  // Tape bookkeeping: trainable variables mark their value so tapes watch it automatically.
  bool is_trainable_variable() const;
  void set_trainable_variable(bool v);

 private:
  struct Impl {
    std::shared_ptr<Storage> storage;
    std::shared_ptr<Storage> keep_alive;  // set by share_to(): the memory's real owner
    size_t offset = 0;
    Shape shape;
    DType dtype = DType::kFloat32;
    uint64_t id = 0;
    bool trainable_variable = false;
  };
  explicit Tensor(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const Impl& impl() const;
  static uint64_t next_id();
  std::shared_ptr<Impl> impl_;
};

}  // namespace dtrain
