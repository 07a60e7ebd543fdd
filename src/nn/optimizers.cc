#include "dtrain/nn/optimizers.h"

#include <algorithm>
#include <cmath>

#include "dtrain/devices/device.h"
#include "dtrain/model/initializers.h"
#include "dtrain/strategies/strategy.h"
#include "model/config_line.h"

namespace dtrain {

using detail::kv;

namespace {

void check_options(const OptimizerOptions& o) {
  auto nonneg = [](float v, const char* what) {
    if (!(v >= 0.f))
      throw InvalidArgument(std::string(what) + " must be >= 0, got " + std::to_string(v));
  };
  nonneg(o.weight_decay, "weight_decay");
  nonneg(o.clipnorm, "clipnorm");
  nonneg(o.clipvalue, "clipvalue");
  nonneg(o.global_clipnorm, "global_clipnorm");
  if (o.clipnorm > 0.f && o.global_clipnorm > 0.f)
    throw InvalidArgument(
        "clipnorm and global_clipnorm are exclusive (as in Keras): set one of them");
}

// Sum of squares of every element, in double (host).
double squared_norm(const Tensor& g) {
  Kernels& k = kernels_for(g);
  std::vector<int> axes(static_cast<size_t>(g.shape().rank()));
  for (size_t i = 0; i < axes.size(); ++i) axes[i] = static_cast<int>(i);
  const Tensor sum = k.reduce(ReductionKind::kSum, k.unary(UnaryOp::kSquare, g), axes, false);
  return static_cast<double>(sum.to(DeviceSpec::cpu()).to_vector<float>().at(0));
}

}  // namespace

Optimizer::Optimizer(std::shared_ptr<const UpdateRule> rule,
                     std::shared_ptr<LearningRateSchedule> schedule, OptimizerOptions options)
    : rule_(std::move(rule)), schedule_(std::move(schedule)), options_(options) {
  if (!rule_) throw InvalidArgument("optimizer: the update rule is null");
  if (!schedule_) throw InvalidArgument("optimizer: the learning-rate schedule is null");
  check_options(options_);
}

float Optimizer::learning_rate() const { return (*schedule_)(iterations()); }
void Optimizer::set_learning_rate(float lr) { schedule_ = std::make_shared<ConstantSchedule>(lr); }
void Optimizer::set_schedule(std::shared_ptr<LearningRateSchedule> s) {
  if (!s) throw InvalidArgument("set_schedule: the schedule is null");
  schedule_ = std::move(s);
}

std::vector<std::shared_ptr<Variable>>& Optimizer::slots_for(const Variable* v) {
  // Caller holds mu_.
  auto it = slot_index_.find(v);
  if (it != slot_index_.end()) return slots_[it->second];
  std::vector<std::shared_ptr<Variable>> s;
  const std::vector<std::string> names = rule_->slot_names();
  for (size_t i = 0; i < names.size(); ++i) {
    VariableSpec spec;
    spec.name = "optimizer/" + v->name() + "/" + names[i];
    spec.shape = v->shape();
    spec.initializer = initializers::constant(slot_initial_value(static_cast<int>(i)));
    spec.trainable = false;
    s.push_back(create_variable(spec));
  }
  slot_index_.emplace(v, slots_.size());
  slots_.push_back(std::move(s));
  return slots_.back();
}

Optimizer::PartSlots& Optimizer::part_slots_for(const Variable& v, int part, int parts,
                                                const DeviceSpec& device) {
  auto it = part_index_.find(&v);
  if (it == part_index_.end()) {
    it = part_index_.emplace(&v, part_slots_.size()).first;
    part_slots_.push_back(VariableParts{v.name(), v.shape(), {}});
  }
  VariableParts& vp = part_slots_[it->second];
  for (PartSlots& p : vp.parts) {
    if (p.parts != parts)
      throw FailedPrecondition(
          "optimizer slots of '" + v.name() + "' are sharded " + std::to_string(p.parts) +
          " ways, but the strategy now divides updates " + std::to_string(parts) +
          " ways (the job re-formed): restore the optimizer from a checkpoint "
          "(BackupAndRestore does) after the workers change");
    if (p.part == part) return p;
  }
  PartSlots p;
  p.part = part;
  p.parts = parts;
  const auto [first, last] = partition_range(v.shape().numel(), part, parts);
  p.first = first;
  p.count = last - first;
  for (int i = 0; i < slots_per_variable(); ++i)
    p.slots.push_back(Tensor::full(Shape{p.count}, slot_initial_value(i)).to(device));
  vp.parts.push_back(std::move(p));
  return vp.parts.back();
}

void Optimizer::build(const std::vector<std::shared_ptr<Variable>>& vars) {
  const std::optional<UpdatePartition> partition = get_strategy().update_partition();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& v : vars) {
    if (v->updates_remotely()) continue;
    if (!partition) {
      slots_for(v.get());
      continue;
    }
    for (size_t j = 0; j < partition->local_parts.size(); ++j)
      part_slots_for(*v, partition->local_parts[j], partition->num_parts, partition->devices[j]);
  }
}

