// Batch norm in training on a bfloat16 input (the copy ops keep under mixed_bfloat16, or a
// convolution's bfloat16 output): loops of our own over channels-last data seen as rows x
// channels, portable (AVX2 and baseline clones) and, on CPUs with AVX-512, in channel chunks held
// in registers. CpuKernels::batch_norm_forward/backward (cpu_batch_norm.cc, oneDNN for float32)
// hand a bfloat16 x here. Built with -ffp-contract=off (CMakeLists.txt).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cpu_isa.h"
#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu/cpu_stream.h"
#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {
namespace {

// --- Training on a bfloat16 input ---
// Under mixed_bfloat16 batch norm normalizes its input rounded to bfloat16 (ops keep that copy for
// the backward pass anyway). oneDNN 2.6 reads float32 here, so the copy was widened again for each
// pass, and its forward kernel reads x three times (mean, variance, normalize): 28 bytes moved an
// element forward, 26 backward, with the widening. These loops read the 2-byte copy: the forward
// pass once for the sums and once to normalize (14 bytes with the copy's making), the backward
// pass once for the sums and once for dx (16). Sums: float within blocks of kBnRows rows, of x less
// the first row (so that a large mean does not cost the variance its digits), then the blocks in
// double, in block order: the same result on any number of threads. Fused ReLU keeps no mask: the
// backward pass computes each y again from x, the same way, and keeps dy where y > 0; relu_mask
// holds the per-channel scale and shift ([2, C]) the forward pass used.
constexpr int64_t kBnRows = 128;

// y before ReLU, as both passes compute it.
__attribute__((always_inline)) inline float bn_y(float x, float mean, float scale, float beta) {
  return (x - mean) * scale + beta;
}

// s[c] = sum of (x - first[c]), q[c] = sum of its squares, over `rows` rows.
DTRAIN_TARGET_CLONES("avx2", "default")
void bn_block_moments(const uint16_t* __restrict x, int64_t rows, int64_t c, int64_t ld,
                      const float* __restrict first, float* __restrict s, float* __restrict q) {
  for (int64_t j = 0; j < c; ++j) s[j] = q[j] = 0.f;
  for (int64_t r = 0; r < rows; ++r, x += ld)
    for (int64_t j = 0; j < c; ++j) {
      const float d = widened_bf16(x[j]) - first[j];
      s[j] += d;
      q[j] += d * d;
    }
}

// v rounded to bfloat16, nearest even (float_to_bf16's bits for every v but NaN, which the ReLU
// before it never gives).
__attribute__((always_inline)) inline uint16_t bf16_not_nan(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <bool kRelu, class Out>
__attribute__((always_inline)) inline void bn_rows(
    const uint16_t* __restrict x, int64_t rows, int64_t c, int64_t ld, const float* __restrict mean,
    const float* __restrict scale, const float* __restrict beta, Out* __restrict y) {
  static_assert(kRelu || std::is_same_v<Out, float>, "bfloat16 outputs are ReLU's");
  for (int64_t r = 0; r < rows; ++r, x += ld, y += ld)
    for (int64_t j = 0; j < c; ++j) {
      const float v = bn_y(widened_bf16(x[j]), mean[j], scale[j], beta[j]);
      // As oneDNN's fused ReLU on float32 x, and ops::relu: max(v, 0), so a NaN (a channel whose
      // statistics are NaN) gives 0, and -0 gives +0; the backward pass keeps dy where v > 0.
      const float out = kRelu && !(v > 0.f) ? 0.f : v;
      if constexpr (std::is_same_v<Out, float>)
        y[j] = out;
      else
        y[j] = bf16_not_nan(out);
    }
}
DTRAIN_TARGET_CLONES("avx2", "default")
void bn_normalize_rows(const uint16_t* x, int64_t rows, int64_t c, int64_t ld, const float* mean,
                       const float* scale, const float* beta, float* y, bool relu) {
  if (relu)
    bn_rows<true>(x, rows, c, ld, mean, scale, beta, y);
  else
    bn_rows<false>(x, rows, c, ld, mean, scale, beta, y);
}
// With ReLU, into bfloat16: the values the convolution after it reads.
DTRAIN_TARGET_CLONES("avx2", "default")
void bn_relu_rows_bf16(const uint16_t* x, int64_t rows, int64_t c, int64_t ld, const float* mean,
                       const float* scale, const float* beta, uint16_t* y) {
  bn_rows<true>(x, rows, c, ld, mean, scale, beta, y);
}

// g = dy (kept where y > 0 with ReLU): s[c] = sum of g, t[c] = sum of g (x - mean).
template <bool kRelu>
__attribute__((always_inline)) inline void bn_grad_sums(
    const uint16_t* __restrict x, const float* __restrict dy, int64_t rows, int64_t c, int64_t ld,
    const float* __restrict mean, const float* __restrict scale, const float* __restrict beta,
    float* __restrict s, float* __restrict t) {
  for (int64_t j = 0; j < c; ++j) s[j] = t[j] = 0.f;
  for (int64_t r = 0; r < rows; ++r, x += ld, dy += ld)
    for (int64_t j = 0; j < c; ++j) {
      const float xv = widened_bf16(x[j]);
      const float g = kRelu && !(bn_y(xv, mean[j], scale[j], beta[j]) > 0.f) ? 0.f : dy[j];
      s[j] += g;
      t[j] += g * (xv - mean[j]);
    }
}
DTRAIN_TARGET_CLONES("avx2", "default")
void bn_block_grad_sums(const uint16_t* x, const float* dy, int64_t rows, int64_t c, int64_t ld,
                        const float* mean, const float* scale, const float* beta, float* s,
                        float* t, bool relu) {
  if (relu)
    bn_grad_sums<true>(x, dy, rows, c, ld, mean, scale, beta, s, t);
  else
    bn_grad_sums<false>(x, dy, rows, c, ld, mean, scale, beta, s, t);
}

// v rounded to bfloat16 as float_to_bf16 (nearest even, every NaN to 0x7fc0), in a form the
// compiler vectorizes.
__attribute__((always_inline)) inline uint16_t bf16_rounded(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint16_t r = bf16_not_nan(v);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : r;
}

// dx = scale g + (x - mean) p + q.
template <bool kRelu, class Out>
__attribute__((always_inline)) inline void bn_dx(
    const uint16_t* __restrict x, const float* __restrict dy, int64_t rows, int64_t c, int64_t ld,
    const float* __restrict mean, const float* __restrict scale, const float* __restrict beta,
    const float* __restrict p, const float* __restrict q, Out* __restrict dx) {
  for (int64_t r = 0; r < rows; ++r, x += ld, dy += ld, dx += ld)
    for (int64_t j = 0; j < c; ++j) {
      const float xv = widened_bf16(x[j]);
      const float g = kRelu && !(bn_y(xv, mean[j], scale[j], beta[j]) > 0.f) ? 0.f : dy[j];
      const float d = scale[j] * g + ((xv - mean[j]) * p[j] + q[j]);
      if constexpr (std::is_same_v<Out, float>)
        dx[j] = d;
      else
        dx[j] = bf16_rounded(d);
    }
}
DTRAIN_TARGET_CLONES("avx2", "default")
void bn_dx_rows(const uint16_t* x, const float* dy, int64_t rows, int64_t c, int64_t ld,
                const float* mean, const float* scale, const float* beta, const float* p,
                const float* q, float* dx, bool relu) {
  if (relu)
    bn_dx<true>(x, dy, rows, c, ld, mean, scale, beta, p, q, dx);
  else
    bn_dx<false>(x, dy, rows, c, ld, mean, scale, beta, p, q, dx);
}
// Into bfloat16: the gradient the convolution before reads.
DTRAIN_TARGET_CLONES("avx2", "default")
void bn_dx_rows_bf16(const uint16_t* x, const float* dy, int64_t rows, int64_t c, int64_t ld,
                     const float* mean, const float* scale, const float* beta, const float* p,
                     const float* q, uint16_t* dx, bool relu) {
  if (relu)
    bn_dx<true>(x, dy, rows, c, ld, mean, scale, beta, p, q, dx);
  else
    bn_dx<false>(x, dy, rows, c, ld, mean, scale, beta, p, q, dx);
}

// --- The same loops on AVX-512, a chunk of channels at a time ---
// The loops above go row by row, each element loading its channel's operands and, for the sums,
// loading and storing the channel's partial sums again: at C channels a row, that store-to-load
// chain and those loads set their pace (`perf annotate` on Zen 5), and the compiler's AVX-512 clone
// used 256-bit vectors. These take a block's rows one chunk of channels at a time (64, then 16),
// the chunk's per-channel operands and sums held in registers. In ResNet-50's mixed bfloat16 step
// on Zen 5 the four loops fell from 15.6% to 12.6% of `perf` samples and the step ran 1.04x
// (cpu-performance.md, "Batch norm's bfloat16 loops on AVX-512"; bit for bit: cpu_batch_norm_test).
// Each element and each channel's sum gets the same IEEE operations in the same order as above
// (multiplies and adds kept apart, as the loops above are compiled: forward and backward must
// decide ReLU's sign alike), so results are bit for bit the portable loops'. Channels past the
// last multiple of 16 go to the portable loops, with the row stride `ld`.
// GCC 12's AVX-512 headers trip its own uninitialized-variable warnings (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {

__attribute__((target("avx512f"), always_inline)) inline __m512 widened(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 floats to bfloat16, nearest even: bf16_not_nan's bits, or with kNan bf16_rounded's (every NaN
// to 0x7fc0).
template <bool kNan>
__attribute__((target("avx512f"), always_inline)) inline void store_bf16(uint16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  if constexpr (kNan) {
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// g: dy where y = (x - mean) scale + beta > 0 (d = x - mean); 0 elsewhere and where y is NaN.
__attribute__((target("avx512f"), always_inline)) inline __m512 relu_kept(__m512 g, __m512 d,
                                                                          __m512 scale,
                                                                          __m512 beta) {
  const __m512 y = _mm512_add_ps(_mm512_mul_ps(d, scale), beta);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ), g);
}

// Channels [j, j + 16 K) of bn_block_moments.
template <int K>
__attribute__((target("avx512f"))) void moments(const uint16_t* x, int64_t rows, int64_t ld,
                                                const float* first, float* s, float* q) {
  __m512 f[K], as[K], aq[K];
  for (int k = 0; k < K; ++k) {
    f[k] = _mm512_loadu_ps(first + 16 * k);
    as[k] = aq[k] = _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < rows; ++r, x += ld)
    for (int k = 0; k < K; ++k) {
      const __m512 d = _mm512_sub_ps(widened(x + 16 * k), f[k]);
      as[k] = _mm512_add_ps(as[k], d);
      aq[k] = _mm512_add_ps(aq[k], _mm512_mul_ps(d, d));
    }
  for (int k = 0; k < K; ++k) {
    _mm512_storeu_ps(s + 16 * k, as[k]);
    _mm512_storeu_ps(q + 16 * k, aq[k]);
  }
}

// Channels [j, j + 16 K) of bn_rows.
template <int K, bool kRelu, class Out>
__attribute__((target("avx512f"))) void normalize(const uint16_t* x, int64_t rows, int64_t ld,
                                                  const float* mean, const float* scale,
                                                  const float* beta, Out* y) {
  __m512 m[K], sc[K], b[K];
  for (int k = 0; k < K; ++k) {
    m[k] = _mm512_loadu_ps(mean + 16 * k);
    sc[k] = _mm512_loadu_ps(scale + 16 * k);
    b[k] = _mm512_loadu_ps(beta + 16 * k);
  }
  for (int64_t r = 0; r < rows; ++r, x += ld, y += ld)
    for (int k = 0; k < K; ++k) {
      __m512 v =
          _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(widened(x + 16 * k), m[k]), sc[k]), b[k]);
      if constexpr (kRelu)
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), v);
      if constexpr (std::is_same_v<Out, float>)
        _mm512_storeu_ps(y + 16 * k, v);
      else
        store_bf16<false>(y + 16 * k, v);
    }
}

