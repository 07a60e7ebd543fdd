// dtrain's own Winograd F(4x4, 3x3) convolution (cpu_winograd.h): the transforms, vectorised over
// 8 channels, around batched matrix products, a chunk of tiles at a time.
#include "devices/cpu/cpu_winograd.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>

#include "core/cpu_isa.h"
#include "devices/cpu/dnnl_util.h"

namespace dtrain::cpu {
namespace {

// 8 floats (one AVX register; two SSE ones where AVX2 is not there). The helpers below take and
// give them through pointers only: a vector passed by value would change the calling convention
// between the AVX2 and the baseline clones of a loop.
typedef float v8 __attribute__((vector_size(32)));
#define DTRAIN_INLINE inline __attribute__((always_inline))

// The same 8 floats at any float's alignment, aliasing floats: one unaligned vector load or store
// (a memcpy into a v8 went through the stack as two 16-byte halves, and the 32-byte reload of
// them stalled).
typedef float v8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
DTRAIN_INLINE void load(v8* v, const float* p) { *v = *reinterpret_cast<const v8_unaligned*>(p); }
DTRAIN_INLINE void store(float* p, const v8* v) { *reinterpret_cast<v8_unaligned*>(p) = *v; }

// The 1-D transforms, each applied along columns then rows of a tile: `in` read at stride `is`,
// `out` written at stride `os`.
// B^T d: the input tile's 6 points to the 6 transformed ones.
DTRAIN_INLINE void input_1d(const v8* in, int is, v8* out, int os) {
  const v8 d0 = in[0], d1 = in[is], d2 = in[2 * is], d3 = in[3 * is], d4 = in[4 * is],
           d5 = in[5 * is];
  out[0] = 4.f * d0 - 5.f * d2 + d4;
  out[os] = d4 + d3 - 4.f * (d1 + d2);
  out[2 * os] = d4 - d3 + 4.f * (d1 - d2);
  out[3 * os] = d4 - d2 + 2.f * (d3 - d1);
  out[4 * os] = d4 - d2 - 2.f * (d3 - d1);
  out[5 * os] = 4.f * d1 - 5.f * d3 + d5;
}
// A^T m: 6 transformed points to the 4 outputs.
DTRAIN_INLINE void output_1d(const v8* in, int is, v8* out, int os) {
  const v8 a = in[is] + in[2 * is], b = in[is] - in[2 * is], c = in[3 * is] + in[4 * is],
           e = in[3 * is] - in[4 * is];
  out[0] = in[0] + a + c;
  out[os] = b + 2.f * e;
  out[2 * os] = a + 4.f * c;
  out[3 * os] = b + 8.f * e + in[5 * is];
}
// G g: the filter's 3 taps to 6 points.
DTRAIN_INLINE void filter_1d(const v8* in, int is, v8* out, int os) {
  const v8 g0 = in[0], g1 = in[is], g2 = in[2 * is], a = g0 + g2, b = g0 + 4.f * g2;
  out[0] = 0.25f * g0;
  out[os] = (-1.f / 6) * (a + g1);
  out[2 * os] = (-1.f / 6) * (a - g1);
  out[3 * os] = (1.f / 24) * (b + 2.f * g1);
  out[4 * os] = (1.f / 24) * (b - 2.f * g1);
  out[5 * os] = g2;
}
// A dy: the adjoint of output_1d (4 output gradients to 6 points).
DTRAIN_INLINE void output_adjoint_1d(const v8* in, int is, v8* out, int os) {
  const v8 a = in[0] + in[2 * is], b = in[is] + in[3 * is], c = in[0] + 4.f * in[2 * is],
           e = 2.f * in[is] + 8.f * in[3 * is];
  out[0] = in[0];
  out[os] = a + b;
  out[2 * os] = a - b;
  out[3 * os] = c + e;
  out[4 * os] = c - e;
  out[5 * os] = in[3 * is];
}
// G^T u: the adjoint of filter_1d (6 points to the 3 taps' gradients).
DTRAIN_INLINE void filter_adjoint_1d(const v8* in, int is, v8* out, int os) {
  const v8 s12 = in[is] + in[2 * is], d21 = in[2 * is] - in[is], s34 = in[3 * is] + in[4 * is],
           d34 = in[3 * is] - in[4 * is];
  out[0] = 0.25f * in[0] - (1.f / 6) * s12 + (1.f / 24) * s34;
  out[os] = (1.f / 6) * d21 + (1.f / 12) * d34;
  out[2 * os] = (1.f / 6) * (s34 - s12) + in[5 * is];
}

// A tiling of an NHWC tensor's images into the 4x4 output blocks: tile t = (image, row, column) in
// that order; the transformed tensors are [36 points, tiles, channels].
struct Tiling {
  int64_t n, h, w;  // the images the tiles read (or, for outputs, write)
  int64_t th, tw;   // tiles down and across an image
  int pad_top, pad_left;
  int64_t tiles() const { return n * th * tw; }
  // The image, and the top-left pixel of tile t's 6x6 input block (or 4x4 output block).
  void origin(int64_t t, int64_t* image, int64_t* row, int64_t* col) const {
    *image = t / (th * tw);
    *row = (t / tw) % th * 4 - pad_top;
    *col = t % tw * 4 - pad_left;
  }
  // Tile t's 4x4 output block: where it starts, and how many of its rows and columns lie in the
  // image (fewer at the bottom and right edges).
  struct Block {
    int64_t image, row, col;
    int rows, cols;
  };
  Block block(int64_t t) const {
    Block b;
    origin(t, &b.image, &b.row, &b.col);
    b.rows = static_cast<int>(std::min<int64_t>(4, h - b.row));
    b.cols = static_cast<int>(std::min<int64_t>(4, w - b.col));
    return b;
  }
};

// A run of consecutive tiles whose transforms are held at once: [36, count, channels], each of the
// 36 planes laid out for `capacity` tiles and one cache line more. Without that line the planes
// lay a multiple of 1 KB apart (tiles a multiple of 16, channels of 16), and of 4 KB in all of
// ResNet-50's layers (57,344 or 65,536 bytes): the 36 vectors a tile's transform writes or reads
// all fell into one set of the L1 cache (12 ways on Zen 5) and evicted each other's lines half
// written. The line made the 56x56x64 layer 1.27x faster under the AVX2 cap on Zen 5.
constexpr int64_t kPlanePad = 16;  // floats
struct Chunk {
  int64_t first, count, capacity;
  size_t plane(int64_t channels) const {
    return static_cast<size_t>(capacity * channels + kPlanePad);
  }
};

// Prefetches the `span` x `span` block of an NHWC tensor that tile t reads (cut at the image's
// edges), one per cache line. The input transform issues it for the next tile before its own
// work: its loads of the input otherwise waited on memory (two thirds of its samples in `perf
// annotate`, after the planes' padding), and ResNet-50's 56x56 layer ran 1.12x faster with it
// under the AVX2 cap on Zen 5 (77.5 -> 69.3 ms, two runs each). The same for the output
// transforms' reads of the products' planes or of dy gained nothing.
DTRAIN_INLINE void prefetch_block(const Tiling& g, const float* x, int64_t c, int64_t t, int span) {
  int64_t img, r0, c0;
  g.origin(t, &img, &r0, &c0);
  const int64_t first = std::max<int64_t>(c0, 0), end = std::min<int64_t>(c0 + span, g.w);
  for (int r = 0; r < span && first < end; ++r) {
    const int64_t y = r0 + r;
    if (y < 0 || y >= g.h) continue;
    const float* row = x + ((img * g.h + y) * g.w + first) * c;
    for (int64_t f = 0; f < (end - first) * c; f += 16) __builtin_prefetch(row + f);
  }
}

// The tile loops, written once and compiled twice (kernels_avx2 / kernels_base below): each takes
// a range of tiles t0..t1 within a chunk (or of input channels, for the filter's).
// v [36, chunk, c] = B^T d B of each 6x6 block of x [n, h, w, c] (zeros outside it).
DTRAIN_INLINE void input_tiles(const Tiling& g, const float* x, int64_t c, float* v, Chunk chunk,
                               int64_t t0, int64_t t1) {
  const size_t plane = chunk.plane(c);
  const float* at[36];
  for (int64_t t = t0; t < t1; ++t) {
    int64_t img, r0, c0;
    g.origin(t, &img, &r0, &c0);
    for (int r = 0; r < 6; ++r)
      for (int s = 0; s < 6; ++s) {
        const int64_t y = r0 + r, xx = c0 + s;
        at[r * 6 + s] = (y >= 0 && y < g.h && xx >= 0 && xx < g.w)
                            ? x + ((img * g.h + y) * g.w + xx) * c
                            : nullptr;
      }
    if (t + 1 < t1) prefetch_block(g, x, c, t + 1, 6);
    float* out = v + static_cast<size_t>((t - chunk.first) * c);
    for (int64_t ch = 0; ch < c; ch += 8) {
      v8 d[36], tmp[36];
      for (int e = 0; e < 36; ++e) {
        if (at[e])
          load(&d[e], at[e] + ch);
        else
          d[e] = v8{};
      }
      for (int s = 0; s < 6; ++s) input_1d(d + s, 6, tmp + s, 6);
      for (int r = 0; r < 6; ++r) input_1d(tmp + r * 6, 1, d + r * 6, 1);
      for (int e = 0; e < 36; ++e) store(out + e * plane + ch, &d[e]);
    }
  }
}

// y [n, h, w, k] = A^T M A (+ bias) of m [36, chunk, k], the 4x4 blocks cut at the edges.
DTRAIN_INLINE void output_tiles(const Tiling& g, const float* m, int64_t k, const float* bias,
                                float* y, Chunk chunk, int64_t t0, int64_t t1) {
  const size_t plane = chunk.plane(k);
  for (int64_t t = t0; t < t1; ++t) {
    const Tiling::Block blk = g.block(t);
    const int rows = blk.rows, cols = blk.cols;
    const float* in = m + static_cast<size_t>((t - chunk.first) * k);
    float* out = y + ((blk.image * g.h + blk.row) * g.w + blk.col) * k;
    for (int64_t ch = 0; ch < k; ch += 8) {
      v8 p[36], tmp[24], o[16], b = v8{};
      for (int e = 0; e < 36; ++e) load(&p[e], in + e * plane + ch);
      for (int s = 0; s < 6; ++s) output_1d(p + s, 6, tmp + s, 6);
      for (int r = 0; r < 4; ++r) output_1d(tmp + r * 6, 1, o + r * 4, 1);
      if (bias) load(&b, bias + ch);
      for (int r = 0; r < rows; ++r)
        for (int s = 0; s < cols; ++s) {
          const v8 sum = o[r * 4 + s] + b;
          store(out + (r * g.w + s) * k + ch, &sum);
        }
    }
  }
}

// dm [36, chunk, k] = A dY A^T of each 4x4 block of dy [n, h, w, k] (zeros outside it).
DTRAIN_INLINE void output_adjoint_tiles(const Tiling& g, const float* dy, int64_t k, float* dm,
                                        Chunk chunk, int64_t t0, int64_t t1) {
  const size_t plane = chunk.plane(k);
  for (int64_t t = t0; t < t1; ++t) {
    const Tiling::Block blk = g.block(t);
    const int rows = blk.rows, cols = blk.cols;
    const float* in = dy + ((blk.image * g.h + blk.row) * g.w + blk.col) * k;
    float* out = dm + static_cast<size_t>((t - chunk.first) * k);
    for (int64_t ch = 0; ch < k; ch += 8) {
      v8 q[16], tmp[24], p[36];
      for (int r = 0; r < 4; ++r)
        for (int s = 0; s < 4; ++s) {
          if (r < rows && s < cols)
            load(&q[r * 4 + s], in + (r * g.w + s) * k + ch);
          else
            q[r * 4 + s] = v8{};
        }
      for (int s = 0; s < 4; ++s) output_adjoint_1d(q + s, 4, tmp + s, 4);
      for (int r = 0; r < 6; ++r) output_adjoint_1d(tmp + r * 4, 1, p + r * 6, 1);
      for (int e = 0; e < 36; ++e) store(out + e * plane + ch, &p[e]);
    }
  }
}

// u [36, c, k] = G g G^T of the filter w [3, 3, c, k], for input channels c0..c1.
DTRAIN_INLINE void filter_tiles(const float* w, int64_t c, int64_t k, float* u, int64_t c0,
                                int64_t c1) {
  const size_t plane = static_cast<size_t>(c * k);
  for (int64_t ci = c0; ci < c1; ++ci)
    for (int64_t ch = 0; ch < k; ch += 8) {
      v8 taps[9], tmp[18], p[36];
      for (int e = 0; e < 9; ++e) load(&taps[e], w + (e * c + ci) * k + ch);
      for (int b = 0; b < 3; ++b) filter_1d(taps + b, 3, tmp + b, 3);
      for (int r = 0; r < 6; ++r) filter_1d(tmp + r * 3, 1, p + r * 6, 1);
      for (int e = 0; e < 36; ++e) store(u + e * plane + ci * k + ch, &p[e]);
    }
}

// dw [3, 3, c, k] = G^T dU G of du [36, c, k], for input channels c0..c1.
DTRAIN_INLINE void filter_adjoint_tiles(const float* du, int64_t c, int64_t k, float* dw,
                                        int64_t c0, int64_t c1) {
  const size_t plane = static_cast<size_t>(c * k);
  for (int64_t ci = c0; ci < c1; ++ci)
    for (int64_t ch = 0; ch < k; ch += 8) {
      v8 p[36], tmp[18], taps[9];
      for (int e = 0; e < 36; ++e) load(&p[e], du + e * plane + ci * k + ch);
      for (int s = 0; s < 6; ++s) filter_adjoint_1d(p + s, 6, tmp + s, 6);
      for (int a = 0; a < 3; ++a) filter_adjoint_1d(tmp + a * 6, 1, taps + a * 3, 1);
      for (int e = 0; e < 9; ++e) store(dw + (e * c + ci) * k + ch, &taps[e]);
    }
}

// The loops above, for a CPU with AVX2 and FMA and for any x86-64 one.
struct Loops {
  void (*input)(const Tiling&, const float*, int64_t, float*, Chunk, int64_t, int64_t);
  void (*output)(const Tiling&, const float*, int64_t, const float*, float*, Chunk, int64_t,
                 int64_t);
  void (*output_adjoint)(const Tiling&, const float*, int64_t, float*, Chunk, int64_t, int64_t);
  void (*filter)(const float*, int64_t, int64_t, float*, int64_t, int64_t);
  void (*filter_adjoint)(const float*, int64_t, int64_t, float*, int64_t, int64_t);
};

#define DTRAIN_WINOGRAD_LOOPS(suffix, attr)                                                       \
  attr void input_##suffix(const Tiling& g, const float* x, int64_t c, float* v, Chunk chunk,     \
                           int64_t t0, int64_t t1) {                                              \
    input_tiles(g, x, c, v, chunk, t0, t1);                                                       \
  }                                                                                               \
  attr void output_##suffix(const Tiling& g, const float* m, int64_t k, const float* bias,        \
                            float* y, Chunk chunk, int64_t t0, int64_t t1) {                      \
    output_tiles(g, m, k, bias, y, chunk, t0, t1);                                                \
  }                                                                                               \
  attr void output_adjoint_##suffix(const Tiling& g, const float* dy, int64_t k, float* dm,       \
                                    Chunk chunk, int64_t t0, int64_t t1) {                        \
    output_adjoint_tiles(g, dy, k, dm, chunk, t0, t1);                                            \
  }                                                                                               \
  attr void filter_##suffix(const float* w, int64_t c, int64_t k, float* u, int64_t c0,           \
                            int64_t c1) {                                                         \
    filter_tiles(w, c, k, u, c0, c1);                                                             \
  }                                                                                               \
  attr void filter_adjoint_##suffix(const float* du, int64_t c, int64_t k, float* dw, int64_t c0, \
                                    int64_t c1) {                                                 \
    filter_adjoint_tiles(du, c, k, dw, c0, c1);                                                   \
  }

