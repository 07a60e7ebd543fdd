// Layout helpers for the convolution wrappers and the transformer ops: NHWC padding and cropping,
// strided subsampling and its adjoint, and an arbitrary permutation of up to kMaxDims axes. Grid-
// stride loops, one output element a thread.
#include <cstdint>

#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_launch.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

// Element i of an NHWC tensor [N, H, W, C] as its coordinates.
struct NhwcIndex {
  int64_t n, h, w, c;
};
__device__ __forceinline__ NhwcIndex nhwc_index(int64_t i, int64_t H, int64_t W, int64_t C) {
  NhwcIndex r;
  r.c = i % C;
  int64_t rest = i / C;
  r.w = rest % W;
  rest /= W;
  r.h = rest % H;
  r.n = rest / H;
  return r;
}

// T: float, or uint16_t for bfloat16 (copies only: value is then its bits).
template <typename T>
__global__ void pad_nhwc_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t total,
                                int64_t H, int64_t W, int64_t C, int64_t top, int64_t left,
                                int64_t Hp, int64_t Wp, T value) {
  DTRAIN_GRID_STRIDE_LOOP(i, total) {
    const NhwcIndex p = nhwc_index(i, Hp, Wp, C);
    const int64_t h = p.h - top, w = p.w - left;
    y[i] = (h >= 0 && h < H && w >= 0 && w < W) ? x[((p.n * H + h) * W + w) * C + p.c] : value;
  }
}

__global__ void crop_nhwc_kernel(const float* __restrict__ xp, float* __restrict__ x, int64_t total,
                                 int64_t H, int64_t W, int64_t C, int64_t top, int64_t left,
                                 int64_t Hp, int64_t Wp) {
  DTRAIN_GRID_STRIDE_LOOP(i, total) {
    const NhwcIndex p = nhwc_index(i, H, W, C);
    x[i] = xp[((p.n * Hp + p.h + top) * Wp + p.w + left) * C + p.c];
  }
}

// Where element i of xs [N, OH, OW, C] lies in x [N, H, W, C]: x[n, i * sh, j * sw, c].
__device__ __forceinline__ int64_t strided_offset(int64_t i, int64_t H, int64_t W, int64_t C,
                                                  int64_t OH, int64_t OW, int64_t sh, int64_t sw) {
  const NhwcIndex p = nhwc_index(i, OH, OW, C);
  return ((p.n * H + p.h * sh) * W + p.w * sw) * C + p.c;
}

// xs[n, i, j, c] = x[n, i * sh, j * sw, c]; xs is [N, OH, OW, C].
template <typename T>
__global__ void subsample_nhwc_kernel(const T* __restrict__ x, T* __restrict__ xs, int64_t total,
                                      int64_t H, int64_t W, int64_t C, int64_t OH, int64_t OW,
                                      int64_t sh, int64_t sw) {
  DTRAIN_GRID_STRIDE_LOOP(i, total) { xs[i] = x[strided_offset(i, H, W, C, OH, OW, sh, sw)]; }
}

// The adjoint's nonzero part: x[n, i * sh, j * sw, c] = xs[n, i, j, c] (the rest of x is zeroed
// by a memset first).
__global__ void scatter_strided_nhwc_kernel(const float* __restrict__ xs, float* __restrict__ x,
                                            int64_t total, int64_t H, int64_t W, int64_t C,
                                            int64_t OH, int64_t OW, int64_t sh, int64_t sw) {
  DTRAIN_GRID_STRIDE_LOOP(i, total) { x[strided_offset(i, H, W, C, OH, OW, sh, sw)] = xs[i]; }
}

struct PermuteGeometry {
  int rank;
  int64_t out_dims[kMaxDims];
  int64_t in_strides[kMaxDims];  // stride in x of the output's dimension i
};

__global__ void permute_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n,
                               PermuteGeometry g) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) {
    int64_t rest = i, off = 0;
    for (int d = g.rank - 1; d >= 0; --d) {
      off += (rest % g.out_dims[d]) * g.in_strides[d];
      rest /= g.out_dims[d];
    }
    y[i] = x[off];
  }
}

}  // namespace

