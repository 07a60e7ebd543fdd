// CudaKernels: the transformer ops (argument checks here, arithmetic in cuda_transformer.cu):
// permute, strided-batched cuBLAS GEMM (cuda_gemm.h), softmax, layer norm, and embedding
// gather/scatter-add.
#include <climits>
#include <vector>

#include "devices/batch_matmul_dims.h"
#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_gemm.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "devices/cuda/cuda_launch.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

float* fptr(const Tensor& t) { return static_cast<float*>(t.raw_data()); }
const int32_t* iptr(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }

int64_t rows_of(const Tensor& x) { return x.shape()[-1] == 0 ? 0 : x.numel() / x.shape()[-1]; }

}  // namespace

Tensor CudaKernels::batch_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  DeviceGuard guard(ctx_.index());
  check_activation(a, "batch_matmul", "a");  // bfloat16: a copy kept under mixed_bfloat16
  check_activation(b, "batch_matmul", "b");  // bfloat16: a copy kept under mixed_bfloat16
  const auto [batch, m, k, n] = detail::batch_matmul_dims(a, b, ta, tb);
  for (int64_t d : {m, n, k, batch})
    if (d > INT_MAX)
      throw InvalidArgument(
          detail::str_cat("batch_matmul: dimension ", d, " exceeds cuBLAS's 32-bit limit"));
  Tensor c = empty(Shape{batch, m, n});
  if (c.numel() == 0) return c;
  if (k == 0) {
    DTRAIN_CUDA_CALL(cudaMemsetAsync(c.raw_data(), 0, c.nbytes(), ctx_.stream()));
    return c;
  }
  const GemmMath math = gemm_math();
  const Tensor ar = gemm_operand(a, math), br = gemm_operand(b, math);
  gemm_row_major_batched(ctx_, math, ta, tb, m, n, k, ar.raw_data(), a.shape()[2],
                         a.shape()[1] * a.shape()[2], br.raw_data(), b.shape()[2],
                         b.shape()[1] * b.shape()[2], fptr(c), n, m * n, batch);
  return c;
}

Tensor CudaKernels::permute(const Tensor& x, const std::vector<int>& perm) {
  DeviceGuard guard(ctx_.index());
  check_device(x, "permute", "x");
  if (x.dtype() != DType::kFloat32 && x.dtype() != DType::kInt32)
    throw InvalidArgument(std::string("permute: float32 or int32 only, got ") +
                          dtype_name(x.dtype()));
  if (static_cast<int>(perm.size()) != x.rank())
    throw InvalidArgument(
        detail::str_cat("permute: ", perm.size(), " axes for ", x.shape().to_string()));
  std::vector<int64_t> out(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) out[i] = x.shape()[perm[i]];
  Tensor y = empty(Shape(out), x.dtype());
  if (y.numel() == 0) return y;
  // 4-byte elements either way: the float kernel moves int32 bits unchanged.
  launch_permute(fptr(x), fptr(y), x.rank(), x.shape().dims().data(), perm.data(), ctx_.stream());
  return y;
}

Tensor CudaKernels::gather_rows(const Tensor& table, const Tensor& indices) {
  DeviceGuard guard(ctx_.index());
  check_f32(table, "gather_rows", "table");
  check_device(indices, "gather_rows", "indices");
  if (table.rank() != 2 || indices.dtype() != DType::kInt32)
    throw InvalidArgument("gather_rows: table [V, D] float32 and int32 indices, got " +
                          table.to_string() + " and " + indices.to_string());
  const int64_t v = table.shape()[0], d = table.shape()[1], n = indices.numel();
  // Indices are checked on the host: one outside the table would read outside it.
  std::vector<int32_t> host(static_cast<size_t>(n));
  if (n > 0) {
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(host.data(), indices.raw_data(), indices.nbytes(),
                                     cudaMemcpyDeviceToHost, ctx_.stream()));
    DTRAIN_CUDA_CALL(cudaStreamSynchronize(ctx_.stream()));
  }
  for (int64_t i = 0; i < n; ++i)
    if (host[static_cast<size_t>(i)] < 0 || host[static_cast<size_t>(i)] >= v)
      throw InvalidArgument(detail::str_cat("gather_rows: index ", host[static_cast<size_t>(i)],
                                            " at position ", i, " is outside [0, ", v,
                                            ") (the table's rows)"));
  std::vector<int64_t> dims = indices.shape().dims();
  dims.push_back(d);
  Tensor y = empty(Shape(dims));
  launch_gather_rows(fptr(table), iptr(indices), fptr(y), n, d, ctx_.stream());
  return y;
}

