// Broadcast from the root straight to every rank: one hop, n-1 sends from the root, then a 4-byte
// receipt from each rank back to it. The receipts make ranks that disagree on the root fail in this
// broadcast: a rank that takes itself for the root only sends, and two such ranks both returned,
// each with its own tensor (the mismatch surfaced at the next collective, or never after the last
// one); now each waits for the other's receipt and gets its data, whose fingerprint names another
// root.
#include <cstdint>

#include "collectives/algorithms/algorithms.h"

namespace dtrain::collectives {

void star_broadcast(Transport& t, void* buf, size_t bytes, int root, const Fingerprint& fp) {
  uint32_t receipt = 0;
  if (t.rank() == root) {
    for (int r = 0; r < t.size(); ++r)
      if (r != root) t.exchange(r, buf, bytes, -1, nullptr, 0, fp, nullptr);
    for (int r = 0; r < t.size(); ++r)
      if (r != root) t.exchange(-1, nullptr, 0, r, &receipt, sizeof(receipt), fp, nullptr);
  } else {
    t.exchange(-1, nullptr, 0, root, buf, bytes, fp, nullptr);
    t.exchange(root, &receipt, sizeof(receipt), -1, nullptr, 0, fp, nullptr);
  }
}

}  // namespace dtrain::collectives