DTRAIN_WINOGRAD_LOOPS(avx2, __attribute__((target("avx2,fma"))))
DTRAIN_WINOGRAD_LOOPS(base, )

const Loops& loops() {
  static const Loops avx2{input_avx2, output_avx2, output_adjoint_avx2, filter_avx2,
                          filter_adjoint_avx2};
  static const Loops base{input_base, output_base, output_adjoint_base, filter_base,
                          filter_adjoint_base};
  return detail::cpu_supports(detail::CpuFeature::kAvx2Fma) ? avx2 : base;
}

// Runs f(begin, end) over [0, count) in blocks of `block`, on `threads` OpenMP threads.
template <class F>
void in_blocks(int threads, int64_t count, int64_t block, F f) {
  const int64_t blocks = (count + block - 1) / block;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) f(b * block, std::min(count, (b + 1) * block));
}

std::atomic<uint64_t> g_runs{0};
std::atomic<bool> g_everywhere{false};  // cpu_testing::OwnWinogradEverywhere

constexpr int64_t kTileBlock = 16;  // tiles per parallel work item

const float* f32(const Tensor& t) { return static_cast<const float*>(t.raw_data()); }
float* f32(Tensor& t) { return static_cast<float*>(t.raw_data()); }

// The tiling of a convolution's outputs (oh x ow) over the input x_shape [N,H,W,C].
Tiling tiling(const Shape& x_shape, const WinogradConv& g) {
  return {x_shape[0],     x_shape[1], x_shape[2], (g.oh + 3) / 4,
          (g.ow + 3) / 4, g.pad_top,  g.pad_left};
}

