#include "devices/cpu/cpu_stream.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/cpu_isa.h"

namespace dtrain::cpu {
namespace {

// The scalar forms (the peeled head, until the output is aligned, and the tail) and the vector
// ones, each with oneDNN 2.6's exact results (cpu_stream_test probes them): its ReLU is max(x, 0)
// as the max instruction takes it, so relu(NaN) = 0 and relu(-0) = +0; its ReLU gradient is
// y <= 0 ? 0 * dy : dy, so a NaN y passes dy on and a NaN or infinite dy at y <= 0 gives NaN.
struct Add {
  static float scalar(float a, float b) { return a + b; }
  __attribute__((target("avx512f"))) static __m512 v512(__m512 a, __m512 b) {
    return _mm512_add_ps(a, b);
  }
  __attribute__((target("avx2"))) static __m256 v256(__m256 a, __m256 b) {
    return _mm256_add_ps(a, b);
  }
};
struct AddRelu {
  static float scalar(float a, float b) {
    const float s = a + b;
    return s > 0.f ? s : 0.f;
  }
  __attribute__((target("avx512f"))) static __m512 v512(__m512 a, __m512 b) {
    const __m512 s = _mm512_add_ps(a, b);  // s > 0 ? s : +0, the max instruction's answer
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), s);
  }
  __attribute__((target("avx2"))) static __m256 v256(__m256 a, __m256 b) {
    return _mm256_max_ps(_mm256_add_ps(a, b), _mm256_setzero_ps());
  }
};
struct ReluGrad {  // a = y, b = dy
  static float scalar(float y, float g) { return y <= 0.f ? 0.f * g : g; }
  __attribute__((target("avx512f"))) static __m512 v512(__m512 y, __m512 g) {
    const __mmask16 off = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LE_OQ);
    return _mm512_mask_mov_ps(g, off, _mm512_mul_ps(g, _mm512_setzero_ps()));
  }
  __attribute__((target("avx2"))) static __m256 v256(__m256 y, __m256 g) {
    const __m256 off = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LE_OQ);
    return _mm256_blendv_ps(g, _mm256_mul_ps(g, _mm256_setzero_ps()), off);
  }
};

// The output's first elements until it is aligned for streaming stores; the count.
inline int64_t head(const float* c, int64_t n, int64_t align) {
  const auto addr = reinterpret_cast<uintptr_t>(c);
  const int64_t off = static_cast<int64_t>((align - addr % align) % align);
  if (off % 4 != 0) return -1;  // not even float-aligned: no streaming
  return std::min<int64_t>(n, off / 4);
}

// The first operand as float32: float32 itself, or a bfloat16 copy widened as it is read (the
// ReLU gradient's kept y under mixed_bfloat16).
inline float at(const float* a, int64_t i) { return a[i]; }
inline float at(const uint16_t* a, int64_t i) { return widened_bf16(a[i]); }
__attribute__((target("avx512f"))) inline __m512 load512(const float* a) {
  return _mm512_loadu_ps(a);
}
__attribute__((target("avx512f"))) inline __m512 load512(const uint16_t* a) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  // (The maskz forms with every lane set: GCC 12 warns on the plain ones' undefined pass-through
  // operand, as in cpu_pool.cc.)
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h), 16));
}
__attribute__((target("avx2"))) inline __m256 load256(const float* a) { return _mm256_loadu_ps(a); }
__attribute__((target("avx2"))) inline __m256 load256(const uint16_t* a) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename Op, typename A>
__attribute__((target("avx512f"))) void run512(const A* a, const float* b, float* c, int64_t n) {
  int64_t i = head(c, n, 64);
  if (i < 0) {
    for (int64_t j = 0; j < n; ++j) c[j] = Op::scalar(at(a, j), b[j]);
    return;
  }
  for (int64_t j = 0; j < i; ++j) c[j] = Op::scalar(at(a, j), b[j]);
  for (; i + 16 <= n; i += 16)
    _mm512_stream_ps(c + i, Op::v512(load512(a + i), _mm512_loadu_ps(b + i)));
  for (; i < n; ++i) c[i] = Op::scalar(at(a, i), b[i]);
  _mm_sfence();
}

