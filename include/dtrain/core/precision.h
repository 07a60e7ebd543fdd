// Mixed precision, as Keras' mixed_precision policies: under "mixed_bfloat16" the convolutions and
// matrix products (forward and both backward passes) round their inputs — activations, weights and
// incoming gradients — to bfloat16 and run oneDNN's bfloat16 kernels (AVX512-BF16 on CPUs that have
// it), accumulating and returning float32. oneDNN has no bfloat16 kernels on CPUs without AVX-512
// (AVX2): there the inputs are rounded to bfloat16 and float32 kernels run them, the same numerics
// (but for Winograd's float32 rounding in the 3x3 layers it applies to, below) without the
// speed-up, and the device's description says so ("mixed_bfloat16 emulated"). The same path runs
// where the bfloat16 kernels exist but measure slower than float32's (timed once, at the first
// bfloat16 product; a Xeon without AMX: 0.5-0.67x); DTRAIN_BF16_KERNELS=native|emulated overrides
// that choice. Convolutions whose outputs sum fewer than 32 products (KH x KW x Cin: a small
// network's first layer) take that path wherever they run: oneDNN's bfloat16 kernels run them
// slower than float32 ones. Variables, optimizer state, losses and weight gradients stay float32,
// and so do activations between layers but where a layer asks to hand bfloat16 on (the ResNets'
// convolutions and batch norms: Conv2D::bfloat16_output), so it needs no loss scaling (bfloat16 has
// float32's range). Unlike Keras, most layer outputs are not rounded to bfloat16 as well; what is
// rounded is what the bfloat16 kernels read, and batch norm's input (Keras's convolution before it
// outputs bfloat16), in both passes. What the backward pass keeps of those tensors (a convolution's
// input, batch norm's input, a ReLU's output, both operands of a matrix product, weights
// included, as PyTorch's autocast and Keras' AutoCastVariable keep theirs) is kept as bfloat16
// copies: ResNet-50 at batch 32 holds 1.5 GB instead of 2.7 at the end of its forward pass, with
// the gradients of keeping the float32 tensors (ReLU's: except where its output is below 2^-133,
// bfloat16's smallest, which counts as 0).
//
//   dtrain::set_precision_policy(dtrain::Precision::kMixedBFloat16);   // --precision=bf16
//
// On CUDA devices (Ampere and later) the same products round the same inputs to bfloat16 and run
// on the GPU's tensor cores: cuBLAS's products and cuDNN's convolutions on bfloat16 operands
// (cuDNN's as TensorFloat-32 on the rounded values where it has no plan for bfloat16 data, or
// under DTRAIN_CUDNN_BF16=0: every bfloat16 value is a TF32 value). Their products are exact in
// float32, so the numerics are those of bfloat16 kernels that accumulate in float32, and of the
// CPU's. What the backward pass keeps is kept as bfloat16 copies there too, and the ResNets hand
// bfloat16 activations between their layers as on the CPU (Conv2D::bfloat16_output;
// DTRAIN_CUDA_BF16_HANDOFFS=0 keeps float32 ones). Measured on an H200 before those two changes
// (float32 activations and copies, cuDNN on TF32): 0.76-0.80x PyTorch's autocast; the changes have
// not yet run on a GPU (docs/gpu-performance.md).
//
// The policy is process-wide and read by the kernels each call; set it before training.
// Thread-safety: set and read atomically.
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

// TensorFloat-32 on NVIDIA GPUs (compute capability 8.0 and later), as TensorFlow's
// tf.config.experimental.enable_tensor_float_32_execution: float32 matrix products and
// convolutions may round their inputs to TF32 (10 bits of mantissa, float32's range) and run on
// tensor cores, accumulating in float32: several times the float32 speed, with about 1e-3
// relative error per product. Unlike TensorFlow (on) and PyTorch (on for cuDNN convolutions, off
// for matrix products), dtrain's default is off: float32 results stay within float32 rounding of
// the CPU device's, so a model trained on GPUs and checked on CPUs agrees, and the switch is one
// call or the examples' --tf32 flag. CPU devices ignore it (no CPU has TF32). Process-wide, read by
// each kernel call; thread-safe.
DTRAIN_API void enable_tensor_float_32_execution(bool enabled);
DTRAIN_API bool tensor_float_32_execution_enabled();

// Winograd convolutions on CPUs. F(4x4, 3x3) computes a 3x3, stride-1 float32 convolution with up
// to 4x fewer multiplications (36 a 4x4 output tile and channel pair, against 144): oneDNN's
// Winograd kernels on AVX-512 CPUs (ResNet-50's 3x3 layers 1.7-2.0x faster, forward and both
// gradients, reorders included, on a Zen 4 EPYC core at batch 32), dtrain's own on CPUs whose
// oneDNN has none (AVX2-only ones: 2.2-2.8x faster there, measured with the instruction sets capped
// to AVX2 on a Zen 5 EPYC; docs/cpu-performance.md). The price is rounding: about 5x float32 direct
// convolution's error with oneDNN's kernels (root-mean-square 8.5e-7 against 1.6e-7 on outputs of
// magnitude 1), about twice that with dtrain's (src/devices/cpu/cpu_winograd.h; a bfloat16
// operand's rounding is 4e-3, TF32's 5e-4), float32-accurate for training, and deterministic on one
// machine. dtrain uses them where they pay: float32 kernels (under mixed_bfloat16 only where a
// layer runs float32 kernels on operands rounded to bfloat16, on CPUs without oneDNN's bfloat16
// kernels or where those are slower: Winograd's error is far inside the operands' rounding; never
// on the bfloat16 kernels, whose products are bfloat16 ones), 3x3 filters, stride 1, at most 1
// pixel of padding, channel counts that are multiples of 16 and at least 16 output tiles of 4x4 an
// image (outputs of 13x13 and more: ResNet-50's 56x56, 28x28 and 14x14 layers, not its 7x7 ones),
// and not in the fused conv+pool op (ops::conv2d_max_pool2d). The kernels: oneDNN's where it has
// them (AVX-512; a shape its own conditions refuse runs direct), dtrain's where it has none, and
// for padding that differs between the two sides of a dimension (oneDNN 2.6's input gradient is
// wrong there). None of these conditions depends on the batch size, so a layer runs the same
// algorithm under every strategy, and strategies agree to rounding. Default on, as cuDNN picks
// Winograd for TensorFlow and PyTorch on GPUs; TensorFlow and PyTorch on CPUs run direct
// convolutions only. Off: this call or DTRAIN_CPU_CONV_WINOGRAD=0 (the starting value). CUDA
// devices ignore it (cuDNN chooses). Process-wide, read at each convolution; thread-safe.
DTRAIN_API void enable_winograd_convolutions(bool enabled);
DTRAIN_API bool winograd_convolutions_enabled();

}  // namespace dtrain
