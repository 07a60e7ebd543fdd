// The CPU device's state (oneDNN engine, streams, primitive cache) and its matrix products
// (elementwise kernels: cpu_elementwise.cc; reductions: cpu_reduce.cc; batch norm:
// cpu_batch_norm.cc, on a bfloat16 input cpu_batch_norm_bf16.cc).
#include <omp.h>

#include <atomic>
#include <cstring>
#include <string>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

std::atomic<uint64_t> g_state_uid{1};
// bf16_blocked_products_for_testing's counts.
std::atomic<int64_t> g_column_block_products{0}, g_dense_a_block_products{0};

// Blocks of a large matmul (see CpuKernels::matmul): the widest block of C's columns over a
// row-major B and of the inner dimension over an untransposed A of at least
// kMatmulInnerBlockMinRows rows and a row-major B, and of C's rows over a transposed A taller than
// kMatmulRowsSplitAbove.
constexpr int64_t kMatmulColumnBlock = 1536, kMatmulInnerBlock = 1536,
                  kMatmulInnerBlockMinRows = 256;
constexpr int64_t kMatmulRowBlock = 4096, kMatmulRowsSplitAbove = 8192;
// On the bfloat16 kernels (see CpuKernels::matmul), blocks of about kBf16ColumnBlock: with AMX,
// of C's columns over a transposed B at least kBf16WideColumns wide, for products of at least
// kMatmulInnerBlockMinRows rows; without, dense blocks of A along an inner dimension or a
// transposed A's rows at least kBf16WideColumns long, the other at least
// kMatmulInnerBlockMinRows.
constexpr int64_t kBf16ColumnBlock = 2048, kBf16WideColumns = 16384;

// `extent` as equal blocks of at most about `most` (multiples of 16 but the last): their width.
int64_t block_width(int64_t extent, int64_t most) {
  if (extent <= most) return extent;
  const int64_t blocks = (extent + most - 1) / most;
  return ((extent + blocks - 1) / blocks + 15) / 16 * 16;
}

}  // namespace

