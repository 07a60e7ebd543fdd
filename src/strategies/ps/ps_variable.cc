#include "dtrain/devices/device.h"
#include "strategies/ps/ps_impl.h"
#include "strategies/ps/ps_protocol.h"

namespace dtrain {

PsVariable::PsVariable(VariableSpec spec,
                       const std::shared_ptr<ParameterServerStrategy::Impl>& impl,
                       std::vector<Shard> shards, DeviceSpec device)
    : ShardedVariable(std::move(spec)), impl_(impl), shards_(std::move(shards)) {
  cache_ = Tensor::zeros(spec_.shape, spec_.dtype, device);
  cache_.set_trainable_variable(spec_.trainable);
}

std::shared_ptr<ParameterServerStrategy::Impl> PsVariable::impl() const {
  auto m = impl_.lock();
  if (!m)
    throw FailedPrecondition("variable '" + spec_.name +
                             "' lives on the parameter servers of a "
                             "ParameterServerStrategy that no longer exists; keep the strategy "
                             "alive while using the model");
  return m;
}

Tensor PsVariable::read_value() const {
  auto m = impl();
  if (!m->in_run.load()) {
    // Outside a step nothing refreshes the cache: read the servers' current values.
    m->pull({const_cast<PsVariable*>(this)});
  }
  return cache_;
}

Tensor PsVariable::shard_of(const Tensor& t, int i) const {
  if (t.rank() == 0) return t;
  const Shard& s = shards_[static_cast<size_t>(i)];
  return t.slice_rows(s.row_begin, s.row_begin + s.rows);
}

std::string PsVariable::shard_task(int i) const {
  return impl()->ps_names.at(static_cast<size_t>(shards_.at(static_cast<size_t>(i)).ps));
}

Shape PsVariable::shard_shape(int i) const {
  if (spec_.shape.rank() == 0) return spec_.shape;
  std::vector<int64_t> dims = spec_.shape.dims();
  dims[0] = shards_.at(static_cast<size_t>(i)).rows;
  return Shape(dims);
}

Tensor PsVariable::read_shard(int i) const {
  const Shard& s = shards_.at(static_cast<size_t>(i));
  auto m = impl();
  std::lock_guard<std::mutex> lock(m->rpc_mu);
  try {
    return m->ps[static_cast<size_t>(s.ps)]
        ->pull({.with_slots = false, .keys = {s.key}})
        .vars[0]
        .value;
  } catch (const Error& e) {
    m->fail(s.ps, e, "reading a shard");
  }
}

void PsVariable::send_assign(ps::AssignMode mode, const Tensor& v) {
  if (v.shape() != spec_.shape || v.dtype() != spec_.dtype)
    throw InvalidArgument("assign to variable '" + spec_.name + "' of shape " +
                          spec_.shape.to_string() + " with " + v.to_string());
  const Tensor host = v.to(DeviceSpec::cpu());
  auto m = impl();
  std::lock_guard<std::mutex> lock(m->rpc_mu);
  std::vector<uint64_t> ids(shards_.size());
  for (size_t i = 0; i < shards_.size(); ++i) {
    const ps::AssignRequest req{
        .mode = mode, .key = shards_[i].key, .value = shard_of(host, static_cast<int>(i))};
    try {
      ids[i] = m->ps[static_cast<size_t>(shards_[i].ps)]->send(req);
    } catch (const Error& e) {
      m->fail(shards_[i].ps, e, "assigning a variable");
    }
  }
  for (size_t i = 0; i < shards_.size(); ++i) {
    try {
      m->ps[static_cast<size_t>(shards_[i].ps)]->receive_assign(ids[i]);
    } catch (const Error& e) {
      m->fail(shards_[i].ps, e, "assigning a variable");
    }
  }
}

void PsVariable::do_assign(const Tensor& v) {
  send_assign(ps::AssignMode::kSet, v);
  cache_.copy_from(v);
}

void PsVariable::do_assign_add(const Tensor& delta) {
  send_assign(ps::AssignMode::kAdd, delta);
  cache_.copy_from(kernels_for(cache_).binary(BinaryOp::kAdd, cache_, delta.to(cache_.device())));
}

void PsVariable::do_assign_sub(const Tensor& delta) {
  send_assign(ps::AssignMode::kSub, delta);
  cache_.copy_from(kernels_for(cache_).binary(BinaryOp::kSub, cache_, delta.to(cache_.device())));
}

void PsVariable::do_update(const std::function<void(Tensor& value, size_t copy_index)>& fn) {
  // Sent as a difference (assign_add), which the server applies atomically: several workers
  // updating e.g. batch-norm statistics at once all count, as TF's assign_sub on a PS variable.
  const Tensor before = value().clone();
  Tensor after = before.clone();
  fn(after, 0);
  assign_add(kernels_for(after).binary(BinaryOp::kSub, after, before));
}

void PsVariable::apply_remote_update(const std::string& config, const Tensor& grad) {
  if (grad.shape() != spec_.shape || grad.dtype() != spec_.dtype)
    throw InvalidArgument("gradient " + grad.to_string() + " for variable '" + spec_.name +
                          "' of shape " + spec_.shape.to_string());
  auto m = impl();
  {
    std::lock_guard<std::mutex> lock(m->out_mu);
    m->outbox.push_back({this, grad.to(DeviceSpec::cpu()), config});
  }
  if (!m->in_run.load()) m->flush();  // apply_gradients outside run(): push now
}

}  // namespace dtrain
