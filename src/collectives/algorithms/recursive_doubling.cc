// Recursive doubling: in step k every rank swaps its whole buffer with rank ^ 2^k and reduces, so a
// power-of-two group finishes in log2(n) round trips (the latency-optimal choice for small
// messages). The reduction is commutative and both partners reduce the same two operands, so they
// stay bitwise equal.

#include "collectives/algorithms/algorithms.h"
#include "collectives/reduction.h"
#include "dtrain/core/allocator.h"

namespace dtrain::collectives {

void recursive_doubling_allreduce(Transport& t, void* buf_v, int64_t count, DType dt, ReduceOp op,
                                  const Fingerprint& fp) {
  char* buf = static_cast<char*>(buf_v);
  const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
  const auto scratch = host_allocator().allocate(bytes, DeviceSpec::cpu());  // as ring.cc's
  char* const got = static_cast<char*>(scratch->data());
  for (int mask = 1; mask < t.size(); mask <<= 1) {
    const int peer = t.rank() ^ mask;
    t.exchange(peer, buf, bytes, peer, got, bytes, fp, nullptr);
    reduce_into(buf, got, static_cast<size_t>(count), dt, op);
  }
  if (op == ReduceOp::kMean) scale_for_mean(buf, static_cast<size_t>(count), dt, t.size());
}

}  // namespace dtrain::collectives