Bf16BlockedProducts bf16_blocked_products_for_testing() {
  return {g_column_block_products.load(), g_dense_a_block_products.load()};
}

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
    // On the bfloat16 kernels without AMX (AVX-512 BF16: AMD Zen 4 and 5), the gradients through
    // GPT-2's tied output layer run in blocks of A, each cast (or copied) into a dense bfloat16
    // block: g E, a long inner dimension over an untransposed A ([1024x50257] @ [50257x768]), in
    // blocks of the inner dimension (the blocks after the first adding into C); and the
    // embedding's gradient g^T x, a transposed A tens of thousands of rows tall ([50257x1024] @
    // [1024x768]), in blocks of C's rows, each summing over the whole inner dimension as the whole
    // product does. Both products are 79 GFLOP a step at 1,024 tokens. On a Zen 4 core whole,
    // from a bfloat16 A: 186 and 173 GFLOP/s; in blocks of 2,048 copied (memcpy) from that
    // bfloat16 A into dense blocks, 197 and 190 (1.06x and 1.10x, copies included;
    // bench/micro/lm_head_blocks.cc). Blocks of a strided A are no use: oneDNN 2.6 runs them on
    // its older jit GEMM. Here each block is cast from the float32 gradient instead (not timed
    // alone), which drops the whole cast before the product. GPT-2 small, mixed bfloat16, one
    // thread on Zen 4 (the forward product whole too, below): +2.2-2.4% tokens/sec (two paired
    // runs, 11 pairs, 0.98-1.09x). Not measured on Zen 5. Left as it was on AMX, where g E in
    // blocks ran at a median 0.85-0.95x and g^T x 1.02-1.14x (blocks of 2,048 and 4,096, the same
    // micro-benchmark's earlier form) but neither in a step; there the forward product runs in
    // column blocks instead (below), which on Zen 4 ran at 0.93-0.94x the whole product.
    const bool amx = native && bf16_kernels_amx();
    const bool inner_blocks16 = native && !amx && !ta && !tb && k >= kBf16WideColumns &&
                                m >= kMatmulInnerBlockMinRows,
               row_blocks16 = native && !amx && ta && !tb && m >= kBf16WideColumns &&
                              k >= kMatmulInnerBlockMinRows;
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
      if (!inner_blocks16 && !row_blocks16) ap = operand(am, abf, a, &a16, ap);
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
    // (A's element strides are `as` but for the dense blocks of A below: `a_strides`.)
    const auto prim = [&](int64_t mb, int64_t kb, int64_t nb, bool accumulate, int64_t ldc,
                          const memory::dims& a_strides) {
      std::string key = bf16 ? (native ? "mm@bf16" : "mm@bf16-emulated") : "mm";
      key_dims(key, {m, k, n, mb, kb, nb, ta, tb, accumulate, ldc, a_strides[0], a_strides[1]});
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
                dnnl::matmul::desc(memory::desc({mb, kb}, op_dt, a_strides),
                                   memory::desc({kb, nb}, op_dt, bs),
                                   memory::desc({mb, nb}, dt::f32, memory::dims{ldc, 1})),
                attr, state_->engine);
            return std::make_shared<MatmulPrimitive>(MatmulPrimitive{dnnl::matmul(pd)});
          },
          mb * nb * kb / 8);
    };
    // On AMX's bfloat16 kernels, a transposed B tens of thousands of columns wide (GPT-2's tied
    // output layer, x E^T with E the [50257 x 768] embedding, 79 GFLOP a step at 1,024 tokens)
    // runs as column blocks of C, each into a dense scratch block copied into place: a block of a
    // transposed B is a dense range of its rows, which the AMX brgemm kernel takes, but a block of
    // C is strided, which oneDNN 2.6 gives to its older jit GEMM. Whole, that product ran at 252
    // GFLOP/s (183-288) against 382-885 for GPT-2's other products; in blocks of 2,048 columns
    // at 436 (1.70x within each of 7 rounds, 1.52-1.88; blocks of 1,024 1.51x, of 4,096 1.46x),
    // the copies included (bench/micro/lm_head_blocks.cc, one thread on an AMX Xeon). Each block
    // sums over the whole inner dimension, as the whole product does.
    if (inner_blocks16 || row_blocks16) {
      // A as stored: `rows` rows of `lda` elements (g [m x k], or g [k x m] read as g^T); each
      // block is `w` of those columns from every row, dense: A [m x w] (strides {w, 1}) or
      // A^T [w x k] (strides {1, w}).
      const int64_t extent = inner_blocks16 ? k : m, rows = inner_blocks16 ? m : k,
                    lda = inner_blocks16 ? k : m, w = block_width(extent, kBf16ColumnBlock);
      Tensor block = scratch(static_cast<size_t>(rows * w) * 2, spec_);
      auto* dense = static_cast<uint16_t*>(block.raw_data());
      g_dense_a_block_products.fetch_add(1, std::memory_order_relaxed);
      const bool a_bf16 = a.dtype() == DType::kBFloat16;
      const int threads = rows * w < State::kSerialWork ? 1 : state_->threads;
      for (int64_t s = 0; s < extent; s += w) {
        const int64_t wb = std::min(w, extent - s);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t r = 0; r < rows; ++r) {
          const size_t from = static_cast<size_t>(r * lda + s), count = static_cast<size_t>(wb);
          if (a_bf16)
            std::memcpy(dense + r * wb, static_cast<const uint16_t*>(a.raw_data()) + from,
                        count * 2);
          else
            floats_to_bf16(static_cast<const float*>(a.raw_data()) + from, dense + r * wb, count);
        }
        const memory::dims dense_as = inner_blocks16 ? memory::dims{wb, 1} : memory::dims{1, wb};
        const int64_t mb = inner_blocks16 ? m : wb, kb = inner_blocks16 ? wb : k;
        auto e = prim(mb, kb, n, inner_blocks16 && s > 0, n, dense_as);
        const memory ab(memory::desc({mb, kb}, op_dt, dense_as), state_->engine, dense);
        const memory bb(memory::desc({kb, n}, op_dt, bs), state_->engine,
                        const_cast<char*>(bp) + (inner_blocks16 ? s * bs[0] * elem : 0));
        const memory cb(memory::desc({mb, n}, dt::f32, memory::dims{n, 1}), state_->engine,
                        cp + (inner_blocks16 ? 0 : s * n));
        auto& strm = state_->stream(mb * n * kb / 8);
        e->prim.execute(strm, {{DNNL_ARG_SRC, ab}, {DNNL_ARG_WEIGHTS, bb}, {DNNL_ARG_DST, cb}});
        strm.wait();
      }
      return c;
    }
    if (amx && !b_rows && n >= kBf16WideColumns && m >= kMatmulInnerBlockMinRows) {
      g_column_block_products.fetch_add(1, std::memory_order_relaxed);
      const int64_t nw = block_width(n, kBf16ColumnBlock);
      Tensor block = scratch(static_cast<size_t>(m * nw) * 4, spec_);
      auto* cblock = static_cast<float*>(block.raw_data());
      const int threads = m * nw < State::kSerialWork ? 1 : state_->threads;
      for (int64_t j = 0; j < n; j += nw) {
        const int64_t nb = std::min(nw, n - j);
        auto e = prim(m, k, nb, false, nb, as);
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
          auto e = prim(mb, kb, nb, p > 0, n, as);
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

}  // namespace dtrain::cpu