// Channels [j, j + 16 K) of bn_grad_sums.
template <int K, bool kRelu>
__attribute__((target("avx512f"))) void grad_sums(const uint16_t* x, const float* dy, int64_t rows,
                                                  int64_t ld, const float* mean, const float* scale,
                                                  const float* beta, float* s, float* t) {
  __m512 m[K], sc[K], b[K], as[K], at[K];
  for (int k = 0; k < K; ++k) {
    m[k] = _mm512_loadu_ps(mean + 16 * k);
    sc[k] = _mm512_loadu_ps(scale + 16 * k);
    b[k] = _mm512_loadu_ps(beta + 16 * k);
    as[k] = at[k] = _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < rows; ++r, x += ld, dy += ld)
    for (int k = 0; k < K; ++k) {
      const __m512 d = _mm512_sub_ps(widened(x + 16 * k), m[k]);
      __m512 g = _mm512_loadu_ps(dy + 16 * k);
      if constexpr (kRelu) g = relu_kept(g, d, sc[k], b[k]);
      as[k] = _mm512_add_ps(as[k], g);
      at[k] = _mm512_add_ps(at[k], _mm512_mul_ps(g, d));
    }
  for (int k = 0; k < K; ++k) {
    _mm512_storeu_ps(s + 16 * k, as[k]);
    _mm512_storeu_ps(t + 16 * k, at[k]);
  }
}

