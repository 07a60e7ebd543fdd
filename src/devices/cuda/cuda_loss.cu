// Softmax cross-entropy: one warp per example computes the row maximum and the sum of
// exponentials with shuffles, then writes the probabilities and
//   loss = log(sum_j exp(x_j - max)) - (x_label - max),
// the log-sum-exp form, which stays finite where log(softmax) would underflow.
#include <cmath>

#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_launch.h"

namespace dtrain::cuda {
namespace {

constexpr int kRowsPerBlock = kBlock / 32;

__global__ void softmax_xent_kernel(const float* __restrict__ logits,
                                    const int32_t* __restrict__ labels, float* __restrict__ loss,
                                    float* __restrict__ probs, int64_t n, int64_t c) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;  // uniform per warp, so the shuffles below see all 32 lanes
  const float* x = logits + row * c;
  float m = -INFINITY;
  for (int64_t j = lane; j < c; j += 32) m = fmaxf(m, x[j]);
  m = warp_max(m);
  float s = 0.f;
  for (int64_t j = lane; j < c; j += 32) s += expf(x[j] - m);
  s = warp_sum(s);
  if (probs) {
    float* p = probs + row * c;
    const float inv = 1.f / s;
    for (int64_t j = lane; j < c; j += 32) p[j] = expf(x[j] - m) * inv;
  }
  if (loss && lane == 0) loss[row] = logf(s) - (x[labels[row]] - m);
}

__global__ void softmax_xent_backward_kernel(const float* __restrict__ probs,
                                             const int32_t* __restrict__ labels,
                                             const float* __restrict__ dloss,
                                             float* __restrict__ dx, int64_t total, int64_t c) {
  DTRAIN_GRID_STRIDE_LOOP(i, total) {
    const int64_t row = i / c;
    const int64_t j = i - row * c;
    const float g = dloss[row];
    const float v = probs[i] * g;  // the CPU's order of operations
    dx[i] = labels[row] == j ? v - g : v;
  }
}

}  // namespace

void launch_softmax_xent(const float* logits, const int32_t* labels, float* loss, float* probs,
                         int64_t n, int64_t c, cudaStream_t s) {
  if (n == 0 || c == 0) return;
  const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  softmax_xent_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, s>>>(logits, labels, loss, probs,
                                                                       n, c);
  DTRAIN_CHECK_LAUNCH("softmax_xent_kernel");
}

void launch_softmax_xent_backward(const float* probs, const int32_t* labels, const float* dloss,
                                  float* dx, int64_t n, int64_t c, cudaStream_t s) {
  const int64_t total = n * c;
  if (total == 0) return;
  softmax_xent_backward_kernel<<<grid_for(total), kBlock, 0, s>>>(probs, labels, dloss, dx, total,
                                                                  c);
  DTRAIN_CHECK_LAUNCH("softmax_xent_backward_kernel");
}

}  // namespace dtrain::cuda
