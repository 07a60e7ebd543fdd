// Private to src/horovod: runs a collective that every active rank has agreed to (descriptor.h)
// over a communicator, and Horovod's Tensor Fusion of a run of all-reduces.
#pragma once

#include <functional>
#include <vector>

#include "dtrain/collectives/communicator.h"
#include "horovod/descriptor.h"

namespace dtrain::hvd::detail {

struct ExecContext {
  Communicator* comm = nullptr;  // null for a job of one rank
  int size = 1;
  size_t fusion_threshold = 0;
  std::function<void()> count_transfer;  // called once per data transfer
};

// Runs the collective `d` (agreed by the `active` ranks; `ds` every rank's description) with this
// rank's host tensor `x` (zeros of the agreed shape when this rank has joined). Throws what the
// transport throws, FailedPrecondition for a collective that cannot run while a rank has joined.
Tensor execute(const ExecContext& c, const Desc& d, Tensor x, const std::vector<int>& active,
               const std::vector<Desc>& ds, bool joined);

// All-reduces a negotiated run (agreed[j] describes inputs[j]) in fused buffers of at most the
// fusion threshold, one transfer per buffer; returns each tensor's result in its shape.
std::vector<Tensor> execute_fused(const ExecContext& c, const std::vector<Desc>& agreed,
                                  const std::vector<Tensor>& inputs, const std::vector<int>& active,
                                  bool joined);

}  // namespace dtrain::hvd::detail