// Channels [j, j + 16 K) of bn_dx.
template <int K, bool kRelu, class Out>
__attribute__((target("avx512f"))) void dx_rows(const uint16_t* x, const float* dy, int64_t rows,
                                                int64_t ld, const float* mean, const float* scale,
                                                const float* beta, const float* p, const float* q,
                                                Out* dx) {
  __m512 m[K], sc[K], b[K], pp[K], qq[K];
  for (int k = 0; k < K; ++k) {
    m[k] = _mm512_loadu_ps(mean + 16 * k);
    sc[k] = _mm512_loadu_ps(scale + 16 * k);
    b[k] = _mm512_loadu_ps(beta + 16 * k);
    pp[k] = _mm512_loadu_ps(p + 16 * k);
    qq[k] = _mm512_loadu_ps(q + 16 * k);
  }
  for (int64_t r = 0; r < rows; ++r, x += ld, dy += ld, dx += ld)
    for (int k = 0; k < K; ++k) {
      const __m512 d = _mm512_sub_ps(widened(x + 16 * k), m[k]);
      __m512 g = _mm512_loadu_ps(dy + 16 * k);
      if constexpr (kRelu) g = relu_kept(g, d, sc[k], b[k]);
      const __m512 v =
          _mm512_add_ps(_mm512_mul_ps(sc[k], g), _mm512_add_ps(_mm512_mul_ps(d, pp[k]), qq[k]));
      if constexpr (std::is_same_v<Out, float>)
        _mm512_storeu_ps(dx + 16 * k, v);
      else
        store_bf16<true>(dx + 16 * k, v);
    }
}

}  // namespace avx512
#pragma GCC diagnostic pop

