// oneDNN-backed dense, elementwise and reorder kernels (reductions: cpu_reduce.cc; batch norm:
// cpu_batch_norm.cc, on a bfloat16 input cpu_batch_norm_bf16.cc).
#include <omp.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <string>

#include "devices/cpu/cpu_stream.h"
#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

std::atomic<uint64_t> g_state_uid{1};

// Whether a memory-bound pass writing `n` floats takes cpu_stream.h's streaming-store loop.
bool streams(int64_t n) { return stream_pass(n); }

// Runs pass(offset, count) over [0, n) in one contiguous part per device thread (for_each_part),
// each a multiple of 32 elements, so that a part's streaming stores start on a 64-byte line where
// the one before ended (the float outputs and add_relu's bfloat16 copy alike). Each part's loop
// ends with its own store fence, before the team's closing barrier. On a 2-thread device the
// streaming loops in parts replaced oneDNN's binary add and ReLU backward primitives, 387 of 4,124
// ms of oneDNN's time in ResNet-50's two steps at batch 32 (ONEDNN_VERBOSE, Zen 5).
template <class Pass>
void in_parts(const CpuKernels::State& state, int64_t n, Pass pass) {
  for_each_part(state.threads, n, 32, pass);
}
// The same for a pass of any size: one part (no OpenMP team) below the device's serial work, as
// its primitives run.
template <class Pass>
void in_parts_or_serial(const CpuKernels::State& state, int64_t n, Pass pass) {
  for_each_part(n < CpuKernels::State::kSerialWork ? 1 : state.threads, n, 32, pass);
}

algorithm eltwise_algorithm(UnaryOp op, float* alpha) {
  *alpha = 0.f;
  switch (op) {
    case UnaryOp::kRelu:
      return algorithm::eltwise_relu;
    case UnaryOp::kTanh:
      return algorithm::eltwise_tanh;
    case UnaryOp::kSigmoid:
      return algorithm::eltwise_logistic;
    case UnaryOp::kNeg:
      *alpha = -1.f;
      return algorithm::eltwise_linear;
    case UnaryOp::kExp:
      return algorithm::eltwise_exp;
    case UnaryOp::kLog:
      return algorithm::eltwise_log;
    case UnaryOp::kSquare:
      return algorithm::eltwise_square;
    case UnaryOp::kSqrt:
      return algorithm::eltwise_sqrt;
    case UnaryOp::kAbs:
      return algorithm::eltwise_abs;
    case UnaryOp::kGeluErf:
      return algorithm::eltwise_gelu_erf;
    case UnaryOp::kGeluTanh:
      return algorithm::eltwise_gelu_tanh;
  }
  throw InvalidArgument("unknown unary op");
}

algorithm binary_algorithm(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd:
      return algorithm::binary_add;
    case BinaryOp::kSub:
      return algorithm::binary_sub;
    case BinaryOp::kMul:
      return algorithm::binary_mul;
    case BinaryOp::kDiv:
      return algorithm::binary_div;
    case BinaryOp::kMax:
      return algorithm::binary_max;
    case BinaryOp::kMin:
      return algorithm::binary_min;
  }
  throw InvalidArgument("unknown binary op");
}

memory::dims padded_dims(const Shape& s, size_t rank) {
  memory::dims d(rank, 1);
  for (int i = 0; i < s.rank(); ++i) d[rank - s.rank() + i] = s.dims()[i];
  return d;
}

struct Eltwise {
  dnnl::eltwise_forward prim;
};
struct EltwiseBwd {
  dnnl::eltwise_backward prim;
};
struct Binary {
  dnnl::binary prim;
};
struct Reorder {
  dnnl::reorder prim;
};

// Blocks of a large matmul (see CpuKernels::matmul): the widest block of C's columns over a
// row-major B and of the inner dimension over an untransposed A of at least
// kMatmulInnerBlockMinRows rows and a row-major B, and of C's rows over a transposed A taller than
// kMatmulRowsSplitAbove.
constexpr int64_t kMatmulColumnBlock = 1536, kMatmulInnerBlock = 1536,
                  kMatmulInnerBlockMinRows = 256;