template <typename Op, typename A>
__attribute__((target("avx2"))) void run256(const A* a, const float* b, float* c, int64_t n) {
  int64_t i = head(c, n, 32);
  if (i < 0) {
    for (int64_t j = 0; j < n; ++j) c[j] = Op::scalar(at(a, j), b[j]);
    return;
  }
  for (int64_t j = 0; j < i; ++j) c[j] = Op::scalar(at(a, j), b[j]);
  for (; i + 8 <= n; i += 8)
    _mm256_stream_ps(c + i, Op::v256(load256(a + i), _mm256_loadu_ps(b + i)));
  for (; i < n; ++i) c[i] = Op::scalar(at(a, i), b[i]);
  _mm_sfence();
}

// v (not NaN) rounded to bfloat16, nearest even: float_to_bf16's bits.
inline uint16_t rounded16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// (GCC 12 warns of the undefined upper lanes its own conversion intrinsics start from.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) inline __m256i rounded16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16));
}
__attribute__((target("avx2"))) inline __m128i rounded16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  // (Each lane at most 0xffff: the unsigned-saturating pack is exact.)
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#pragma GCC diagnostic pop

__attribute__((target("avx512f"))) void add_relu_rounded512(const float* a, const float* b,
                                                            float* c, uint16_t* c16, int64_t n) {
  int64_t i = head(c, n, 64);
  const auto scalar = [&](int64_t j) {
    c[j] = AddRelu::scalar(a[j], b[j]);
    c16[j] = rounded16(c[j]);
  };
  if (i < 0) {
    for (int64_t j = 0; j < n; ++j) scalar(j);
    return;
  }
  for (int64_t j = 0; j < i; ++j) scalar(j);
  const bool stream16 = reinterpret_cast<uintptr_t>(c16 + i) % 32 == 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 s = AddRelu::v512(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i));
    _mm512_stream_ps(c + i, s);
    if (stream16)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(c16 + i), rounded16x16(s));
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c16 + i), rounded16x16(s));
  }
  for (; i < n; ++i) scalar(i);
  _mm_sfence();
}

__attribute__((target("avx2"))) void add_relu_rounded256(const float* a, const float* b, float* c,
                                                         uint16_t* c16, int64_t n) {
  int64_t i = head(c, n, 32);
  const auto scalar = [&](int64_t j) {
    c[j] = AddRelu::scalar(a[j], b[j]);
    c16[j] = rounded16(c[j]);
  };
  if (i < 0) {
    for (int64_t j = 0; j < n; ++j) scalar(j);
    return;
  }
  for (int64_t j = 0; j < i; ++j) scalar(j);
  for (; i + 8 <= n; i += 8) {
    const __m256 s = AddRelu::v256(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    _mm256_stream_ps(c + i, s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c16 + i), rounded16x8(s));
  }
  for (; i < n; ++i) scalar(i);
  _mm_sfence();
}

// dx = ReluGrad(y, a + b): the ReLU gradient of a gradient that arrives in two parts (a residual
// block's input: its shortcut's and its first convolution's), the sum never stored. The same bits
// as stream_add then stream_relu_grad.
template <typename Y>
__attribute__((target("avx512f"))) void relu_grad_sum512(const Y* y, const float* a, const float* b,
                                                         float* dx, int64_t n) {
  int64_t i = head(dx, n, 64);
  const auto scalar = [&](int64_t j) { dx[j] = ReluGrad::scalar(at(y, j), a[j] + b[j]); };
  if (i < 0) {
    for (int64_t j = 0; j < n; ++j) scalar(j);
    return;
  }
  for (int64_t j = 0; j < i; ++j) scalar(j);
  for (; i + 16 <= n; i += 16)
    _mm512_stream_ps(dx + i, ReluGrad::v512(load512(y + i), _mm512_add_ps(_mm512_loadu_ps(a + i),
                                                                          _mm512_loadu_ps(b + i))));
  for (; i < n; ++i) scalar(i);
  _mm_sfence();
}

