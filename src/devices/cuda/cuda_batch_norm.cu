// Channels-last batch norm on x viewed as [rows, C]: per-channel statistics are column reductions
// (cuda_reduce.cuh), the normalisation and the input gradient are elementwise kernels.
//   forward:  y = (x - mean) * inv_std * gamma + beta,  inv_std = 1 / sqrt(var + eps)
//   backward: dbeta = sum(dy), dgamma = sum(dy * xhat),
//             dx = gamma * inv_std * (dy - dbeta / M - xhat * dgamma / M)
// The variance is computed in a second pass over (x - mean)^2 rather than as E[x^2] - mean^2,
// which cancels catastrophically when |mean| >> std. With relu (batch_norm_relu_training), the
// normalisation writes relu(y) in the same pass (x > 0 ? x : 0, as the ReLU kernel), saving the
// ReLU's own pass over y.
#include "devices/cuda/cuda_launch.h"
#include "devices/cuda/cuda_reduce.cuh"

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
    return dy[i] * ((x[i] - mean[c]) * inv_std(var, c, eps));
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

template <bool kVec>
__global__ void bn_dx_kernel(const float* __restrict__ dy, const float* __restrict__ x, BnDx f,
                             float* __restrict__ dx, int64_t total, int64_t cols) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, total / 4) {
      const int64_t c = (4 * q) % cols;
      const float4 d = load4(dy, 4 * q), v = load4(x, 4 * q);
      store4(
          dx, 4 * q,
          make_float4(f(d.x, v.x, c), f(d.y, v.y, c + 1), f(d.z, v.z, c + 2), f(d.w, v.w, c + 3)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, total) { dx[i] = f(dy[i], x[i], i % cols); }
  }
}

}  // namespace

void launch_bn_stats(const float* x, int64_t rows, int64_t C, float* mean, float* var,
                     CudaContext& ctx) {
  const float m = static_cast<float>(rows);
  run_column_reduce<SumOp>(MatrixColumnLoad{x, C}, StoreDivided{mean, m}, rows, C, ctx);
  run_column_reduce<SumOp>(SquaredDeviationLoad{x, mean, C}, StoreDivided{var, m}, rows, C, ctx);
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

void launch_bn_backward(const float* dy, const float* x, const float* gamma, const float* mean,
                        const float* var, float eps, float* dx, float* dgamma, float* dbeta,
                        int64_t rows, int64_t C, CudaContext& ctx) {
  run_column_reduce<SumOp>(MatrixColumnLoad{dy, C}, Store{dbeta}, rows, C, ctx);
  run_column_reduce<SumOp>(DyXhatLoad{dy, x, mean, var, eps, C}, Store{dgamma}, rows, C, ctx);
  const int64_t total = rows * C;
  if (total == 0) return;
  const BnDx f{gamma, mean, var, eps, dgamma, dbeta, static_cast<float>(rows)};
  if (vec4_ok(C, {dy, x, dx}))
    bn_dx_kernel<true><<<grid_for(total / 4), kBlock, 0, ctx.stream()>>>(dy, x, f, dx, total, C);
  else
    bn_dx_kernel<false><<<grid_for(total), kBlock, 0, ctx.stream()>>>(dy, x, f, dx, total, C);
  DTRAIN_CHECK_LAUNCH("bn_dx_kernel");
}

}  // namespace dtrain::cuda
