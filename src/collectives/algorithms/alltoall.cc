// All-to-all by pairwise exchange: in step s (1..n-1) rank r sends its block for rank r+s while
// receiving rank r-s's block for it, so every block crosses one link once and every step keeps
// every link busy in both directions.
#include <cstring>

#include "collectives/algorithms/algorithms.h"

namespace dtrain::collectives {

void pairwise_alltoall(Transport& t, const void* in, void* out, size_t block_bytes,
                       const Fingerprint& fp) {
  const int n = t.size(), r = t.rank();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::memcpy(dst + static_cast<size_t>(r) * block_bytes,
              src + static_cast<size_t>(r) * block_bytes, block_bytes);
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n, from = (r - s + n) % n;
    t.exchange(to, src + static_cast<size_t>(to) * block_bytes, block_bytes, from,
               dst + static_cast<size_t>(from) * block_bytes, block_bytes, fp, nullptr);
  }
}

}  // namespace dtrain::collectives