template <typename Y>
__attribute__((target("avx2"))) void relu_grad_sum256(const Y* y, const float* a, const float* b,
                                                      float* dx, int64_t n) {
  int64_t i = head(dx, n, 32);
  const auto scalar = [&](int64_t j) { dx[j] = ReluGrad::scalar(at(y, j), a[j] + b[j]); };
  if (i < 0) {
    for (int64_t j = 0; j < n; ++j) scalar(j);
    return;
  }
  for (int64_t j = 0; j < i; ++j) scalar(j);
  for (; i + 8 <= n; i += 8)
    _mm256_stream_ps(dx + i, ReluGrad::v256(load256(y + i), _mm256_add_ps(_mm256_loadu_ps(a + i),
                                                                          _mm256_loadu_ps(b + i))));
  for (; i < n; ++i) scalar(i);
  _mm_sfence();
}

template <typename Y>
void relu_grad_sum(const Y* y, const float* a, const float* b, float* dx, int64_t n,
                   StreamIsa isa) {
  if (isa == StreamIsa::kAvx512) return relu_grad_sum512(y, a, b, dx, n);
  if (isa == StreamIsa::kAvx2) return relu_grad_sum256(y, a, b, dx, n);
  for (int64_t i = 0; i < n; ++i) dx[i] = ReluGrad::scalar(at(y, i), a[i] + b[i]);
}

template <typename Op, typename A>
void run(const A* a, const float* b, float* c, int64_t n, StreamIsa isa) {
  if (isa == StreamIsa::kAvx512)
    run512<Op>(a, b, c, n);
  else if (isa == StreamIsa::kAvx2)
    run256<Op>(a, b, c, n);
  else
    for (int64_t i = 0; i < n; ++i) c[i] = Op::scalar(at(a, i), b[i]);
}

}  // namespace

StreamIsa stream_isa() {
  static const StreamIsa v = [] {
    const char* e = std::getenv("DTRAIN_CPU_STREAM_STORES");
    if (e && std::string(e) == "0") return StreamIsa::kNone;
    if (detail::cpu_supports(detail::CpuFeature::kAvx512f)) return StreamIsa::kAvx512;
    if (detail::cpu_supports(detail::CpuFeature::kAvx2Fma)) return StreamIsa::kAvx2;
    return StreamIsa::kNone;
  }();
  return v;
}

bool stream_pass(int64_t n) { return stream_isa() != StreamIsa::kNone && n * 4 >= kStreamBytes; }

void stream_add(const float* a, const float* b, float* c, int64_t n, StreamIsa isa) {
  run<Add>(a, b, c, n, isa);
}
void stream_add_relu(const float* a, const float* b, float* c, int64_t n, StreamIsa isa) {
  run<AddRelu>(a, b, c, n, isa);
}
void stream_add_relu_rounded(const float* a, const float* b, float* c, uint16_t* c16, int64_t n,
                             StreamIsa isa) {
  if (isa == StreamIsa::kAvx512) return add_relu_rounded512(a, b, c, c16, n);
  if (isa == StreamIsa::kAvx2) return add_relu_rounded256(a, b, c, c16, n);
  for (int64_t i = 0; i < n; ++i) {
    c[i] = AddRelu::scalar(a[i], b[i]);
    c16[i] = rounded16(c[i]);
  }
}
void stream_relu_grad(const float* y, const float* dy, float* dx, int64_t n, StreamIsa isa) {
  run<ReluGrad>(y, dy, dx, n, isa);
}
void stream_relu_grad(const uint16_t* y, const float* dy, float* dx, int64_t n, StreamIsa isa) {
  run<ReluGrad>(y, dy, dx, n, isa);
}

void stream_relu_grad_sum(const float* y, const float* a, const float* b, float* dx, int64_t n,
                          StreamIsa isa) {
  relu_grad_sum(y, a, b, dx, n, isa);
}
void stream_relu_grad_sum(const uint16_t* y, const float* a, const float* b, float* dx, int64_t n,
                          StreamIsa isa) {
  relu_grad_sum(y, a, b, dx, n, isa);
}

}  // namespace dtrain::cpu
