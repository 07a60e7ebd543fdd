// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011, as in TF and cuRAND).
// Element i of a stream depends only on (seed, stream, i), so results are identical whatever thread
// or device produces them, and a tensor can be filled in parallel. Thread-safety: const methods are
// safe; next_stream() is not.
#pragma once

#include <array>
#include <cstdint>

#include "dtrain/core/export.h"

namespace dtrain {

class DTRAIN_API Philox {
 public:
  Philox(uint64_t seed, uint64_t stream)
      : key_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}, stream_(stream) {}
  // Four 32-bit random words for block `counter`.
  std::array<uint32_t, 4> block(uint64_t counter) const;
  // Uniform float in [0, 1) for element i.
  float uniform(uint64_t i) const;
  // Standard normal for element i (Box-Muller on the block's words).
  float normal(uint64_t i) const;
  // out[j] = uniform(first + j) and normal(first + j) for j < n: the same values, one block for
  // every four uniforms or two normals instead of one per element.
  void uniform_fill(uint64_t first, int64_t n, float* out) const;
  void normal_fill(uint64_t first, int64_t n, float* out) const;
  // An independent stream for `branch` (branch 0: this one). EnsembleStrategy's member m draws its
  // initial weights from branch m of each initializer's stream.
  Philox fork(uint64_t branch) const;

 private:
  std::array<uint32_t, 2> key_;
  uint64_t stream_;
};

// Hands out independent streams from one seed: each variable initializer, dropout layer and
// shuffle asks for its own, in creation order, so a run is reproducible from --seed.
class DTRAIN_API SeedSequence {
 public:
  explicit SeedSequence(uint64_t seed = 0) : seed_(seed) {}
  Philox next_stream() { return Philox(seed_, counter_++); }
  uint64_t seed() const { return seed_; }
  void reset(uint64_t seed) {
    seed_ = seed;
    counter_ = 0;
  }

 private:
  uint64_t seed_;
  uint64_t counter_ = 0;
};

// The process-wide sequence (set from --seed); thread-safe.
DTRAIN_API Philox global_next_stream();
DTRAIN_API void set_global_seed(uint64_t seed);
// The branch random initializers fork their stream by on the calling thread (0 by default):
// EnsembleStrategy sets it to the member whose copy of a variable it is initializing.
DTRAIN_API uint64_t initializer_branch();
DTRAIN_API void set_initializer_branch(uint64_t branch);

}  // namespace dtrain