std::vector<Optimizer::SlotShard> Optimizer::slot_shards() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SlotShard> out;
  const std::vector<std::string> names = rule_->slot_names();
  for (const VariableParts& vp : part_slots_)
    for (size_t i = 0; i < names.size(); ++i)
      for (const PartSlots& p : vp.parts)
        out.push_back(SlotShard{"optimizer/" + vp.name + "/" + names[i], vp.shape, p.part, p.parts,
                                p.first, p.slots[i]});
  return out;
}

bool Optimizer::repartition_slots() {
  const std::optional<UpdatePartition> partition = get_strategy().update_partition();
  std::lock_guard<std::mutex> lock(mu_);
  bool dropped = false;
  for (VariableParts& vp : part_slots_) {
    bool stale = false;
    for (const PartSlots& p : vp.parts)
      stale = stale || !partition || p.parts != partition->num_parts ||
              std::find(partition->local_parts.begin(), partition->local_parts.end(), p.part) ==
                  partition->local_parts.end();
    if (stale) vp.parts.clear();
    dropped = dropped || stale;
  }
  return dropped;
}

int64_t Optimizer::iterations() const {
  std::lock_guard<std::mutex> lock(mu_);
  // This process's first replica (replica ids start at worker rank x local replicas elsewhere than
  // on the chief of a multi-worker job).
  return steps_.empty() ? base_iterations_ : steps_.begin()->second;
}

void Optimizer::set_iterations(int64_t n) {
  if (n < 0)
    throw InvalidArgument("set_iterations: the count must be >= 0, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mu_);
  base_iterations_ = n;
  for (auto& [replica, steps] : steps_) steps = n;
}

std::vector<std::shared_ptr<Variable>> Optimizer::slot_variables() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Variable>> out;
  for (const auto& s : slots_) out.insert(out.end(), s.begin(), s.end());
  return out;
}

namespace {
void clip_by_value(std::vector<Tensor>& g, float c) {
  if (c > 0.f)
    for (Tensor& t : g)
      if (t.defined()) {
        Kernels& k = kernels_for(t);
        const Tensor hi = Tensor::full(Shape{1}, c).to(t.device());
        const Tensor lo = Tensor::full(Shape{1}, -c).to(t.device());
        t = k.binary(BinaryOp::kMax, k.binary(BinaryOp::kMin, t, hi), lo);
      }
}
}  // namespace

std::vector<float> Optimizer::clip(std::vector<Tensor>& g) const {
  const OptimizerOptions& o = options_;
  clip_by_value(g, o.clipvalue);
  std::vector<float> scale(g.size(), 1.f);
  if (o.clipnorm == 0.f && o.global_clipnorm == 0.f) return scale;
  std::vector<double> sq(g.size(), 0.0);
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i].defined()) sq[i] = squared_norm(g[i]);
  if (o.clipnorm > 0.f)
    for (size_t i = 0; i < g.size(); ++i) {
      const double norm = std::sqrt(sq[i]);
      if (g[i].defined() && norm > o.clipnorm) {
        scale[i] = static_cast<float>(o.clipnorm / norm);
        sq[i] *= static_cast<double>(scale[i]) * scale[i];  // the global norm sees clipped ones
      }
    }
  if (o.global_clipnorm > 0.f) {
    double total = 0;
    for (double v : sq) total += v;
    const double norm = std::sqrt(total);
    if (norm > o.global_clipnorm)
      for (float& s : scale) s *= static_cast<float>(o.global_clipnorm / norm);
  }
  return scale;
}

