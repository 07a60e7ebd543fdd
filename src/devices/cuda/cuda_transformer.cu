// The transformer kernels: softmax and log-softmax over the last axis and their gradients, layer
// normalisation and its gradients, and row gather / scatter-add (embeddings). One warp per row
// with shuffle reductions; layer norm's dgamma/dbeta are column sums on the reduction engine
// (cuda_reduce.cuh: chunks of rows in parallel, combined in a fixed order) and the scatter-add runs
// one thread per output element over its rows in order, so every result is bitwise repeatable.
// (dgamma/dbeta ran one thread per column over all rows until 2026-11-27: 768 threads for GPT-2's
// 8,192 rows, a few SMs of the GPU busy.)
#include <cmath>

#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_launch.h"
#include "devices/cuda/cuda_reduce.cuh"

namespace dtrain::cuda {
namespace {

constexpr int kWarpsPerBlock = kBlock / 32;

// kCausal: x is [..., t, c], and key j of query row i (row % t) gets mask_value added where j > i
// and 0 elsewhere, in float32, as binary(kAdd) adds the mask: the values of that add and then
// softmax, bit for bit, without the mask or the sum in memory.
template <bool kCausal>
__global__ void softmax_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows,
                               int64_t c, bool log, int64_t t, float mask_value) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* xr = x + row * c;
  float* yr = y + row * c;
  const int64_t last = kCausal ? row % t : c;  // keys after query row % t are masked
  auto at = [&](int64_t j) {
    if constexpr (kCausal)
      return xr[j] + (j > last ? mask_value : 0.f);
    else
      return xr[j];
  };
  float m = -INFINITY;
  for (int64_t j = lane; j < c; j += 32) m = fmaxf(m, at(j));
  m = warp_max(m);
  float s = 0.f;
  for (int64_t j = lane; j < c; j += 32) s += expf(at(j) - m);
  s = warp_sum(s);
  if (log) {
    const float ls = logf(s);
    for (int64_t j = lane; j < c; j += 32) yr[j] = at(j) - m - ls;
  } else {
    const float inv = 1.f / s;
    for (int64_t j = lane; j < c; j += 32) yr[j] = expf(at(j) - m) * inv;
  }
}

// softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy).
__global__ void softmax_backward_kernel(const float* __restrict__ y, const float* __restrict__ dy,
                                        float* __restrict__ dx, int64_t rows, int64_t c, bool log) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* yr = y + row * c;
  const float* gr = dy + row * c;
  float* dr = dx + row * c;
  float s = 0.f;
  for (int64_t j = lane; j < c; j += 32) s += log ? gr[j] : gr[j] * yr[j];
  s = warp_sum(s);
  for (int64_t j = lane; j < c; j += 32)
    dr[j] = log ? gr[j] - expf(yr[j]) * s : yr[j] * (gr[j] - s);
}

