// Row-major float32 matrix products on cuBLAS, on the GPU's float32 units or its tensor cores
// (TensorFloat-32), for the matrix products, the batched products and the pointwise convolutions.
// cuBLAS is column-major; a row-major [r, c] matrix is the same memory as a column-major [c, r]
// one, i.e. its transpose. So row-major C = op(A) op(B) is computed as column-major
// C^T = op(B)^T op(A)^T: swap the operands, keep each one's op, and use each stored matrix's row
// length as its leading dimension.
#pragma once

#include <cstdint>

#include "devices/cuda/cuda_context.h"

namespace dtrain::cuda {

// C[m, n] = op(A) op(B): A's stored rows are lda long, B's ldb, C's ldc; m, n, k, lda, ldb and ldc
// fit an int (the caller checks). tensor_cores: cublasGemmEx with CUBLAS_COMPUTE_32F_FAST_TF32
// (inputs rounded to TF32, float32 accumulation); else cublasSgemm, float32 throughout.
void gemm_row_major(CudaContext& ctx, bool tensor_cores, bool ta, bool tb, int64_t m, int64_t n,
                    int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                    int64_t ldc);

// `batch` such products, the i-th on a + i * stride_a, b + i * stride_b, c + i * stride_c.
void gemm_row_major_batched(CudaContext& ctx, bool tensor_cores, bool ta, bool tb, int64_t m,
                            int64_t n, int64_t k, const float* a, int64_t lda, int64_t stride_a,
                            const float* b, int64_t ldb, int64_t stride_b, float* c, int64_t ldc,
                            int64_t stride_c, int64_t batch);

}  // namespace dtrain::cuda