std::atomic<int64_t> g_chunk_tiles{0};  // cpu_testing::WinogradChunkTiles; 0: chunk_tiles's own

// Tiles a chunk holds: the transformed tiles of both operands of a chunk's products, 36 x chunk x
// (Cin + Cout) floats, in about kChunkBytes, a core's share of the last-level cache (the
// transforms write them and the products read them back from there, not from memory: ResNet-50's
// 56x56 and 28x28 layers about 7% faster than with all tiles at once on Zen 5 under the AVX2 cap),
// and the scratch bounded whatever the batch. A multiple of the parallel blocks, at least 64 tiles
// (the products' rows; the inner dimension of the filter gradient's). The size depends on the
// channels only: every strategy runs the same algorithm per layer (the filter gradient's rounding
// depends on how the batch's tiles fall into chunks, as any sum over a batch's does).
constexpr int64_t kChunkBytes = int64_t{4} << 20;
int64_t chunk_tiles(int64_t c, int64_t k) {
  if (const int64_t forced = g_chunk_tiles.load(std::memory_order_relaxed)) return forced;
  const int64_t per_tile = 36 * (c + k) * static_cast<int64_t>(sizeof(float));
  return std::max<int64_t>(64, kChunkBytes / per_tile / kTileBlock * kTileBlock);
}