std::atomic<bool> g_force_portable{false};  // cpu_testing::force_portable_batch_norm_loops

// Whether the loops below take the AVX-512 chunks (this CPU, under DTRAIN_MAX_CPU_ISA).
bool bn_avx512() {
  static const bool v = detail::cpu_supports(detail::CpuFeature::kAvx512f);
  return v && !g_force_portable.load(std::memory_order_relaxed);
}

// The loops over a block of rows: AVX-512 chunks where bn_avx512(), the rest portable.
void block_moments(const uint16_t* x, int64_t rows, int64_t c, const float* first, float* s,
                   float* q) {
  int64_t j = 0;
  if (bn_avx512()) {
    for (; j + 64 <= c; j += 64) avx512::moments<4>(x + j, rows, c, first + j, s + j, q + j);
    for (; j + 16 <= c; j += 16) avx512::moments<1>(x + j, rows, c, first + j, s + j, q + j);
  }
  if (j < c) bn_block_moments(x + j, rows, c - j, c, first + j, s + j, q + j);
}

template <bool kRelu, class Out>
void normalize_chunks(const uint16_t* x, int64_t rows, int64_t c, const float* mean,
                      const float* scale, const float* beta, Out* y, int64_t& j) {
  for (; j + 64 <= c; j += 64)
    avx512::normalize<4, kRelu>(x + j, rows, c, mean + j, scale + j, beta + j, y + j);
  for (; j + 16 <= c; j += 16)
    avx512::normalize<1, kRelu>(x + j, rows, c, mean + j, scale + j, beta + j, y + j);
}
template <class Out>
void normalize_rows(const uint16_t* x, int64_t rows, int64_t c, const float* mean,
                    const float* scale, const float* beta, Out* y, bool relu) {
  int64_t j = 0;
  if (bn_avx512()) {
    if (relu)
      normalize_chunks<true>(x, rows, c, mean, scale, beta, y, j);
    else if constexpr (std::is_same_v<Out, float>)
      normalize_chunks<false>(x, rows, c, mean, scale, beta, y, j);
  }
  if (j == c) return;
  if constexpr (std::is_same_v<Out, float>)
    bn_normalize_rows(x + j, rows, c - j, c, mean + j, scale + j, beta + j, y + j, relu);
  else
    bn_relu_rows_bf16(x + j, rows, c - j, c, mean + j, scale + j, beta + j, y + j);
}

