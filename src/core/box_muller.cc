#include "core/box_muller.h"

#include <cmath>
#include <iterator>
#include <string_view>

#include "core/cpu_isa.h"

#if defined(DTRAIN_HAVE_LIBMVEC) && defined(__x86_64__)
#include <immintrin.h>
#define DTRAIN_BOX_MULLER_SIMD 1
// glibc's vector math (libmvec), by its x86_64 vector ABI names: 'e' is AVX-512 with 8 doubles,
// 'd' AVX2 with 4.
extern "C" {
__attribute__((target("avx512f"))) __m512d _ZGVeN8v_log(__m512d);
__attribute__((target("avx512f"))) __m512d _ZGVeN8v_cos(__m512d);
__attribute__((target("avx2,fma"))) __m256d _ZGVdN4v_log(__m256d);
__attribute__((target("avx2,fma"))) __m256d _ZGVdN4v_cos(__m256d);
}
#endif

namespace dtrain::detail {

float box_muller(uint32_t w0, uint32_t w1) {
  const double u1 = (static_cast<double>(w0) + 1.0) / 4294967297.0;  // (0, 1]
  const double u2 = static_cast<double>(w1) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

namespace {

void fill_scalar(const uint32_t* w0, const uint32_t* w1, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = box_muller(w0[k], w1[k]);
}

#ifdef DTRAIN_BOX_MULLER_SIMD
// (GCC 12 warns of the undefined upper lanes its own intrinsics start from.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The margin: a result within kMargin * |r| of a float rounding boundary goes the scalar way.
constexpr double kMargin = 0x1p-40;

// Lanes whose float differs at r (1 - margin) or r (1 + margin) from r's (bits of `same` clear):
// redone by the scalar path.
inline void redo_near_ties(int same, int lanes, const uint32_t* w0, const uint32_t* w1,
                           float* out) {
  for (int i = 0; i < lanes; ++i)
    if (!(same >> i & 1)) out[i] = box_muller(w0[i], w1[i]);
}

__attribute__((target("avx512f"))) void fill_avx512(const uint32_t* w0, const uint32_t* w1,
                                                    int64_t n, float* out) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m512d a =
        _mm512_cvtepu32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k)));
    const __m512d b =
        _mm512_cvtepu32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k)));
    // The scalar path's operations in its order: each one rounds the same.
    const __m512d u1 =
        _mm512_div_pd(_mm512_add_pd(a, _mm512_set1_pd(1.0)), _mm512_set1_pd(4294967297.0));
    const __m512d u2 = _mm512_div_pd(b, _mm512_set1_pd(4294967296.0));
    const __m512d radius = _mm512_sqrt_pd(_mm512_mul_pd(_mm512_set1_pd(-2.0), _ZGVeN8v_log(u1)));
    const __m512d r =
        _mm512_mul_pd(radius, _ZGVeN8v_cos(_mm512_mul_pd(_mm512_set1_pd(2.0 * M_PI), u2)));
    const __m512d e = _mm512_mul_pd(_mm512_abs_pd(r), _mm512_set1_pd(kMargin));
    const __m256 f = _mm512_cvtpd_ps(r);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_sub_pd(r, e));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_add_pd(r, e));
    _mm256_storeu_ps(out + k, f);
    const int same = _mm256_movemask_ps(
        _mm256_and_ps(_mm256_cmp_ps(lo, f, _CMP_EQ_OQ), _mm256_cmp_ps(hi, f, _CMP_EQ_OQ)));
    if (same != 0xff) redo_near_ties(same, 8, w0 + k, w1 + k, out + k);
  }
  fill_scalar(w0 + k, w1 + k, n - k, out + k);
}

// uint32 -> double on AVX2 (no unsigned conversion): as a signed value less 2^31, plus 2^31; exact.
__attribute__((target("avx2,fma"))) inline __m256d widened_u32(const uint32_t* w) {
  const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)),
                                  _mm_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_add_pd(_mm256_cvtepi32_pd(v), _mm256_set1_pd(2147483648.0));
}

__attribute__((target("avx2,fma"))) void fill_avx2(const uint32_t* w0, const uint32_t* w1,
                                                   int64_t n, float* out) {
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256d u1 = _mm256_div_pd(_mm256_add_pd(widened_u32(w0 + k), _mm256_set1_pd(1.0)),
                                     _mm256_set1_pd(4294967297.0));
    const __m256d u2 = _mm256_div_pd(widened_u32(w1 + k), _mm256_set1_pd(4294967296.0));
    const __m256d radius = _mm256_sqrt_pd(_mm256_mul_pd(_mm256_set1_pd(-2.0), _ZGVdN4v_log(u1)));
    const __m256d r =
        _mm256_mul_pd(radius, _ZGVdN4v_cos(_mm256_mul_pd(_mm256_set1_pd(2.0 * M_PI), u2)));
    const __m256d abs_r = _mm256_andnot_pd(_mm256_set1_pd(-0.0), r);
    const __m256d e = _mm256_mul_pd(abs_r, _mm256_set1_pd(kMargin));
    const __m128 f = _mm256_cvtpd_ps(r);
    _mm_storeu_ps(out + k, f);
    const __m128 lo = _mm256_cvtpd_ps(_mm256_sub_pd(r, e)),
                 hi = _mm256_cvtpd_ps(_mm256_add_pd(r, e));
    const int same =
        _mm_movemask_ps(_mm_and_ps(_mm_cmp_ps(lo, f, _CMP_EQ_OQ), _mm_cmp_ps(hi, f, _CMP_EQ_OQ)));
    if (same != 0xf) redo_near_ties(same, 4, w0 + k, w1 + k, out + k);
  }
  fill_scalar(w0 + k, w1 + k, n - k, out + k);
}
#pragma GCC diagnostic pop
#endif

using Fill = void (*)(const uint32_t*, const uint32_t*, int64_t, float*);

struct Path {
  const char* name;
  Fill fill;
  bool (*available)();
};

// Fastest first; the scalar path is always there.
constexpr Path kPaths[] = {
#ifdef DTRAIN_BOX_MULLER_SIMD
    {"avx512", fill_avx512, [] { return cpu_supports(CpuFeature::kAvx512f); }},
    {"avx2", fill_avx2, [] { return cpu_supports(CpuFeature::kAvx2Fma); }},
#endif
    {"scalar", fill_scalar, [] { return true; }},
};

const Path& path() {
  static const Path& p =
      [&]() -> const Path& {  // at first use: safe from other static initializers
    for (const Path& q : kPaths)
      if (q.available()) return q;
    return kPaths[std::size(kPaths) - 1];
  }();
  return p;
}

}  // namespace

void box_muller_fill(const uint32_t* w0, const uint32_t* w1, int64_t n, float* out) {
  path().fill(w0, w1, n, out);
}

const char* box_muller_path() { return path().name; }

bool box_muller_fill_on(const char* name, const uint32_t* w0, const uint32_t* w1, int64_t n,
                        float* out) {
  for (const Path& q : kPaths)
    if (std::string_view(name) == q.name && q.available()) {
      q.fill(w0, w1, n, out);
      return true;
    }
  return false;
}

}  // namespace dtrain::detail
