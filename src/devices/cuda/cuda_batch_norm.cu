// Channels-last batch norm on x viewed as [rows, C]: per-channel statistics are column reductions,
// the normalisation and the input gradient elementwise kernels.
//   forward:  y = (x - mean) * inv_std * gamma + beta,  inv_std = 1 / sqrt(var + eps)
//   backward: dbeta = sum(dy), dgamma = sum(dy * xhat),
//             dx = gamma * inv_std * (dy - dbeta / M - xhat * dgamma / M)
// The statistics read x once (Welford's update per thread on x less the channel's first value,
// partial results merged in a fixed order: welford.h), so the result does not depend on atomics;
// the backward sums read dy and x once for both. With relu (batch_norm_relu_training), the
// normalisation writes relu(y) in the same pass (x > 0 ? x : 0, as the ReLU kernel), and the
// backward kernels take dy where y > 0 as they read it, instead of a ReLU gradient kernel writing
// that product first: the same values bit for bit.
// DTRAIN_CUDA_BN=two_pass brings back the kernels before, for comparisons: the mean, then the
// squared deviations from it, in two reductions; dbeta and dgamma in two more; the ReLU gradient in
// a kernel of its own. (Those builds may have fused dy * xhat into dgamma's sum; it is rounded
// first now, in both paths.)
#include <cstdlib>
#include <cstring>

#include "devices/cuda/cuda_launch.h"
#include "devices/cuda/cuda_reduce.cuh"
#include "devices/cuda/welford.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

__device__ __forceinline__ float inv_std(const float* var, int64_t c, float eps) {
  return 1.f / sqrtf(var[c] + eps);
}

struct SquaredDeviationLoad {
  const float* x;
  const float* mean;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    const float d = x[r * cols + c] - mean[c];
    return d * d;
  }
};

struct DyXhatLoad {
  const float* dy;
  const float* x;
  const float* mean;
  const float* var;
  float eps;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    const int64_t i = r * cols + c;
    // __fmul_rn: never contracted into the sum's FMA, so the one-pass kernel's sums (below) are
    // these bit for bit.
    return __fmul_rn(dy[i], (x[i] - mean[c]) * inv_std(var, c, eps));
  }
};

template <bool kRelu>
__device__ __forceinline__ float bn_apply_at(float x, const float* mean, const float* var,
                                             const float* gamma, const float* beta, float eps,
                                             int64_t c) {
  const float y = (x - mean[c]) * inv_std(var, c, eps) * gamma[c] + beta[c];
  if constexpr (kRelu) return y > 0.f ? y : 0.f;
  return y;
}

// kVec: 4 elements at a time (cols a multiple of 4, so they share a row; see vec4_ok).
template <bool kVec, bool kRelu>
__global__ void bn_apply_kernel(const float* __restrict__ x, const float* __restrict__ mean,
                                const float* __restrict__ var, const float* __restrict__ gamma,
                                const float* __restrict__ beta, float eps, float* __restrict__ y,
                                int64_t total, int64_t cols) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, total / 4) {
      const int64_t c = (4 * q) % cols;
      const float4 v = load4(x, 4 * q);
      store4(y, 4 * q,
             make_float4(bn_apply_at<kRelu>(v.x, mean, var, gamma, beta, eps, c),
                         bn_apply_at<kRelu>(v.y, mean, var, gamma, beta, eps, c + 1),
                         bn_apply_at<kRelu>(v.z, mean, var, gamma, beta, eps, c + 2),
                         bn_apply_at<kRelu>(v.w, mean, var, gamma, beta, eps, c + 3)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, total) {
      y[i] = bn_apply_at<kRelu>(x[i], mean, var, gamma, beta, eps, i % cols);
    }
  }
}

struct BnDx {
  const float* gamma;
  const float* mean;
  const float* var;
  float eps;
  const float* dgamma;
  const float* dbeta;
  float m;
  __device__ __forceinline__ float operator()(float dy, float x, int64_t c) const {
    const float is = inv_std(var, c, eps);
    const float xhat = (x - mean[c]) * is;
    return gamma[c] * is * (dy - dbeta[c] / m - xhat * dgamma[c] / m);
  }
};

// The ReLU's gradient where y is its output (activation_backward's kRelu: dy where y > 0).
__device__ __forceinline__ float relu_kept(float dy, float y) { return y > 0.f ? dy : 0.f; }