template <bool kRelu>
void grad_sums_chunks(const uint16_t* x, const float* dy, int64_t rows, int64_t c,
                      const float* mean, const float* scale, const float* beta, float* s, float* t,
                      int64_t& j) {
  for (; j + 64 <= c; j += 64)
    avx512::grad_sums<4, kRelu>(x + j, dy + j, rows, c, mean + j, scale + j, beta + j, s + j,
                                t + j);
  for (; j + 16 <= c; j += 16)
    avx512::grad_sums<1, kRelu>(x + j, dy + j, rows, c, mean + j, scale + j, beta + j, s + j,
                                t + j);
}
void block_grad_sums(const uint16_t* x, const float* dy, int64_t rows, int64_t c, const float* mean,
                     const float* scale, const float* beta, float* s, float* t, bool relu) {
  int64_t j = 0;
  if (bn_avx512()) {
    if (relu)
      grad_sums_chunks<true>(x, dy, rows, c, mean, scale, beta, s, t, j);
    else
      grad_sums_chunks<false>(x, dy, rows, c, mean, scale, beta, s, t, j);
  }
  if (j < c)
    bn_block_grad_sums(x + j, dy + j, rows, c - j, c, mean + j, scale + j, beta + j, s + j, t + j,
                       relu);
}

template <bool kRelu, class Out>
void dx_chunks(const uint16_t* x, const float* dy, int64_t rows, int64_t c, const float* mean,
               const float* scale, const float* beta, const float* p, const float* q, Out* dx,
               int64_t& j) {
  for (; j + 64 <= c; j += 64)
    avx512::dx_rows<4, kRelu>(x + j, dy + j, rows, c, mean + j, scale + j, beta + j, p + j, q + j,
                              dx + j);
  for (; j + 16 <= c; j += 16)
    avx512::dx_rows<1, kRelu>(x + j, dy + j, rows, c, mean + j, scale + j, beta + j, p + j, q + j,
                              dx + j);
}
template <class Out>
void dx_rows(const uint16_t* x, const float* dy, int64_t rows, int64_t c, const float* mean,
             const float* scale, const float* beta, const float* p, const float* q, Out* dx,
             bool relu) {
  int64_t j = 0;
  if (bn_avx512()) {
    if (relu)
      dx_chunks<true>(x, dy, rows, c, mean, scale, beta, p, q, dx, j);
    else
      dx_chunks<false>(x, dy, rows, c, mean, scale, beta, p, q, dx, j);
  }
  if (j == c) return;
  if constexpr (std::is_same_v<Out, float>)
    bn_dx_rows(x + j, dy + j, rows, c - j, c, mean + j, scale + j, beta + j, p + j, q + j, dx + j,
               relu);
  else
    bn_dx_rows_bf16(x + j, dy + j, rows, c - j, c, mean + j, scale + j, beta + j, p + j, q + j,
                    dx + j, relu);
}

// Sums over the row blocks of [m, c] data: `block` fills two [c] partials for rows [r0, r0 + n),
// in parallel; then out0/out1 = their totals in double, in block order.
template <class Block>
void bn_sums(int64_t m, int64_t c, int threads, DeviceSpec spec, double* out0, double* out1,
             Block block) {
  const int64_t blocks = (m + kBnRows - 1) / kBnRows;
  Tensor parts = Tensor::empty(Shape{blocks, 2, c}, DType::kFloat32, spec);
  float* pp = static_cast<float*>(parts.raw_data());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b)
    block(b * kBnRows, std::min(kBnRows, m - b * kBnRows), pp + b * 2 * c, pp + (b * 2 + 1) * c);
  for (int64_t j = 0; j < c; ++j) out0[j] = out1[j] = 0;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < c; ++j) {
      out0[j] += pp[b * 2 * c + j];
      out1[j] += pp[(b * 2 + 1) * c + j];
    }
}

