#include "dtrain/core/random.h"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "core/box_muller.h"

namespace dtrain {

std::array<uint32_t, 4> Philox::block(uint64_t counter) const {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = static_cast<uint32_t>(stream_), c3 = static_cast<uint32_t>(stream_ >> 32);
  uint32_t k0 = key_[0], k1 = key_[1];
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = static_cast<uint32_t>(p1);
    c2 = n2;
    c3 = static_cast<uint32_t>(p0);
    k0 += kW0;
    k1 += kW1;
  }
  return {c0, c1, c2, c3};
}

namespace {
// 24 random bits -> [0, 1) exactly representable.
float uniform_of(uint32_t w) { return static_cast<float>(w >> 8) * (1.0f / 16777216.0f); }
// Box-Muller on two words.
float normal_of(uint32_t w0, uint32_t w1) { return detail::box_muller(w0, w1); }
}  // namespace

float Philox::uniform(uint64_t i) const { return uniform_of(block(i / 4)[i % 4]); }

float Philox::normal(uint64_t i) const {
  const auto b = block(i / 2);
  return normal_of(b[(i % 2) * 2], b[(i % 2) * 2 + 1]);
}

void Philox::uniform_fill(uint64_t first, int64_t n, float* out) const {
  int64_t j = 0;
  while (j < n) {
    const uint64_t i = first + static_cast<uint64_t>(j);
    const auto b = block(i / 4);
    for (uint64_t w = i % 4; w < 4 && j < n; ++w, ++j) out[j] = uniform_of(b[w]);
  }
}

// Element 2k of block k's pair is Box-Muller on its words 0 and 1, element 2k + 1 on words 2 and 3.
// Whole blocks go through box_muller_fill in batches (the vector path: the same floats, 8-9x the
// rate); an odd first or last element alone.
void Philox::normal_fill(uint64_t first, int64_t n, float* out) const {
  if (n <= 0) return;
  int64_t j = 0;
  if (first % 2) out[j++] = normal(first);
  constexpr int64_t kBlocks = 128;  // a batch: 256 normals
  uint32_t w0[2 * kBlocks], w1[2 * kBlocks];
  while (n - j >= 2) {
    const int64_t blocks = std::min(kBlocks, (n - j) / 2);
    for (int64_t k = 0; k < blocks; ++k) {
      // element i's block is i / 2, i wrapping at 2^64 as in normal(i)
      const auto b = block((first + static_cast<uint64_t>(j + 2 * k)) / 2);
      w0[2 * k] = b[0];
      w1[2 * k] = b[1];
      w0[2 * k + 1] = b[2];
      w1[2 * k + 1] = b[3];
    }
    detail::box_muller_fill(w0, w1, 2 * blocks, out + j);
    j += 2 * blocks;
  }
  if (j < n) out[j] = normal(first + static_cast<uint64_t>(j));
}

namespace {
std::mutex g_mu;
SeedSequence g_seq(0);
}  // namespace

Philox global_next_stream() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_seq.next_stream();
}

void set_global_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_seq.reset(seed);
}

namespace {
thread_local uint64_t t_branch = 0;
}  // namespace

uint64_t initializer_branch() { return t_branch; }
void set_initializer_branch(uint64_t branch) { t_branch = branch; }

Philox Philox::fork(uint64_t branch) const {
  if (branch == 0) return *this;
  uint64_t z = branch * 0x9E3779B97F4A7C15ull;  // splitmix64 of the branch, folded into the stream
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  Philox p = *this;
  p.stream_ ^= z ^ (z >> 31);
  return p;
}

}  // namespace dtrain