void Optimizer::apply_dense(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots,
                            int64_t step, float lr) {
  rule_->apply(value, grad, slots, step, lr, options_.weight_decay);
}

float Optimizer::weight_decay_for(const Variable& variable) const {
  for (const std::string& part : decay_excluded_)
    if (variable.name().find(part) != std::string::npos) return 0.f;
  return options_.weight_decay;
}

void Optimizer::apply_gradients(const std::vector<Tensor>& grads,
                                const std::vector<std::shared_ptr<Variable>>& vars) {
  if (grads.size() != vars.size())
    throw InvalidArgument("apply_gradients: " + std::to_string(grads.size()) + " gradients for " +
                          std::to_string(vars.size()) + " variables");
  for (size_t i = 0; i < vars.size(); ++i)
    if (grads[i].defined() && grads[i].shape() != vars[i]->shape())
      throw InvalidArgument("apply_gradients: gradient " + grads[i].shape().to_string() +
                            " for variable '" + vars[i]->name() + "' of shape " +
                            vars[i]->shape().to_string());

  ReplicaContext* ctx = get_replica_context();
  if (ctx && ctx->strategy().update_partition()) {
    apply_partitioned(*ctx, grads, vars);
    return;
  }
  std::vector<Tensor> g = grads;
  // Replicas that share their variables' memory each update a slice of every variable (clipping by
  // norm and aggregators see whole gradients, so those keep the whole-variable update).
  if (ctx && ctx->num_replicas_in_sync() > 1 && !aggregator_ && options_.clipnorm == 0.f &&
      options_.global_clipnorm == 0.f) {
    std::vector<Tensor> defined;
    std::vector<std::shared_ptr<Variable>> owners;
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i].defined()) {
        defined.push_back(g[i]);
        owners.push_back(vars[i]);
      }
    if (!defined.empty())
      if (std::optional<ReplicaContext::UpdateSlices> slices =
              ctx->reduce_scatter_for_update(defined, owners)) {
        apply_slices(*ctx, slices->grads, slices->offsets, owners);
        return;
      }
  }
  if (ctx && ctx->num_replicas_in_sync() > 1) {
    // Sum across replicas (losses are already scaled by the global batch).
    std::vector<Tensor> defined;
    std::vector<size_t> where;
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i].defined()) {
        defined.push_back(g[i]);
        where.push_back(i);
      }
    std::vector<Tensor> reduced = ctx->all_reduce(ReduceOp::kSum, defined);
    for (size_t j = 0; j < where.size(); ++j) g[where[j]] = reduced[j];
  }
  if (aggregator_) {
    std::optional<std::vector<Tensor>> aggregated = aggregator_(std::move(g));
    if (!aggregated) return;  // accumulating: nothing applied this call
    g = std::move(*aggregated);
    if (g.size() != vars.size())
      throw Internal("the gradient aggregator returned " + std::to_string(g.size()) +
                     " gradients for " + std::to_string(vars.size()) + " variables");
  }
  const std::vector<float> scale = clip(g);
  const int replica = ctx ? ctx->replica_id_in_sync_group() : 0;
  int64_t step;
  std::vector<std::vector<std::shared_ptr<Variable>>*> slot_lists;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, fresh] = steps_.try_emplace(replica, base_iterations_);
    step = ++it->second;
    for (const auto& v : vars)
      slot_lists.push_back(v->updates_remotely() ? nullptr : &slots_for(v.get()));
  }
  const float lr = (*schedule_)(step - 1);
  for (size_t i = 0; i < vars.size(); ++i) {
    if (!g[i].defined()) continue;
    const Tensor& grad = g[i];
    const float decay = weight_decay_for(*vars[i]);
    if (!slot_lists[i]) {  // the variable lives on a parameter server, which applies the update
      vars[i]->apply_remote_update(
          name() + kv("learning_rate", lr) + rule_->hyper_config() + kv("weight_decay", decay),
          scale[i] == 1.f ? grad : kernels_for(grad).affine(grad, scale[i], 0.f));
      continue;
    }
    vars[i]->update([&](Tensor& value, size_t copy) {
      std::vector<Tensor> slots;
      for (const auto& s : *slot_lists[i]) slots.push_back(s->device_values().at(copy));
      rule_->apply(value, grad.device() == value.device() ? grad : grad.to(value.device()), slots,
                   step, lr, decay, scale[i]);
    });
  }
}

