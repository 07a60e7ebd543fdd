// The CPU kernels oneDNN has no primitive for: fused sparse softmax cross-entropy, Philox dropout
// masks, optimizer updates, and general broadcasting for non-commutative binary ops.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu_isa.h"
#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"
#include "dtrain/core/random.h"

namespace dtrain::cpu {

void require_f32(const Tensor& t, const char* op, const char* what) {
  if (!t.defined()) throw InvalidArgument(std::string(op) + ": " + what + " is undefined");
  if (t.dtype() != DType::kFloat32)
    throw InvalidArgument(std::string(op) + ": " + what + " must be float32, got " +
                          dtype_name(t.dtype()) + "; cast it with ops::cast(x, DType::kFloat32)");
}

void require_f32_or_kept_bf16(const Tensor& t, const char* op, const char* what) {
  if (t.defined() && t.dtype() == DType::kBFloat16 &&
      precision_policy() == Precision::kMixedBFloat16)
    return;
  require_f32(t, op, what);
}

namespace {
inline float apply(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::kAdd:
      return a + b;
    case BinaryOp::kSub:
      return a - b;
    case BinaryOp::kMul:
      return a * b;
    case BinaryOp::kDiv:
      return a / b;
    case BinaryOp::kMax:
      return std::max(a, b);
    case BinaryOp::kMin:
      return std::min(a, b);
  }
  return 0.f;
}
}  // namespace

void binary_broadcast_loop(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& c) {
  const Shape& out = c.shape();
  const int r = out.rank();
  std::vector<int64_t> sa(static_cast<size_t>(r), 0), sb(static_cast<size_t>(r), 0);
  // Strides with 0 on broadcast dimensions.
  for (int64_t i = r - 1, st_a = 1, st_b = 1; i >= 0; --i) {
    const int ia = a.rank() - r + static_cast<int>(i), ib = b.rank() - r + static_cast<int>(i);
    const int64_t da = ia >= 0 ? a.shape().dims()[static_cast<size_t>(ia)] : 1;
    const int64_t db = ib >= 0 ? b.shape().dims()[static_cast<size_t>(ib)] : 1;
    sa[static_cast<size_t>(i)] = da == 1 ? 0 : st_a;
    sb[static_cast<size_t>(i)] = db == 1 ? 0 : st_b;
    st_a *= da;
    st_b *= db;
  }
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* pc = c.data<float>();
  const int64_t inner = r ? out.dims().back() : 1;
  const int64_t ia_in = r ? sa.back() : 0, ib_in = r ? sb.back() : 0;
  std::vector<int64_t> idx(static_cast<size_t>(r), 0);
  for (int64_t base = 0; base < c.numel(); base += inner) {
    int64_t oa = 0, ob = 0;
    for (int d = 0; d + 1 < r; ++d) {
      oa += idx[static_cast<size_t>(d)] * sa[static_cast<size_t>(d)];
      ob += idx[static_cast<size_t>(d)] * sb[static_cast<size_t>(d)];
    }
    for (int64_t j = 0; j < inner; ++j)
      pc[base + j] = apply(op, pa[oa + j * ia_in], pb[ob + j * ib_in]);
    for (int d = r - 2; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < out.dims()[static_cast<size_t>(d)]) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
}

void cast_loop(const Tensor& x, Tensor& y) {
  const int64_t n = x.numel();
  std::vector<double> tmp = x.to_vector<double>();
  void* p = y.raw_data();
  for (int64_t i = 0; i < n; ++i) {
    const double v = tmp[static_cast<size_t>(i)];
    switch (y.dtype()) {
      case DType::kFloat32:
        static_cast<float*>(p)[i] = static_cast<float>(v);
        break;
      case DType::kFloat64:
        static_cast<double*>(p)[i] = v;
        break;
      case DType::kInt32:
        static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
        break;
      case DType::kInt64:
        static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
        break;
      case DType::kFloat16:
        static_cast<uint16_t*>(p)[i] = float_to_f16(static_cast<float>(v));
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v));
        break;
    }
  }
}

void CpuKernels::fill(Tensor& x, float value) {
  require_f32(x, "fill", "x");
  std::fill_n(x.data<float>(), x.numel(), value);
}

