// NHWC max pooling with an arg-max workspace (cpu_pool.h): 16 channels a vector on AVX-512, the
// tail masked; a portable loop elsewhere.
#include "devices/cpu/cpu_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cpu_isa.h"
#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {
namespace {

// The part of output position (oy, ox)'s window inside the image: rows [y0, y1), columns [x0, x1);
// (ys, xs) is the window's top-left corner (negative in the padding).
struct Span {
  int64_t ys, xs, y0, y1, x0, x1;
};
inline Span span(const PoolGeometry& g, int64_t oy, int64_t ox) {
  Span s;
  s.ys = oy * g.sh - g.pt;
  s.xs = ox * g.sw - g.pl;
  s.y0 = std::max<int64_t>(s.ys, 0);
  s.y1 = std::min(s.ys + g.kh, g.h);
  s.x0 = std::max<int64_t>(s.xs, 0);
  s.x1 = std::min(s.xs + g.kw, g.w);
  return s;
}

// ---- portable ----
// Written for the compiler to vectorise over the channels (clones for AVX2 and baseline x86-64;
// selects, no branches), on int32 arg-maxes: the callers narrow and widen the workspace's rows.

// Output row oy of one image: yrow [ow, c] and its arg-maxes krow [ow, c].
DTRAIN_TARGET_CLONES("avx2", "default")
void forward_row_portable(const PoolGeometry& g, const float* img, int64_t oy, float* yrow,
                          int32_t* krow) {
  const int64_t c = g.c;
  for (int64_t ox = 0; ox < g.ow; ++ox) {
    const Span s = span(g, oy, ox);
    float* __restrict m = yrow + ox * c;
    int32_t* __restrict k = krow + ox * c;
    const float* __restrict first = img + (s.y0 * g.w + s.x0) * c;
    const auto k0 = static_cast<int32_t>((s.y0 - s.ys) * g.kw + (s.x0 - s.xs));
    for (int64_t ch = 0; ch < c; ++ch) {
      m[ch] = first[ch];
      k[ch] = k0;
    }
    for (int64_t i = s.y0; i < s.y1; ++i)
      for (int64_t j = s.x0; j < s.x1; ++j) {
        if (i == s.y0 && j == s.x0) continue;
        const float* __restrict p = img + (i * g.w + j) * c;
        const auto kp = static_cast<int32_t>((i - s.ys) * g.kw + (j - s.xs));
        for (int64_t ch = 0; ch < c; ++ch) {
          // p takes the max from m: greater, or the first NaN (a NaN never gives way).
          const float v = p[ch], cur = m[ch];
          const bool takes = !(v <= cur) & (cur == cur);
          m[ch] = takes ? v : cur;
          k[ch] = takes ? kp : k[ch];
        }
      }
    if (g.relu) {
      const auto none = static_cast<int32_t>(g.kh * g.kw);
      for (int64_t ch = 0; ch < c; ++ch) {
        const float v = m[ch];
        const bool positive = v > 0.f;
        m[ch] = positive | (v != v) ? v : 0.f;
        k[ch] = positive ? k[ch] : none;
      }
    }
  }
}

// Output row oy's gradient into dxi (one image): disjoint windows write every position they cover
// (dy at the max, 0 elsewhere), overlapping ones add into a zeroed dx (adding 0 elsewhere: exact,
// as dx is never -0).
DTRAIN_TARGET_CLONES("avx2", "default")
void backward_row_portable(const PoolGeometry& g, const float* dyrow, const int32_t* krow,
                           int64_t oy, float* dxi, bool disjoint) {
  const int64_t c = g.c;
  for (int64_t ox = 0; ox < g.ow; ++ox) {
    const Span s = span(g, oy, ox);
    const float* __restrict d = dyrow + ox * c;
    const int32_t* __restrict k = krow + ox * c;
    for (int64_t i = s.y0; i < s.y1; ++i)
      for (int64_t j = s.x0; j < s.x1; ++j) {
        float* __restrict p = dxi + (i * g.w + j) * c;
        const auto kp = static_cast<int32_t>((i - s.ys) * g.kw + (j - s.xs));
        if (disjoint)
          for (int64_t ch = 0; ch < c; ++ch) p[ch] = k[ch] == kp ? d[ch] : 0.f;
        else
          for (int64_t ch = 0; ch < c; ++ch) p[ch] += k[ch] == kp ? d[ch] : 0.f;
      }
  }
}

// A workspace row's one-byte arg-maxes from and to int32 (windows of up to 255 positions).
DTRAIN_TARGET_CLONES("avx2", "default")
void narrow(const int32_t* __restrict from, uint8_t* __restrict to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<uint8_t>(from[i]);
}
DTRAIN_TARGET_CLONES("avx2", "default")
void widen(const uint8_t* __restrict from, int32_t* __restrict to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = from[i];
}

template <typename Idx>
void backward_image_portable(const PoolGeometry& g, const float* dyi, const Idx* wsi, float* dxi,
                             bool disjoint) {
  const int64_t row = g.ow * g.c;
  thread_local std::vector<int32_t> k;
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    const int32_t* krow;
    if constexpr (sizeof(Idx) == 4) {
      krow = wsi + oy * row;
    } else {
      k.resize(static_cast<size_t>(row));
      widen(wsi + oy * row, k.data(), row);
      krow = k.data();
    }
    backward_row_portable(g, dyi + oy * row, krow, oy, dxi, disjoint);
  }
}

