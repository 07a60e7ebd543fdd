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

bool Work::wait_for(std::chrono::milliseconds timeout) const { return !tracker_ || tracker_->wait(id_, timeout); }

Work Work::completed() { return Work(); }

Compression parse_compression(const std::string& n) {
  if (n == "none") return Compression::kNone;
  if (n == "fp16") return Compression::kFP16;
  if (n == "bf16") return Compression::kBF16;
  throw InvalidArgument("unknown compression '" + n + "' (none, fp16, bf16)");
}

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone: return "none";
    case Compression::kFP16: return "fp16";
    case Compression::kBF16: return "bf16";
  }
  return "?";
}

}  // namespace dtrain
