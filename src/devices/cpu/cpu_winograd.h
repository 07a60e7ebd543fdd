// dtrain's own Winograd convolution, F(4x4, 3x3), for CPUs whose oneDNN has none (oneDNN 2.6 has
// Winograd kernels for avx512_core only: an AVX2-only EPYC ran ResNet-50's 3x3 layers as direct
// convolutions, with 4x the multiplications of this: 144 a 4x4 output tile and channel pair against
// its 36). Private to the CPU convolution kernels; which
// convolutions take it: cpu_conv_prims.h (own_winograd).
//
// The algorithm (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016), on
// channels-last data: each 4x4 block of outputs reads a 6x6 block of inputs. Each such input tile
// is transformed per channel (V = B^T d B), the filter per channel pair (U = G g G^T), and the 36
// points of the transformed tiles become 36 independent matrix products over the channels
// (M[e] = V[e] U[e]: [tiles, Cin] x [Cin, Cout], one batched oneDNN matmul per chunk of tiles
// whose transforms fit a core's share of the cache), whose results are transformed back
// (Y = A^T M A). The filter's gradient is that chain's adjoint
// (dU[e] = V[e]^T (A dY A^T)[e], dW = G^T dU G); the input's gradient is the same forward algorithm
// on dy with the filter turned 180 degrees and its channels swapped. The transforms are vectorised
// by the compiler over 8 channels (AVX2 with FMA where the CPU has it and DTRAIN_MAX_CPU_ISA allows
// it, else SSE). Numerics (cpu_conv_test's 16x14x14x32 -> 64 case, root-mean-square error against
// float64 relative to the values' own): y 4.2e-6, dx 3.0e-6, dw 1.7e-5, about twice oneDNN's
// Winograd kernels' (2.3e-6, 1.7e-6, 9.1e-6) and 4.5-40x the direct convolution's (3.6e-7, 6.6e-7,
// 4.4e-7); a bfloat16 operand's rounding is 4e-3. Deterministic on one machine; the AVX2 clone
// contracts into FMAs where the baseline one cannot, so their bits differ, as oneDNN's products
// differ between instruction sets.
#pragma once

#include <cstdint>

#include "devices/cpu/cpu_kernels.h"

namespace dtrain::cpu {

// A 3x3, stride-1 convolution: x [N,H,W,C] (NHWC) and w [3,3,C,K] (HWIO), both float32, C and K
// multiples of 8; `pad_top` / `pad_left` rows and columns of zeros before the input (0 to 2), and
// the output's size oh x ow (the padding after the input follows from them).
struct WinogradConv {
  int pad_top, pad_left;
  int64_t oh, ow;
};

// y [N, oh, ow, K] = conv2d(x, w) + bias (bias [K], or undefined for none), on the device whose
// State `st` is (its threads, its oneDNN engine and primitive cache). The callers
// (cpu_conv_pool.cc) have checked the shapes and types. Thread-safe as the device's other kernels
// are (the cache is guarded; each call's scratch is its own); a oneDNN failure throws through
// rethrow_dnnl.
Tensor winograd_conv2d(CpuKernels::State& st, const Tensor& x, const Tensor& w, const Tensor& bias,
                       const WinogradConv& g);
// dx [N,H,W,C] (x_shape) of that convolution for dy [N, oh, ow, K].
Tensor winograd_conv2d_backward_input(CpuKernels::State& st, const Tensor& dy, const Tensor& w,
                                      const Shape& x_shape, const WinogradConv& g);
// dw [3,3,C,K] of that convolution for x and dy [N, oh, ow, K].
Tensor winograd_conv2d_backward_filter(CpuKernels::State& st, const Tensor& x, const Tensor& dy,
                                       const WinogradConv& g);

}  // namespace dtrain::cpu

namespace dtrain::cpu_testing {
// While one lives, dtrain's own Winograd kernels run wherever Winograd's algorithm is wanted, also
// on CPUs whose oneDNN has Winograd kernels (so that an AVX-512 machine tests them), and fill
// their outputs with NaN before writing them (so that a value left unwritten fails a test). For
// tests: one at a time, not nested across threads.
class OwnWinogradEverywhere {
 public:
  OwnWinogradEverywhere();
  ~OwnWinogradEverywhere();
  OwnWinogradEverywhere(const OwnWinogradEverywhere&) = delete;
  OwnWinogradEverywhere& operator=(const OwnWinogradEverywhere&) = delete;

 private:
  bool previous_;
};
bool own_winograd_everywhere();
// How many convolution passes (forward, backward input, backward filter) dtrain's own Winograd
// kernels have run in this process.
uint64_t own_winograd_runs();
// While one lives, dtrain's Winograd kernels hold `tiles` tiles' transforms at a time (their
// chunks: cpu_winograd.cc), in every pass, instead of their own choice: many chunks on small
// inputs, for tests.
class WinogradChunkTiles {
 public:
  explicit WinogradChunkTiles(int64_t tiles);
  ~WinogradChunkTiles();
  WinogradChunkTiles(const WinogradChunkTiles&) = delete;
  WinogradChunkTiles& operator=(const WinogradChunkTiles&) = delete;

 private:
  int64_t previous_;
};
}  // namespace dtrain::cpu_testing
