#include "dtrain/collectives/communicator.h"

#include <cstring>

#include "collectives/sync_collectives.h"

namespace dtrain {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "SUM";
    case ReduceOp::kMean:
      return "MEAN";
    case ReduceOp::kMax:
      return "MAX";
    case ReduceOp::kMin:
      return "MIN";
  }
  return "?";
}

void Work::wait(std::chrono::milliseconds timeout) const {
  if (!tracker_) return;
  if (!tracker_->wait(id_, timeout)) {
    const std::string what =
        tracker_->describe(id_) + " did not finish within " + std::to_string(timeout.count()) +
        " ms; a peer is stuck or gone — check the other ranks' logs, or wait longer";
    tracker_->abort_and_drain(id_, what);  // it must not touch the caller's tensors after we return
    throw DeadlineExceeded(what);
  }
  tracker_->rethrow(id_);
}

bool Work::ready() const { return !tracker_ || tracker_->done(id_); }

bool Work::wait_for(std::chrono::milliseconds timeout) const {
  return !tracker_ || tracker_->wait(id_, timeout);
}

Work Work::completed() { return Work(); }

void SyncCollectives::check_alltoall(const Tensor& in, const Tensor& out, int n) {
  if (in.numel() % n != 0 || out.numel() != in.numel() || out.dtype() != in.dtype())
    throw InvalidArgument(
        "alltoall: input and output must hold the same number of elements of one dtype, divisible "
        "into size() = " +
        std::to_string(n) + " blocks; got " + in.to_string() + " and " + out.to_string());
}

namespace {

// out's block j = all's block (j * n + r), all = every rank's input one after another.
void keep_own_blocks(const Tensor& all, Tensor& out, int n, int r) {
  const size_t block = out.nbytes() / static_cast<size_t>(n);
  for (int j = 0; j < n; ++j)
    std::memcpy(static_cast<char*>(out.raw_data()) + static_cast<size_t>(j) * block,
                static_cast<const char*>(all.raw_data()) + (static_cast<size_t>(j) * n + r) * block,
                block);
}

}  // namespace

Work Communicator::alltoall(const Tensor& input, Tensor& output) {
  SyncCollectives::check_alltoall(input, output, size());
  Tensor all = Tensor::empty(Shape{input.numel() * size()}, input.dtype());
  allgather(input.view(Shape{input.numel()}), all).wait();
  keep_own_blocks(all, output, size(), rank());
  return Work::completed();
}

void SyncCollectives::alltoall(const Tensor& input, Tensor& output) {
  check_alltoall(input, output, size());
  Tensor all = Tensor::empty(Shape{input.numel() * size()}, input.dtype());
  allgather(input.view(Shape{input.numel()}), all);
  keep_own_blocks(all, output, size(), rank());
}

int64_t SyncCollectives::check_reduce_scatter_concat(const std::vector<Tensor>& inputs,
                                                     const Tensor& output, int n) {
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].dtype() != output.dtype())
      throw InvalidArgument("reduce_scatter_concat: input " + std::to_string(i) + " is " +
                            inputs[i].to_string() + " but the output is " + output.to_string() +
                            "; every input must be of the output's dtype");
    total += inputs[i].numel();
  }
  if (total > output.numel() * n)
    throw InvalidArgument("reduce_scatter_concat: the inputs hold " + std::to_string(total) +
                          " elements, more than " + std::to_string(n) + " ranks x the output's " +
                          std::to_string(output.numel()) +
                          "; make the output at least ceil(total / size()) elements");
  return total;
}

Tensor SyncCollectives::pack_for_reduce_scatter(const std::vector<Tensor>& inputs,
                                                const Tensor& output, int n) {
  const int64_t total = check_reduce_scatter_concat(inputs, output, n);
  Tensor buf = Tensor::empty(Shape{output.numel() * n}, output.dtype());
  const size_t esize = dtype_size(output.dtype());
  char* p = static_cast<char*>(buf.raw_data());
  for (const Tensor& t : inputs) {
    if (!t.device().host_accessible())
      throw InvalidArgument("reduce_scatter_concat packs on the host, got " + t.to_string());
    if (t.numel()) std::memcpy(p, t.raw_data(), t.nbytes());
    p += static_cast<size_t>(t.numel()) * esize;
  }
  std::memset(p, 0, static_cast<size_t>(output.numel() * n - total) * esize);
  return buf;
}

void SyncCollectives::reduce_scatter_concat(const std::vector<Tensor>& inputs, Tensor& output,
                                            ReduceOp op) {
  const Tensor buf = pack_for_reduce_scatter(inputs, output, size());
  reduce_scatter(buf, output, op);
}

Work Communicator::reduce_scatter_concat(const std::vector<Tensor>& inputs, Tensor& output,
                                         ReduceOp op) {
  const Tensor buf = SyncCollectives::pack_for_reduce_scatter(inputs, output, size());
  reduce_scatter(buf, output, op).wait();
  return Work::completed();
}

Compression parse_compression(const std::string& n) {
  if (n == "none") return Compression::kNone;
  if (n == "fp16") return Compression::kFP16;
  if (n == "bf16") return Compression::kBF16;
  throw InvalidArgument("unknown compression '" + n + "' (none, fp16, bf16)");
}

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone:
      return "none";
    case Compression::kFP16:
      return "fp16";
    case Compression::kBF16:
      return "bf16";
  }
  return "?";
}

}  // namespace dtrain
