// Private to the CPU device: the memory-bound elementwise passes whose output is too large for a
// core's caches (a ResNet-50 activation at batch 32 is 6-103 MB), written with streaming
// (non-temporal) stores. A normal store first reads the line it writes (read for ownership), so a
// pass c = a + b moves four tensors' bytes; streamed, three. One thread, 103 MB tensors, this Xeon:
// 24 ms -> 17 ms for a sum or a ReLU gradient, and oneDNN's primitives took 24-33 ms in a training
// step. Results are bitwise those of the oneDNN primitives they replace (cpu_stream_test).
#pragma once

#include <bit>
#include <cstdint>

namespace dtrain::cpu {

// The float32 value of bfloat16 bits (exact: the 16 bits above 16 zero bits). Inline, for the
// loops the compiler vectorises (core's bf16_to_float is a library call).
inline float widened_bf16(uint16_t v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v) << 16);
}

// Whether a pass writing `n` floats should stream: the CPU has AVX-512F or AVX2, the output is at
// least kStreamBytes, and DTRAIN_CPU_STREAM_STORES is not 0 (for comparisons).
inline constexpr int64_t kStreamBytes = 4 << 20;
bool stream_pass(int64_t n);

// The instructions a pass runs on: what the CPU has (kNone also when DTRAIN_CPU_STREAM_STORES=0:
// plain scalar stores); tests pass each explicitly.
enum class StreamIsa { kNone, kAvx2, kAvx512 };
StreamIsa stream_isa();

// c = a + b.
void stream_add(const float* a, const float* b, float* c, int64_t n, StreamIsa isa = stream_isa());
// c = relu(a + b), as oneDNN's binary add with a ReLU post-op (which takes relu(NaN) as 0).
void stream_add_relu(const float* a, const float* b, float* c, int64_t n,
                     StreamIsa isa = stream_isa());
// The same, and c16 = c rounded to bfloat16 (nearest even; c is never NaN) in the same pass: the
// copy ops keep of a residual block's output under mixed_bfloat16, without a pass of its own.
void stream_add_relu_rounded(const float* a, const float* b, float* c, uint16_t* c16, int64_t n,
                             StreamIsa isa = stream_isa());
// dx = y <= 0 ? 0 * dy : dy, as oneDNN's ReLU backward pass.
void stream_relu_grad(const float* y, const float* dy, float* dx, int64_t n,
                      StreamIsa isa = stream_isa());
// The same with y a bfloat16 copy (the one ops keep for ReLU's backward pass under
// mixed_bfloat16), read as it is: the results of widening it first, without that pass.
void stream_relu_grad(const uint16_t* y, const float* dy, float* dx, int64_t n,
                      StreamIsa isa = stream_isa());

// dx = ReLU's gradient (as stream_relu_grad) of dy = a + b, the sum never stored: the gradient of
// a ReLU's output that arrives in two parts (Kernels::relu_grad_of_sum). The bits of stream_add
// then stream_relu_grad.
void stream_relu_grad_sum(const float* y, const float* a, const float* b, float* dx, int64_t n,
                          StreamIsa isa = stream_isa());
void stream_relu_grad_sum(const uint16_t* y, const float* a, const float* b, float* dx, int64_t n,
                          StreamIsa isa = stream_isa());

}  // namespace dtrain::cpu
