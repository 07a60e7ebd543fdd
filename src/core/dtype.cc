#include "dtrain/core/dtype.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/cpu_isa.h"
#include "dtrain/core/error.h"

namespace dtrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  DTRAIN_CHECK(false, "unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

DType dtype_from_name(const std::string& name) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt32, DType::kInt64})
    if (name == dtype_name(t)) return t;
  throw InvalidArgument("unknown dtype '" + name +
                        "'; valid: float32, float64, float16, bfloat16, int32, int64");
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  // IEEE binary16 with round-to-nearest-even, handling subnormals, inf and nan.
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u)
    return static_cast<uint16_t>(sign | (absx > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (absx < 0x38800000u) {                                               // subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... yields the subnormal mantissa
    uint32_t r = m >> (shift);
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ((absx - 0x38000000u) >> 13);
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return static_cast<uint16_t>(sign | r);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1f;
  const uint32_t m = h & 0x3ff;
  float out;
  if (e == 0) {
    out = std::ldexp(static_cast<float>(m), -24);
  } else if (e == 31) {
    out = m ? NAN : INFINITY;
  } else {
    out = std::ldexp(static_cast<float>(m | 0x400), static_cast<int>(e) - 25);
  }
  uint32_t u;
  std::memcpy(&u, &out, 4);
  u |= sign;
  std::memcpy(&out, &u, 4);
  return out;
}

#if defined(__x86_64__)
namespace {
__attribute__((target("avx,f16c"))) void f32_to_f16_f16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = float_to_f16(in[i]);
}
__attribute__((target("avx,f16c"))) void f16_to_f32_f16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = f16_to_float(in[i]);
}
// (GCC 12 warns of the undefined upper lanes its own intrinsics start from.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// float32 <-> bfloat16, 16 at a time, the scalar functions' results (round to nearest even; every
// NaN to 0x7fc0); mixed_bfloat16 runs them over every kept activation. With ordinary stores they
// run at the speed of oneDNN 2.6's reorder (25.7M values on a Xeon core: 18-21 ms either way), so
// outputs of 4 MB and more, aligned to their vector, are written with streaming stores (no read for
// ownership: widening 17 -> 9 ms, narrowing 17 -> 16.5); they are past the caches by then anyway.
constexpr size_t kStreamBytes = size_t{4} << 20;
bool streams(const void* out, size_t bytes, size_t align) {
  return bytes >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % align == 0;
}
__attribute__((target("avx512f"))) void f32_to_bf16_avx512(const float* in, uint16_t* out,
                                                           size_t n) {
  const bool stream = streams(out, n * 2, 32);
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff),
                abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                qnan = _mm512_set1_epi32(0x7fc0);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(in + i);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, qnan);
    if (stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}
__attribute__((target("avx512f"))) void bf16_to_f32_avx512(const uint16_t* in, float* out,
                                                           size_t n) {
  const bool stream = streams(out, n * 4, 64);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i h =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), _mm512_slli_epi32(h, 16));
    else
      _mm512_storeu_si512(out + i, _mm512_slli_epi32(h, 16));
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}
#pragma GCC diagnostic pop
// The same 8 at a time on AVX2 (AVX2-only CPUs, where the scalar loops ran before 2026-11-29: 17%
// of ResNet-50's mixed bfloat16 step under DTRAIN_MAX_CPU_ISA=avx2). Ordinary stores.
__attribute__((target("avx2"))) void f32_to_bf16_avx2(const float* in, uint16_t* out, size_t n) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff),
                abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000),
                qnan = _mm256_set1_epi32(0x7fc0);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    // |u| > infinity's bits: a NaN (both sides non-negative as signed 32-bit integers)
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    r = _mm256_blendv_epi8(r, qnan, nan);
    // 8 values of at most 0xffff to 16 bits: packus works within each 128-bit half
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}
__attribute__((target("avx2"))) void bf16_to_f32_avx2(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(h, 16));
  }
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}
// Asked at each call, not in static initializers (a bad DTRAIN_MAX_CPU_ISA throws).
bool have_f16c() { return detail::cpu_supports(detail::CpuFeature::kAvxF16c); }
bool have_avx512() { return detail::cpu_supports(detail::CpuFeature::kAvx512f); }
bool have_avx2() { return detail::cpu_supports(detail::CpuFeature::kAvx2Fma); }
}  // namespace
#endif

void floats_to_f16(const float* in, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  if (have_f16c()) return f32_to_f16_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = float_to_f16(in[i]);
}

void floats_to_bf16(const float* in, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  if (have_avx512()) return f32_to_bf16_avx512(in, out, n);
  if (have_avx2()) return f32_to_bf16_avx2(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

void bf16_to_floats(const uint16_t* in, float* out, size_t n) {
#if defined(__x86_64__)
  if (have_avx512()) return bf16_to_f32_avx512(in, out, n);
  if (have_avx2()) return bf16_to_f32_avx2(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void f16_to_floats(const uint16_t* in, float* out, size_t n) {
#if defined(__x86_64__)
  if (have_f16c()) return f16_to_f32_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_float(in[i]);
}

}  // namespace dtrain