Tensor CudaKernels::scatter_add_rows(const Tensor& dy, const Tensor& indices, int64_t rows) {
  DeviceGuard guard(ctx_.index());
  check_f32(dy, "scatter_add_rows", "dy");
  check_device(indices, "scatter_add_rows", "indices");
  const int64_t n = indices.numel();
  if (indices.dtype() != DType::kInt32 || dy.rank() < 1 || dy.numel() != n * dy.shape()[-1])
    throw InvalidArgument("scatter_add_rows: dy [indices..., D] for int32 indices, got " +
                          dy.to_string() + " and " + indices.to_string());
  const int64_t d = dy.shape()[-1];
  Tensor out = empty(Shape{rows, d});
  if (out.numel() == 0) return out;
  // Group dy's rows by target row on the host (a counting sort, stable), so each output element
  // is summed by one thread in index order: no atomics, the same bits on every run.
  std::vector<int32_t> host(static_cast<size_t>(n));
  if (n > 0) {
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(host.data(), indices.raw_data(), indices.nbytes(),
                                     cudaMemcpyDeviceToHost, ctx_.stream()));
    DTRAIN_CUDA_CALL(cudaStreamSynchronize(ctx_.stream()));
  }
  std::vector<int64_t> starts(static_cast<size_t>(rows) + 1, 0);
  for (int32_t r : host) {
    if (r < 0 || r >= rows)
      throw InvalidArgument(
          detail::str_cat("scatter_add_rows: index ", r, " outside [0, ", rows, ")"));
    ++starts[static_cast<size_t>(r) + 1];
  }
  for (size_t r = 0; r < static_cast<size_t>(rows); ++r) starts[r + 1] += starts[r];
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < n; ++i)
    order[static_cast<size_t>(fill[static_cast<size_t>(host[static_cast<size_t>(i)])]++)] =
        static_cast<int32_t>(i);
  Tensor order_d = empty(Shape{std::max<int64_t>(n, 1)}, DType::kInt32);
  Tensor starts_d = empty(Shape{rows + 1}, DType::kInt64);
  if (n > 0)
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(order_d.raw_data(), order.data(), order.size() * 4,
                                     cudaMemcpyHostToDevice, ctx_.stream()));
  DTRAIN_CUDA_CALL(cudaMemcpyAsync(starts_d.raw_data(), starts.data(), starts.size() * 8,
                                   cudaMemcpyHostToDevice, ctx_.stream()));
  launch_scatter_add_rows(fptr(dy), iptr(order_d), static_cast<const int64_t*>(starts_d.raw_data()),
                          fptr(out), rows, d, ctx_.stream());
  // The host vectors die here: wait until the copies out of them are done.
  DTRAIN_CUDA_CALL(cudaStreamSynchronize(ctx_.stream()));
  return out;
}

Tensor CudaKernels::softmax(const Tensor& x, bool log) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "softmax", "x");
  if (x.rank() < 1) throw InvalidArgument("softmax: x must have rank >= 1");
  Tensor y = empty(x.shape());
  launch_softmax(fptr(x), fptr(y), rows_of(x), x.shape()[-1], log, ctx_.stream());
  return y;
}

Tensor CudaKernels::causal_softmax(const Tensor& x, float mask_value) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "causal_softmax", "x");
  if (x.rank() < 2)
    throw InvalidArgument("causal_softmax: x must be [..., T, S], got " + x.shape().to_string());
  const int64_t t = x.shape()[-2], c = x.shape()[-1];
  Tensor y = empty(x.shape());
  if (x.numel() > 0)
    launch_causal_softmax(fptr(x), fptr(y), x.numel() / c, t, c, mask_value, ctx_.stream());
  return y;
}

Tensor CudaKernels::softmax_backward(const Tensor& y, const Tensor& dy, bool log) {
  DeviceGuard guard(ctx_.index());
  check_f32(y, "softmax_backward", "y");
  check_f32(dy, "softmax_backward", "dy");
  check_same_shape(y, dy, "softmax_backward");
  Tensor dx = empty(y.shape());
  launch_softmax_backward(fptr(y), fptr(dy), fptr(dx), rows_of(y), y.shape()[-1], log,
                          ctx_.stream());
  return dx;
}

LayerNormForward CudaKernels::layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         float epsilon) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "layer_norm", "x");
  check_f32(gamma, "layer_norm", "gamma");
  check_f32(beta, "layer_norm", "beta");
  if (x.rank() < 1 || gamma.shape() != Shape{x.shape()[-1]} || beta.shape() != gamma.shape())
    throw InvalidArgument("layer_norm: gamma and beta must be [C] for x [..., C], got " +
                          gamma.shape().to_string() + ", " + beta.shape().to_string() + " for " +
                          x.shape().to_string());
  const int64_t rows = rows_of(x), c = x.shape()[-1];
  LayerNormForward f{empty(x.shape()), empty(Shape{rows}), empty(Shape{rows})};
  launch_layer_norm(fptr(x), fptr(gamma), fptr(beta), fptr(f.y), fptr(f.mean), fptr(f.var), rows, c,
                    epsilon, ctx_.stream());
  return f;
}

LayerNormBackward CudaKernels::layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                   const Tensor& gamma, const Tensor& mean,
                                                   const Tensor& var, float epsilon) {
  DeviceGuard guard(ctx_.index());
  check_f32(dy, "layer_norm_backward", "dy");
  check_f32(x, "layer_norm_backward", "x");
  check_same_shape(dy, x, "layer_norm_backward");
  const int64_t rows = rows_of(x), c = x.shape()[-1];
  LayerNormBackward b{empty(x.shape()), empty(Shape{c}), empty(Shape{c})};
  launch_layer_norm_backward(fptr(dy), fptr(x), fptr(gamma), fptr(mean), fptr(var), fptr(b.dx),
                             fptr(b.dgamma), fptr(b.dbeta), rows, c, epsilon, ctx_);
  return b;
}

}  // namespace dtrain::cuda
