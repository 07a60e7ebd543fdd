// Shape: the dimensions of a dense, row-major tensor. Plain value type.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "dtrain/core/export.h"

namespace dtrain {

class DTRAIN_API Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  // Dimension i; negative i counts from the end. Throws InvalidArgument when out of range.
  int64_t operator[](int i) const;
  int64_t numel() const;
  const std::vector<int64_t>& dims() const { return dims_; }
  std::vector<int64_t>& mutable_dims() { return dims_; }
  // "[64, 28, 28, 1]"
  std::string to_string() const;
  bool operator==(const Shape& o) const { return dims_ == o.dims_; }
  bool operator!=(const Shape& o) const { return dims_ != o.dims_; }

 private:
  std::vector<int64_t> dims_;
};

}  // namespace dtrain
