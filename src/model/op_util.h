#pragma once

#include <utility>

#include "dtrain/core/tensor.h"

namespace dtrain::ops {
// Throws InvalidArgument when a and b live on different devices.
void same_device(const char* op, const Tensor& a, const Tensor& b);

// What an op keeps for its backward pass. Under mixed_bfloat16 (dtrain/core/precision.h) a float32
// tensor on a device whose kernels read such copies (Kernels::hands_off_bfloat16: the CPU, CUDA
// GPUs from compute capability 8.0) is kept as a bfloat16 copy, half the memory, as Keras and
// PyTorch's autocast keep bfloat16 activations; otherwise the tensor itself. Ops that keep the same
// tensor share one copy (a ReLU's output and the convolutions that read it). Exact where the
// backward pass rounds what it reads to bfloat16 anyway (a convolution's input); batch norm rounds
// its input in the forward pass too, so that both passes see the same values.
Tensor keep_for_backward(const Tensor& x);
// The same where a kernel wrote x's bfloat16 copy `made` in the pass that wrote x (undefined: it
// did not): that copy is kept, and shared as keep_for_backward's, instead of a new one.
Tensor keep_for_backward(const Tensor& x, const Tensor& made);
// The copy keep_for_backward made of x for another op, if it did (and x is still the last few
// tensors copied), else x: for an op whose backward pass reads x rounded, but which would not make
// a copy of its own (a matmul reading a ReLU's output: it then shares the ReLU's copy).
Tensor kept_copy_if_made(const Tensor& x);
// Under mixed_bfloat16 on such a device, a bfloat16 copy of the float32 x for kernels that read it
// rounded (a convolution's gradient, read by both of its backward kernels), not remembered; else
// x.
Tensor kernel_copy(const Tensor& x);
// A matrix product's operands (ops::matmul, the batched products): under mixed_bfloat16 on such a
// device, when one tape records the product, the bfloat16 copies its kernel reads, which its
// backward pass then keeps and reads too (its products round the same operands: nothing is
// converted twice); else a and b. GPT-2 small converted each Dense layer's weight and input twice
// a step and its output gradient twice: 6 conversions a layer, now 3, for a bfloat16 copy of every
// weight held through the step (peak RSS 2,982 -> 3,103 MB). Not under nested tapes, which
// differentiate the backward pass itself.
// `made_a` (or undefined): a bfloat16 copy of a's values kept already (for the tensor a views),
// kept for a as it is.
std::pair<Tensor, Tensor> product_operands(const Tensor& a, const Tensor& b,
                                           const Tensor& made_a = Tensor());
// The incoming gradient g of a product whose backward pass reads the operands ka and kb: one
// kernel_copy for both of its products, unless an outer tape differentiates the backward pass.
Tensor product_gradient(const Tensor& g, const Tensor& ka, const Tensor& kb);
// Whether an op may hand x's consumer a bfloat16 activation where asked (Conv2D::bfloat16_output,
// BatchNormalization::bfloat16_output): under mixed_bfloat16 on a device whose kernels take them
// (Kernels::hands_off_bfloat16: the CPU's and the CUDA device's, where ops also keep bfloat16
// copies and the kernels read them). x is float32 or already such an activation.
bool bf16_activations(const Tensor& x);
// Drops this thread's references to the copies made (GradientTape calls it when gradient()
// starts, when a tape that never computed one is destroyed, and when the first tape is made).
void forget_kept_copies();
// Under mixed_bfloat16, x's values rounded to bfloat16 (float32; a new tensor), else x, on every
// device (keep_for_backward makes bfloat16 copies only where the kernels read them). For what is
// rounded but not kept (batch norm in inference, SyncBatchNorm, batch norm where no copy is kept);
// no copy is remembered.
Tensor rounded_under_policy(const Tensor& x);
}  // namespace dtrain::ops

namespace dtrain::tape_testing {
// How many backward passes of ops took their output's gradient in two parts (SumBackwardFn) on this
// thread, and turning that off (the sum made first, as before), so that a test compares the two.
uint64_t summed_in_backward();
void take_sums_in_backward(bool on);
}  // namespace dtrain::tape_testing
