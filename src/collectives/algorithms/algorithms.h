// Collective algorithms over a Transport (transport.h). Each element is reduced in one place and
// then copied, so every rank ends with bitwise identical results. Private to src/collectives.
#pragma once

#include "collectives/algorithms/transport.h"

namespace dtrain::collectives {

// Below this many bytes, a power-of-two group all-reduces by recursive doubling (fewest round
// trips); otherwise by the ring (bandwidth-optimal).
inline constexpr size_t kSmallMessageBytes = 64 * 1024;

// In place: buf (count elements of dt) becomes op over every rank's buf. Picks the algorithm.
void allreduce(Transport& t, void* buf, int64_t count, DType dt, ReduceOp op,
               const Fingerprint& fp);

// Ring reduce-scatter then ring all-gather: 2 (n-1)/n of the buffer crosses each link.
void ring_allreduce(Transport& t, void* buf, int64_t count, DType dt, ReduceOp op,
                    const Fingerprint& fp);
// Ring reduce-scatter over buf split into size() chunks; afterwards chunk (rank + 1 + shift) mod
// size() is fully reduced here (MEAN not yet divided). Returns that chunk's index.
int ring_reduce_scatter(Transport& t, void* buf, int64_t count, DType dt, ReduceOp op,
                        const Fingerprint& fp, int shift);
// out holds size() blocks of block_bytes; this rank's block is in place; afterwards all are.
void ring_allgather(Transport& t, void* out, size_t block_bytes, const Fingerprint& fp);

// log2(size) pairwise exchanges; size() must be a power of two.
void recursive_doubling_allreduce(Transport& t, void* buf, int64_t count, DType dt, ReduceOp op,
                                  const Fingerprint& fp);

// in and out hold size() blocks of block_bytes; out's block j becomes rank j's block for this rank
// (its in block rank()). Pairwise exchange: n-1 steps, each block crosses one link once.
void pairwise_alltoall(Transport& t, const void* in, void* out, size_t block_bytes,
                       const Fingerprint& fp);

// The root sends buf to every other rank; each sends it a receipt (ranks that disagree on the root
// fail here, not at the next collective).
void star_broadcast(Transport& t, void* buf, size_t bytes, int root, const Fingerprint& fp);

}  // namespace dtrain::collectives