__global__ void layer_norm_kernel(const float* __restrict__ x, const float* __restrict__ gamma,
                                  const float* __restrict__ beta, float* __restrict__ y,
                                  float* __restrict__ mean, float* __restrict__ var, int64_t rows,
                                  int64_t c, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* xr = x + row * c;
  float s = 0.f;
  for (int64_t j = lane; j < c; j += 32) s += xr[j];
  const float mu = warp_sum(s) / static_cast<float>(c);
  float q = 0.f;
  for (int64_t j = lane; j < c; j += 32) q += (xr[j] - mu) * (xr[j] - mu);
  const float v = warp_sum(q) / static_cast<float>(c);
  const float rstd = rsqrtf(v + eps);
  for (int64_t j = lane; j < c; j += 32) y[row * c + j] = (xr[j] - mu) * rstd * gamma[j] + beta[j];
  if (lane == 0) {
    mean[row] = mu;
    var[row] = v;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
__global__ void layer_norm_dx_kernel(const float* __restrict__ dy, const float* __restrict__ x,
                                     const float* __restrict__ gamma,
                                     const float* __restrict__ mean, const float* __restrict__ var,
                                     float* __restrict__ dx, int64_t rows, int64_t c, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float mu = mean[row], rstd = rsqrtf(var[row] + eps);
  const float* xr = x + row * c;
  const float* gr = dy + row * c;
  float a = 0.f, b = 0.f;
  for (int64_t j = lane; j < c; j += 32) {
    const float g = gr[j] * gamma[j];
    a += g;
    b += g * (xr[j] - mu) * rstd;
  }
  a = warp_sum(a) / static_cast<float>(c);
  b = warp_sum(b) / static_cast<float>(c);
  for (int64_t j = lane; j < c; j += 32) {
    const float xhat = (xr[j] - mu) * rstd;
    dx[row * c + j] = rstd * (gr[j] * gamma[j] - a - xhat * b);
  }
}

// dgamma's terms: dy[r, j] * xhat[r, j], xhat = (x - mean[r]) * rsqrt(var[r] + eps).
struct LayerNormGammaLoad {
  const float* dy;
  const float* x;
  const float* mean;
  const float* var;
  int64_t c;
  float eps;
  __device__ float operator()(int64_t r, int64_t j) const {
    return dy[r * c + j] * (x[r * c + j] - mean[r]) * rsqrtf(var[r] + eps);
  }
};

__global__ void gather_rows_kernel(const float* __restrict__ table, const int32_t* __restrict__ idx,
                                   float* __restrict__ out, int64_t n, int64_t d) {
  DTRAIN_GRID_STRIDE_LOOP(i, n * d) {
    const int64_t r = i / d;
    out[i] = table[static_cast<int64_t>(idx[r]) * d + (i - r * d)];
  }
}

// order: the positions of dy's rows grouped by target row (stable: in index order); starts[r] ..
// starts[r + 1] the group of row r. One thread per (target row, column) sums its group in order.
__global__ void scatter_add_rows_kernel(const float* __restrict__ dy,
                                        const int32_t* __restrict__ order,
                                        const int64_t* __restrict__ starts, float* __restrict__ out,
                                        int64_t rows, int64_t d) {
  DTRAIN_GRID_STRIDE_LOOP(i, rows * d) {
    const int64_t r = i / d, j = i - r * d;
    float s = 0.f;
    for (int64_t k = starts[r]; k < starts[r + 1]; ++k)
      s += dy[static_cast<int64_t>(order[k]) * d + j];
    out[i] = s;
  }
}

unsigned int row_blocks(int64_t rows) {
  return static_cast<unsigned int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void launch_softmax(const float* x, float* y, int64_t rows, int64_t c, bool log, cudaStream_t s) {
  if (rows == 0 || c == 0) return;
  softmax_kernel<false><<<row_blocks(rows), kBlock, 0, s>>>(x, y, rows, c, log, 1, 0.f);
  DTRAIN_CHECK_LAUNCH("softmax_kernel");
}

void launch_causal_softmax(const float* x, float* y, int64_t rows, int64_t t, int64_t c,
                           float mask_value, cudaStream_t s) {
  if (rows == 0 || c == 0) return;
  softmax_kernel<true><<<row_blocks(rows), kBlock, 0, s>>>(x, y, rows, c, false, t, mask_value);
  DTRAIN_CHECK_LAUNCH("softmax_kernel (causal)");
}

void launch_softmax_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t c,
                             bool log, cudaStream_t s) {
  if (rows == 0 || c == 0) return;
  softmax_backward_kernel<<<row_blocks(rows), kBlock, 0, s>>>(y, dy, dx, rows, c, log);
  DTRAIN_CHECK_LAUNCH("softmax_backward_kernel");
}

void launch_layer_norm(const float* x, const float* gamma, const float* beta, float* y, float* mean,
                       float* var, int64_t rows, int64_t c, float eps, cudaStream_t s) {
  if (rows == 0 || c == 0) return;
  layer_norm_kernel<<<row_blocks(rows), kBlock, 0, s>>>(x, gamma, beta, y, mean, var, rows, c, eps);
  DTRAIN_CHECK_LAUNCH("layer_norm_kernel");
}

void launch_layer_norm_backward(const float* dy, const float* x, const float* gamma,
                                const float* mean, const float* var, float* dx, float* dgamma,
                                float* dbeta, int64_t rows, int64_t c, float eps,
                                CudaContext& ctx) {
  if (c == 0) return;
  if (rows > 0) {
    layer_norm_dx_kernel<<<row_blocks(rows), kBlock, 0, ctx.stream()>>>(dy, x, gamma, mean, var, dx,
                                                                        rows, c, eps);
    DTRAIN_CHECK_LAUNCH("layer_norm_dx_kernel");
  }
  // rows == 0: the engine's identity, zeros.
  run_column_reduce<SumOp>(LayerNormGammaLoad{dy, x, mean, var, c, eps}, Store{dgamma}, rows, c,
                           ctx);
  run_column_reduce<SumOp>(MatrixColumnLoad{dy, c}, Store{dbeta}, rows, c, ctx);
}

void launch_gather_rows(const float* table, const int32_t* idx, float* out, int64_t n, int64_t d,
                        cudaStream_t s) {
  if (n == 0 || d == 0) return;
  gather_rows_kernel<<<grid_for(n * d), kBlock, 0, s>>>(table, idx, out, n, d);
  DTRAIN_CHECK_LAUNCH("gather_rows_kernel");
}

void launch_scatter_add_rows(const float* dy, const int32_t* order, const int64_t* starts,
                             float* out, int64_t rows, int64_t d, cudaStream_t s) {
  if (rows == 0 || d == 0) return;
  scatter_add_rows_kernel<<<grid_for(rows * d), kBlock, 0, s>>>(dy, order, starts, out, rows, d);
  DTRAIN_CHECK_LAUNCH("scatter_add_rows_kernel");
}

}  // namespace dtrain::cuda
