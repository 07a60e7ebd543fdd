// Channels-last batch norm on x viewed as [rows, C]: per-channel statistics are column reductions,
// the normalisation and the input gradient elementwise kernels.
//   forward:  y = (x - mean) * inv_std * gamma + beta,  inv_std = 1 / sqrt(var + eps)
//   backward: dbeta = sum(dy), dgamma = sum(dy * xhat),
//             dx = gamma * inv_std * (dy - dbeta / M - xhat * dgamma / M)
// The statistics read x once (Welford's update per thread on x less the channel's first value,
// partial results merged in a fixed order: welford.h), so the result does not depend on atomics;
// the backward sums read dy and x once for both. x, the ReLU's output and dx may be bfloat16 (an
// activation handed on under mixed_bfloat16: CudaKernels::hands_off_bfloat16); the arithmetic is
// float32 either way. With relu (batch_norm_relu_training), the
// normalisation writes relu(y) in the same pass (x > 0 ? x : 0, as the ReLU kernel), and the
// backward kernels take dy where y > 0 (else +0) as they read it, instead of a ReLU gradient kernel
// writing that product first: the same values, as the CPU's fused batch norm selects them too (the
// ReLU gradient kernel's 0 * dy gives -0 for a negative dy, and NaN for a NaN or infinite one).
// DTRAIN_CUDA_BN=two_pass brings back the kernels before, for comparisons: the mean, then the
// squared deviations from it, in two reductions; dbeta and dgamma in two more; the ReLU gradient in
// a kernel of its own. (Those builds may have fused dy * xhat into dgamma's sum; it is rounded
// first now, in both paths.)
#include <cstdlib>
#include <cstring>
#include <string>

#include "devices/cuda/cuda_half.cuh"
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

