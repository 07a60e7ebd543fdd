// Box-Muller on Philox's words, one normal from each pair (w0, w1): the one definition of the
// standard normals every initializer and Philox::normal() draw (internal).
#pragma once

#include <cstdint>

namespace dtrain::detail {

// sqrt(-2 log u1) cos(2 pi u2) in double, rounded to float once, with u1 = (w0 + 1) / (2^32 + 1) in
// (0, 1] and u2 = w1 / 2^32 in [0, 1): glibc's scalar log and cos.
float box_muller(uint32_t w0, uint32_t w1);

// out[k] = box_muller(w0[k], w1[k]) for k < n, bit for bit, 8 (AVX-512) or 4 (AVX2) at a time
// where glibc's vector log and cos (libmvec) are there: 8-9x the scalar rate. A vector result
// whose double value lies within 2^-40 of its size of a float rounding boundary (about 1 value in
// 50,000) is computed by the scalar path instead: libmvec's documented errors (up to 4 ulps of a
// double, 2^-50 relative) are far inside that margin, so every other value rounds to the float the
// scalar path gives. box_muller_test checks the equality on 2^25 pairs, among them the regions
// where cos and log are near 0.
void box_muller_fill(const uint32_t* w0, const uint32_t* w1, int64_t n, float* out);

// Which path box_muller_fill takes on this CPU: "avx512", "avx2" or "scalar".
const char* box_muller_path();
// For tests: box_muller_fill through the named path; false (nothing written) where this build or
// CPU does not have it.
bool box_muller_fill_on(const char* path, const uint32_t* w0, const uint32_t* w1, int64_t n,
                        float* out);

}  // namespace dtrain::detail
