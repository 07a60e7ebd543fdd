#include "strategies/mirrored_variables.h"

#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"

namespace dtrain {
namespace {

Tensor combine(const Tensor& base, const Tensor& v, int sign) {
  Kernels& k = kernels_for(base);
  const Tensor d = v.to(base.device());
  if (sign == 0) return d;
  return k.binary(sign > 0 ? BinaryOp::kAdd : BinaryOp::kSub, base, d);
}

void check_same(const Variable& var, const Tensor& t, const char* op) {
  if (t.shape() != var.shape() || t.dtype() != var.dtype())
    throw InvalidArgument(std::string(op) + " on variable '" + var.name() + "' of shape " +
                          var.shape().to_string() + " with " + t.to_string());
}

// The value every replica should write, per the variable's aggregation (TF semantics).
Tensor aggregate_in_replica(ReplicaContext& ctx, const Variable& var, const Tensor& v) {
  switch (var.spec().aggregation) {
    case VariableAggregation::kNone:
      throw InvalidArgument("variable '" + var.name() + "' was written in replica context with " +
                            std::to_string(ctx.num_replicas_in_sync()) +
                            " replicas but has aggregation NONE; create it with aggregation "
                            "VariableAggregation::kSum, kMean or kOnlyFirstReplica, or write it "
                            "in cross-replica context");
    case VariableAggregation::kSum:
      return ctx.all_reduce(ReduceOp::kSum, {v})[0];
    case VariableAggregation::kMean:
      return ctx.all_reduce(ReduceOp::kMean, {v})[0];
    case VariableAggregation::kOnlyFirstReplica: {
      const Tensor mine =
          ctx.replica_id_in_sync_group() == 0 ? v : Tensor::zeros(v.shape(), v.dtype(), v.device());
      return ctx.all_reduce(ReduceOp::kSum, {mine})[0];
    }
  }
  return v;
}

}  // namespace

// --- MirroredVariable ---

MirroredVariable::MirroredVariable(VariableSpec spec, const Strategy* owner,
                                   const std::vector<DeviceSpec>& devices, bool shared,
                                   std::shared_ptr<ParameterGatherer> gatherer)
    : Variable(std::move(spec)),
      owner_(owner),
      shared_(shared && devices.size() > 1),
      gatherer_(gatherer),
      parts_(devices.size()) {
  // Initialised once, on the first device, and copied: every replica starts identical.
  Tensor init = spec_.initializer(spec_.shape, spec_.dtype, devices.front());
  if (init.shape() != spec_.shape || init.dtype() != spec_.dtype)
    throw InvalidArgument("initializer of variable '" + spec_.name + "' returned " +
                          init.to_string());
  DTRAIN_CHECK(!shared_ || !on_read(), "sync-on-read variables keep one copy per replica");
  for (const auto& d : devices) {
    Tensor copy;
    if (shared_ && !values_.empty()) {
      copy = values_.front().share_to(d);  // (share_to refuses a device that is not host memory)
      DTRAIN_CHECK(copy.raw_data() == values_.front().raw_data(),
                   "shared copies need host devices");
    } else {
      copy = Tensor::empty(spec_.shape, spec_.dtype, d);
      copy.copy_from(init);
    }
    copy.set_trainable_variable(spec_.trainable);
    values_.push_back(copy);
  }
}

ReplicaContext* MirroredVariable::my_replica() const {
  ReplicaContext* ctx = get_replica_context();
  return ctx && &ctx->strategy() == owner_ ? ctx : nullptr;
}

Tensor MirroredVariable::read_value() const {
  if (ReplicaContext* ctx = my_replica()) return values_[local(*ctx)];
  if (holds_part(0) && !values_[0].has_memory()) return assemble();
  if (!on_read() || values_.size() == 1) return values_[0];
  // Cross-replica read of a sync-on-read variable: the aggregate of the replicas' copies.
  Kernels& k = kernels_for(values_[0]);
  Tensor acc = values_[0].clone();
  for (size_t i = 1; i < values_.size(); ++i)
    acc = k.binary(BinaryOp::kAdd, acc, values_[i].to(acc.device()));
  if (spec_.aggregation == VariableAggregation::kMean)
    acc = k.affine(acc, 1.f / static_cast<float>(values_.size()), 0.f);
  else if (spec_.aggregation == VariableAggregation::kOnlyFirstReplica)
    acc = values_[0].clone();
  return acc;
}

std::vector<Tensor> MirroredVariable::device_values() const {
  for (size_t l = 0; l < parts_.size(); ++l)
    if (holds_part(l) && !values_[l].has_memory())
      throw FailedPrecondition("variable '" + name() +
                               "' is sharded across replicas (Sharding::kParameters): its copies "
                               "hold parts only; read it with value() or save a checkpoint");
  return values_;
}

std::vector<ValuePart> MirroredVariable::value_parts() const {
  for (size_t l = 0; l < parts_.size(); ++l)
    if (!holds_part(l)) return {};
  return parts_;
}

void MirroredVariable::release_copy(size_t l, int part, int parts) {
  Tensor& whole = values_[l];
  if (!holds_part(l)) {
    const auto [b, e] = partition_range(whole.numel(), part, parts);
    parts_[l] =
        ValuePart{part, parts, b, whole.view(Shape{whole.numel()}).slice_rows(b, e).clone()};
  }
  whole.release_memory();
}

bool MirroredVariable::make_whole_locally() {
  constexpr size_t kNone = ~size_t{0};
  bool partial = false;
  size_t whole = kNone;  // a copy never released (a step that failed early) holds the whole value
  for (size_t l = 0; l < parts_.size(); ++l) {
    if (holds_part(l))
      partial = true;
    else if (whole == kNone)
      whole = l;
  }
  if (!partial) return true;
  if (whole == kNone && static_cast<size_t>(parts_[0].parts) != parts_.size()) return false;
  const Tensor value = whole != kNone ? values_[whole].clone() : assemble();
  for (size_t l = 0; l < parts_.size(); ++l) {
    if (!values_[l].has_memory())
      values_[l].adopt_memory(Tensor::empty(spec_.shape, spec_.dtype, values_[l].device()));
    values_[l].copy_from(value.to(values_[l].device()));
    parts_[l] = ValuePart{};
  }
  return true;
}

Tensor MirroredVariable::assemble() const {
  const int parts = parts_[0].parts;
  if (static_cast<size_t>(parts) != parts_.size() && gatherer_.expired())
    throw FailedPrecondition(
        "variable '" + name() + "' is sharded across " + std::to_string(parts) +
        " replicas of several workers (Sharding::kParameters) and its strategy has been destroyed: "
        "this process holds only its own parts. Read the model, or save a checkpoint "
        "(Checkpoint(model, optimizer, &strategy).save), while the strategy lives");
  if (static_cast<size_t>(parts) != parts_.size())
    throw FailedPrecondition(
        "variable '" + name() + "' is sharded across " + std::to_string(parts) +
        " replicas of several workers (Sharding::kParameters): read its whole value inside "
        "strategy.run() (a layer that gathers it), or save a checkpoint and restore it unsharded");
  Tensor whole = Tensor::empty(spec_.shape, spec_.dtype, values_[0].device());
  Tensor flat = whole.view(Shape{whole.numel()});
  for (const ValuePart& p : parts_)
    if (p.value.numel() > 0) flat.slice_rows(p.first, p.first + p.value.numel()).copy_from(p.value);
  return whole;
}

void MirroredVariable::write(const Tensor& v, Kind kind) {
  check_same(*this, v,
             kind == Kind::kAssign ? "assign"
             : kind == Kind::kAdd  ? "assign_add"
                                   : "assign_sub");
  const int sign = kind == Kind::kAssign ? 0 : kind == Kind::kAdd ? 1 : -1;
  bool partial = false;  // some copy holds only its part (Sharding::kParameters)
  for (size_t l = 0; l < parts_.size(); ++l) partial = partial || holds_part(l);
  if (partial) {
    if (my_replica())
      throw FailedPrecondition("variable '" + name() +
                               "' is sharded across replicas (Sharding::kParameters): assign it "
                               "in cross-replica context (outside strategy.run())");
    if (sign == 0) {
      // A whole value: every copy becomes whole again, as a new variable is, and its part is
      // dropped; the next release cuts the part for the strategy's partition then. Every worker
      // that restores a checkpoint so ends in the same state (an elastic job's newcomers too, and
      // after the job re-formed with another number of replicas).
      for (size_t l = 0; l < parts_.size(); ++l) {
        if (!values_[l].has_memory())
          values_[l].adopt_memory(Tensor::empty(spec_.shape, spec_.dtype, values_[l].device()));
        values_[l].copy_from(combine(values_[l], v, 0));
        parts_[l] = ValuePart{};
      }
      return;
    }
    // An increment: each copy's part takes its range of it; whole copies (gathered) follow.
    const Tensor flat_v = v.view(Shape{v.numel()});
    // (With the strategy gone, no partition to check against: the parts are what this process has.)
    const std::optional<UpdatePartition> now =
        gatherer_.expired() ? std::nullopt : owner_->update_partition();
    for (size_t l = 0; l < parts_.size(); ++l) {
      ValuePart& p = parts_[l];
      if (p.value.defined() && now && l < now->local_parts.size() &&
          (p.parts != now->num_parts || p.part != now->local_parts[l]))
        throw FailedPrecondition(
            "variable '" + name() + "' holds its part of " + std::to_string(p.parts) +
            " (Sharding::kParameters) but the strategy now has " + std::to_string(now->num_parts) +
            " replicas: assign() it whole (restore a checkpoint) first");
      if (p.value.defined() && p.value.numel() > 0)
        p.value.copy_from(
            combine(p.value, flat_v.slice_rows(p.first, p.first + p.value.numel()), sign));
      if (values_[l].has_memory()) values_[l].copy_from(combine(values_[l], v, sign));
    }
    return;
  }
  if (ReplicaContext* ctx = my_replica()) {
    Tensor& mine = values_[local(*ctx)];
    Tensor local = v.to(mine.device());
    if (!on_read() && ctx->num_replicas_in_sync() > 1)
      local = aggregate_in_replica(*ctx, *this, local);
    if (!shared_) {
      mine.copy_from(combine(mine, local, sign));
      return;
    }
    // One block for every replica: all read it, then replica 0 writes, then all go on.
    const Tensor next = combine(mine, local, sign).clone();
    auto& mirrored = static_cast<MirroredReplicaContext&>(*ctx);
    mirrored.barrier();
    if (mirrored.local_replica() == 0) mine.copy_from(next);
    mirrored.barrier();
    return;
  }
  // Cross-replica: write every copy. A SUM sync-on-read variable splits the value so that the
  // aggregate reads back as written.
  Tensor per = v;
  if (on_read() && spec_.aggregation == VariableAggregation::kSum && sign == 0 &&
      values_.size() > 1)
    per = kernels_for(v).affine(v, 1.f / static_cast<float>(values_.size()), 0.f);
  for (size_t i = 0; i < (shared_ ? 1 : values_.size()); ++i)
    values_[i].copy_from(combine(values_[i], per, sign));
}

void MirroredVariable::do_update(const std::function<void(Tensor&, size_t)>& fn) {
  if (ReplicaContext* ctx = my_replica()) {
    const size_t r = local(*ctx);
    auto& mirrored = static_cast<MirroredReplicaContext&>(*ctx);
    if (holds_part(r)) {       // a sharded update writes the replica's part (flat); a whole value
      fn(parts_[r].value, r);  // gathered meanwhile is released at the update's end
      return;
    }
    if (!shared_ || mirrored.in_sharded_update()) {
      fn(values_[r], r);
      return;
    }
    // A whole-variable update of the one block: once, by replica 0, after every replica has
    // stopped reading the old value and before any reads the new one.
    mirrored.barrier();
    if (r == 0) fn(values_[0], 0);
    mirrored.barrier();
    return;
  }
  if (holds_part(0) && gatherer_.expired())
    throw FailedPrecondition(
        "variable '" + name() +
        "' holds only this process's part (Sharding::kParameters) and its strategy has been "
        "destroyed, which held the others: restore a checkpoint into it (assign) first");
  if (holds_part(0))
    throw FailedPrecondition("variable '" + name() +
                             "' is sharded across replicas (Sharding::kParameters): update it in "
                             "replica context, or assign() it");
  for (size_t i = 0; i < (shared_ ? 1 : values_.size()); ++i) fn(values_[i], i);
}

// --- CentralVariable ---

CentralVariable::CentralVariable(VariableSpec spec, const Strategy* owner,
                                 DeviceSpec parameter_device, size_t replicas)
    : Variable(std::move(spec)), owner_(owner), cache_(replicas) {
  Tensor init = spec_.initializer(spec_.shape, spec_.dtype, parameter_device);
  if (init.shape() != spec_.shape || init.dtype() != spec_.dtype)
    throw InvalidArgument("initializer of variable '" + spec_.name + "' returned " +
                          init.to_string());
  storage_ = Tensor::empty(spec_.shape, spec_.dtype, parameter_device);
  storage_.copy_from(init);
}

ReplicaContext* CentralVariable::my_replica() const {
  ReplicaContext* ctx = get_replica_context();
  return ctx && &ctx->strategy() == owner_ ? ctx : nullptr;
}

Tensor CentralVariable::read_value() const {
  ReplicaContext* ctx = my_replica();
  if (!ctx) return storage_;
  // One copy per replica per version: the tape sees the same tensor for every read in a step.
  Cached& c = cache_[static_cast<size_t>(ctx->replica_id_in_sync_group())];
  const uint64_t v = version_.load(std::memory_order_acquire);
  if (c.version != v) {
    // A fresh tensor (and identity) each version, so a tape never confuses two steps' reads.
    Tensor fresh = Tensor::empty(spec_.shape, spec_.dtype, ctx->device());
    fresh.copy_from(storage_);
    fresh.set_trainable_variable(spec_.trainable);
    c.copy = fresh;
    c.version = v;
  }
  return c.copy;
}

void CentralVariable::write(const Tensor& v, int sign) {
  check_same(*this, v, sign == 0 ? "assign" : sign > 0 ? "assign_add" : "assign_sub");
  if (ReplicaContext* ctx = my_replica()) {
    Tensor local = v.to(ctx->device());
    if (ctx->num_replicas_in_sync() > 1) local = aggregate_in_replica(*ctx, *this, local);
    if (ctx->replica_id_in_sync_group() == 0) {  // applied once, to the central copy
      storage_.copy_from(combine(storage_, local, sign));
      version_.fetch_add(1, std::memory_order_release);
    }
    return;
  }
  storage_.copy_from(combine(storage_, v, sign));
  version_.fetch_add(1, std::memory_order_release);
}

void CentralVariable::do_update(const std::function<void(Tensor&, size_t)>& fn) {
  ReplicaContext* ctx = my_replica();
  if (ctx && ctx->replica_id_in_sync_group() != 0) return;  // the others' gradients are identical
  fn(storage_, 0);
  version_.fetch_add(1, std::memory_order_release);
}

}  // namespace dtrain