namespace {
// One row of the fused softmax cross-entropy: probabilities into prow, the loss returned
// (log(sum) - (x_y - max), which stays finite where p_y underflows).
// The sum is a double: one float accumulator over GPT-2's 50,257 columns drifted 6e-6 from the
// exact sum (the vector rows below spread it over 16 lanes).
float softmax_xent_row_scalar(const float* row, float* prow, int64_t c, int32_t y) {
  float mx = row[0];
  for (int64_t j = 1; j < c; ++j) mx = row[j] > mx ? row[j] : mx;
  double sum = 0.0;
  for (int64_t j = 0; j < c; ++j) {
    prow[j] = std::exp(row[j] - mx);
    sum += prow[j];
  }
  const auto inv = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < c; ++j) prow[j] *= inv;
  return static_cast<float>(std::log(sum)) - (row[y] - mx);
}

// Cephes' expf constants, one definition for both widths: log2(e), ln 2 in two parts (n ln2 is
// subtracted exactly), and the polynomial's coefficients, highest degree first.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// GCC 12's AVX-512 headers trip its own uninitialized-variable warnings (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// exp on 16 lanes of x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in
// r, then 2^n by scalef; relative error about 1e-7 where the result is a normal float). x below
// -104, -inf included, is taken as -104, whose exp is below float's smallest denormal and rounds
// to 0, as std::exp's does.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive_avx512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // -inf to 0; a NaN stays NaN (max's 2nd operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The same row on AVX-512: 16 columns at a time, the tail masked. The scalar loop's std::exp calls
// took 7% of GPT-2 small's step (50,257 classes for 1,024 tokens); this row, 1.8%.
__attribute__((target("avx512f"))) float softmax_xent_row_avx512(const float* row, float* prow,
                                                                 int64_t c, int32_t y) {
  const int64_t body = c / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (c - body)) - 1u);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < body; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
  if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, row + body));
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < body; j += 16) {
    const __m512 e = exp_nonpositive_avx512(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmx));
    _mm512_storeu_ps(prow + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (tail) {
    const __m512 e =
        exp_nonpositive_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + body), vmx));
    _mm512_mask_storeu_ps(prow + body, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t j = 0; j < body; j += 16)
    _mm512_storeu_ps(prow + j, _mm512_mul_ps(_mm512_loadu_ps(prow + j), inv));
  if (tail)
    _mm512_mask_storeu_ps(prow + body, tail,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, prow + body), inv));
  return std::log(sum) - (row[y] - mx);
}

#pragma GCC diagnostic pop

// 2^k for k in [-126, 127], as a float built from its exponent bits.
__attribute__((target("avx2,fma"))) inline __m256 pow2_avx2(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

// exp on 8 lanes (AVX2 with FMA) of x already clamped to [-104, 89]: exp_nonpositive_avx512's
// reduction and polynomial; 2^n (n in [-150, 128]) applied as two factors 2^floor(n/2) and the
// rest, each a normal float, so that a result in the denormals is rounded once, as scalef rounds
// it, and n = 128 (x above 88.72) gives +inf.
__attribute__((target("avx2,fma"))) inline __m256 exp_clamped_avx2(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);  // floor(n / 2)
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_avx2(n1)), pow2_avx2(n2));
}

// exp_nonpositive_avx512 on 8 lanes: -inf and anything below -104 taken as -104 (0 after
// rounding); a NaN stays NaN (max's 2nd operand).
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive_avx2(__m256 x) {
  return exp_clamped_avx2(_mm256_max_ps(_mm256_set1_ps(-104.f), x));
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 16 columns of a row: out = exp(in - max), added to the sums s0 (the first 8) and s1.
__attribute__((target("avx2,fma"))) inline void softmax_block_avx2(const float* in, float* out,
                                                                   __m256 vmx, __m256& s0,
                                                                   __m256& s1) {
  const __m256 e0 = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(in), vmx));
  const __m256 e1 = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(in + 8), vmx));
  _mm256_storeu_ps(out, e0);
  _mm256_storeu_ps(out + 8, e1);
  s0 = _mm256_add_ps(s0, e0);
  s1 = _mm256_add_ps(s1, e1);
}