// kVec: 4 elements at a time (cols a multiple of 4, so they share a row; see vec4_ok). TX, TY:
// float or uint16_t (bfloat16).
template <bool kVec, bool kRelu, typename TX, typename TY>
__global__ void bn_apply_kernel(const TX* __restrict__ x, const float* __restrict__ mean,
                                const float* __restrict__ var, const float* __restrict__ gamma,
                                const float* __restrict__ beta, float eps, TY* __restrict__ y,
                                int64_t total, int64_t cols) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, total / 4) {
      const int64_t c = (4 * q) % cols;
      const float4 v = ld4(x, 4 * q);
      st4(y, 4 * q,
          make_float4(bn_apply_at<kRelu>(v.x, mean, var, gamma, beta, eps, c),
                      bn_apply_at<kRelu>(v.y, mean, var, gamma, beta, eps, c + 1),
                      bn_apply_at<kRelu>(v.z, mean, var, gamma, beta, eps, c + 2),
                      bn_apply_at<kRelu>(v.w, mean, var, gamma, beta, eps, c + 3)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, total) {
      st(y, i, bn_apply_at<kRelu>(ld(x, i), mean, var, gamma, beta, eps, i % cols));
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

// The ReLU's gradient where y is its output: dy where y > 0, else +0 (as the CPU's fused batch
// norm; activation_backward's kRelu gives 0 * dy there).
__device__ __forceinline__ float relu_kept(float dy, float y) { return y > 0.f ? dy : 0.f; }

// kRelu: dy is the gradient of relu(y) and `y` that output; the normalisation's input gradient is
// taken of relu_kept(dy, y). TM (y), TX, TD (dx): float or uint16_t (bfloat16).
template <bool kVec, bool kRelu, typename TM, typename TX, typename TD>
__global__ void bn_dx_kernel(const float* __restrict__ dy, const TM* __restrict__ y,
                             const TX* __restrict__ x, BnDx f, TD* __restrict__ dx, int64_t total,
                             int64_t cols) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, total / 4) {
      const int64_t c = (4 * q) % cols;
      float4 d = load4(dy, 4 * q);
      const float4 v = ld4(x, 4 * q);
      if constexpr (kRelu) {
        const float4 m = ld4(y, 4 * q);
        d = make_float4(relu_kept(d.x, m.x), relu_kept(d.y, m.y), relu_kept(d.z, m.z),
                        relu_kept(d.w, m.w));
      }
      st4(dx, 4 * q,
          make_float4(f(d.x, v.x, c), f(d.y, v.y, c + 1), f(d.z, v.z, c + 2), f(d.w, v.w, c + 3)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, total) {
      float d = dy[i];
      if constexpr (kRelu) d = relu_kept(d, ld(y, i));
      st(dx, i, f(d, ld(x, i), i % cols));
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
template <typename TX>
__global__ void bn_moments_kernel(const TX* __restrict__ x, int64_t rows, int64_t cols,
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
    const float shift = ld(x, c);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows)
      welford_push(a, ld(x, r * cols + c) - shift);
  }
  sn[threadIdx.y][threadIdx.x] = a.n;
  smean[threadIdx.y][threadIdx.x] = a.mean;
  sm2[threadIdx.y][threadIdx.x] = a.m2;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  for (int i = 1; i < kColRows; ++i)
    a = welford_merge(a, Moments{sn[i][threadIdx.x], smean[i][threadIdx.x], sm2[i][threadIdx.x]});
  if (gridDim.y == 1) {
    mean[c] = a.mean + ld(x, c);
    var[c] = a.m2 / a.n;  // biased, as the CPU's
  } else {                // three planes of [chunks, cols]: n, the shifted mean, m2
    const int64_t plane = static_cast<int64_t>(gridDim.y) * cols;
    const int64_t at = static_cast<int64_t>(blockIdx.y) * cols + c;
    partial[at] = a.n;
    partial[plane + at] = a.mean;
    partial[2 * plane + at] = a.m2;
  }
}

template <typename TX>
__global__ void bn_moments_finish(const TX* __restrict__ x, const float* __restrict__ partial,
                                  int64_t chunks, int64_t cols, float* __restrict__ mean,
                                  float* __restrict__ var) {
  const int64_t plane = chunks * cols;
  DTRAIN_GRID_STRIDE_LOOP(c, cols) {
    Moments a;
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t at = k * cols + c;
      a = welford_merge(a, Moments{partial[at], partial[plane + at], partial[2 * plane + at]});
    }
    mean[c] = a.mean + ld(x, c);
    var[c] = a.m2 / a.n;
  }
}

// dbeta = sum(g), dgamma = sum(g * xhat) with g = dy, or relu_kept(dy, y) under kRelu: the sums of
// the two column reductions DTRAIN_CUDA_BN=two_pass runs (MatrixColumnLoad, DyXhatLoad), in their
// order, bit for bit.
template <bool kRelu, typename TM, typename TX>
__global__ void bn_grad_sums_kernel(const float* __restrict__ dy, const TM* __restrict__ y,
                                    const TX* __restrict__ x, const float* __restrict__ mean,
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
      if constexpr (kRelu) d = relu_kept(d, ld(y, i));
      b = b + d;
      g = g + __fmul_rn(d, (ld(x, i) - m) * is);
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
  if (!v || !*v || std::strcmp(v, "one_pass") == 0) return true;
  if (std::strcmp(v, "two_pass") == 0) return false;
  throw InvalidArgument(std::string("DTRAIN_CUDA_BN=") + v +
                        " is not one_pass (the default) or two_pass (the kernels before "
                        "2026-11-29, for comparisons)");
}

void launch_bn_stats(const void* x, DType x_type, int64_t rows, int64_t C, float* mean, float* var,
                     bool one_pass, CudaContext& ctx) {
  DTRAIN_CHECK(rows > 0, "no samples: the caller writes zero statistics");
  if (C == 0) return;
  if (!one_pass) {
    DTRAIN_CHECK(x_type == DType::kFloat32, "the two-pass statistics read float32");
    const float* xf = static_cast<const float*>(x);
    const float m = static_cast<float>(rows);
    run_column_reduce<SumOp>(MatrixColumnLoad{xf, C}, StoreDivided{mean, m}, rows, C, ctx);
    run_column_reduce<SumOp>(SquaredDeviationLoad{xf, mean, C}, StoreDivided{var, m}, rows, C, ctx);
    return;
  }
  const ColumnChunks p = plan_columns(rows, C, 3, ctx);
  with_type(x_type, [&](auto xt) {
    using TX = decltype(xt);
    const TX* xp = static_cast<const TX*>(x);
    bn_moments_kernel<TX><<<p.grid, dim3(kColTile, kColRows), 0, ctx.stream()>>>(
        xp, rows, C, p.rows_per_chunk, mean, var, p.partial);
    DTRAIN_CHECK_LAUNCH("bn_moments_kernel");
    if (p.chunks > 1) {
      bn_moments_finish<TX>
          <<<grid_for(C), kBlock, 0, ctx.stream()>>>(xp, p.partial, p.chunks, C, mean, var);
      DTRAIN_CHECK_LAUNCH("bn_moments_finish");
    }
  });
}

void launch_bn_apply(const void* x, DType x_type, const float* mean, const float* var,
                     const float* gamma, const float* beta, float eps, void* y, DType y_type,
                     int64_t rows, int64_t C, bool relu, cudaStream_t s) {
  const int64_t total = rows * C;
  if (total == 0) return;
  const bool vec = vec4_ok(C, {x, y});
  const unsigned grid = grid_for(vec ? total / 4 : total);
  with_type(x_type, [&](auto xt) {
    with_type(y_type, [&](auto yt) {
      using TX = decltype(xt);
      using TY = decltype(yt);
      const TX* xp = static_cast<const TX*>(x);
      TY* yp = static_cast<TY*>(y);
      if (vec && relu)
        bn_apply_kernel<true, true, TX, TY>
            <<<grid, kBlock, 0, s>>>(xp, mean, var, gamma, beta, eps, yp, total, C);
      else if (vec)
        bn_apply_kernel<true, false, TX, TY>
            <<<grid, kBlock, 0, s>>>(xp, mean, var, gamma, beta, eps, yp, total, C);
      else if (relu)
        bn_apply_kernel<false, true, TX, TY>
            <<<grid, kBlock, 0, s>>>(xp, mean, var, gamma, beta, eps, yp, total, C);
      else
        bn_apply_kernel<false, false, TX, TY>
            <<<grid, kBlock, 0, s>>>(xp, mean, var, gamma, beta, eps, yp, total, C);
    });
  });
  DTRAIN_CHECK_LAUNCH("bn_apply_kernel");
}

void launch_bn_backward(const float* dy, const void* relu_y, DType relu_y_type, const void* x,
                        DType x_type, const float* gamma, const float* mean, const float* var,
                        float eps, void* dx, DType dx_type, float* dgamma, float* dbeta,
                        int64_t rows, int64_t C, bool one_pass, CudaContext& ctx) {
  if (C == 0) return;
  const bool relu = relu_y != nullptr;
  if (!one_pass) {
    DTRAIN_CHECK(!relu, "DTRAIN_CUDA_BN=two_pass runs the ReLU gradient in a kernel of its own");
    DTRAIN_CHECK(x_type == DType::kFloat32, "the two-pass sums read float32");
    const float* xf = static_cast<const float*>(x);
    run_column_reduce<SumOp>(MatrixColumnLoad{dy, C}, Store{dbeta}, rows, C, ctx);
    run_column_reduce<SumOp>(DyXhatLoad{dy, xf, mean, var, eps, C}, Store{dgamma}, rows, C, ctx);
  } else {
    const ColumnChunks p = plan_columns(rows, C, 2, ctx);
    const dim3 block(kColTile, kColRows);
    with_type(x_type, [&](auto xt) {
      with_type(relu ? relu_y_type : DType::kFloat32, [&](auto mt) {
        using TX = decltype(xt);
        using TM = decltype(mt);
        const TX* xp = static_cast<const TX*>(x);
        const TM* mp = static_cast<const TM*>(relu_y);
        if (relu)
          bn_grad_sums_kernel<true, TM, TX><<<p.grid, block, 0, ctx.stream()>>>(
              dy, mp, xp, mean, var, eps, rows, C, p.rows_per_chunk, dgamma, dbeta, p.partial);
        else
          bn_grad_sums_kernel<false, TM, TX><<<p.grid, block, 0, ctx.stream()>>>(
              dy, mp, xp, mean, var, eps, rows, C, p.rows_per_chunk, dgamma, dbeta, p.partial);
      });
    });
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
  with_type(x_type, [&](auto xt) {
    with_type(relu ? relu_y_type : DType::kFloat32, [&](auto mt) {
      with_type(dx_type, [&](auto dt) {
        using TX = decltype(xt);
        using TM = decltype(mt);
        using TD = decltype(dt);
        const TX* xp = static_cast<const TX*>(x);
        const TM* mp = static_cast<const TM*>(relu_y);
        TD* dp = static_cast<TD*>(dx);
        if (vec && relu)
          bn_dx_kernel<true, true, TM, TX, TD>
              <<<grid_vec, kBlock, 0, s>>>(dy, mp, xp, f, dp, total, C);
        else if (vec)
          bn_dx_kernel<true, false, TM, TX, TD>
              <<<grid_vec, kBlock, 0, s>>>(dy, mp, xp, f, dp, total, C);
        else if (relu)
          bn_dx_kernel<false, true, TM, TX, TD>
              <<<grid, kBlock, 0, s>>>(dy, mp, xp, f, dp, total, C);
        else
          bn_dx_kernel<false, false, TM, TX, TD>
              <<<grid, kBlock, 0, s>>>(dy, mp, xp, f, dp, total, C);
      });
    });
  });
  DTRAIN_CHECK_LAUNCH("bn_dx_kernel");
}

}  // namespace dtrain::cuda