void Optimizer::apply_partitioned(ReplicaContext& ctx, const std::vector<Tensor>& grads,
                                  const std::vector<std::shared_ptr<Variable>>& vars) {
  if (aggregator_)
    throw FailedPrecondition(
        "a gradient aggregator (hvd::DistributedOptimizer, or one set with "
        "set_gradient_aggregator) sees whole gradients, but this strategy shards the optimizer's "
        "update (MirroredOptions::sharding): use one or the other");
  std::vector<Tensor> defined;
  std::vector<std::shared_ptr<Variable>> owners;
  for (size_t i = 0; i < grads.size(); ++i)
    if (grads[i].defined()) {
      defined.push_back(grads[i]);
      owners.push_back(vars[i]);
    }
  std::optional<ReplicaContext::UpdateSlices> slices =
      ctx.reduce_scatter_for_update(defined, owners);
  if (!slices)
    throw Internal(
        "the strategy shards the update (update_partition) but its replica context "
        "returned no slices");
  apply_slices(ctx, slices->grads, slices->offsets, owners, /*partitioned=*/true);
}

std::vector<float> Optimizer::clip_parts(ReplicaContext& ctx, std::vector<Tensor>& g) const {
  const OptimizerOptions& o = options_;
  clip_by_value(g, o.clipvalue);  // first, as clip() does
  std::vector<float> scale(g.size(), 1.f);
  if (o.clipnorm == 0.f && o.global_clipnorm == 0.f) return scale;
  // Squares summed per part here, then across the replicas (float64: the parts' sums are exact
  // enough that the norm does not depend on the shard count beyond float rounding).
  std::vector<double> sq(g.size(), 0.0);
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i].numel() > 0) sq[i] = squared_norm(g[i]);
  std::vector<double> totals;
  if (o.global_clipnorm > 0.f) {
    double mine = 0;
    for (double v : sq) mine += v;
    totals = {mine};
  } else {
    totals = sq;
  }
  if (!totals.empty()) {
    Tensor t =
        Tensor::from_vector(totals, Shape{static_cast<int64_t>(totals.size())}).to(ctx.device());
    totals = ctx.all_reduce(ReduceOp::kSum, {t}).at(0).to(DeviceSpec::cpu()).to_vector<double>();
  }
  for (size_t i = 0; i < g.size(); ++i) {
    const double norm = std::sqrt(o.global_clipnorm > 0.f ? totals.at(0) : totals.at(i));
    const double limit = o.global_clipnorm > 0.f ? o.global_clipnorm : o.clipnorm;
    if (norm > limit && g[i].numel() > 0) scale[i] = static_cast<float>(limit / norm);
  }
  return scale;
}