// The filter gradient's chunks: as chunk_tiles, but at least 4 C K / (C + K) tiles, so that the
// running sum dU [36, C, K] each chunk's product reads and writes again is at most a quarter of
// the chunk's transforms (at 14x14x256, 4 MB chunks of 64 tiles moved 9.4 MB of dU each).
int64_t filter_chunk_tiles(int64_t c, int64_t k) {
  if (const int64_t forced = g_chunk_tiles.load(std::memory_order_relaxed)) return forced;
  const int64_t least = (4 * c * k / (c + k) + kTileBlock - 1) / kTileBlock * kTileBlock;
  return std::max(chunk_tiles(c, k), least);
}

// An uninitialised float32 tensor; NaN-filled under OwnWinogradEverywhere, so that a value read
// before anything wrote it (scratch) or never written (an output) fails a test.
Tensor fresh(const Shape& shape, DeviceSpec device) {
  Tensor t = Tensor::empty(shape, DType::kFloat32, device);
  if (g_everywhere.load(std::memory_order_relaxed))
    std::fill_n(static_cast<float*>(t.raw_data()), t.numel(),
                std::numeric_limits<float>::quiet_NaN());
  return t;
}

// c[e] (+)= op(a[e]) b[e] for the 36 points e: a [36, m, kk] (transpose_a: [36, kk, m]), b
// [36, kk, n], c [36, m, n], each point's matrix plane.a (b, c) floats after the one before;
// `accumulate` adds to c (oneDNN's sum post-op) instead of writing it.
struct Planes {
  int64_t a, b, c;
};
void batched_product(CpuKernels::State& st, const float* a, const float* b, float* c, int64_t m,
                     int64_t kk, int64_t n, Planes plane, bool transpose_a, bool accumulate) {
  const memory::desc amd({36, m, kk}, dt::f32,
                         transpose_a ? memory::dims{plane.a, 1, m} : memory::dims{plane.a, kk, 1});
  const memory::desc bmd({36, kk, n}, dt::f32, memory::dims{plane.b, n, 1});
  const memory::desc cmd({36, m, n}, dt::f32, memory::dims{plane.c, n, 1});
  std::string key = "wino_mm";
  key_dims(key, {m, kk, n, plane.a, plane.b, plane.c, transpose_a, accumulate});
  const int64_t work = 36 * m * n * kk / 8;
  try {
    auto e = st.get<MatmulPrimitive>(
        key,
        [&] {
          dnnl::primitive_attr attr;
          if (accumulate) {
            dnnl::post_ops ops;
            ops.append_sum(1.f);
            attr.set_post_ops(ops);
          }
          dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(amd, bmd, cmd), attr, st.engine);
          return std::make_shared<MatmulPrimitive>(MatmulPrimitive{dnnl::matmul(pd)});
        },
        work);
    e->prim.execute(st.stream(work),
                    {{DNNL_ARG_SRC, memory(amd, st.engine, const_cast<float*>(a))},
                     {DNNL_ARG_WEIGHTS, memory(bmd, st.engine, const_cast<float*>(b))},
                     {DNNL_ARG_DST, memory(cmd, st.engine, c)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("conv2d (Winograd's products)", err);
  }
}

}  // namespace

Tensor winograd_conv2d(CpuKernels::State& st, const Tensor& x, const Tensor& w, const Tensor& bias,
                       const WinogradConv& g) {
  g_runs.fetch_add(1, std::memory_order_relaxed);
  const int threads = st.threads;
  const int64_t c = w.shape()[2], k = w.shape()[3];
  Tensor u = fresh(Shape{36, c, k}, w.device());
  const auto& l = loops();
  in_blocks(threads, c, 8, [&](int64_t a, int64_t b) { l.filter(f32(w), c, k, f32(u), a, b); });
  const Tiling t = tiling(x.shape(), g);
  // The outputs' tiling: the same tiles, over y's rows and columns.
  const Tiling out{t.n, g.oh, g.ow, t.th, t.tw, 0, 0};
  Tensor y = fresh(Shape{x.shape()[0], g.oh, g.ow, k}, x.device());
  const float* b = bias.defined() ? f32(bias) : nullptr;
  const int64_t per_chunk = chunk_tiles(c, k), capacity = std::min(per_chunk, t.tiles());
  const Chunk whole{0, capacity, capacity};
  Tensor v = fresh(Shape{36, static_cast<int64_t>(whole.plane(c))}, x.device()),
         m = fresh(Shape{36, static_cast<int64_t>(whole.plane(k))}, x.device());
  for (int64_t first = 0; first < t.tiles(); first += per_chunk) {
    const Chunk chunk{first, std::min(per_chunk, t.tiles() - first), capacity};
    in_blocks(threads, chunk.count, kTileBlock, [&](int64_t a, int64_t e) {
      l.input(t, f32(x), c, f32(v), chunk, first + a, first + e);
    });
    batched_product(
        st, f32(v), f32(u), f32(m), chunk.count, c, k,
        {static_cast<int64_t>(chunk.plane(c)), c * k, static_cast<int64_t>(chunk.plane(k))}, false,
        false);
    in_blocks(threads, chunk.count, kTileBlock, [&](int64_t a, int64_t e) {
      l.output(out, f32(m), k, b, f32(y), chunk, first + a, first + e);
    });
  }
  return y;
}

Tensor winograd_conv2d_backward_input(CpuKernels::State& st, const Tensor& dy, const Tensor& w,
                                      const Shape& x_shape, const WinogradConv& g) {
  // dx[p] = sum over taps a of dy[p + pad - a] w[a] = sum over a' of dy[p - (2 - pad) + a']
  // w[2 - a']: the convolution of dy, padded by 2 - pad before, with the filter turned 180 degrees
  // and its input and output channels swapped ([3, 3, K, C]).
  const int64_t c = w.shape()[2], k = w.shape()[3];
  Tensor turned = Tensor::empty(Shape{3, 3, k, c}, DType::kFloat32, w.device());
  const float* from = f32(w);
  float* to = f32(turned);
  for (int64_t tap = 0; tap < 9; ++tap)
    for (int64_t ci = 0; ci < c; ++ci)
      for (int64_t co = 0; co < k; ++co)
        to[((8 - tap) * k + co) * c + ci] = from[(tap * c + ci) * k + co];
  return winograd_conv2d(st, dy, turned, Tensor(),
                         {2 - g.pad_top, 2 - g.pad_left, x_shape[1], x_shape[2]});
}

Tensor winograd_conv2d_backward_filter(CpuKernels::State& st, const Tensor& x, const Tensor& dy,
                                       const WinogradConv& g) {
  g_runs.fetch_add(1, std::memory_order_relaxed);
  const int threads = st.threads;
  const int64_t c = x.shape()[3], k = dy.shape()[3];
  const Tiling t = tiling(x.shape(), g);
  const Tiling out{t.n, g.oh, g.ow, t.th, t.tw, 0, 0};
  const auto& l = loops();
  const int64_t per_chunk = filter_chunk_tiles(c, k), capacity = std::min(per_chunk, t.tiles());
  const Chunk whole{0, capacity, capacity};
  Tensor v = fresh(Shape{36, static_cast<int64_t>(whole.plane(c))}, x.device()),
         dm = fresh(Shape{36, static_cast<int64_t>(whole.plane(k))}, x.device());
  Tensor du = fresh(Shape{36, c, k}, x.device());
  for (int64_t first = 0; first < t.tiles(); first += per_chunk) {
    const Chunk chunk{first, std::min(per_chunk, t.tiles() - first), capacity};
    in_blocks(threads, chunk.count, kTileBlock, [&](int64_t a, int64_t e) {
      l.input(t, f32(x), c, f32(v), chunk, first + a, first + e);
    });
    in_blocks(threads, chunk.count, kTileBlock, [&](int64_t a, int64_t e) {
      l.output_adjoint(out, f32(dy), k, f32(dm), chunk, first + a, first + e);
    });
    // du [36, C, K] (+)= v^T dm
    batched_product(
        st, f32(v), f32(dm), f32(du), c, chunk.count, k,
        {static_cast<int64_t>(chunk.plane(c)), static_cast<int64_t>(chunk.plane(k)), c * k}, true,
        first > 0);
  }
  Tensor dw = fresh(Shape{3, 3, c, k}, x.device());
  in_blocks(threads, c, 8,
            [&](int64_t a, int64_t b) { l.filter_adjoint(f32(du), c, k, f32(dw), a, b); });
  return dw;
}

}  // namespace dtrain::cpu

namespace dtrain::cpu_testing {
OwnWinogradEverywhere::OwnWinogradEverywhere() : previous_(cpu::g_everywhere.exchange(true)) {}
OwnWinogradEverywhere::~OwnWinogradEverywhere() { cpu::g_everywhere.store(previous_); }
bool own_winograd_everywhere() { return cpu::g_everywhere.load(std::memory_order_relaxed); }
uint64_t own_winograd_runs() { return cpu::g_runs.load(std::memory_order_relaxed); }
WinogradChunkTiles::WinogradChunkTiles(int64_t tiles)
    : previous_(cpu::g_chunk_tiles.exchange(tiles)) {}
WinogradChunkTiles::~WinogradChunkTiles() { cpu::g_chunk_tiles.store(previous_); }
}  // namespace dtrain::cpu_testing
