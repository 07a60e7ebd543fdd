#include "dtrain/core/shape.h"

#include "dtrain/core/error.h"

namespace dtrain {

int64_t Shape::operator[](int i) const {
  const int r = rank();
  if (i < -r || i >= r)
    throw InvalidArgument(
        detail::str_cat("dimension ", i, " out of range for shape ", to_string()));
  return dims_[static_cast<size_t>(i < 0 ? i + r : i)];
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int64_t d : dims_) n *= d;
  return n;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  return s + "]";
}

}  // namespace dtrain