// kRelu: dy is the gradient of relu(y) and `y` that output; the normalisation's input gradient is
// taken of relu_kept(dy, y).
template <bool kVec, bool kRelu>
__global__ void bn_dx_kernel(const float* __restrict__ dy, const float* __restrict__ y,
                             const float* __restrict__ x, BnDx f, float* __restrict__ dx,
                             int64_t total, int64_t cols) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, total / 4) {
      const int64_t c = (4 * q) % cols;
      float4 d = load4(dy, 4 * q);
      const float4 v = load4(x, 4 * q);
      if constexpr (kRelu) {
        const float4 m = load4(y, 4 * q);
        d = make_float4(relu_kept(d.x, m.x), relu_kept(d.y, m.y), relu_kept(d.z, m.z),
                        relu_kept(d.w, m.w));
      }
      store4(
          dx, 4 * q,
          make_float4(f(d.x, v.x, c), f(d.y, v.y, c + 1), f(d.z, v.z, c + 2), f(d.w, v.w, c + 3)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, total) {
      float d = dy[i];
      if constexpr (kRelu) d = relu_kept(d, y[i]);
      dx[i] = f(d, x[i], i % cols);
    }
  }
}

// --- one read of x for the statistics, one of dy and x for dbeta and dgamma ---
// The column reductions' layout (cuda_reduce.cuh): a block of kColTile channels by kColRows rows of
// threads, each thread every kColRows-th row of its chunk of rows; the block's rows merged in
// order, then the chunks' results in chunk order by a finishing kernel when there is more than one
// chunk.
using reduce_detail::kColRows;
using reduce_detail::kColTile;

// Each value less its channel's first (row 0), so that the running means stay near zero where a
// channel's spread is small against its mean (float32 Welford on std = mean / 3000 lost the
// variance to 9e-5; shifted, 5e-7: tests/devices/welford_test.cc); the mean is shifted back at the
// end.
__global__ void bn_moments_kernel(const float* __restrict__ x, int64_t rows, int64_t cols,
                                  int64_t rows_per_chunk, float* __restrict__ mean,
                                  float* __restrict__ var, float* __restrict__ partial) {
  // Floats: a __shared__ array's elements are never constructed (a Moments starts at zero).
  __shared__ float sn[kColRows][kColTile + 1], smean[kColRows][kColTile + 1],
      sm2[kColRows][kColTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  Moments a;
  if (c < cols) {
    const float shift = x[c];
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows)
      welford_push(a, x[r * cols + c] - shift);
  }
  sn[threadIdx.y][threadIdx.x] = a.n;
  smean[threadIdx.y][threadIdx.x] = a.mean;
  sm2[threadIdx.y][threadIdx.x] = a.m2;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (int i = 1; i < kColRows; ++i)
    a = welford_merge(a, Moments{sn[i][threadIdx.x], smean[i][threadIdx.x], sm2[i][threadIdx.x]});
  if (gridDim.y == 1) {
    mean[c] = a.mean + x[c];
    var[c] = a.m2 / a.n;  // biased, as the CPU's
  } else {                // three planes of [chunks, cols]: n, the shifted mean, m2
    const int64_t plane = static_cast<int64_t>(gridDim.y) * cols;
    const int64_t at = static_cast<int64_t>(blockIdx.y) * cols + c;
    partial[at] = a.n;
    partial[plane + at] = a.mean;
    partial[2 * plane + at] = a.m2;
  }
}

__global__ void bn_moments_finish(const float* __restrict__ x, const float* __restrict__ partial,
                                  int64_t chunks, int64_t cols, float* __restrict__ mean,
                                  float* __restrict__ var) {
  const int64_t plane = chunks * cols;
  DTRAIN_GRID_STRIDE_LOOP(c, cols) {
    Moments a;
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t at = k * cols + c;
      a = welford_merge(a, Moments{partial[at], partial[plane + at], partial[2 * plane + at]});
    }
    mean[c] = a.mean + x[c];
    var[c] = a.m2 / a.n;
  }
}

