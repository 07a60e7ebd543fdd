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
  if (!tracker_->wait(id_, timeout)) {
    const std::string what = tracker_->describe(id_) + " did not finish within " + std::to_string(timeout.count()) +
                             " ms; a peer is stuck or gone — check the other ranks' logs, or wait longer";
    tracker_->abort_and_drain(id_, what);  // it must not touch the caller's tensors after we return
    throw DeadlineExceeded(what);
  }
  tracker_->rethrow(id_);
}

bool Work::ready() const { return !tracker_ || tracker_->done(id_); }

Work Work::completed() { return Work(); }

}  // namespace dtrain
