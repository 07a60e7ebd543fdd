// Private to the CPU pooling kernels (cpu_conv_pool.cc, cpu_conv_pool_fused.cc): NHWC max pooling
// with an arg-max workspace, as plain loops. Not a public header.
//
// Why not oneDNN's pooling primitive: on channels-last data with few channels (the reference CNN's
// 32 and 64) oneDNN 2.6's jit pooling spends ~200 ns per output position; over 120 steps of the
// reference CNN at 64 images on one core of a Xeon (family 6 model 207) its forward and backward
// passes took 552 of 2,087 ms of oneDNN time in float32 and 460 of 1,143 in mixed bfloat16, more
// than any convolution. These loops read each input value once and keep the channel axis in vector
// registers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dtrain::cpu {

// One max pooling over [n, h, w, c] (NHWC) into [n, oh, ow, c]; windows kh x kw, strides sh x sw,
// pt rows and pl columns of padding before the image (padding is never the max: a window's max
// is over its positions inside the image, of which it always has at least one).
struct PoolGeometry {
  int64_t n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl;
  bool relu = false;  // then ReLU: y = max(y, 0) but a NaN stays; no gradient where y is not > 0
  // Backward: dx rounded to the nearest bfloat16 (kept as float32) as it is written, for float32
  // kernels under mixed bfloat16 that would otherwise round a copy of it (dnnl_util.h).
  bool round_dx = false;
};

// The workspace: per output value the window position its max came from (i * kw + j), or kh * kw
// where no gradient passes (the ReLU's zeros); one byte for windows of up to 255 positions, else
// four (int32).
size_t max_pool_workspace_bytes(const PoolGeometry& g);

// y = max over each window (then ReLU where g.relu); ties go to the first position in row-major
// window order, and a NaN anywhere in a window is the window's max (torch.nn.MaxPool2d's rule: a
// NaN input never vanishes).
// threads: at most this many OpenMP threads (over images and output rows). allow_avx512 = false
// runs the portable loop on any CPU (what the tests compare the AVX-512 one against).
void max_pool_forward(const PoolGeometry& g, const float* x, float* y, void* workspace, int threads,
                      bool allow_avx512 = true);

// dx (the input's shape, overwritten) = each dy value added at the position its window's max came
// from (overlapping windows add up).
void max_pool_backward(const PoolGeometry& g, const float* dy, const void* workspace, float* dx,
                       int threads, bool allow_avx512 = true);

}  // namespace dtrain::cpu