// The same row on AVX2 (the AVX-512 row's on CPUs without it: AVX2-only EPYCs): 16 columns a step
// in two registers, so that the sums spread over 16 lanes as there; the last 1-15 columns through a
// block padded with -inf (exp 0).
__attribute__((target("avx2,fma"))) float softmax_xent_row_avx2(const float* row, float* prow,
                                                                int64_t c, int32_t y) {
  const int64_t body = c / 16 * 16, rest = c - body;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < body; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float mx = lanes[0];
  for (int k = 1; k < 8; ++k) mx = lanes[k] > mx ? lanes[k] : mx;
  for (int64_t j = body; j < c; ++j) mx = row[j] > mx ? row[j] : mx;
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 16) softmax_block_avx2(row + j, prow + j, vmx, s0, s1);
  if (rest > 0) {
    float in[16], out[16];
    std::fill_n(in, 16, -std::numeric_limits<float>::infinity());
    std::copy_n(row + body, rest, in);
    softmax_block_avx2(in, out, vmx, s0, s1);
    std::copy_n(out, rest, prow + body);
  }
  const float sum = hsum_avx2(_mm256_add_ps(s0, s1));
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  for (int64_t j = 0; j < body; j += 8)
    _mm256_storeu_ps(prow + j, _mm256_mul_ps(_mm256_loadu_ps(prow + j), inv));
  for (int64_t j = body; j < c; ++j) prow[j] *= 1.f / sum;
  return std::log(sum) - (row[y] - mx);
}

// The widest row this CPU (and DTRAIN_MAX_CPU_ISA) allows; at first use (a bad value throws).
using SoftmaxRow = float (*)(const float*, float*, int64_t, int32_t);
SoftmaxRow softmax_row() {
  static const SoftmaxRow row =
      detail::cpu_supports(detail::CpuFeature::kAvx512f)   ? softmax_xent_row_avx512
      : detail::cpu_supports(detail::CpuFeature::kAvx2Fma) ? softmax_xent_row_avx2
                                                           : softmax_xent_row_scalar;
  return row;
}

// Softmax's backward pass over one row: dx = y * (dy - sum(dy * y)).
void softmax_backward_row_scalar(const float* y, const float* dy, float* dx, int64_t c) {
  float s = 0.f;
  for (int64_t j = 0; j < c; ++j) s += dy[j] * y[j];
  for (int64_t j = 0; j < c; ++j) dx[j] = y[j] * (dy[j] - s);
}

// The same on AVX2 with FMA: the sum in 16 lanes (two registers), the last 1-15 columns added
// after them in order.
__attribute__((target("avx2,fma"))) void softmax_backward_row_avx2(const float* y, const float* dy,
                                                                   float* dx, int64_t c) {
  const int64_t body = c / 16 * 16;
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(dy + j), _mm256_loadu_ps(y + j), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(dy + j + 8), _mm256_loadu_ps(y + j + 8), s1);
  }
  float s = hsum_avx2(_mm256_add_ps(s0, s1));
  for (int64_t j = body; j < c; ++j) s += dy[j] * y[j];
  const __m256 vs = _mm256_set1_ps(s);
  for (int64_t j = 0; j < body; j += 8)
    _mm256_storeu_ps(
        dx + j, _mm256_mul_ps(_mm256_loadu_ps(y + j), _mm256_sub_ps(_mm256_loadu_ps(dy + j), vs)));
  for (int64_t j = body; j < c; ++j) dx[j] = y[j] * (dy[j] - s);
}

// The widest row this CPU (and DTRAIN_MAX_CPU_ISA) allows.
using SoftmaxBackwardRow = void (*)(const float*, const float*, float*, int64_t);
SoftmaxBackwardRow softmax_backward_row() {
  return detail::cpu_supports(detail::CpuFeature::kAvx2Fma) ? softmax_backward_row_avx2
                                                            : softmax_backward_row_scalar;
}

std::atomic<uint64_t> g_softmax_backward_runs{0};

// --- GELU, tanh form, on AVX2 with FMA ---
// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as x s with
// s = 1 / (1 + e), e = exp(-2u): the same function, without the cancellation of 1 + tanh(u) for
// x << 0 (oneDNN's gives -2.98e-7 at x = -5 where it is -2.29e-7). Its derivative:
// s + x s (1 - s) 2u', 2u' = 2 sqrt(2/pi) (1 + 3 0.044715 x^2), with 1 - s taken as e s (exact
// where s is near 1), or 1 where e overflowed (x << 0: s = 0, the term 0). x = +-inf gives +inf and
// NaN forward, NaN backward, as oneDNN's; below x = -10.06 (e overflows) -0 forward and 0
// backward. 2u' is computed from x clamped to +-1e9, so that x^2's overflow (|x| > 1.8e19) does
// not make 0 times inf.
constexpr float kGeluK = 0.7978845608028654f, kGeluC = 0.044715f;