void launch_pad_nhwc(const void* x, void* y, DType dtype, int64_t N, int64_t H, int64_t W,
                     int64_t C, int64_t top, int64_t left, int64_t Hp, int64_t Wp, float value,
                     cudaStream_t s) {
  const int64_t total = N * Hp * Wp * C;
  if (total == 0) return;
  if (dtype == DType::kBFloat16) {
    DTRAIN_CHECK(value == 0.f, "launch_pad_nhwc: bfloat16 pads with zeros only");
    pad_nhwc_kernel<uint16_t><<<grid_for(total), kBlock, 0, s>>>(
        static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y), total, H, W, C, top, left, Hp,
        Wp, uint16_t{0});
  } else {
    DTRAIN_CHECK(dtype == DType::kFloat32, "launch_pad_nhwc: float32 or bfloat16 only");
    pad_nhwc_kernel<float><<<grid_for(total), kBlock, 0, s>>>(static_cast<const float*>(x),
                                                              static_cast<float*>(y), total, H, W,
                                                              C, top, left, Hp, Wp, value);
  }
  DTRAIN_CHECK_LAUNCH("pad_nhwc_kernel");
}

void launch_crop_nhwc(const float* xp, float* x, int64_t N, int64_t H, int64_t W, int64_t C,
                      int64_t top, int64_t left, int64_t Hp, int64_t Wp, cudaStream_t s) {
  const int64_t total = N * H * W * C;
  if (total == 0) return;
  crop_nhwc_kernel<<<grid_for(total), kBlock, 0, s>>>(xp, x, total, H, W, C, top, left, Hp, Wp);
  DTRAIN_CHECK_LAUNCH("crop_nhwc_kernel");
}

void launch_subsample_nhwc(const void* x, void* xs, DType dtype, int64_t N, int64_t H, int64_t W,
                           int64_t C, int64_t OH, int64_t OW, int64_t sh, int64_t sw,
                           cudaStream_t s) {
  const int64_t total = N * OH * OW * C;
  if (total == 0) return;
  if (dtype == DType::kBFloat16) {
    subsample_nhwc_kernel<uint16_t><<<grid_for(total), kBlock, 0, s>>>(
        static_cast<const uint16_t*>(x), static_cast<uint16_t*>(xs), total, H, W, C, OH, OW, sh,
        sw);
  } else {
    DTRAIN_CHECK(dtype == DType::kFloat32, "launch_subsample_nhwc: float32 or bfloat16 only");
    subsample_nhwc_kernel<float><<<grid_for(total), kBlock, 0, s>>>(
        static_cast<const float*>(x), static_cast<float*>(xs), total, H, W, C, OH, OW, sh, sw);
  }
  DTRAIN_CHECK_LAUNCH("subsample_nhwc_kernel");
}

void launch_upsample_zero_nhwc(const float* xs, float* x, int64_t N, int64_t H, int64_t W,
                               int64_t C, int64_t OH, int64_t OW, int64_t sh, int64_t sw,
                               cudaStream_t s) {
  const int64_t total = N * OH * OW * C;
  if (N * H * W * C == 0) return;
  DTRAIN_CUDA_CALL(cudaMemsetAsync(x, 0, static_cast<size_t>(N * H * W * C) * sizeof(float), s));
  if (total == 0) return;
  scatter_strided_nhwc_kernel<<<grid_for(total), kBlock, 0, s>>>(xs, x, total, H, W, C, OH, OW, sh,
                                                                 sw);
  DTRAIN_CHECK_LAUNCH("scatter_strided_nhwc_kernel");
}

void launch_permute(const float* x, float* y, int rank, const int64_t* x_dims, const int* perm,
                    cudaStream_t s) {
  if (rank < 1 || rank > kMaxDims)
    throw InvalidArgument(detail::str_cat("permute: rank ", rank, " outside [1, ", kMaxDims, "]"));
  int64_t x_strides[kMaxDims];
  int64_t n = 1;
  for (int d = rank - 1; d >= 0; --d) {
    x_strides[d] = n;
    n *= x_dims[d];
  }
  if (n == 0) return;
  PermuteGeometry g{};
  g.rank = rank;
  for (int d = 0; d < rank; ++d) {
    g.out_dims[d] = x_dims[perm[d]];
    g.in_strides[d] = x_strides[perm[d]];
  }
  permute_kernel<<<grid_for(n), kBlock, 0, s>>>(x, y, n, g);
  DTRAIN_CHECK_LAUNCH("permute_kernel");
}

}  // namespace dtrain::cuda
