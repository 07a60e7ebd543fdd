#pragma once

#include "dtrain/core/tensor.h"

namespace dtrain::ops {
// Throws InvalidArgument when a and b live on different devices.
void same_device(const char* op, const Tensor& a, const Tensor& b);
}  // namespace dtrain::ops