// exp(x) for any x: above 88.72 +inf, below -104 taken as -104 (0 after rounding); a NaN stays
// NaN (min's and max's 2nd operand).
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  return exp_clamped_avx2(
      _mm256_max_ps(_mm256_set1_ps(-104.f), _mm256_min_ps(_mm256_set1_ps(89.f), x)));
}

// e = exp(-2u) and s = 1 / (1 + e) for 8 lanes of x.
__attribute__((target("avx2,fma"))) inline __m256 gelu_s_avx2(__m256 x, __m256& e) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 u =
      _mm256_mul_ps(_mm256_fmadd_ps(_mm256_set1_ps(kGeluC), x3, x), _mm256_set1_ps(kGeluK));
  e = exp_avx2(_mm256_mul_ps(u, _mm256_set1_ps(-2.f)));
  return _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
__attribute__((target("avx2,fma"))) inline __m256 gelu_fwd8(__m256 x) {
  __m256 e;
  return _mm256_mul_ps(x, gelu_s_avx2(x, e));
}
__attribute__((target("avx2,fma"))) inline __m256 gelu_bwd8(__m256 x, __m256 dy) {
  __m256 e;
  const __m256 s = gelu_s_avx2(x, e);
  const __m256 one_minus_s = _mm256_min_ps(_mm256_mul_ps(e, s), _mm256_set1_ps(1.f));  // inf 0: 1
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-1e9f), _mm256_min_ps(_mm256_set1_ps(1e9f), x));
  const __m256 du = _mm256_mul_ps(
      _mm256_fmadd_ps(_mm256_set1_ps(3.f * kGeluC), _mm256_mul_ps(xc, xc), _mm256_set1_ps(1.f)),
      _mm256_set1_ps(2.f * kGeluK));
  const __m256 d = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(x, one_minus_s), s), du, s);
  return _mm256_mul_ps(dy, d);
}
// The last 1-7 elements through a full vector (the same arithmetic as the body's).
__attribute__((target("avx2,fma"))) void gelu_tanh_forward_avx2(const float* x, float* y,
                                                                int64_t n) {
  const int64_t body = n / 8 * 8;
  for (int64_t i = 0; i < body; i += 8) _mm256_storeu_ps(y + i, gelu_fwd8(_mm256_loadu_ps(x + i)));
  if (body == n) return;
  float in[8] = {}, out[8];
  std::copy_n(x + body, n - body, in);
  _mm256_storeu_ps(out, gelu_fwd8(_mm256_loadu_ps(in)));
  std::copy_n(out, n - body, y + body);
}
__attribute__((target("avx2,fma"))) void gelu_tanh_backward_avx2(const float* x, const float* dy,
                                                                 float* dx, int64_t n) {
  const int64_t body = n / 8 * 8;
  for (int64_t i = 0; i < body; i += 8)
    _mm256_storeu_ps(dx + i, gelu_bwd8(_mm256_loadu_ps(x + i), _mm256_loadu_ps(dy + i)));
  if (body == n) return;
  float in[8] = {}, g[8] = {}, out[8];
  std::copy_n(x + body, n - body, in);
  std::copy_n(dy + body, n - body, g);
  _mm256_storeu_ps(out, gelu_bwd8(_mm256_loadu_ps(in), _mm256_loadu_ps(g)));
  std::copy_n(out, n - body, dx + body);
}

std::atomic<uint64_t> g_gelu_runs{0};
std::atomic<bool> g_force_own_gelu{false};
}  // namespace

bool own_gelu_tanh() {
  static const bool v = detail::cpu_supports(detail::CpuFeature::kAvx2Fma) &&
                        !detail::cpu_supports(detail::CpuFeature::kAvx512f);
  return v || (g_force_own_gelu.load(std::memory_order_relaxed) &&
               detail::cpu_supports(detail::CpuFeature::kAvx2Fma));
}
void gelu_tanh_forward(const float* x, float* y, int64_t n) {
  g_gelu_runs.fetch_add(1, std::memory_order_relaxed);
  gelu_tanh_forward_avx2(x, y, n);
}
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n) {
  g_gelu_runs.fetch_add(1, std::memory_order_relaxed);
  gelu_tanh_backward_avx2(x, dy, dx, n);
}

