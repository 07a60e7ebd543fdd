// Row-major matrix products on cuBLAS with float32 results, on the GPU's float32 units or its
// tensor cores (TensorFloat-32, or bfloat16 operands), for the matrix products, the batched
// products and the pointwise convolutions. cuBLAS is column-major; a row-major [r, c] matrix is the
// same memory as a column-major [c, r] one, i.e. its transpose. So row-major C = op(A) op(B) is
// computed as column-major C^T = op(B)^T op(A)^T: swap the operands, keep each one's op, and use
// each stored matrix's row length as its leading dimension.
#pragma once

#include <cstdint>

#include "devices/cuda/cuda_context.h"
#include "dtrain/core/dtype.h"

namespace dtrain::cuda {

// What A and B hold and which units multiply them; C is float32 and sums in float32 in all three.
enum class GemmMath {
  kFloat32,        // float32 operands, cublasSgemm: float32 throughout
  kTensorFloat32,  // float32 operands, rounded to TF32 by the tensor cores
                   // (CUBLAS_COMPUTE_32F_FAST_TF32)
  kBFloat16,       // bfloat16 operands (DType::kBFloat16), bfloat16 tensor cores, products exact
                   // (CUBLAS_COMPUTE_32F): the mixed_bfloat16 policy's products, at twice TF32's
                   // rate and half its operand bytes
};

// C[m, n] = op(A) op(B): A's stored rows are lda long, B's ldb, C's ldc (in elements); m, n, k,
// lda, ldb and ldc fit an int (the caller checks). a and b point at float32 data, or bfloat16 under
// GemmMath::kBFloat16. c is float32, or under GemmMath::kBFloat16 may be bfloat16 (c_type): the
// float32 sums rounded to bfloat16 as cuBLAS writes them (an activation handed on in bfloat16).
void gemm_row_major(CudaContext& ctx, GemmMath math, bool ta, bool tb, int64_t m, int64_t n,
                    int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb, void* c,
                    int64_t ldc, DType c_type = DType::kFloat32);

// `batch` such products, the i-th on a + i * stride_a, b + i * stride_b, c + i * stride_c
// (strides in elements).
void gemm_row_major_batched(CudaContext& ctx, GemmMath math, bool ta, bool tb, int64_t m, int64_t n,
                            int64_t k, const void* a, int64_t lda, int64_t stride_a, const void* b,
                            int64_t ldb, int64_t stride_b, float* c, int64_t ldc, int64_t stride_c,
                            int64_t batch);

}  // namespace dtrain::cuda