// ---- AVX-512 ----

__attribute__((target("avx512f"))) inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

template <typename Idx>
__attribute__((target("avx512f"))) void forward_row_avx512(const PoolGeometry& g, const float* img,
                                                           int64_t oy, float* yrow, Idx* wrow) {
  const int64_t c = g.c;
  for (int64_t ox = 0; ox < g.ow; ++ox) {
    const Span s = span(g, oy, ox);
    const float* first = img + (s.y0 * g.w + s.x0) * c;
    const int k0 = static_cast<int>((s.y0 - s.ys) * g.kw + (s.x0 - s.xs));
    for (int64_t cb = 0; cb < c; cb += 16) {
      const __mmask16 mask = lanes(c - cb);
      __m512 m = _mm512_maskz_loadu_ps(mask, first + cb);
      __m512i idx = _mm512_set1_epi32(k0);
      for (int64_t i = s.y0; i < s.y1; ++i)
        for (int64_t j = s.x0; j < s.x1; ++j) {
          if (i == s.y0 && j == s.x0) continue;
          const __m512 v = _mm512_maskz_loadu_ps(mask, img + (i * g.w + j) * c + cb);
          // takes(v, m): !(v <= m) where m is not NaN.
          const __mmask16 r =
              _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(m, m, _CMP_ORD_Q), v, m, _CMP_NLE_UQ);
          m = _mm512_mask_mov_ps(m, r, v);
          idx = _mm512_mask_mov_epi32(
              idx, r, _mm512_set1_epi32(static_cast<int>((i - s.ys) * g.kw + (j - s.xs))));
        }
      if (g.relu) {  // keep the positive values and NaNs; no gradient but through positive ones
        const __mmask16 positive = _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ);
        m = _mm512_maskz_mov_ps(positive | _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q), m);
        idx =
            _mm512_mask_mov_epi32(_mm512_set1_epi32(static_cast<int>(g.kh * g.kw)), positive, idx);
      }
      _mm512_mask_storeu_ps(yrow + ox * c + cb, mask, m);
      if constexpr (sizeof(Idx) == 1)
        _mm512_mask_cvtepi32_storeu_epi8(wrow + ox * c + cb, mask, idx);
      else
        _mm512_mask_storeu_epi32(wrow + ox * c + cb, mask, idx);
    }
  }
}

// v rounded to the nearest bfloat16, as round_to_bf16 (ties to even; a NaN to the quiet NaN).
__attribute__((target("avx512f"))) inline __m512 rounded_to_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  // (maskz with every lane set is srli itself: GCC 12's srli warns of its undefined pass-through.)
  const __m512i lsb = _mm512_and_si512(
      _mm512_maskz_srli_epi32(static_cast<__mmask16>(0xFFFF), x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}

template <typename Idx, bool Disjoint>
__attribute__((target("avx512f"))) void backward_image_avx512(const PoolGeometry& g,
                                                              const float* dyi, const Idx* wsi,
                                                              float* dxi) {
  const int64_t c = g.c;
  for (int64_t oy = 0; oy < g.oh; ++oy)
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      const Span s = span(g, oy, ox);
      const float* d = dyi + (oy * g.ow + ox) * c;
      const Idx* k = wsi + (oy * g.ow + ox) * c;
      for (int64_t cb = 0; cb < c; cb += 16) {
        const __mmask16 mask = lanes(c - cb);
        __m512 dv = _mm512_maskz_loadu_ps(mask, d + cb);
        // (Disjoint: each dx value is one dy or 0, so rounding dy rounds dx; overlapping windows
        // add first and round after.)
        if (Disjoint && g.round_dx) dv = rounded_to_bf16(dv);
        __m512i idx;
        if constexpr (sizeof(Idx) == 1) {
          __m128i bytes;
          if (c - cb >= 16) {
            bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + cb));
          } else {
            alignas(16) uint8_t b[16] = {};
            std::memcpy(b, k + cb, static_cast<size_t>(c - cb));
            bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(b));
          }
          idx = _mm512_maskz_cvtepu8_epi32(static_cast<__mmask16>(0xFFFF), bytes);
        } else {
          idx = _mm512_maskz_loadu_epi32(mask, k + cb);
        }
        for (int64_t i = s.y0; i < s.y1; ++i)
          for (int64_t j = s.x0; j < s.x1; ++j) {
            const __mmask16 hit = _mm512_mask_cmpeq_epi32_mask(
                mask, idx, _mm512_set1_epi32(static_cast<int>((i - s.ys) * g.kw + (j - s.xs))));
            float* p = dxi + (i * g.w + j) * c + cb;
            if constexpr (Disjoint) {
              _mm512_mask_storeu_ps(p, mask, _mm512_maskz_mov_ps(hit, dv));
            } else if (hit) {
              _mm512_mask_storeu_ps(p, hit, _mm512_add_ps(_mm512_maskz_loadu_ps(hit, p), dv));
            }
          }
      }
    }
}