void softmax_backward_rows(const float* y, const float* dy, float* dx, int64_t rows, int64_t c,
                           int threads) {
  g_softmax_backward_runs.fetch_add(1, std::memory_order_relaxed);
  static const SoftmaxBackwardRow row = softmax_backward_row();
  const int t = rows * c < CpuKernels::State::kSerialWork
                    ? 1
                    : static_cast<int>(std::min<int64_t>(rows, threads));
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
  for (int64_t i = 0; i < rows; ++i) row(y + i * c, dy + i * c, dx + i * c, c);
}

}  // namespace dtrain::cpu

namespace dtrain::cpu_testing {
uint64_t own_softmax_backward_runs() {
  return cpu::g_softmax_backward_runs.load(std::memory_order_relaxed);
}
const char* own_softmax_backward_row() {
  return cpu::softmax_backward_row() == cpu::softmax_backward_row_avx2 ? "avx2" : "scalar";
}
uint64_t own_gelu_runs() { return cpu::g_gelu_runs.load(std::memory_order_relaxed); }
void force_own_gelu(bool on) { cpu::g_force_own_gelu = on; }
}  // namespace dtrain::cpu_testing

namespace dtrain::cpu {

void CpuKernels::softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor* loss,
                                       Tensor* probs) {
  require_f32(logits, "softmax_cross_entropy", "logits");
  if (logits.rank() != 2 || labels.rank() != 1 || labels.shape()[0] != logits.shape()[0])
    throw InvalidArgument("softmax_cross_entropy expects logits [N, C] and labels [N], got " +
                          logits.shape().to_string() + " and " + labels.shape().to_string());
  if (labels.dtype() != DType::kInt32)
    throw InvalidArgument(std::string("softmax_cross_entropy: labels must be int32, got ") +
                          dtype_name(labels.dtype()));
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const int32_t* py = labels.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)  // before any work: nothing may throw inside the parallel loop
    if (py[i] < 0 || py[i] >= c)
      throw InvalidArgument("softmax_cross_entropy: label " + std::to_string(py[i]) + " at row " +
                            std::to_string(i) + " is outside [0, " + std::to_string(c) +
                            "); check the dataset's labels and the number of classes");
  *loss = Tensor::empty(Shape{n}, DType::kFloat32, spec_);
  *probs = Tensor::empty(logits.shape(), DType::kFloat32, spec_);
  if (c == 0) return;
  const float* pl = logits.data<float>();
  float* pp = probs->data<float>();
  float* ploss = loss->data<float>();
  const int threads = n * c < State::kSerialWork ? 1 : std::min<int64_t>(n, state_->threads);
  const SoftmaxRow row = softmax_row();
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) ploss[i] = row(pl + i * c, pp + i * c, c, py[i]);
}

Tensor CpuKernels::softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels,
                                                  const Tensor& dloss) {
  const int64_t n = probs.shape()[0], c = probs.shape()[1];
  Tensor dx = Tensor::empty(probs.shape(), DType::kFloat32, spec_);
  const float* pp = probs.data<float>();
  const float* pd = dloss.data<float>();
  const int32_t* py = labels.data<int32_t>();
  float* px = dx.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float g = pd[i];
    for (int64_t j = 0; j < c; ++j) px[i * c + j] = pp[i * c + j] * g;
    px[i * c + py[i]] -= g;
  }
  return dx;
}

Tensor CpuKernels::dropout_mask(const Shape& shape, float rate, uint64_t seed, uint64_t stream) {
  if (rate < 0.f || rate >= 1.f)
    throw InvalidArgument("dropout rate must be in [0, 1), got " + std::to_string(rate));
  Tensor m = Tensor::empty(shape, DType::kFloat32, spec_);
  const Philox rng(seed, stream);
  const float keep = 1.f / (1.f - rate);
  float* p = m.data<float>();
  const int64_t n = m.numel();
  for (int64_t blk = 0; blk * 4 < n; ++blk) {
    const auto w = rng.block(static_cast<uint64_t>(blk));
    for (int j = 0; j < 4 && blk * 4 + j < n; ++j) {
      const float u = static_cast<float>(w[static_cast<size_t>(j)] >> 8) * (1.0f / 16777216.0f);
      p[blk * 4 + j] = u >= rate ? keep : 0.f;
    }
  }
  return m;
}

