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
  if (!f_.valid()) return;
  if (help_ && f_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) help_(state_.get(), id_, timeout);
  if (f_.wait_for(timeout) != std::future_status::ready)
    throw DeadlineExceeded((what_ ? *what_ : std::string("a collective")) + " did not finish within " + std::to_string(timeout.count()) +
                           " ms; a peer is stuck or gone — check the other ranks' logs, or raise "
                           "the collective timeout");
  f_.get();
}

bool Work::ready() const {
  return !f_.valid() || f_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Work Work::completed() { return Work(); }

}  // namespace dtrain
