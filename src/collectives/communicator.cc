#include "dtrain/collectives/communicator.h"

namespace dtrain {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kMean: return "MEAN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kMin: return "MIN";
  }
  return "?";
}

void Work::wait(std::chrono::milliseconds timeout) const {
  if (!tracker_) return;
  if (!tracker_->wait(id_, timeout))
    throw DeadlineExceeded(tracker_->describe(id_) + " did not finish within " + std::to_string(timeout.count()) +
                           " ms; a peer is stuck or gone — check the other ranks' logs, or raise "
                           "the collective timeout");
  tracker_->rethrow(id_);
}

bool Work::ready() const { return !tracker_ || tracker_->done(id_); }

Work Work::completed() { return Work(); }

}  // namespace dtrain