int team(int64_t work, int threads, int64_t items) {
  if (work < CpuKernels::State::kSerialWork) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
}

template <typename Idx>
void forward(const PoolGeometry& g, const float* x, float* y, Idx* ws, int threads, bool avx512) {
  const int64_t rows = g.n * g.oh;
  const int t = team(g.n * g.oh * g.ow * g.c * g.kh * g.kw, threads, rows);
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t img = r / g.oh, oy = r % g.oh;
    const float* xi = x + img * g.h * g.w * g.c;
    const int64_t off = r * g.ow * g.c;
    if (avx512) {
      forward_row_avx512(g, xi, oy, y + off, ws + off);
    } else if constexpr (sizeof(Idx) == 4) {
      forward_row_portable(g, xi, oy, y + off, ws + off);
    } else {
      thread_local std::vector<int32_t> k;
      k.resize(static_cast<size_t>(g.ow * g.c));
      forward_row_portable(g, xi, oy, y + off, k.data());
      narrow(k.data(), ws + off, g.ow * g.c);
    }
  }
}

template <typename Idx>
void backward(const PoolGeometry& g, const float* dy, const Idx* ws, float* dx, int threads,
              bool avx512) {
  const bool disjoint = g.sh >= g.kh && g.sw >= g.kw;
  // Under disjoint windows, the rows and columns no window reaches (a floor-divided edge, the gaps
  // of strides wider than the window): the positions to zero.
  std::vector<char> row_hit(static_cast<size_t>(g.h), 0), col_hit(static_cast<size_t>(g.w), 0);
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    const Span s = span(g, oy, 0);
    std::fill(row_hit.begin() + s.y0, row_hit.begin() + s.y1, 1);
  }
  for (int64_t ox = 0; ox < g.ow; ++ox) {
    const Span s = span(g, 0, ox);
    std::fill(col_hit.begin() + s.x0, col_hit.begin() + s.x1, 1);
  }
  // Images apart: overlapping windows of one image add into the same dx values.
  const int t = team(g.n * g.h * g.w * g.c, threads, g.n);
  const int64_t in = g.h * g.w * g.c, out = g.oh * g.ow * g.c, c = g.c;
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
  for (int64_t img = 0; img < g.n; ++img) {
    float* dxi = dx + img * in;
    const float* dyi = dy + img * out;
    const Idx* wsi = ws + img * out;
    if (!disjoint) {
      std::memset(dxi, 0, static_cast<size_t>(in) * sizeof(float));
      if (avx512)
        backward_image_avx512<Idx, false>(g, dyi, wsi, dxi);
      else
        backward_image_portable(g, dyi, wsi, dxi, false);
      if (g.round_dx) round_to_bf16(dxi, static_cast<size_t>(in));  // the sums, while in cache
      continue;
    }
    for (int64_t i = 0; i < g.h; ++i) {
      if (!row_hit[static_cast<size_t>(i)]) {
        std::memset(dxi + i * g.w * c, 0, static_cast<size_t>(g.w * c) * sizeof(float));
        continue;
      }
      for (int64_t j = 0; j < g.w; ++j)
        if (!col_hit[static_cast<size_t>(j)])
          std::memset(dxi + (i * g.w + j) * c, 0, static_cast<size_t>(c) * sizeof(float));
    }
    if (avx512) {
      backward_image_avx512<Idx, true>(g, dyi, wsi, dxi);  // (rounds as it writes)
    } else {
      backward_image_portable(g, dyi, wsi, dxi, true);
      if (g.round_dx) round_to_bf16(dxi, static_cast<size_t>(in));
    }
  }
}

bool wide_index(const PoolGeometry& g) { return g.kh * g.kw > 255; }

}  // namespace

size_t max_pool_workspace_bytes(const PoolGeometry& g) {
  return static_cast<size_t>(g.n * g.oh * g.ow * g.c) * (wide_index(g) ? 4 : 1);
}

void max_pool_forward(const PoolGeometry& g, const float* x, float* y, void* workspace, int threads,
                      bool allow_avx512) {
  const bool avx512 = allow_avx512 && detail::cpu_supports(detail::CpuFeature::kAvx512f);
  if (wide_index(g))
    forward(g, x, y, static_cast<int32_t*>(workspace), threads, avx512);
  else
    forward(g, x, y, static_cast<uint8_t*>(workspace), threads, avx512);
}

void max_pool_backward(const PoolGeometry& g, const float* dy, const void* workspace, float* dx,
                       int threads, bool allow_avx512) {
  const bool avx512 = allow_avx512 && detail::cpu_supports(detail::CpuFeature::kAvx512f);
  if (wide_index(g))
    backward(g, dy, static_cast<const int32_t*>(workspace), dx, threads, avx512);
  else
    backward(g, dy, static_cast<const uint8_t*>(workspace), dx, threads, avx512);
}

}  // namespace dtrain::cpu