constexpr int64_t kMatmulRowBlock = 4096, kMatmulRowsSplitAbove = 8192;
// On the bfloat16 kernels: column blocks of about kBf16ColumnBlock over a transposed B at least
// kBf16WideColumns wide, for products of at least kMatmulInnerBlockMinRows rows (see
// CpuKernels::matmul).
constexpr int64_t kBf16ColumnBlock = 2048, kBf16WideColumns = 16384;

// `extent` as equal blocks of at most about `most` (multiples of 16 but the last): their width.
int64_t block_width(int64_t extent, int64_t most) {
  if (extent <= most) return extent;
  const int64_t blocks = (extent + most - 1) / most;
  return ((extent + blocks - 1) / blocks + 15) / 16 * 16;
}

}  // namespace

CpuKernels::State::State(int t) : uid(g_state_uid.fetch_add(1)), threads(t) {}

void CpuKernels::State::set_threads(int64_t work) const {
  // The thread count belongs to the device, not to the calling thread: the training loop's thread
  // (reductions, metrics) and the replica threads all run this device's primitives with its count.
  // Otherwise a thread left at the process default (all cores) starts an OpenMP team whose idle
  // workers spin on the cores the replicas need.
  const int want = work < kSerialWork ? 1 : threads;
  if (omp_get_max_threads() != want) omp_set_num_threads(want);
}

dnnl::stream& CpuKernels::State::stream(int64_t work) {
  set_threads(work);
  thread_local std::unordered_map<uint64_t, dnnl::stream> streams;
  auto it = streams.find(uid);
  if (it == streams.end()) it = streams.emplace(uid, dnnl::stream(engine)).first;
  return it->second;
}

CpuKernels::CpuKernels(DeviceSpec spec, int threads)
    : spec_(spec), state_(std::make_unique<State>(threads)) {}
CpuKernels::~CpuKernels() = default;

