#include <cstring>

#include "devices/worker_thread.h"
#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"
#include "strategies/replica_scope.h"

namespace dtrain {

MirroredReplicaContext::MirroredReplicaContext(MirroredStrategy* s, MirroredStrategy::Impl* impl, int replica)
    : strategy_(s), impl_(impl), replica_(replica), packer_(this) {}

Strategy& MirroredReplicaContext::strategy() const { return *strategy_; }
int MirroredReplicaContext::num_replicas_in_sync() const {
  return impl_->global_replicas;
}
int MirroredReplicaContext::replica_id_in_sync_group() const { return impl_->replica_offset + replica_; }
DeviceSpec MirroredReplicaContext::device() const { return impl_->devices[static_cast<size_t>(replica_)]; }
size_t MirroredReplicaContext::bytes_per_pack() const { return impl_->options.bytes_per_pack; }

std::future<std::vector<Tensor>> MirroredReplicaContext::all_reduce_async(ReduceOp op, std::vector<Tensor> values,
                                                                          bool deferred) {
  auto body = [this, op, values = std::move(values)] {
    const DeviceSpec dev = device();
    timeline::Span whole("all-reduce " + std::to_string(values.size()) + " tensor(s)", "collective");
    std::vector<Tensor> out(values.size());
    // One flat buffer per dtype: one collective regardless of how many tensors.
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
      int64_t total = 0;
      for (const auto& v : values)
        if (v.dtype() == dt) total += v.numel();
      bool any = false;
      for (const auto& v : values) any = any || v.dtype() == dt;
      if (!any) continue;
      Tensor buf = Tensor::empty(Shape{total}, dt, dev);
      int64_t off = 0;
      {
        timeline::Span pack("pack", "collective");
        for (const auto& v : values) {
          if (v.dtype() != dt) continue;
          if (v.numel()) buf.slice_rows(off, off + v.numel()).copy_from(v.view(Shape{v.numel()}));
          off += v.numel();
        }
      }
      {
        timeline::Span reduce("all-reduce " + std::to_string(total * static_cast<int64_t>(dtype_size(dt)) / 1024) + " KiB",
                              "collective");
        impl_->comms[static_cast<size_t>(replica_)]->allreduce(buf, op).wait();
      }
      timeline::Span unpack("unpack", "collective");
      off = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        if (values[i].dtype() != dt) continue;
        out[i] = buf.slice_rows(off, off + values[i].numel()).view(values[i].shape());
        off += values[i].numel();
      }
    }
    return out;
  };
  if (deferred) return std::async(std::launch::deferred, std::move(body));
  auto task = std::make_shared<std::packaged_task<std::vector<Tensor>()>>(std::move(body));
  std::future<std::vector<Tensor>> f = task->get_future();
  impl_->comm_threads[static_cast<size_t>(replica_)]->submit([task] { (*task)(); });
  return f;
}

std::vector<Tensor> MirroredReplicaContext::all_reduce(ReduceOp op, const std::vector<Tensor>& values) {
  std::vector<Tensor> out;
  if (packer_.take(values, op, &out)) return out;
  for (const auto& v : values)
    if (v.device() != device())
      throw InvalidArgument("all_reduce on replica " + std::to_string(replica_) + ": " + v.to_string() +
                            " is not on the replica's device " + device().to_string());
  // Inline unless gradient packs are still in flight on the communication thread (a collective
  // issued during backward, e.g. by SyncBatchNorm): then queue behind them to keep the order.
  return all_reduce_async(op, values, /*deferred=*/packer_.idle()).get();
}

void MirroredReplicaContext::barrier() {
  auto* comm = impl_->comms[static_cast<size_t>(replica_)].get();
  impl_->comm_threads[static_cast<size_t>(replica_)]->submit([comm] { comm->barrier().wait(); }).get();
}

std::vector<Tensor> MirroredReplicaContext::merge_call(
    const std::function<std::vector<Tensor>(Strategy&, const PerReplica&)>& fn, const std::vector<Tensor>& args) {
  {
    std::lock_guard<std::mutex> lock(impl_->exchange_mu);
    impl_->exchange[static_cast<size_t>(replica_)] = args;
  }
  barrier();
  if (replica_ == 0) {
    PerReplica all;
    {
      std::lock_guard<std::mutex> lock(impl_->exchange_mu);
      all.values = impl_->exchange;
    }
    detail::ReplicaThreadScope cross(strategy_, nullptr);  // fn runs in cross-replica context
    std::vector<Tensor> r = fn(*strategy_, all);
    std::lock_guard<std::mutex> lock(impl_->exchange_mu);
    impl_->exchange_result = std::move(r);
  }
  barrier();
  std::vector<Tensor> out;
  {
    std::lock_guard<std::mutex> lock(impl_->exchange_mu);
    for (const auto& t : impl_->exchange_result) out.push_back(t.to(device()));
  }
  barrier();  // nobody overwrites the exchange before everyone has read it
  return out;
}

Tensor MirroredReplicaContext::all_gather(const Tensor& value, int axis) {
  return merge_call(
             [axis](Strategy& s, const PerReplica& all) { return s.gather(all, axis); }, {value})
      .at(0);
}

// --- GradientPacker ---

void GradientPacker::reset() {
  seen_.clear();
  packs_.clear();
  current_ = Pack();
}

void GradientPacker::on_ready(size_t index, const Tensor& grad) {
  if (seen_.size() <= index) seen_.resize(index + 1);
  if (current_.grads.empty() && timeline::enabled()) current_.first_ready_us = timeline::now_us();
  seen_[index] = grad;
  if (!grad.defined()) return;
  current_.indices.push_back(index);
  current_.grads.push_back(grad);
  current_.bytes += grad.nbytes();
  if (current_.bytes >= ctx_->bytes_per_pack()) launch(false);
}

// The last pack has nothing left to overlap with: reduce it inline when the optimizer asks.
void GradientPacker::on_done() { launch(true); }

void GradientPacker::launch(bool last) {
  if (current_.grads.empty()) return;
  if (current_.first_ready_us > 0)
    timeline::complete("gradient pack " + std::to_string(packs_.size()) + ": wait for its gradients", "collective",
                       current_.first_ready_us, timeline::now_us());
  packs_.push_back(std::move(current_));
  current_ = Pack();
  // Optimizers all-reduce gradients with SUM (losses are scaled by the global batch).
  Pack& p = packs_.back();
  p.result = ctx_->all_reduce_async(ReduceOp::kSum, p.grads, /*deferred=*/last);
}

bool GradientPacker::take(const std::vector<Tensor>& grads, ReduceOp op, std::vector<Tensor>* out) {
  if (op != ReduceOp::kSum || packs_.empty()) return false;
  // Must be exactly the defined gradients we saw, in the same order.
  std::vector<Tensor> defined;
  for (const auto& g : seen_)
    if (g.defined()) defined.push_back(g);
  bool same = defined.size() == grads.size();
  for (size_t i = 0; same && i < grads.size(); ++i) same = grads[i].defined() && grads[i].id() == defined[i].id();
  if (!same) return false;
  std::unordered_map<uint64_t, Tensor> reduced;
  for (auto& p : packs_) {
    std::vector<Tensor> r = p.result.get();
    for (size_t k = 0; k < p.grads.size(); ++k) reduced[p.grads[k].id()] = r[k];
  }
  out->clear();
  for (const auto& g : grads) out->push_back(reduced.at(g.id()));
  reset();
  return true;
}

}  // namespace dtrain
