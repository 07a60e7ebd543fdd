// A channel's mean and sum of squared deviations in one read of its values: Welford's update for
// one value at a time, and Chan, Golub and LeVeque's merge of two partial results. The GPU's batch
// norm statistics (cuda_batch_norm.cu) run on these, in place of two passes over x (the mean, then
// the squared deviations from it). Neither cancels the way E[x^2] - mean^2 does when |mean| >> std.
//
// Plain C++, with CUDA's qualifiers where nvcc compiles it, so that tests/devices/welford_test.cc
// runs the same formulas, in the GPU kernel's order, on the CPU (nvcc may fuse their multiply-adds,
// so the test checks the method's accuracy, not the GPU's exact bits).
#pragma once

#if defined(__CUDACC__)
#define DTRAIN_HOST_DEVICE __host__ __device__
#else
#define DTRAIN_HOST_DEVICE
#endif

namespace dtrain::cuda {

// n values with mean `mean` and sum of squared deviations `m2` (variance m2 / n). n is a float,
// exact up to 2^24 values in one partial result; past that the merge weights round at 6e-8.
struct Moments {
  float n = 0.f;
  float mean = 0.f;
  float m2 = 0.f;
};

DTRAIN_HOST_DEVICE inline void welford_push(Moments& a, float x) {
  a.n += 1.f;
  const float d = x - a.mean;
  a.mean += d / a.n;
  a.m2 += d * (x - a.mean);
}

// An empty side returns the other unchanged (no rounding through the weights).
DTRAIN_HOST_DEVICE inline Moments welford_merge(const Moments& a, const Moments& b) {
  if (b.n == 0.f) return a;
  if (a.n == 0.f) return b;
  const float n = a.n + b.n;
  const float d = b.mean - a.mean;
  const float wb = b.n / n;
  return {n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb};
}

}  // namespace dtrain::cuda
