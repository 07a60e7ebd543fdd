#include <algorithm>
#include <cstring>

#include "devices/worker_thread.h"
#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"
#include "strategies/mirrored_variables.h"
#include "strategies/replica_scope.h"

namespace dtrain {

MirroredReplicaContext::MirroredReplicaContext(MirroredStrategy* s, MirroredStrategy::Impl* impl,
                                               int replica)
    : strategy_(s), impl_(impl), replica_(replica), packer_(this) {}

Strategy& MirroredReplicaContext::strategy() const { return *strategy_; }
int MirroredReplicaContext::num_replicas_in_sync() const { return impl_->global_replicas; }
int MirroredReplicaContext::replica_id_in_sync_group() const {
  return impl_->replica_offset + replica_;
}
DeviceSpec MirroredReplicaContext::device() const {
  return impl_->devices[static_cast<size_t>(replica_)];
}
size_t MirroredReplicaContext::bytes_per_pack() const { return impl_->pack_bytes; }
bool MirroredReplicaContext::shares_variables() const { return impl_->shared_variables; }

std::future<std::vector<Tensor>> MirroredReplicaContext::all_reduce_async(
    ReduceOp op, std::vector<Tensor> values, bool deferred) {
  auto body = [this, op, values = std::move(values)] {
    const DeviceSpec dev = device();
    timeline::Span whole("all-reduce " + std::to_string(values.size()) + " tensor(s)",
                         "collective");
    std::vector<Tensor> out(values.size());
    // One flat buffer per dtype: one collective regardless of how many tensors.
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                     DType::kInt32, DType::kInt64}) {
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
        timeline::Span reduce(
            "all-reduce " + std::to_string(total * static_cast<int64_t>(dtype_size(dt)) / 1024) +
                " KiB",
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
  return on_comm_thread(std::move(body), deferred);
}

std::future<ScatteredSum> MirroredReplicaContext::reduce_scatter_async(std::vector<Tensor> values,
                                                                       bool deferred) {
  auto body = [this, values = std::move(values)] {
    const DeviceSpec dev = device();
    const int n = static_cast<int>(impl_->comms.size());
    timeline::Span whole("reduce-scatter " + std::to_string(values.size()) + " tensor(s)",
                         "collective");
    ScatteredSum s;
    int64_t total = 0;
    for (const auto& v : values) {
      DTRAIN_CHECK(v.dtype() == DType::kFloat32, "reduce_scatter_async takes float32 tensors");
      s.starts.push_back(total);
      total += v.numel();
    }
    // Whole 64-byte blocks per replica: no cache line is written by two replicas' updates.
    const int64_t unit = 16 * static_cast<int64_t>(n);
    s.padded = (total + unit - 1) / unit * unit;
    const int64_t block = s.padded / n, begin = block * replica_, end = begin + block;
    s.shard = Tensor::empty(Shape{block}, DType::kFloat32, dev);
    {
      // The gradients end to end: the in-process transport sums them where they lie (no packing
      // copy); a transport between processes packs them first.
      timeline::Span reduce("reduce-scatter " + std::to_string(total * 4 / 1024) + " KiB",
                            "collective");
      impl_->comms[static_cast<size_t>(replica_)]
          ->reduce_scatter_concat(values, s.shard, ReduceOp::kSum)
          .wait();
    }
    for (size_t i = 0; i < values.size(); ++i) {
      const int64_t lo = std::max(begin, s.starts[i]),
                    hi = std::min(end, s.starts[i] + values[i].numel());
      s.slices.push_back(lo < hi ? s.shard.slice_rows(lo - begin, hi - begin)
                                 : s.shard.slice_rows(0, 0));
      s.offsets.push_back(lo < hi ? lo - s.starts[i] : 0);
    }
    return s;
  };
  return on_comm_thread(std::move(body), deferred);
}

std::optional<ReplicaContext::UpdateSlices> MirroredReplicaContext::reduce_scatter_for_update(
    const std::vector<Tensor>& grads, const std::vector<std::shared_ptr<Variable>>& vars) {
  const bool partitioned = impl_->options.sharding != Sharding::kNone;
  if (!partitioned && (!impl_->shared_variables || impl_->global_replicas < 2)) return std::nullopt;
  if (grads.size() != vars.size())
    throw InvalidArgument("reduce_scatter_for_update: " + std::to_string(grads.size()) +
                          " gradients for " + std::to_string(vars.size()) + " variables");
  for (size_t i = 0; i < vars.size(); ++i) {
    if (partitioned) {
      if (!grads[i].defined() || grads[i].numel() != vars[i]->shape().numel())
        throw InvalidArgument("reduce_scatter_for_update: the gradient of '" + vars[i]->name() +
                              "' is " + grads[i].to_string() + ", not one for its shape " +
                              vars[i]->shape().to_string());
      continue;
    }
    const auto* mv = dynamic_cast<const MirroredVariable*>(vars[i].get());
    if (!mv || !mv->shares_storage() || !grads[i].defined() ||
        grads[i].dtype() != DType::kFloat32 || grads[i].numel() != vars[i]->shape().numel())
      return std::nullopt;
  }
  UpdateSlices out;
  if (!packer_.take_slices(grads, &out)) {
    for (const auto& g : grads)
      if (g.device() != device())
        throw InvalidArgument("reduce_scatter_for_update on replica " + std::to_string(replica_) +
                              ": " + g.to_string() + " is not on the replica's device " +
                              device().to_string());
    bool f32 = true;
    for (const auto& g : grads) f32 = f32 && g.dtype() == DType::kFloat32;
    // Queued behind any collective still in flight (as all_reduce), else inline.
    const bool inline_ = comm_idle();
    if (partitioned && !f32) {
      // Whole sums, of which this replica takes its part.
      const std::vector<Tensor> sums = all_reduce_async(ReduceOp::kSum, grads, inline_).get();
      const int n = impl_->global_replicas, me = replica_id_in_sync_group();
      for (const Tensor& t : sums) {
        const auto [b, e] = partition_range(t.numel(), me, n);
        out.grads.push_back(t.view(Shape{t.numel()}).slice_rows(b, e));
        out.offsets.push_back(b);
      }
    } else {
      ScatteredSum s = partitioned ? reduce_scatter_partitioned_async(grads, inline_).get()
                                   : reduce_scatter_async(grads, inline_).get();
      out.grads = std::move(s.slices);
      out.offsets = std::move(s.offsets);
    }
  }
  sharded_update_ = true;
  if (partitioned) sharded_vars_ = vars;
  return out;
}

void MirroredReplicaContext::end_sharded_update() {
  if (!sharded_update_) return;
  sharded_update_ = false;
  if (impl_->options.sharding != Sharding::kNone) {
    std::vector<std::shared_ptr<Variable>> vars = std::move(sharded_vars_);
    sharded_vars_.clear();
    if (impl_->params) impl_->params->end_step(*this);
    gather_parts(vars);
    return;
  }
  timeline::Span span("barrier: every slice updated", "collective");
  impl_->comms[static_cast<size_t>(replica_)]->barrier().wait();
}

std::vector<Tensor> MirroredReplicaContext::all_reduce(ReduceOp op,
                                                       const std::vector<Tensor>& values) {
  std::vector<Tensor> out;
  if (packer_.take(values, op, &out)) return out;
  for (const auto& v : values)
    if (v.device() != device())
      throw InvalidArgument("all_reduce on replica " + std::to_string(replica_) + ": " +
                            v.to_string() + " is not on the replica's device " +
                            device().to_string());
  // Inline unless gradient packs are still in flight on the communication thread (a collective
  // issued during backward, e.g. by SyncBatchNorm): then queue behind them to keep the order.
  return all_reduce_async(op, values, /*deferred=*/comm_idle()).get();
}

void MirroredReplicaContext::barrier() {
  auto* comm = impl_->comms[static_cast<size_t>(replica_)].get();
  impl_->comm_threads[static_cast<size_t>(replica_)]
      ->submit([comm] { comm->barrier().wait(); })
      .get();
}

std::vector<Tensor> MirroredReplicaContext::merge_call(
    const std::function<std::vector<Tensor>(Strategy&, const PerReplica&)>& fn,
    const std::vector<Tensor>& args) {
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
  return merge_call([axis](Strategy& s, const PerReplica& all) { return s.gather(all, axis); },
                    {value})
      .at(0);
}

// --- GradientPacker ---

void GradientPacker::reset() {
  seen_.clear();
  packs_.clear();
  current_ = Pack();
}

void GradientPacker::on_ready(size_t index, const Tensor& grad, bool exclusive) {
  if (seen_.size() <= index) seen_.resize(index + 1);
  if (current_.grads.empty() && timeline::enabled()) current_.first_ready_us = timeline::now_us();
  seen_[index] = grad;
  if (!grad.defined()) return;
  // One zero-length event per gradient: when backward produced it and its size, the profile that
  // `dtrain-bench simulate` replays at other worker counts and link speeds.
  if (timeline::enabled()) {
    const int64_t t = timeline::now_us();
    timeline::complete(
        "gradient " + std::to_string(index) + ": " + std::to_string(grad.nbytes()) + " B",
        "gradient", t, t);
  }
  current_.indices.push_back(index);
  current_.grads.push_back(grad);
  current_.exclusive.push_back(exclusive);
  current_.bytes += grad.nbytes();
  if (current_.bytes >= ctx_->bytes_per_pack()) launch(false);
}

// The last pack has nothing left to overlap with: reduce it inline when the optimizer asks.
void GradientPacker::on_done() { launch(true); }

void GradientPacker::launch(bool last) {
  if (current_.grads.empty()) return;
  if (current_.first_ready_us > 0)
    timeline::complete(
        "gradient pack " + std::to_string(packs_.size()) + ": wait for its gradients", "collective",
        current_.first_ready_us, timeline::now_us());
  packs_.push_back(std::move(current_));
  current_ = Pack();
  // Optimizers all-reduce gradients with SUM (losses are scaled by the global batch). Where the
  // replicas share their variables, each will update a slice: reduce-scatter instead.
  Pack& p = packs_.back();
  bool f32 = true;
  for (const auto& g : p.grads) f32 = f32 && g.dtype() == DType::kFloat32;
  if (ctx_->sharding() != Sharding::kNone && f32) {
    // Each replica receives its part of the sums. ZeRO-2/3 keep nothing more: the whole local
    // gradients go as soon as they are packed (those the tape says nothing else holds); ZeRO-1
    // keeps them until the update (DeepSpeed's stage 1).
    const bool free_local = ctx_->sharding() != Sharding::kOptimizerState;
    p.scattered = ctx_->reduce_scatter_partitioned_async(
        p.grads, /*deferred=*/last, free_local ? p.exclusive : std::vector<bool>{});
  } else if (ctx_->shares_variables() && f32)
    p.scattered = ctx_->reduce_scatter_async(p.grads, /*deferred=*/last);
  else
    p.result = ctx_->all_reduce_async(ReduceOp::kSum, p.grads, /*deferred=*/last);
}

bool GradientPacker::same_as_seen(const std::vector<Tensor>& grads) const {
  std::vector<Tensor> defined;
  for (const auto& g : seen_)
    if (g.defined()) defined.push_back(g);
  bool same = defined.size() == grads.size();
  for (size_t i = 0; same && i < grads.size(); ++i)
    same = grads[i].defined() && grads[i].id() == defined[i].id();
  return same;
}

bool GradientPacker::take(const std::vector<Tensor>& grads, ReduceOp op, std::vector<Tensor>* out) {
  if (op != ReduceOp::kSum || packs_.empty() || !same_as_seen(grads)) return false;
  // Every pack's collective first: a gather issued from this thread while a later pack's
  // reduce-scatter is still queued on the communication thread could be issued before it on one
  // replica and after it on another.
  std::vector<std::vector<Tensor>> results(packs_.size());
  std::vector<std::optional<ScatteredSum>> scattered(packs_.size());
  for (size_t i = 0; i < packs_.size(); ++i) {
    if (packs_[i].result.valid())
      results[i] = packs_[i].result.get();
    else
      scattered[i] = packs_[i].scattered.get();
  }
  std::unordered_map<uint64_t, Tensor> reduced;
  for (size_t i = 0; i < packs_.size(); ++i) {
    // A reduce-scattered pack (the optimizer did not shard its update after all) is gathered whole.
    if (scattered[i]) results[i] = ctx_->gather_sums(*scattered[i], packs_[i].grads);
    for (size_t k = 0; k < packs_[i].grads.size(); ++k)
      reduced[packs_[i].grads[k].id()] = results[i][k];
  }
  out->clear();
  for (const auto& g : grads) out->push_back(reduced.at(g.id()));
  reset();
  return true;
}

bool GradientPacker::take_slices(const std::vector<Tensor>& grads,
                                 ReplicaContext::UpdateSlices* out) {
  if (packs_.empty() || !same_as_seen(grads)) return false;
  const int64_t n = ctx_->num_replicas_in_sync(), me = ctx_->replica_id_in_sync_group();
  std::unordered_map<uint64_t, std::pair<Tensor, int64_t>> part;
  for (auto& p : packs_) {
    if (p.scattered.valid()) {
      ScatteredSum s = p.scattered.get();
      for (size_t k = 0; k < p.grads.size(); ++k)
        part[p.grads[k].id()] = {s.slices[k], s.offsets[k]};
      continue;
    }
    // An all-reduced pack: every replica has the whole sums, and takes an even share of each.
    std::vector<Tensor> r = p.result.get();
    for (size_t k = 0; k < p.grads.size(); ++k) {
      const int64_t count = r[k].numel(), b = count * me / n, e = count * (me + 1) / n;
      part[p.grads[k].id()] = {r[k].view(Shape{count}).slice_rows(b, e), b};
    }
  }
  out->grads.clear();
  out->offsets.clear();
  for (const auto& g : grads) {
    const auto& [slice, offset] = part.at(g.id());
    out->grads.push_back(slice);
    out->offsets.push_back(offset);
  }
  reset();
  return true;
}

}  // namespace dtrain