// dbeta = sum(g), dgamma = sum(g * xhat) with g = dy, or relu_kept(dy, y) under kRelu: the sums of
// the two column reductions DTRAIN_CUDA_BN=two_pass runs (MatrixColumnLoad, DyXhatLoad), in their
// order, bit for bit.
template <bool kRelu>
__global__ void bn_grad_sums_kernel(const float* __restrict__ dy, const float* __restrict__ y,
                                    const float* __restrict__ x, const float* __restrict__ mean,
                                    const float* __restrict__ var, float eps, int64_t rows,
                                    int64_t cols, int64_t rows_per_chunk,
                                    float* __restrict__ dgamma, float* __restrict__ dbeta,
                                    float* __restrict__ partial) {
  __shared__ float sb[kColRows][kColTile + 1];
  __shared__ float sg[kColRows][kColTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float b = 0.f, g = 0.f;
  if (c < cols) {
    const float m = mean[c], is = inv_std(var, c, eps);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const int64_t i = r * cols + c;
      float d = dy[i];
      if constexpr (kRelu) d = relu_kept(d, y[i]);
      b = b + d;
      g = g + __fmul_rn(d, (x[i] - m) * is);
    }
  }
  sb[threadIdx.y][threadIdx.x] = b;
  sg[threadIdx.y][threadIdx.x] = g;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (int i = 1; i < kColRows; ++i) {
    b = b + sb[i][threadIdx.x];
    g = g + sg[i][threadIdx.x];
  }
  if (gridDim.y == 1) {
    dbeta[c] = b;
    dgamma[c] = g;
  } else {  // two planes of [chunks, cols]: dbeta's sums, dgamma's
    const int64_t at = static_cast<int64_t>(blockIdx.y) * cols + c;
    partial[at] = b;
    partial[static_cast<int64_t>(gridDim.y) * cols + at] = g;
  }
}

__global__ void bn_grad_sums_finish(const float* __restrict__ partial, int64_t chunks, int64_t cols,
                                    float* __restrict__ dgamma, float* __restrict__ dbeta) {
  const int64_t plane = chunks * cols;
  DTRAIN_GRID_STRIDE_LOOP(c, cols) {
    float b = 0.f, g = 0.f;
    for (int64_t k = 0; k < chunks; ++k) {
      b = b + partial[k * cols + c];
      g = g + partial[plane + k * cols + c];
    }
    dbeta[c] = b;
    dgamma[c] = g;
  }
}

// The chunks of a column reduction of [rows, cols] (as run_column_reduce plans them), and scratch
// for `planes` floats per chunk and column when there is more than one.
struct ColumnChunks {
  int64_t chunks = 1;
  int64_t rows_per_chunk = 1;
  std::shared_ptr<Storage> scratch;
  float* partial = nullptr;
  dim3 grid;
};

ColumnChunks plan_columns(int64_t rows, int64_t cols, int planes, CudaContext& ctx) {
  ColumnChunks p;
  const int64_t col_blocks = (cols + kColTile - 1) / kColTile;
  reduce_detail::plan_chunks(rows, col_blocks, ctx.sm_count(), 8 * kColRows, &p.chunks,
                             &p.rows_per_chunk);
  if (p.chunks > 1) {
    p.scratch = ctx.scratch(static_cast<size_t>(planes * p.chunks * cols) * sizeof(float));
    p.partial = static_cast<float*>(p.scratch->data());
  }
  p.grid = dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(p.chunks));
  return p;
}

}  // namespace

bool bn_one_pass() {
  const char* v = std::getenv("DTRAIN_CUDA_BN");
  return !(v && std::strcmp(v, "two_pass") == 0);
}

void launch_bn_stats(const float* x, int64_t rows, int64_t C, float* mean, float* var,
                     bool one_pass, CudaContext& ctx) {
  DTRAIN_CHECK(rows > 0, "no samples: the caller writes zero statistics");
  if (C == 0) return;
  if (!one_pass) {
    const float m = static_cast<float>(rows);
    run_column_reduce<SumOp>(MatrixColumnLoad{x, C}, StoreDivided{mean, m}, rows, C, ctx);
    run_column_reduce<SumOp>(SquaredDeviationLoad{x, mean, C}, StoreDivided{var, m}, rows, C, ctx);
    return;
  }
  const ColumnChunks p = plan_columns(rows, C, 3, ctx);
  bn_moments_kernel<<<p.grid, dim3(kColTile, kColRows), 0, ctx.stream()>>>(
      x, rows, C, p.rows_per_chunk, mean, var, p.partial);
  DTRAIN_CHECK_LAUNCH("bn_moments_kernel");
  if (p.chunks > 1) {
    bn_moments_finish<<<grid_for(C), kBlock, 0, ctx.stream()>>>(x, p.partial, p.chunks, C, mean,
                                                                var);
    DTRAIN_CHECK_LAUNCH("bn_moments_finish");
  }
}