// Row ranges of [m, c] data for `threads` threads, each a whole number of blocks.
template <class Rows>
void bn_parallel_rows(int64_t m, int threads, Rows rows) {
  const int64_t blocks = (m + kBnRows - 1) / kBnRows;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) rows(b * kBnRows, std::min(kBnRows, m - b * kBnRows));
}

}  // namespace

BatchNormForward CpuKernels::batch_norm_forward_bf16(const Tensor& x, const Tensor& gamma,
                                                     const Tensor& beta, float eps,
                                                     Tensor* relu_mask, DType y_dtype) {
  const auto [m, c] = batch_norm_rows(x.shape());
  if (y_dtype == DType::kBFloat16 && !relu_mask) {  // (no caller: the loops round ReLU's outputs)
    BatchNormForward f = batch_norm_forward_bf16(x, gamma, beta, eps, nullptr, DType::kFloat32);
    f.y = cast(f.y, DType::kBFloat16);
    return f;
  }
  BatchNormForward out{Tensor::empty(x.shape(), y_dtype, spec_),
                       Tensor::empty(Shape{c}, DType::kFloat32, spec_),
                       Tensor::empty(Shape{c}, DType::kFloat32, spec_)};
  // [2, c]: the scale gamma / sqrt(var + eps), then beta (what the backward pass computes y from).
  Tensor coef = Tensor::empty(Shape{2, c}, DType::kFloat32, spec_);
  if (relu_mask) *relu_mask = coef;
  if (m == 0 || c == 0) {
    fill(out.mean, 0.f);
    fill(out.var, 0.f);
    fill(coef, 0.f);
    return out;
  }
  const uint16_t* xp = static_cast<const uint16_t*>(x.raw_data());
  float* first = static_cast<float*>(out.var.raw_data());  // (overwritten below)
  for (int64_t j = 0; j < c; ++j) first[j] = widened_bf16(xp[j]);
  Tensor sums = Tensor::empty(Shape{2 * c}, DType::kFloat64, spec_);
  double* s = static_cast<double*>(sums.raw_data());
  double* q = s + c;
  bn_sums(m, c, state_->threads, spec_, s, q, [&](int64_t r0, int64_t n, float* ps, float* pq) {
    block_moments(xp + r0 * c, n, c, first, ps, pq);
  });
  float* mean = static_cast<float*>(out.mean.raw_data());
  float* var = static_cast<float*>(out.var.raw_data());
  float* scale = static_cast<float*>(coef.raw_data());
  float* shift = scale + c;
  const float* g = static_cast<const float*>(gamma.raw_data());
  const float* b = static_cast<const float*>(beta.raw_data());
  for (int64_t j = 0; j < c; ++j) {
    const double mu = s[j] / static_cast<double>(m);
    const double v = std::max(q[j] / static_cast<double>(m) - mu * mu, 0.0);
    mean[j] = static_cast<float>(first[j] + mu);  // (first is var's memory: read before written)
    var[j] = static_cast<float>(v);
    scale[j] = g[j] / std::sqrt(var[j] + eps);
    shift[j] = b[j];
  }
  const bool relu = relu_mask != nullptr;
  if (y_dtype == DType::kBFloat16) {
    auto* y16 = static_cast<uint16_t*>(out.y.raw_data());
    bn_parallel_rows(m, state_->threads, [&](int64_t r0, int64_t n) {
      normalize_rows(xp + r0 * c, n, c, mean, scale, shift, y16 + r0 * c, true);
    });
    return out;
  }
  float* y = static_cast<float*>(out.y.raw_data());
  bn_parallel_rows(m, state_->threads, [&](int64_t r0, int64_t n) {
    normalize_rows(xp + r0 * c, n, c, mean, scale, shift, y + r0 * c, relu);
  });
  return out;
}

