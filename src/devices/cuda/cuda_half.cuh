// Device-side float16 / bfloat16 conversions. Narrowing is a line-for-line port of the host's
// float_to_f16 / float_to_bf16 (src/core/dtype.cc) rather than __float2half_rn /
// __float2bfloat16, so that a cast produces the same bits on every device, NaNs included.
// Widening is exact, so the CUDA intrinsics are used.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "devices/cuda/cuda_common.cuh"
#include "dtrain/core/dtype.h"

namespace dtrain::cuda {

// Storage-only element types for kernels templated on the element type.
struct Half16 {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
  if (isnan(f)) return 0x7fc0;
  uint32_t u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ uint16_t float_to_half_bits(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u)
    return static_cast<uint16_t>(sign | (absx > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (absx < 0x38800000u) {                                               // subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (absx - 0x38000000u) >> 13;
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// Element access for kernels templated on float or bfloat16 arrays (uint16_t bits: an activation
// or a kept copy in bfloat16 under mixed_bfloat16, CudaKernels::hands_off_bfloat16). Narrowing
// rounds as the CPU's (float_to_bf16_bits: nearest even, a NaN to 0x7fc0).
__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const uint16_t* p, int64_t i) {
  return bf16_bits_to_float(p[i]);
}
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(uint16_t* p, int64_t i, float v) {
  p[i] = float_to_bf16_bits(v);
}
// Four elements from i (a multiple of 4; the arrays 16-byte aligned: vec4_ok).
__device__ __forceinline__ float4 ld4(const float* p, int64_t i) { return load4(p, i); }
__device__ __forceinline__ float4 ld4(const uint16_t* p, int64_t i) {
  const uint2 u = *reinterpret_cast<const uint2*>(p + i);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ void st4(float* p, int64_t i, float4 v) { store4(p, i, v); }
__device__ __forceinline__ void st4(uint16_t* p, int64_t i, float4 v) {
  const uint32_t a = float_to_bf16_bits(v.x), b = float_to_bf16_bits(v.y),
                 c = float_to_bf16_bits(v.z), d = float_to_bf16_bits(v.w);
  *reinterpret_cast<uint2*>(p + i) = make_uint2(a | (b << 16), c | (d << 16));
}

// Calls f with a value of the element type that dtype names (float, or uint16_t for bfloat16).
template <typename F>
void with_type(DType dtype, F&& f) {
  if (dtype == DType::kBFloat16)
    f(uint16_t{});
  else
    f(float{});
}

}  // namespace dtrain::cuda