void launch_bn_apply(const float* x, const float* mean, const float* var, const float* gamma,
                     const float* beta, float eps, float* y, int64_t rows, int64_t C, bool relu,
                     cudaStream_t s) {
  const int64_t total = rows * C;
  if (total == 0) return;
  const bool vec = vec4_ok(C, {x, y});
  const unsigned grid = grid_for(vec ? total / 4 : total);
  if (vec && relu)
    bn_apply_kernel<true, true>
        <<<grid, kBlock, 0, s>>>(x, mean, var, gamma, beta, eps, y, total, C);
  else if (vec)
    bn_apply_kernel<true, false>
        <<<grid, kBlock, 0, s>>>(x, mean, var, gamma, beta, eps, y, total, C);
  else if (relu)
    bn_apply_kernel<false, true>
        <<<grid, kBlock, 0, s>>>(x, mean, var, gamma, beta, eps, y, total, C);
  else
    bn_apply_kernel<false, false>
        <<<grid, kBlock, 0, s>>>(x, mean, var, gamma, beta, eps, y, total, C);
  DTRAIN_CHECK_LAUNCH("bn_apply_kernel");
}

void launch_bn_backward(const float* dy, const float* relu_y, const float* x, const float* gamma,
                        const float* mean, const float* var, float eps, float* dx, float* dgamma,
                        float* dbeta, int64_t rows, int64_t C, bool one_pass, CudaContext& ctx) {
  if (C == 0) return;
  const bool relu = relu_y != nullptr;
  if (!one_pass) {
    DTRAIN_CHECK(!relu, "DTRAIN_CUDA_BN=two_pass runs the ReLU gradient in a kernel of its own");
    run_column_reduce<SumOp>(MatrixColumnLoad{dy, C}, Store{dbeta}, rows, C, ctx);
    run_column_reduce<SumOp>(DyXhatLoad{dy, x, mean, var, eps, C}, Store{dgamma}, rows, C, ctx);
  } else {
    const ColumnChunks p = plan_columns(rows, C, 2, ctx);
    const dim3 block(kColTile, kColRows);
    if (relu)
      bn_grad_sums_kernel<true><<<p.grid, block, 0, ctx.stream()>>>(
          dy, relu_y, x, mean, var, eps, rows, C, p.rows_per_chunk, dgamma, dbeta, p.partial);
    else
      bn_grad_sums_kernel<false><<<p.grid, block, 0, ctx.stream()>>>(
          dy, relu_y, x, mean, var, eps, rows, C, p.rows_per_chunk, dgamma, dbeta, p.partial);
    DTRAIN_CHECK_LAUNCH("bn_grad_sums_kernel");
    if (p.chunks > 1) {
      bn_grad_sums_finish<<<grid_for(C), kBlock, 0, ctx.stream()>>>(p.partial, p.chunks, C, dgamma,
                                                                    dbeta);
      DTRAIN_CHECK_LAUNCH("bn_grad_sums_finish");
    }
  }
  const int64_t total = rows * C;
  if (total == 0) return;
  const BnDx f{gamma, mean, var, eps, dgamma, dbeta, static_cast<float>(rows)};
  const unsigned grid_vec = grid_for(total / 4), grid = grid_for(total);
  cudaStream_t s = ctx.stream();
  const bool vec = relu ? vec4_ok(C, {dy, relu_y, x, dx}) : vec4_ok(C, {dy, x, dx});
  if (vec && relu)
    bn_dx_kernel<true, true><<<grid_vec, kBlock, 0, s>>>(dy, relu_y, x, f, dx, total, C);
  else if (vec)
    bn_dx_kernel<true, false><<<grid_vec, kBlock, 0, s>>>(dy, relu_y, x, f, dx, total, C);
  else if (relu)
    bn_dx_kernel<false, true><<<grid, kBlock, 0, s>>>(dy, relu_y, x, f, dx, total, C);
  else
    bn_dx_kernel<false, false><<<grid, kBlock, 0, s>>>(dy, relu_y, x, f, dx, total, C);
  DTRAIN_CHECK_LAUNCH("bn_dx_kernel");
}

}  // namespace dtrain::cuda