Tensor CpuKernels::matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  require_f32_or_kept_bf16(a, "matmul", "a");
  require_f32_or_kept_bf16(b, "matmul", "b");
  if (a.rank() != 2 || b.rank() != 2)
    throw InvalidArgument("matmul expects 2-D operands, got " + a.shape().to_string() + " and " +
                          b.shape().to_string());
  const int64_t m = ta ? a.shape()[1] : a.shape()[0], k = ta ? a.shape()[0] : a.shape()[1];
  const int64_t kb = tb ? b.shape()[1] : b.shape()[0], n = tb ? b.shape()[0] : b.shape()[1];
  if (k != kb)
    throw InvalidArgument("matmul: inner dimensions differ: " + a.shape().to_string() +
                          (ta ? "^T" : "") + " @ " + b.shape().to_string() + (tb ? "^T" : ""));
  Tensor c = Tensor::empty(Shape{m, n}, DType::kFloat32, spec_);
  if (c.numel() == 0) return c;
  if (k == 0) {
    fill(c, 0.f);
    return c;
  }
  try {
    // mixed_bfloat16 (core/precision.h): both operands rounded to bfloat16, float32 accumulation
    // and result. On the bfloat16 kernels the copies keep the operands' layouts (a transposed
    // operand converted as it lies: oneDNN's brgemm kernels read transposed bfloat16 operands,
    // where a transposing copy took 1.4 of GPT-2's 7.2 s of oneDNN time over two steps on an AMX
    // Xeon), and a bfloat16 operand (a copy an op kept) is read as it is. Without bfloat16 kernels
    // (dnnl_util.h) the copies are row-major float32, rounded to bfloat16 in place.
    const bool bf16 = mixed_bf16(), native = bf16 && bf16_kernels_native();
    const dt in_dt = native ? dt::bf16 : dt::f32;
    const bool a_rows = (bf16 && !native) || !ta, b_rows = (bf16 && !native) || !tb;
    const dt op_dt = bf16 ? in_dt : dt::f32;
    // Element strides of the operands the primitive reads: A(i, p), B(p, j), C(i, j).
    const memory::dims as = a_rows ? memory::dims{k, 1} : memory::dims{1, m};
    const memory::dims bs = b_rows ? memory::dims{n, 1} : memory::dims{1, k};
    const char* ap = static_cast<const char*>(a.raw_data());
    const char* bp = static_cast<const char*>(b.raw_data());
    Tensor a16, b16;
    if (bf16) {
      const memory::desc abf({m, k}, in_dt, as), bbf({k, n}, in_dt, bs);
      // (A bfloat16 operand is what an op kept for its backward pass: exact in bfloat16.)
      memory am = mem(
          memory::desc({m, k}, dnnl_type(a.dtype()), ta ? memory::dims{1, m} : memory::dims{k, 1}),
          state_->engine, a);
      memory bm = mem(
          memory::desc({k, n}, dnnl_type(b.dtype()), tb ? memory::dims{1, k} : memory::dims{n, 1}),
          state_->engine, b);
      // The operand the primitive reads: `user` itself where it is that already (native), else a
      // copy in `holder` (emulated: always, rounded unless the operand is a bfloat16 copy).
      const auto operand = [&](memory user, const memory::desc& want, const Tensor& t,
                               Tensor* holder, const char* p) -> const char* {
        if (native && user.get_desc() == want) return p;
        *holder = scratch(want.get_size(), spec_);
        memory out(want, state_->engine, holder->raw_data());
        const int64_t elems = t.numel();
        convert(*state_, user, out, spec_, elems);
        if (!native && t.dtype() != DType::kBFloat16)
          round_to_bf16(static_cast<float*>(holder->raw_data()), static_cast<size_t>(elems));
        return static_cast<const char*>(holder->raw_data());
      };
      ap = operand(am, abf, a, &a16, ap);
      bp = operand(bm, bbf, b, &b16, bp);
    }
    // oneDNN 2.6's brgemm matmul loses up to two thirds of its rate on some large operands that
    // it runs well in pieces (Xeon family 6 model 207, one thread, GFLOP/s whole -> in blocks):
    //  - a row-major B thousands of columns wide: [1024x768] @ [768x3072] 50 -> 129-155 (the first
    //    layer of each transformer block's MLP, and its weight gradient);
    //  - a long inner dimension, A and B row-major: [1024x50257] @ [50257x768] 110 -> 157 (the
    //    gradient into GPT-2's tied embedding), [1024x2048] @ [2048x768] 87 -> 154;
    //  - a transposed A tens of thousands of rows tall: [50257x1024] @ [1024x768] 101 -> 137 (the
    //    embedding's weight gradient).
    // Such a product runs as blocks of C's columns, of the inner dimension (the blocks after the
    // first adding into C: a sum post-op) and of C's rows, one primitive call each on views of the
    // operands. The float32 sums are then taken in a different order: equal to within rounding.
    // None of this on the bfloat16 kernels: oneDNN 2.6 runs a block of a bfloat16 B (strided rows)
    // on its older jit GEMM instead of the AMX brgemm one, at a fraction of the rate (GPT-2 small's
    // MLP products, [1024x768] @ [768x1536] blocks of [768x3072]: 221 GFLOP/s on an AMX Xeon, 3.6
    // of 8.8 s of oneDNN time over two steps).
    const size_t elem = op_dt == dt::bf16 ? 2 : 4;
    auto* cp = static_cast<float*>(c.raw_data());
    // The primitive for an mb x kb x nb block (the operands keep their full strides; C's rows are
    // ldc apart: n in C itself, nb in a dense scratch block).
    const auto prim = [&](int64_t mb, int64_t kb, int64_t nb, bool accumulate, int64_t ldc) {
      std::string key = bf16 ? (native ? "mm@bf16" : "mm@bf16-emulated") : "mm";
      key_dims(key, {m, k, n, mb, kb, nb, ta, tb, accumulate, ldc});
      return state_->get<MatmulPrimitive>(
          key,
          [&] {
            dnnl::primitive_attr attr;
            if (accumulate) {
              dnnl::post_ops po;
              po.append_sum(1.f);
              attr.set_post_ops(po);
            }
            dnnl::matmul::primitive_desc pd(
                dnnl::matmul::desc(memory::desc({mb, kb}, op_dt, as),
                                   memory::desc({kb, nb}, op_dt, bs),
                                   memory::desc({mb, nb}, dt::f32, memory::dims{ldc, 1})),
                attr, state_->engine);
            return std::make_shared<MatmulPrimitive>(MatmulPrimitive{dnnl::matmul(pd)});
          },
          mb * nb * kb / 8);
    };
    // On the bfloat16 kernels, a transposed B tens of thousands of columns wide (GPT-2's tied
    // output layer, x E^T with E the [50257 x 768] embedding, 79 GFLOP a step at 1,024 tokens)
    // runs as column blocks of C, each into a dense scratch block copied into place: a block of a
    // transposed B is a dense range of its rows, which the AMX brgemm kernel takes, but a block of
    // C is strided, which oneDNN 2.6 gives to its older jit GEMM. Whole, that product ran at 252
    // GFLOP/s (183-288) against 382-885 for GPT-2's other products; in blocks of 2,048 columns
    // at 436 (1.70x within each of 7 rounds, 1.52-1.88; blocks of 1,024 1.51x, of 4,096 1.46x),
    // the copies included (bench/micro/lm_head_blocks.cc, one thread on an AMX Xeon). Each block
    // sums over the whole inner dimension, as the whole product does.
    if (native && !b_rows && n >= kBf16WideColumns && m >= kMatmulInnerBlockMinRows) {
      const int64_t nw = block_width(n, kBf16ColumnBlock);
      Tensor block = scratch(static_cast<size_t>(m * nw) * 4, spec_);
      auto* cblock = static_cast<float*>(block.raw_data());
      const int threads = m * nw < State::kSerialWork ? 1 : state_->threads;
      for (int64_t j = 0; j < n; j += nw) {
        const int64_t nb = std::min(nw, n - j);
        auto e = prim(m, k, nb, false, nb);
        const memory am(memory::desc({m, k}, op_dt, as), state_->engine, const_cast<char*>(ap));
        const memory bb(memory::desc({k, nb}, op_dt, bs), state_->engine,
                        const_cast<char*>(bp) + j * bs[1] * elem);
        const memory cb(memory::desc({m, nb}, dt::f32, memory::dims{nb, 1}), state_->engine,
                        cblock);
        auto& strm = state_->stream(m * nb * k / 8);
        e->prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bb}, {DNNL_ARG_DST, cb}});
        strm.wait();
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t i = 0; i < m; ++i)
          std::memcpy(cp + i * n + j, cblock + i * nb, static_cast<size_t>(nb) * sizeof(float));
      }
      return c;
    }
    const bool blocks = !native;
    const int64_t nw = block_width(n, blocks && b_rows ? kMatmulColumnBlock : n);
    // (Not under a transposed A: ResNet-50's 1x1 weight gradients, x^T dy with inner dimensions of
    // 1,568-100,352, ran 0.86-1.09x as fast in blocks. Those with 2,048 output channels do run as
    // two column blocks: 0.96-0.98x, within the noise of those timings.)
    // Nor for few rows: [64x1600] @ [1600x128] (the reference CNN's first dense layer at 64 images)
    // took 0.19-0.26 ms in two blocks against 0.17-0.22 whole; at 1,000 rows, 2.8 against 7.7.
    const int64_t kw = block_width(
        k, blocks && b_rows && !ta && m >= kMatmulInnerBlockMinRows ? kMatmulInnerBlock : k);
    const int64_t mw =
        block_width(m, blocks && !a_rows && m > kMatmulRowsSplitAbove ? kMatmulRowBlock : m);
    for (int64_t i = 0; i < m; i += mw)
      for (int64_t j = 0; j < n; j += nw)
        for (int64_t p = 0; p < k; p += kw) {
          const int64_t mb = std::min(mw, m - i), nb = std::min(nw, n - j),
                        kb = std::min(kw, k - p);
          auto e = prim(mb, kb, nb, p > 0, n);
          const memory ab(memory::desc({mb, kb}, op_dt, as), state_->engine,
                          const_cast<char*>(ap) + (i * as[0] + p * as[1]) * elem);
          const memory bb(memory::desc({kb, nb}, op_dt, bs), state_->engine,
                          const_cast<char*>(bp) + (p * bs[0] + j * bs[1]) * elem);
          const memory cb(memory::desc({mb, nb}, dt::f32, memory::dims{n, 1}), state_->engine,
                          cp + i * n + j);
          e->prim.execute(state_->stream(mb * nb * kb / 8),
                          {{DNNL_ARG_SRC, ab}, {DNNL_ARG_WEIGHTS, bb}, {DNNL_ARG_DST, cb}});
        }
  } catch (const dnnl::error& err) {
    rethrow_dnnl("matmul", err);
  }
  return c;
}

