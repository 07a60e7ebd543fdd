// Broadcast from the root straight to every rank: one hop, n-1 sends from the root.
#include "collectives/algorithms/algorithms.h"

namespace dtrain::collectives {

void star_broadcast(Transport& t, void* buf, size_t bytes, int root, const Fingerprint& fp) {
  if (t.rank() == root) {
    for (int r = 0; r < t.size(); ++r)
      if (r != root) t.exchange(r, buf, bytes, -1, nullptr, 0, fp, nullptr);
  } else {
    t.exchange(-1, nullptr, 0, root, buf, bytes, fp, nullptr);
  }
}

}  // namespace dtrain::collectives
