// Dropout masks from the Philox4x32-10 stream of src/core/random.cc, ported to the device word for
// word: element i uses word i % 4 of block i / 4 for key (seed), counter (i / 4) and stream, so the
// GPU draws exactly the CPU's mask. Each thread computes one block and writes its four elements.
#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_launch.h"

namespace dtrain::cuda {
namespace {

__device__ __forceinline__ uint4 philox4x32_10(uint32_t k0, uint32_t k1, uint64_t counter,
                                               uint64_t stream) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = static_cast<uint32_t>(stream), c3 = static_cast<uint32_t>(stream >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return make_uint4(c0, c1, c2, c3);
}

// Philox::uniform: 24 random bits -> [0, 1), exactly representable.
__device__ __forceinline__ float word_to_uniform(uint32_t w) {
  return static_cast<float>(w >> 8) * (1.0f / 16777216.0f);
}

__global__ void dropout_mask_kernel(float* __restrict__ out, int64_t n, int64_t blocks, float rate,
                                    float scale, uint32_t k0, uint32_t k1, uint64_t stream) {
  DTRAIN_GRID_STRIDE_LOOP(b, blocks) {
    const uint4 w = philox4x32_10(k0, k1, static_cast<uint64_t>(b), stream);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    const int64_t base = b * 4;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (base + k < n) out[base + k] = word_to_uniform(words[k]) >= rate ? scale : 0.f;
  }
}

}  // namespace

void launch_dropout_mask(float* out, int64_t n, float rate, float scale, uint64_t seed,
                         uint64_t stream, cudaStream_t s) {
  if (n == 0) return;
  const int64_t blocks = (n + 3) / 4;
  dropout_mask_kernel<<<grid_for(blocks), kBlock, 0, s>>>(
      out, n, blocks, rate, scale, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
      stream);
  DTRAIN_CHECK_LAUNCH("dropout_mask_kernel");
}

}  // namespace dtrain::cuda