void Optimizer::apply_slices(ReplicaContext& ctx, const std::vector<Tensor>& grads,
                             const std::vector<int64_t>& offsets,
                             const std::vector<std::shared_ptr<Variable>>& vars, bool partitioned) {
  // As apply_gradients, on flat slices: every rule here is elementwise, and clipvalue too.
  if (grads.size() != vars.size() || offsets.size() != vars.size())
    throw Internal("reduce_scatter_for_update returned " + std::to_string(grads.size()) +
                   " slices for " + std::to_string(vars.size()) + " variables");
  std::vector<Tensor> g = grads;
  const std::vector<float> scale = partitioned ? clip_parts(ctx, g) : clip(g);
  int64_t step;
  std::vector<std::vector<std::shared_ptr<Variable>>*> slot_lists;
  std::vector<PartSlots*> parts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, fresh] = steps_.try_emplace(ctx.replica_id_in_sync_group(), base_iterations_);
    step = ++it->second;
    for (size_t i = 0; i < vars.size(); ++i) {
      if (!partitioned) {
        slot_lists.push_back(&slots_for(vars[i].get()));
        continue;
      }
      if (slot_index_.count(vars[i].get()))
        throw FailedPrecondition(
            "the optimizer holds whole slots for '" + vars[i]->name() +
            "', but its strategy shards the update (MirroredOptions::sharding): build the "
            "optimizer (optimizer.build, or its first apply_gradients) inside strategy.scope()");
      PartSlots& p = part_slots_for(*vars[i], ctx.replica_id_in_sync_group(),
                                    ctx.num_replicas_in_sync(), ctx.device());
      if (p.first != offsets[i] || p.count != g[i].numel())
        throw Internal("the update slice of '" + vars[i]->name() + "' starts at " +
                       std::to_string(offsets[i]) + " with " + std::to_string(g[i].numel()) +
                       " elements; its part is " + std::to_string(p.first) + " + " +
                       std::to_string(p.count));
      parts.push_back(&p);
    }
  }
  const float lr = (*schedule_)(step - 1);
  auto part = [](const Tensor& whole, int64_t offset, int64_t count) {
    return whole.view(Shape{whole.numel()}).slice_rows(offset, offset + count);
  };
  try {
    for (size_t i = 0; i < vars.size(); ++i) {
      const int64_t count = g[i].numel(), offset = offsets[i];
      if (count == 0) continue;
      vars[i]->update([&](Tensor& value, size_t copy) {
        // A variable sharded across replicas (Sharding::kParameters) hands its part alone.
        Tensor mine =
            value.numel() == count ? value.view(Shape{count}) : part(value, offset, count);
        std::vector<Tensor> slots;
        if (partitioned)
          slots = parts[i]->slots;
        else
          for (const auto& s : *slot_lists[i])
            slots.push_back(part(s->device_values().at(copy), offset, count));
        rule_->apply(mine, g[i].device() == value.device() ? g[i] : g[i].to(value.device()), slots,
                     step, lr, weight_decay_for(*vars[i]), scale[i]);
      });
    }
  } catch (...) {
    try {  // the other replicas are waiting for this one's slices; the first error is the one to
           // report
      ctx.end_sharded_update();
    } catch (...) {
    }
    throw;
  }
  ctx.end_sharded_update();
}

std::string Optimizer::config() const {
  return name() + kv("learning_rate", learning_rate()) + rule_->hyper_config() +
         kv("weight_decay", options_.weight_decay) + kv("clipnorm", options_.clipnorm) +
         kv("clipvalue", options_.clipvalue) + kv("global_clipnorm", options_.global_clipnorm);
}

std::unique_ptr<Optimizer> Optimizer::from_config(const std::string& config) {
  UpdateConfig c = parse_update_config(config);
  OptimizerOptions o;
  o.weight_decay = c.weight_decay;
  o.clipnorm = c.clipnorm;
  o.clipvalue = c.clipvalue;
  o.global_clipnorm = c.global_clipnorm;
  try {
    return std::make_unique<Optimizer>(std::move(c.rule),
                                       std::make_shared<ConstantSchedule>(c.learning_rate), o);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("malformed optimizer config '" + config + "': " + e.what());
  }
}

float scale_learning_rate(float lr, int num_replicas_in_sync) {
  if (num_replicas_in_sync < 1)
    throw InvalidArgument("scale_learning_rate: num_replicas_in_sync must be >= 1, got " +
                          std::to_string(num_replicas_in_sync));
  return lr * static_cast<float>(num_replicas_in_sync);
}

}  // namespace dtrain