void CpuKernels::sgd_update(Tensor& var, const Tensor& grad, Tensor* momentum, float lr, float mu,
                            bool nesterov) {
  require_f32(var, "sgd_update", "variable");
  require_f32(grad, "sgd_update", "gradient");
  if (var.shape() != grad.shape())
    throw InvalidArgument("sgd_update: variable " + var.shape().to_string() + " but gradient " +
                          grad.shape().to_string());
  float* w = var.data<float>();
  const float* g = grad.data<float>();
  const int64_t n = var.numel();
  if (!momentum) {
    for (int64_t i = 0; i < n; ++i) w[i] -= lr * g[i];
    return;
  }
  float* b = momentum->data<float>();
  if (nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      b[i] = mu * b[i] + g[i];
      w[i] -= lr * (g[i] + mu * b[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      b[i] = mu * b[i] + g[i];
      w[i] -= lr * b[i];
    }
  }
}

namespace {
// Adam's elementwise pass, built for AVX-512 and AVX2 beside the baseline (the library itself
// targets baseline x86-64) and picked at first use for this CPU under DTRAIN_MAX_CPU_ISA (a
// target_clones ifunc would take AVX-512 under a cap of AVX2). This file is compiled with
// -fno-math-errno, so the square root vectorizes, and -ffp-contract=off, so no build fuses a
// multiply-add: every element gets the same IEEE operations in the same order, whichever path
// (vector body, peeled head or tail, instruction set) computes it.
__attribute__((always_inline)) inline void adam_body(float* __restrict w, float* __restrict pm,
                                                     float* __restrict pv,
                                                     const float* __restrict g, int64_t n,
                                                     float lr_t, float beta1, float beta2,
                                                     float epsilon, float grad_scale, float decay) {
  const float b1c = 1.f - beta1, b2c = 1.f - beta2;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = grad_scale * g[i];
    const float mi = beta1 * pm[i] + b1c * gi;
    const float vi = beta2 * pv[i] + b2c * gi * gi;
    pm[i] = mi;
    pv[i] = vi;
    w[i] = decay * w[i] - lr_t * mi / (std::sqrt(vi) + epsilon);
  }
}
__attribute__((target("avx512f"))) void adam_avx512(float* w, float* pm, float* pv, const float* g,
                                                    int64_t n, float lr_t, float beta1, float beta2,
                                                    float epsilon, float grad_scale, float decay) {
  adam_body(w, pm, pv, g, n, lr_t, beta1, beta2, epsilon, grad_scale, decay);
}
__attribute__((target("avx2"))) void adam_avx2(float* w, float* pm, float* pv, const float* g,
                                               int64_t n, float lr_t, float beta1, float beta2,
                                               float epsilon, float grad_scale, float decay) {
  adam_body(w, pm, pv, g, n, lr_t, beta1, beta2, epsilon, grad_scale, decay);
}
void adam_portable(float* w, float* pm, float* pv, const float* g, int64_t n, float lr_t,
                   float beta1, float beta2, float epsilon, float grad_scale, float decay) {
  adam_body(w, pm, pv, g, n, lr_t, beta1, beta2, epsilon, grad_scale, decay);
}
using AdamLoop = void (*)(float*, float*, float*, const float*, int64_t, float, float, float, float,
                          float, float);
AdamLoop adam_loop() {
  static const AdamLoop loop = detail::cpu_supports(detail::CpuFeature::kAvx512f)   ? adam_avx512
                               : detail::cpu_supports(detail::CpuFeature::kAvx2Fma) ? adam_avx2
                                                                                    : adam_portable;
  return loop;
}
}  // namespace

void CpuKernels::adam_update(Tensor& var, Tensor& m, Tensor& v, const Tensor& grad, float lr,
                             float beta1, float beta2, float epsilon, int64_t step,
                             float grad_scale, float decay) {
  require_f32(var, "adam_update", "variable");
  require_f32(grad, "adam_update", "gradient");
  if (var.shape() != grad.shape())
    throw InvalidArgument("adam_update: variable " + var.shape().to_string() + " but gradient " +
                          grad.shape().to_string());
  const double t = static_cast<double>(step);
  const float lr_t =
      static_cast<float>(lr * std::sqrt(1.0 - std::pow(beta2, t)) / (1.0 - std::pow(beta1, t)));
  float* w = var.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  const float* g = grad.data<float>();
  const int64_t n = var.numel();
  adam_loop()(w, pm, pv, g, n, lr_t, beta1, beta2, epsilon, grad_scale, decay);
}

}  // namespace dtrain::cpu

namespace dtrain::cpu_testing {
const char* adam_loop_isa() {
  const auto loop = cpu::adam_loop();
  return loop == cpu::adam_avx512 ? "avx512" : loop == cpu::adam_avx2 ? "avx2" : "portable";
}
}  // namespace dtrain::cpu_testing
