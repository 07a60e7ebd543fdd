// Fused, in-place optimizer updates: one pass over var (and its slots) per step.
#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_launch.h"

namespace dtrain::cuda {
namespace {

__global__ void sgd_kernel(float* __restrict__ var, const float* __restrict__ grad, int64_t n,
                           float lr) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) { var[i] -= lr * grad[i]; }
}

template <bool kNesterov>
__global__ void sgd_momentum_kernel(float* __restrict__ var, const float* __restrict__ grad,
                                    float* __restrict__ buf, int64_t n, float lr, float mu) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) {
    const float g = grad[i];
    const float b = mu * buf[i] + g;
    buf[i] = b;
    var[i] -= lr * (kNesterov ? g + mu * b : b);
  }
}

__global__ void adam_kernel(float* __restrict__ var, float* __restrict__ m, float* __restrict__ v,
                            const float* __restrict__ grad, int64_t n, float lr_t, float beta1,
                            float beta2, float epsilon, float grad_scale, float decay) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) {
    const float g = __fmul_rn(grad_scale, grad[i]);
    const float mi = beta1 * m[i] + (1.f - beta1) * g;
    const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    var[i] = __fmul_rn(decay, var[i]) - lr_t * mi / (sqrtf(vi) + epsilon);
  }
}

}  // namespace

void launch_sgd_update(float* var, const float* grad, float* momentum, int64_t n, float lr,
                       float mu, bool nesterov, cudaStream_t s) {
  if (n == 0) return;
  if (!momentum) {
    sgd_kernel<<<grid_for(n), kBlock, 0, s>>>(var, grad, n, lr);
  } else if (nesterov) {
    sgd_momentum_kernel<true><<<grid_for(n), kBlock, 0, s>>>(var, grad, momentum, n, lr, mu);
  } else {
    sgd_momentum_kernel<false><<<grid_for(n), kBlock, 0, s>>>(var, grad, momentum, n, lr, mu);
  }
  DTRAIN_CHECK_LAUNCH("sgd_kernel");
}

void launch_adam_update(float* var, float* m, float* v, const float* grad, int64_t n, float lr_t,
                        float beta1, float beta2, float epsilon, float grad_scale, float decay,
                        cudaStream_t s) {
  if (n == 0) return;
  adam_kernel<<<grid_for(n), kBlock, 0, s>>>(var, m, v, grad, n, lr_t, beta1, beta2, epsilon,
                                             grad_scale, decay);
  DTRAIN_CHECK_LAUNCH("adam_kernel");
}

}  // namespace dtrain::cuda