BatchNormBackward CpuKernels::batch_norm_backward_bf16(const Tensor& dy, const Tensor& x,
                                                       const Tensor& gamma, const Tensor& mean,
                                                       const Tensor& var, float eps,
                                                       const Tensor* relu_mask, DType dx_dtype) {
  const auto [m, c] = batch_norm_rows(x.shape());
  if (relu_mask && (relu_mask->dtype() != DType::kFloat32 || relu_mask->shape() != Shape{2, c}))
    throw InvalidArgument("batch_norm_relu_backward: x is bfloat16, so the mask must be the [2, " +
                          std::to_string(c) + "] batch_norm_relu_training wrote for it, got " +
                          relu_mask->shape().to_string() + " " + dtype_name(relu_mask->dtype()));
  BatchNormBackward out{Tensor::empty(x.shape(), dx_dtype, spec_),
                        Tensor::empty(Shape{c}, DType::kFloat32, spec_),
                        Tensor::empty(Shape{c}, DType::kFloat32, spec_)};
  if (m == 0 || c == 0) {
    fill(out.dgamma, 0.f);
    fill(out.dbeta, 0.f);
    return out;
  }
  const uint16_t* xp = static_cast<const uint16_t*>(x.raw_data());
  const float* dyp = static_cast<const float*>(dy.raw_data());
  const float* mu = static_cast<const float*>(mean.raw_data());
  const float* va = static_cast<const float*>(var.raw_data());
  const float* g = static_cast<const float*>(gamma.raw_data());
  // scale and beta: those of the forward pass (ReLU's zeros), else gamma / sqrt(var + eps).
  Tensor coef = relu_mask ? *relu_mask : Tensor::empty(Shape{2, c}, DType::kFloat32, spec_);
  float* scale = static_cast<float*>(coef.raw_data());
  if (!relu_mask)
    for (int64_t j = 0; j < c; ++j) scale[j] = g[j] / std::sqrt(va[j] + eps);
  const float* beta = scale + c;
  Tensor sums = Tensor::empty(Shape{2 * c}, DType::kFloat64, spec_);
  double* s = static_cast<double*>(sums.raw_data());
  double* t = s + c;
  const bool relu = relu_mask != nullptr;
  bn_sums(m, c, state_->threads, spec_, s, t, [&](int64_t r0, int64_t n, float* ps, float* pt) {
    block_grad_sums(xp + r0 * c, dyp + r0 * c, n, c, mu, scale, beta, ps, pt, relu);
  });
  // dbeta = sum g, dgamma = sum g xhat; dx = scale (g - dbeta/m - xhat dgamma/m), xhat = (x -
  // mean) inv: dx = scale g + (x - mean) p + q with p = -scale inv dgamma / m, q = -scale dbeta /
  // m.
  Tensor pq = Tensor::empty(Shape{2, c}, DType::kFloat32, spec_);
  float* p = static_cast<float*>(pq.raw_data());
  float* q = p + c;
  float* dgamma = static_cast<float*>(out.dgamma.raw_data());
  float* dbeta = static_cast<float*>(out.dbeta.raw_data());
  for (int64_t j = 0; j < c; ++j) {
    const double inv = 1.0 / std::sqrt(static_cast<double>(va[j]) + eps);
    const double dg = t[j] * inv;
    dgamma[j] = static_cast<float>(dg);
    dbeta[j] = static_cast<float>(s[j]);
    p[j] = static_cast<float>(-scale[j] * inv * dg / static_cast<double>(m));
    q[j] = static_cast<float>(-scale[j] * s[j] / static_cast<double>(m));
  }
  if (dx_dtype == DType::kBFloat16) {
    auto* dx16 = static_cast<uint16_t*>(out.dx.raw_data());
    bn_parallel_rows(m, state_->threads, [&](int64_t r0, int64_t n) {
      dx_rows(xp + r0 * c, dyp + r0 * c, n, c, mu, scale, beta, p, q, dx16 + r0 * c, relu);
    });
    return out;
  }
  float* dx = static_cast<float*>(out.dx.raw_data());
  bn_parallel_rows(m, state_->threads, [&](int64_t r0, int64_t n) {
    dx_rows(xp + r0 * c, dyp + r0 * c, n, c, mu, scale, beta, p, q, dx + r0 * c, relu);
  });
  return out;
}

}  // namespace dtrain::cpu

namespace dtrain::cpu_testing {
bool batch_norm_loops_avx512() { return cpu::bn_avx512(); }
void force_portable_batch_norm_loops(bool on) { cpu::g_force_portable = on; }
}  // namespace dtrain::cpu_testing
