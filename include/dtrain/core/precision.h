// Mixed precision, as Keras' mixed_precision policies: under "mixed_bfloat16" the convolutions and
// matrix products (forward and both backward passes) round their inputs — activations, weights and
// incoming gradients — to bfloat16 and run oneDNN's bfloat16 kernels (AVX512-BF16 on CPUs that have
// it), accumulating and returning float32. oneDNN has no bfloat16 kernels on CPUs without AVX-512
// (AVX2): there the inputs are rounded to bfloat16 and float32 kernels run them, the same numerics
// without the speed-up, and the device's description says so ("mixed_bfloat16 emulated"). The same
// path runs where the bfloat16 kernels exist but measure slower than float32's (timed once, at the
// first bfloat16 product; a Xeon without AMX: 0.5-0.67x); DTRAIN_BF16_KERNELS=native|emulated
// overrides that choice.
// Variables, optimizer state, activations between layers, losses and gradients stay float32, so it
// needs no loss scaling (bfloat16 has float32's range).
// Unlike Keras, most layer outputs are not rounded to bfloat16 as well; what is rounded is what
// the bfloat16 kernels read, and batch norm's input (Keras's convolution before it outputs
// bfloat16), in both passes. What the backward pass keeps of those tensors (a convolution's
// input, batch norm's input, a ReLU's output) is kept as bfloat16 copies: ResNet-50 at batch 32
// holds 1.5 GB instead of 2.7 at the end of its forward pass, with the gradients of keeping the
// float32 tensors (ReLU's: except where its output is below 2^-133, bfloat16's smallest, which
// counts as 0).
//
//   dtrain::set_precision_policy(dtrain::Precision::kMixedBFloat16);   // --precision=bf16
//
// The policy is process-wide and read by the CPU kernels each call; set it before training. CUDA
// devices do not implement it yet: their kernels throw Unimplemented under it, never run float32
// silently. Thread-safety: set and read atomically.
#pragma once

#include <string>

#include "dtrain/core/export.h"

namespace dtrain {

enum class Precision { kFloat32, kMixedBFloat16 };

DTRAIN_API void set_precision_policy(Precision p);
DTRAIN_API Precision precision_policy();
// "fp32" / "float32", "bf16" / "mixed_bfloat16"; InvalidArgument naming the accepted values.
DTRAIN_API Precision parse_precision(const std::string& name);
DTRAIN_API const char* precision_name(Precision p);  // "float32", "mixed_bfloat16"

}  // namespace dtrain
