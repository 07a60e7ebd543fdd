// What the collective algorithms need from a transport, and nothing more (as gloo's algorithms use
// its pairs): the ranks, and one full-duplex exchange step that moves a buffer to one peer while
// receiving another from a peer, in segments, checking every segment's fingerprint. The TCP
// transport implements it; ring, recursive doubling and broadcast are written against it only.
// Private to src/collectives.
//
// Thread-safety: one thread runs collectives on a Transport at a time; abort() may come from any.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "dtrain/collectives/communicator.h"
#include "dtrain/core/dtype.h"

namespace dtrain::collectives {

// Identifies one collective on every rank; a peer's segment with another fingerprint is an error
// naming both (ranks issued different collectives, shapes or orders).
struct Fingerprint {
  uint64_t seq = 0;  // the group's collective sequence number
  uint16_t op = 0;   // which collective
  DType dtype = DType::kFloat32;
  uint64_t count = 0;  // elements
  uint8_t reduce = 0;  // ReduceOp, or the root of a broadcast
};

// Called after each received segment with its offset and size in the receive buffer.
using SegmentFn = std::function<void(size_t offset, size_t bytes)>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sends `sbytes` from `sbuf` to rank `to` while receiving `rbytes` from rank `from` into `rbuf`
  // (to / from = -1: nothing that way). Throws Unavailable (peer closed, hung or aborted),
  // DeadlineExceeded, DataLoss (malformed segment), InvalidArgument (fingerprint mismatch).
  virtual void exchange(int to, const void* sbuf, size_t sbytes, int from, void* rbuf,
                        size_t rbytes, const Fingerprint& fp, const SegmentFn& on_segment) = 0;
};

}  // namespace dtrain::collectives
