// CudaKernels::matmul and the row-major GEMMs of cuda_gemm.h on cuBLAS.
#include <climits>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_gemm.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_kernels.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {

namespace {

cudaDataType_t operand_type(GemmMath math) {
  return math == GemmMath::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
}

cublasComputeType_t compute_type(GemmMath math) {
  return math == GemmMath::kTensorFloat32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

}  // namespace

void gemm_row_major(CudaContext& ctx, GemmMath math, bool ta, bool tb, int64_t m, int64_t n,
                    int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb, void* c,
                    int64_t ldc, DType c_type) {
  DTRAIN_CHECK(
      c_type == DType::kFloat32 || (c_type == DType::kBFloat16 && math == GemmMath::kBFloat16),
      "gemm_row_major: a bfloat16 result needs bfloat16 operands");
  const float alpha = 1.f, beta = 0.f;
  const cublasOperation_t op_a = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  auto lock = ctx.lock_cublas();
  if (math != GemmMath::kFloat32) {
    const cudaDataType_t c_cuda = c_type == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    DTRAIN_CUBLAS_CALL(
        cublasGemmEx(ctx.cublas(), op_b, op_a, static_cast<int>(n), static_cast<int>(m),
                     static_cast<int>(k), &alpha, b, operand_type(math), static_cast<int>(ldb), a,
                     operand_type(math), static_cast<int>(lda), &beta, c, c_cuda,
                     static_cast<int>(ldc), compute_type(math), CUBLAS_GEMM_DEFAULT));
    return;
  }
  DTRAIN_CUBLAS_CALL(cublasSgemm(
      ctx.cublas(), op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
      &alpha, static_cast<const float*>(b), static_cast<int>(ldb), static_cast<const float*>(a),
      static_cast<int>(lda), &beta, static_cast<float*>(c), static_cast<int>(ldc)));
}

void gemm_row_major_batched(CudaContext& ctx, GemmMath math, bool ta, bool tb, int64_t m, int64_t n,
                            int64_t k, const void* a, int64_t lda, int64_t stride_a, const void* b,
                            int64_t ldb, int64_t stride_b, float* c, int64_t ldc, int64_t stride_c,
                            int64_t batch) {
  const float alpha = 1.f, beta = 0.f;
  const cublasOperation_t op_a = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  auto lock = ctx.lock_cublas();
  if (math != GemmMath::kFloat32) {
    DTRAIN_CUBLAS_CALL(cublasGemmStridedBatchedEx(
        ctx.cublas(), op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
        &alpha, b, operand_type(math), static_cast<int>(ldb), stride_b, a, operand_type(math),
        static_cast<int>(lda), stride_a, &beta, c, CUDA_R_32F, static_cast<int>(ldc), stride_c,
        static_cast<int>(batch), compute_type(math), CUBLAS_GEMM_DEFAULT));
    return;
  }
  DTRAIN_CUBLAS_CALL(cublasSgemmStridedBatched(
      ctx.cublas(), op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
      &alpha, static_cast<const float*>(b), static_cast<int>(ldb), stride_b,
      static_cast<const float*>(a), static_cast<int>(lda), stride_a, &beta, c,
      static_cast<int>(ldc), stride_c, static_cast<int>(batch)));
}

Tensor CudaKernels::matmul(const Tensor& a, const Tensor& b, bool transpose_a, bool transpose_b) {
  DeviceGuard guard(ctx_.index());
  check_activation(a, "matmul", "a");  // bfloat16: a copy kept under mixed_bfloat16
  check_activation(b, "matmul", "b");  // bfloat16: a copy kept under mixed_bfloat16
  if (a.rank() != 2 || b.rank() != 2)
    throw InvalidArgument("matmul: operands must be 2-D, got " + a.shape().to_string() + " and " +
                          b.shape().to_string());
  const int64_t m = transpose_a ? a.shape()[1] : a.shape()[0];
  const int64_t k = transpose_a ? a.shape()[0] : a.shape()[1];
  const int64_t kb = transpose_b ? b.shape()[1] : b.shape()[0];
  const int64_t n = transpose_b ? b.shape()[0] : b.shape()[1];
  if (k != kb)
    throw InvalidArgument(detail::str_cat(
        "matmul: inner dimensions differ: ", a.shape().to_string(), transpose_a ? "^T" : "", " @ ",
        b.shape().to_string(), transpose_b ? "^T" : "", " (", k, " vs ", kb, ")"));
  for (int64_t d : {m, n, k, a.shape()[1], b.shape()[1]})
    if (d > INT_MAX)
      throw InvalidArgument(detail::str_cat("matmul: dimension ", d,
                                            " exceeds cuBLAS's 32-bit limit; split the matrix"));
  Tensor c = empty(Shape{m, n});
  if (m == 0 || n == 0) return c;
  if (k == 0) {  // an empty sum: C = 0
    DTRAIN_CUDA_CALL(cudaMemsetAsync(c.raw_data(), 0, c.nbytes(), ctx_.stream()));
    return c;
  }
  const GemmMath math = gemm_math();
  const Tensor ar = gemm_operand(a, math), br = gemm_operand(b, math);
  gemm_row_major(ctx_, math, transpose_a, transpose_b, m, n, k, ar.raw_data(), a.shape()[1],
                 br.raw_data(), b.shape()[1], static_cast<float*>(c.raw_data()), n);
  return c;
}

}  // namespace dtrain::cuda
