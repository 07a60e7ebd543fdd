// A small reduction engine shared by reduce, the conv bias gradient and batch norm.
//
// A reduction is described by a Load functor, value = load(r, c), for reduced index r in
// [0, rows) and output index c in [0, cols), an Op (identity, combine) and a Finish functor called
// once per output with the combined value. Two thread layouts cover the memory patterns:
//   - column mode: consecutive threads take consecutive c (use when load is contiguous in c),
//   - row mode: a group of threads shares one c and strides over r (use when contiguous in r).
// Long reductions are split into chunks of r across grid.y; chunk results go to a scratch buffer
// and a second kernel combines them, so the result does not depend on atomics and is
// deterministic for a given shape and GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_context.h"

namespace dtrain::cuda {

struct SumOp {
  __device__ static float identity() { return 0.f; }
  __device__ static float combine(float a, float b) { return a + b; }
};
struct MaxOp {
  __device__ static float identity() { return -INFINITY; }
  __device__ static float combine(float a, float b) { return fmaxf(a, b); }
};

namespace reduce_detail {

constexpr int kColTile = 32;  // outputs per block in column mode
constexpr int kColRows = 8;   // threads per output in column mode
constexpr int kMaxChunks = 1024;

// Writes the chunk's value: finished when there is one chunk, else into partial[chunk, c].
template <typename Finish>
__device__ __forceinline__ void emit(const Finish& fin, float* partial, int64_t cols, int64_t c,
                                     float v) {
  if (gridDim.y == 1)
    fin(c, v);
  else
    partial[static_cast<int64_t>(blockIdx.y) * cols + c] = v;
}

template <typename Op, typename Load, typename Finish>
__global__ void column_kernel(Load load, Finish fin, int64_t rows, int64_t cols,
                              int64_t rows_per_chunk, float* partial) {
  __shared__ float sh[kColRows][kColTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc = Op::identity();
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) acc = Op::combine(acc, load(r, c));
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int i = 1; i < kColRows; ++i) acc = Op::combine(acc, sh[i][threadIdx.x]);
    emit(fin, partial, cols, c, acc);
  }
}

// kGroup threads (32 or 256) per output; kBlock / kGroup outputs per block.
template <int kGroup, typename Op, typename Load, typename Finish>
__global__ void row_kernel(Load load, Finish fin, int64_t rows, int64_t cols,
                           int64_t rows_per_chunk, float* partial) {
  constexpr int kOuts = kBlock / kGroup;
  const int lane = threadIdx.x % kGroup;
  const int slot = threadIdx.x / kGroup;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kOuts + slot;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc = Op::identity();
  if (c < cols)
    for (int64_t r = r0 + lane; r < r1; r += kGroup) acc = Op::combine(acc, load(r, c));
  // Every thread reaches the shuffles (no early exit), so full-warp masks are valid.
  for (int off = 16; off > 0; off /= 2)
    acc = Op::combine(acc, __shfl_down_sync(0xffffffffu, acc, off));
  if constexpr (kGroup > 32) {
    __shared__ float sh[kBlock / 32];
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) sh[warp] = acc;
    __syncthreads();
    if (lane == 0) {
      acc = sh[slot * (kGroup / 32)];
      for (int w = 1; w < kGroup / 32; ++w) acc = Op::combine(acc, sh[slot * (kGroup / 32) + w]);
    }
  }
  if (lane == 0 && c < cols) emit(fin, partial, cols, c, acc);
}

template <typename Op, typename Finish>
__global__ void finish_kernel(const float* __restrict__ partial, int64_t chunks, int64_t cols,
                              Finish fin) {
  DTRAIN_GRID_STRIDE_LOOP(c, cols) {
    float acc = Op::identity();
    for (int64_t k = 0; k < chunks; ++k) acc = Op::combine(acc, partial[k * cols + c]);
    fin(c, acc);
  }
}

