#pragma once

#include "dtrain/core/tensor.h"

namespace dtrain::ops {
// Throws InvalidArgument when a and b live on different devices.
void same_device(const char* op, const Tensor& a, const Tensor& b);

// Mixed bfloat16 matrix products on a device whose kernels read bfloat16 operands
// (Kernels::matmul_operand_dtype): whether ops::matmul converts operand x once, by a recorded cast,
// and keeps the copy for the backward pass. Activations are converted once: their product and both
// backward products read the one copy, and the tape keeps it (half the bytes) instead of the
// float32 tensor. A trainable variable is left to the kernel, which converts it at each product
// (twice a step): its float32 memory lives anyway, and keeping a converted copy of every weight
// from the forward to the backward pass (what PyTorch autocast's cast cache and Keras'
// AutoCastVariable do) cost GPT-2 small (4 x 256 tokens) 237 MB more at the allocator's peak, 3,580
// against 3,343 MB, for a difference in speed within the run-to-run noise.
bool convert_operand_once(const Tensor& x, DType operand);
}  // namespace dtrain::ops
