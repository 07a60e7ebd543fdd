// Synchronized batch normalisation (TF's SyncBatchNormalization / PyTorch's SyncBatchNorm): the
// batch statistics are over the global batch, all-reduced across replicas (and workers) in the
// forward pass in two rounds: the sums and row count give the global mean, then every replica sums
// its squared deviations from that mean. E[x^2] - E[x]^2 in one round would cancel in float32 when
// the mean is large against the spread (a mean of 1000 and a spread of 0.01 lose the variance
// entirely); the second all-reduce of c values is what the centred sum costs. The backward pass
// all-reduces the two per-channel sums the input gradient needs:
//   dx = gamma * inv_std / N * (N * dy - sum(dy) - xhat * sum(dy * xhat)),  sums over all replicas.
// gamma's and beta's gradients stay local sums: the optimizer all-reduces them like any gradient.
#include "dtrain/nn/sync_batch_norm.h"

#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/strategies/strategy.h"
#include "model/op_util.h"

namespace dtrain::ops {

Tensor sync_batch_norm_training(ReplicaContext& ctx, const Tensor& x, const Tensor& gamma,
                                const Tensor& beta, float eps, Tensor* batch_mean,
                                Tensor* batch_var) {
  if (x.rank() < 2)
    throw InvalidArgument("batch norm needs rank >= 2, got " + x.shape().to_string());
  Kernels& k = kernels_for(x);
  const int64_t c = x.shape()[-1], m = x.numel() / c;
  // Under mixed_bfloat16 the input rounded to bfloat16, as batch_norm_training's (ops_nn.cc).
  const Tensor x2 = ops::rounded_under_policy(x).view(Shape{m, c});
  // Round 1: the global sum of x and the global row count give the mean.
  const Tensor count = Tensor::full(Shape{1}, static_cast<float>(m), x.device());
  std::vector<Tensor> g =
      ctx.all_reduce(ReduceOp::kSum, {k.reduce(ReductionKind::kSum, x2, {0}, false), count});
  const float n = g[1].item();
  if (n == 0) throw InvalidArgument("sync batch norm: the global batch is empty");
  const Tensor mean = k.affine(g[0], 1.f / n, 0.f);
  // Round 2: the global sum of squared deviations from that mean (an empty replica adds zeros).
  const Tensor centred_sq =
      k.reduce(ReductionKind::kSum, k.unary(UnaryOp::kSquare, k.binary(BinaryOp::kSub, x2, mean)),
               {0}, false);
  const Tensor var = k.affine(ctx.all_reduce(ReduceOp::kSum, {centred_sq})[0], 1.f / n, 0.f);
  const Tensor inv_std = k.binary(BinaryOp::kDiv, Tensor::full(Shape{c}, 1.f, x.device()),
                                  k.unary(UnaryOp::kSqrt, k.affine(var, 1.f, eps)));
  const Tensor xhat = k.binary(BinaryOp::kMul, k.binary(BinaryOp::kSub, x2, mean), inv_std);
  Tensor y = k.binary(BinaryOp::kAdd, k.binary(BinaryOp::kMul, xhat, gamma), beta).view(x.shape());
  *batch_mean = mean;
  *batch_var = var;
  if (tape::should_record({&x, &gamma, &beta})) {
    ReplicaContext* pctx = &ctx;
    tape::record("sync_batch_norm", {x, gamma, beta}, {y},
                 [pctx, x, gamma, xhat, inv_std, n, m,
                  c](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
                   Kernels& k = kernels_for(x);
                   const Tensor dy = grads[0].view(Shape{m, c});
                   const Tensor dbeta = k.reduce(ReductionKind::kSum, dy, {0}, false);
                   const Tensor dgamma = k.reduce(ReductionKind::kSum,
                                                  k.binary(BinaryOp::kMul, dy, xhat), {0}, false);
                   const std::vector<Tensor> s = pctx->all_reduce(ReduceOp::kSum, {dbeta, dgamma});
                   // dx = gamma * inv_std / n * (n * dy - S_dy - xhat * S_dyxhat)
                   Tensor t = k.binary(BinaryOp::kSub, k.affine(dy, n, 0.f), s[0]);
                   t = k.binary(BinaryOp::kSub, t, k.binary(BinaryOp::kMul, xhat, s[1]));
                   const Tensor scale =
                       k.affine(k.binary(BinaryOp::kMul, gamma, inv_std), 1.f / n, 0.f);
                   Tensor dx = k.binary(BinaryOp::kMul, t, scale).view(x.shape());
                   if (tape::should_record({&grads[0], &x, &gamma}))
                     tape::record_nondifferentiable("sync_batch_norm_grad", {grads[0], x, gamma},
                                                    {dx, dgamma, dbeta});
                   return {dx, dgamma, dbeta};
                 });
  }
  return y;
}

}  // namespace dtrain::ops