// Splits rows into chunks so that about four blocks per SM are busy, keeping at least
// min_rows_per_chunk rows in each.
inline void plan_chunks(int64_t rows, int64_t col_blocks, int sm_count, int64_t min_rows_per_chunk,
                        int64_t* chunks, int64_t* rows_per_chunk) {
  const int64_t target = 4 * static_cast<int64_t>(sm_count);
  int64_t k = std::max<int64_t>(1, target / std::max<int64_t>(1, col_blocks));
  k = std::min<int64_t>(k, kMaxChunks);
  k = std::min<int64_t>(k,
                        std::max<int64_t>(1, (rows + min_rows_per_chunk - 1) / min_rows_per_chunk));
  int64_t per = std::max<int64_t>(1, (rows + k - 1) / k);
  *rows_per_chunk = per;
  *chunks = std::max<int64_t>(1, (rows + per - 1) / per);
}

template <typename Op, typename Finish>
void finish_chunks(const float* partial, int64_t chunks, int64_t cols, const Finish& fin,
                   cudaStream_t s) {
  finish_kernel<Op><<<grid_for(cols), kBlock, 0, s>>>(partial, chunks, cols, fin);
  DTRAIN_CHECK_LAUNCH("reduce finish_kernel");
}

}  // namespace reduce_detail

// Column mode: load(r, c) contiguous in c.
template <typename Op, typename Load, typename Finish>
void run_column_reduce(const Load& load, const Finish& fin, int64_t rows, int64_t cols,
                       CudaContext& ctx) {
  using namespace reduce_detail;
  if (cols == 0) return;
  const int64_t col_blocks = (cols + kColTile - 1) / kColTile;
  int64_t chunks = 1, per = 1;
  plan_chunks(rows, col_blocks, ctx.sm_count(), 8 * kColRows, &chunks, &per);
  std::shared_ptr<Storage> scratch;
  float* partial = nullptr;
  if (chunks > 1) {
    scratch = ctx.scratch(static_cast<size_t>(chunks * cols) * sizeof(float));
    partial = static_cast<float*>(scratch->data());
  }
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks));
  const dim3 block(kColTile, kColRows);
  column_kernel<Op><<<grid, block, 0, ctx.stream()>>>(load, fin, rows, cols, per, partial);
  DTRAIN_CHECK_LAUNCH("reduce column_kernel");
  if (chunks > 1) finish_chunks<Op>(partial, chunks, cols, fin, ctx.stream());
}

// Row mode: load(r, c) contiguous in r.
template <typename Op, typename Load, typename Finish>
void run_row_reduce(const Load& load, const Finish& fin, int64_t rows, int64_t cols,
                    CudaContext& ctx) {
  using namespace reduce_detail;
  if (cols == 0) return;
  const bool wide = rows >= 1024;
  const int group = wide ? kBlock : 32;
  const int64_t outs_per_block = kBlock / group;
  const int64_t col_blocks = (cols + outs_per_block - 1) / outs_per_block;
  int64_t chunks = 1, per = 1;
  plan_chunks(rows, col_blocks, ctx.sm_count(), 8 * group, &chunks, &per);
  std::shared_ptr<Storage> scratch;
  float* partial = nullptr;
  if (chunks > 1) {
    scratch = ctx.scratch(static_cast<size_t>(chunks * cols) * sizeof(float));
    partial = static_cast<float*>(scratch->data());
  }
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks));
  if (wide)
    row_kernel<kBlock, Op><<<grid, kBlock, 0, ctx.stream()>>>(load, fin, rows, cols, per, partial);
  else
    row_kernel<32, Op><<<grid, kBlock, 0, ctx.stream()>>>(load, fin, rows, cols, per, partial);
  DTRAIN_CHECK_LAUNCH("reduce row_kernel");
  if (chunks > 1) finish_chunks<Op>(partial, chunks, cols, fin, ctx.stream());
}

// Finish functors.
struct Store {
  float* out;
  __device__ void operator()(int64_t c, float v) const { out[c] = v; }
};
struct StoreDivided {  // a mean: sum / count, like the CPU
  float* out;
  float count;
  __device__ void operator()(int64_t c, float v) const { out[c] = v / count; }
};

// Load functors for dense row-major [rows, cols] and [cols, rows] matrices.
struct MatrixColumnLoad {  // value at x[r * cols + c]
  const float* x;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return x[r * cols + c]; }
};
struct MatrixRowLoad {  // value at x[c * rows + r]
  const float* x;
  int64_t rows;
  __device__ float operator()(int64_t r, int64_t c) const { return x[c * rows + r]; }
};

}  // namespace dtrain::cuda