Tensor CpuKernels::unary(UnaryOp op, const Tensor& x) {
  require_f32(x, "unary", "x");
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  if (y.numel() == 0) return y;
  if (op == UnaryOp::kGeluTanh && own_gelu_tanh()) {
    const float* xp = x.data<float>();
    float* yp = y.data<float>();
    in_parts_or_serial(*state_, y.numel(),
                       [&](int64_t o, int64_t n) { gelu_tanh_forward(xp + o, yp + o, n); });
    return y;
  }
  float alpha;
  const algorithm alg = eltwise_algorithm(op, &alpha);
  const memory::desc md({x.numel()}, dt::f32, tag::a);
  try {
    std::string key = "ew" + std::to_string(static_cast<int>(op)) + ":";
    key_dims(key, {x.numel()});
    auto e = state_->get<Eltwise>(
        key,
        [&] {
          dnnl::eltwise_forward::primitive_desc pd(
              {prop_kind::forward_inference, alg, md, alpha, 0.f}, state_->engine);
          return std::make_shared<Eltwise>(Eltwise{dnnl::eltwise_forward(pd)});
        },
        x.numel());
    e->prim.execute(state_->stream(x.numel()), {{DNNL_ARG_SRC, mem(md, state_->engine, x)},
                                                {DNNL_ARG_DST, mem(md, state_->engine, y)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("unary", err);
  }
  return y;
}

Tensor CpuKernels::activation_backward(UnaryOp op, const Tensor& x_or_y, const Tensor& dy) {
  require_f32(dy, "activation_backward", "dy");
  if (x_or_y.shape() != dy.shape())
    throw InvalidArgument("activation_backward: " + x_or_y.shape().to_string() + " vs dy " +
                          dy.shape().to_string());
  if (op == UnaryOp::kRelu && x_or_y.dtype() == DType::kBFloat16) {
    // ReLU's kept bfloat16 output under mixed_bfloat16 (ops::relu): read as it is where the pass
    // streams, else widened first (the same results).
    require_f32_or_kept_bf16(x_or_y, "activation_backward", "y");
    if (!streams(dy.numel())) return activation_backward(op, cast(x_or_y, DType::kFloat32), dy);
    Tensor dx = Tensor::empty(dy.shape(), DType::kFloat32, spec_);
    const auto* y = static_cast<const uint16_t*>(x_or_y.raw_data());
    const float* g = dy.data<float>();
    float* d = dx.data<float>();
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad(y + o, g + o, d + o, n); });
    return dx;
  }
  // Another activation's bfloat16 x or y (no op keeps one today, but the kernel contract,
  // hands_off_bfloat16, allows it): widened, as oneDNN's primitive below reads float32.
  if (x_or_y.dtype() == DType::kBFloat16)
    return activation_backward(op, cast(x_or_y, DType::kFloat32), dy);
  require_f32(x_or_y, "activation_backward", "x_or_y");
  if (op == UnaryOp::kGeluTanh && own_gelu_tanh()) {
    Tensor dx = Tensor::empty(dy.shape(), DType::kFloat32, spec_);
    const float *xp = x_or_y.data<float>(), *g = dy.data<float>();
    float* d = dx.data<float>();
    in_parts_or_serial(*state_, dx.numel(),
                       [&](int64_t o, int64_t n) { gelu_tanh_backward(xp + o, g + o, d + o, n); });
    return dx;
  }
  algorithm alg;
  int data_arg = DNNL_ARG_SRC;
  switch (op) {
    case UnaryOp::kRelu:
      alg = algorithm::eltwise_relu;
      break;
    case UnaryOp::kTanh:
      alg = algorithm::eltwise_tanh_use_dst_for_bwd;
      data_arg = DNNL_ARG_DST;
      break;
    case UnaryOp::kSigmoid:
      alg = algorithm::eltwise_logistic_use_dst_for_bwd;
      data_arg = DNNL_ARG_DST;
      break;
    case UnaryOp::kGeluErf:
      alg = algorithm::eltwise_gelu_erf;
      break;
    case UnaryOp::kGeluTanh:
      alg = algorithm::eltwise_gelu_tanh;
      break;
    default:
      throw InvalidArgument("activation_backward supports relu, tanh, sigmoid and gelu");
  }
  Tensor dx = Tensor::empty(dy.shape(), DType::kFloat32, spec_);
  if (dx.numel() == 0) return dx;
  if (op == UnaryOp::kRelu && x_or_y.dtype() == DType::kFloat32 && streams(dx.numel())) {
    const float *y = x_or_y.data<float>(), *g = dy.data<float>();
    float* d = dx.data<float>();
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad(y + o, g + o, d + o, n); });
    return dx;
  }
  const memory::desc md({dy.numel()}, dt::f32, tag::a);
  try {
    std::string key = "ewb" + std::to_string(static_cast<int>(op)) + ":";
    key_dims(key, {dy.numel()});
    auto e = state_->get<EltwiseBwd>(
        key,
        [&] {
          dnnl::eltwise_forward::primitive_desc hint(
              {prop_kind::forward_training, alg, md, 0.f, 0.f}, state_->engine);
          dnnl::eltwise_backward::primitive_desc pd({alg, md, md, 0.f, 0.f}, state_->engine, hint);
          return std::make_shared<EltwiseBwd>(EltwiseBwd{dnnl::eltwise_backward(pd)});
        },
        x_or_y.numel());
    e->prim.execute(state_->stream(x_or_y.numel()),
                    {{data_arg, mem(md, state_->engine, x_or_y)},
                     {DNNL_ARG_DIFF_DST, mem(md, state_->engine, dy)},
                     {DNNL_ARG_DIFF_SRC, mem(md, state_->engine, dx)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("activation_backward", err);
  }
  return dx;
}

Tensor CpuKernels::binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  require_f32(a, "binary", "a");
  require_f32(b, "binary", "b");
  const Shape out = broadcast_shapes(a.shape(), b.shape());
  Tensor c = Tensor::empty(out, DType::kFloat32, spec_);
  if (c.numel() == 0) return c;
  if (op == BinaryOp::kAdd && a.shape() == b.shape() &&
      streams(c.numel())) {  // a residual sum, or a gradient's from two paths
    const float *x = a.data<float>(), *y = b.data<float>();
    float* z = c.data<float>();
    in_parts(*state_, c.numel(), [&](int64_t o, int64_t n) { stream_add(x + o, y + o, z + o, n); });
    return c;
  }
  const size_t rank = static_cast<size_t>(std::max(out.rank(), 1));
  memory::dims ad = padded_dims(a.shape(), rank), bd = padded_dims(b.shape(), rank);
  const memory::dims cd = padded_dims(out, rank);
  const Tensor* src0 = &a;
  const Tensor* src1 = &b;
  // oneDNN broadcasts src1 only; commutative ops swap, sub/div with a broadcast lhs use a loop.
  if (ad != cd) {
    const bool commutative = op == BinaryOp::kAdd || op == BinaryOp::kMul || op == BinaryOp::kMax ||
                             op == BinaryOp::kMin;
    if (commutative && bd == cd) {
      std::swap(src0, src1);
      std::swap(ad, bd);
    } else {
      binary_broadcast_loop(op, a, b, c);
      return c;
    }
  }
  try {
    std::string key = "bin" + std::to_string(static_cast<int>(op)) + ":";
    key_dims(key, ad);
    key_dims(key, bd);
    auto e = state_->get<Binary>(
        key,
        [&] {
          dnnl::binary::primitive_desc pd(
              {binary_algorithm(op), plain_md(ad), plain_md(bd), plain_md(cd)}, state_->engine);
          return std::make_shared<Binary>(Binary{dnnl::binary(pd)});
        },
        c.numel());
    e->prim.execute(state_->stream(c.numel()),
                    {{DNNL_ARG_SRC_0, mem(plain_md(ad), state_->engine, *src0)},
                     {DNNL_ARG_SRC_1, mem(plain_md(bd), state_->engine, *src1)},
                     {DNNL_ARG_DST, mem(plain_md(cd), state_->engine, c)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("binary", err);
  }
  return c;
}

// One pass: oneDNN's binary add with a ReLU post-op. ResNet-50 at batch 32, one thread, two steps
// (ONEDNN_VERBOSE): the ReLU primitives' forward time 602 -> 76 ms, the sums' 1,001 -> 1,004 ms
// with the ReLU in them (a ReLU pass over 25.7 M floats took 37 ms, memory-bound).
Tensor CpuKernels::add_relu(const Tensor& a, const Tensor& b, Tensor* rounded) {
  require_f32(a, "add_relu", "a");
  require_f32(b, "add_relu", "b");
  if (a.shape() != b.shape())
    throw InvalidArgument("add_relu: operands of one shape only, got " + a.shape().to_string() +
                          " and " + b.shape().to_string());
  Tensor c = Tensor::empty(a.shape(), DType::kFloat32, spec_);
  if (c.numel() == 0) return c;
  if (streams(c.numel())) {
    const float *x = a.data<float>(), *y = b.data<float>();
    float* z = c.data<float>();
    if (rounded) {
      *rounded = Tensor::empty(a.shape(), DType::kBFloat16, spec_);
      auto* z16 = static_cast<uint16_t*>(rounded->raw_data());
      in_parts(*state_, c.numel(), [&](int64_t o, int64_t n) {
        stream_add_relu_rounded(x + o, y + o, z + o, z16 + o, n);
      });
    } else {
      in_parts(*state_, c.numel(),
               [&](int64_t o, int64_t n) { stream_add_relu(x + o, y + o, z + o, n); });
    }
    return c;
  }
  const memory::desc md({c.numel()}, dt::f32, tag::a);
  try {
    std::string key = "addrelu:";
    key_dims(key, {c.numel()});
    auto e = state_->get<Binary>(
        key,
        [&] {
          dnnl::post_ops po;
          po.append_eltwise(1.f, algorithm::eltwise_relu, 0.f, 0.f);
          dnnl::primitive_attr attr;
          attr.set_post_ops(po);
          dnnl::binary::primitive_desc pd({algorithm::binary_add, md, md, md}, attr,
                                          state_->engine);
          return std::make_shared<Binary>(Binary{dnnl::binary(pd)});
        },
        c.numel());
    e->prim.execute(state_->stream(c.numel()), {{DNNL_ARG_SRC_0, mem(md, state_->engine, a)},
                                                {DNNL_ARG_SRC_1, mem(md, state_->engine, b)},
                                                {DNNL_ARG_DST, mem(md, state_->engine, c)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("add_relu", err);
  }
  return c;
}

// Where the pass streams (4 MB and more, as the ReLU gradient's and the sum's own passes): one pass
// reading y, a and b, instead of a sum written and read again: ResNet-50's residual blocks whose
// input is the block before's output (15 of 16; the first reads the stem's pooling), 15 fewer
// passes a step. Elsewhere (and for operands the kernel does not take) the default's two passes,
// which give the same bits.
Tensor CpuKernels::relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) {
  const bool y_ok = y.dtype() == DType::kFloat32 || y.dtype() == DType::kBFloat16;
  if (!y_ok || a.dtype() != DType::kFloat32 || b.dtype() != DType::kFloat32 ||
      a.shape() != y.shape() || b.shape() != y.shape() || !streams(y.numel()))
    return Kernels::relu_grad_of_sum(y, a, b);
  if (y.dtype() == DType::kBFloat16) require_f32_or_kept_bf16(y, "relu_grad_of_sum", "y");
  Tensor dx = Tensor::empty(y.shape(), DType::kFloat32, spec_);
  const float *pa = a.data<float>(), *pb = b.data<float>();
  float* d = dx.data<float>();
  if (y.dtype() == DType::kBFloat16) {
    const auto* py = static_cast<const uint16_t*>(y.raw_data());
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad_sum(py + o, pa + o, pb + o, d + o, n); });
  } else {
    const float* py = y.data<float>();
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad_sum(py + o, pa + o, pb + o, d + o, n); });
  }
  return dx;
}

Tensor CpuKernels::affine(const Tensor& x, float alpha, float beta) {
  require_f32(x, "affine", "x");
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) py[i] = alpha * px[i] + beta;
  return y;
}

Tensor CpuKernels::cast(const Tensor& x, DType to) {
  Tensor y = Tensor::empty(x.shape(), to, spec_);
  if (y.numel() == 0 || x.dtype() == to) {
    if (y.numel()) y.copy_from(x);
    return y;
  }
  // float32 <-> float16 with F16C (oneDNN 2.6's reorder for f16 is its reference loop: 50x slower).
  if (x.dtype() == DType::kFloat32 && to == DType::kFloat16) {
    floats_to_f16(x.data<float>(), static_cast<uint16_t*>(y.raw_data()),
                  static_cast<size_t>(x.numel()));
    return y;
  }
  if (x.dtype() == DType::kFloat16 && to == DType::kFloat32) {
    f16_to_floats(static_cast<const uint16_t*>(x.raw_data()), y.data<float>(),
                  static_cast<size_t>(x.numel()));
    return y;
  }
  // float32 <-> bfloat16 (mixed_bfloat16's kept copies): AVX-512 loops with streaming stores for
  // large outputs (dtype.cc; widening 2x oneDNN 2.6's reorder), split over the device's threads
  // as a primitive would be.
  const bool narrow = x.dtype() == DType::kFloat32 && to == DType::kBFloat16;
  if (narrow || (x.dtype() == DType::kBFloat16 && to == DType::kFloat32)) {
    const int64_t n = x.numel();
    const int threads = n < State::kSerialWork ? 1 : state_->threads;
    const int64_t chunk = ((n + threads - 1) / threads + 15) / 16 * 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int t = 0; t < threads; ++t) {
      const int64_t b = std::min(n, t * chunk), len = std::min(n, b + chunk) - b;
      if (len <= 0) continue;
      if (narrow)
        floats_to_bf16(x.data<float>() + b, static_cast<uint16_t*>(y.raw_data()) + b,
                       static_cast<size_t>(len));
      else
        bf16_to_floats(static_cast<const uint16_t*>(x.raw_data()) + b, y.data<float>() + b,
                       static_cast<size_t>(len));
    }
    return y;
  }
  const dt from_dt = dnnl_type(x.dtype()), to_dt = dnnl_type(to);
  if (from_dt == dt::undef || to_dt == dt::undef) {  // float64 / int64: no oneDNN type
    cast_loop(x, y);
    return y;
  }
  try {
    const memory::desc src({x.numel()}, from_dt, tag::a), dst({x.numel()}, to_dt, tag::a);
    std::string key = std::string("cast") + dtype_name(x.dtype()) + dtype_name(to);
    key_dims(key, {x.numel()});
    auto e = state_->get<Reorder>(
        key,
        [&] {
          return std::make_shared<Reorder>(Reorder{dnnl::reorder(
              dnnl::reorder::primitive_desc(state_->engine, src, state_->engine, dst))});
        },
        x.numel());
    memory sm = mem(src, state_->engine, x), dm = mem(dst, state_->engine, y);
    e->prim.execute(state_->stream(x.numel()), sm, dm);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("cast", err);
  }
  return y;
}

}  // namespace dtrain::cpu
