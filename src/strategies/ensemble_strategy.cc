#include "dtrain/strategies/ensemble_strategy.h"

#include <algorithm>
#include <exception>
#include <future>

#include "dtrain/devices/device.h"
#include "strategies/cross_worker.h"
#include "strategies/replica_scope.h"
#include "strategies/solo_replica_context.h"

namespace dtrain {
namespace {

class EnsemblePolicy final : public TrainingPolicy {
 public:
  bool independent_replicas() const override { return true; }
};

// One copy per member; a member reads and writes its own, cross-replica reads see member 0 and
// cross-replica writes go to every member.
class EnsembleVariable final : public Variable {
 public:
  EnsembleVariable(VariableSpec spec, std::vector<Tensor> copies)
      : Variable(std::move(spec)), copies_(std::move(copies)) {
    for (Tensor& c : copies_)
      c.set_trainable_variable(spec_.trainable);  // the tape watches it when read
  }
  std::vector<Tensor> device_values() const override { return copies_; }

 protected:
  Tensor read_value() const override { return copies_[member()]; }
  void do_assign(const Tensor& v) override {
    check(v, "assign");
    for_each([&](Tensor& c) { c.copy_from(v.to(c.device())); });
  }
  void do_assign_add(const Tensor& d) override {
    check(d, "assign_add");
    for_each([&](Tensor& c) {
      c.copy_from(kernels_for(c).binary(BinaryOp::kAdd, c, d.to(c.device())));
    });
  }
  void do_assign_sub(const Tensor& d) override {
    check(d, "assign_sub");
    for_each([&](Tensor& c) {
      c.copy_from(kernels_for(c).binary(BinaryOp::kSub, c, d.to(c.device())));
    });
  }
  void do_update(const std::function<void(Tensor& value, size_t copy_index)>& fn) override {
    if (in_member()) {
      const size_t m = member();
      fn(copies_[m], m);
      return;
    }
    for (size_t m = 0; m < copies_.size(); ++m) fn(copies_[m], m);
  }

 private:
  // Inside this strategy's run(): a member's own copy; otherwise (cross-replica) member 0 / all.
  bool in_member() const {
    const VariableCreator* running = detail::running_creator();
    return running && running->instance_id() == strategy_id() && strategy_id() != 0;
  }
  size_t member() const {
    if (!in_member()) return 0;
    ReplicaContext* ctx = get_replica_context();
    return ctx ? static_cast<size_t>(ctx->replica_id_in_sync_group()) : 0;
  }
  template <typename F>
  void for_each(F f) {
    if (in_member()) {
      f(copies_[member()]);
      return;
    }
    for (Tensor& c : copies_) f(c);
  }
  void check(const Tensor& v, const char* what) const {
    if (v.shape() != shape() || v.dtype() != dtype())
      throw InvalidArgument(std::string(what) + " of " + v.to_string() + " to variable '" + name() +
                            "' of " + dtype_name(dtype()) + " " + shape().to_string());
  }
  std::vector<Tensor> copies_;
};

}  // namespace

// A member: its own sync group of one, whose replica id is the member index.
class EnsembleStrategy::Context final : public detail::SoloReplicaContext {
 public:
  Context(Strategy* s, int member, DeviceSpec d) : SoloReplicaContext(s, member, d) {}
};

EnsembleStrategy::EnsembleStrategy(std::vector<DeviceSpec> devices) : devices_(std::move(devices)) {
  make_contexts();
  assemble(StrategyExtended(std::nullopt, nullptr, std::make_shared<EnsemblePolicy>()));
}

EnsembleStrategy::EnsembleStrategy(std::vector<DeviceSpec> devices, ClusterResolution cluster,
                                   CommunicationOptions communication, std::string token)
    : devices_(std::move(devices)) {
  make_contexts();
  cluster = detail::training_worker(std::move(cluster), communication.implementation, "ensemble");
  std::shared_ptr<CrossWorkerOps> cross;
  if (cluster.num_workers() > 1) {
    cross = detail::connect_cross_worker(devices_, communication, cluster, std::move(token));
    // Member numbers are worker * L + i: every worker must hold the same number L of members.
    Tensor counts = Tensor::zeros(Shape{cluster.num_workers()}, DType::kFloat64);
    static_cast<double*>(counts.raw_data())[cluster.worker_rank()] =
        static_cast<double>(devices_.size());
    cross->all_reduce_sum(counts);
    const std::vector<double> c = counts.to_vector<double>();
    std::string table;
    bool differ = false;
    for (size_t w = 0; w < c.size(); ++w) {
      differ = differ || c[w] != c[0];
      table += (w ? ", " : "") + std::string("worker ") + std::to_string(w) + ": " +
               std::to_string(static_cast<int>(c[w]));
    }
    if (differ)
      throw FailedPrecondition(
          "ensemble across workers: every worker must have the same number of devices (one "
          "member each), but they have " +
          table + "; pass the same --devices to every worker");
  }
  assemble(
      StrategyExtended(std::move(cluster), std::move(cross), std::make_shared<EnsemblePolicy>()));
}

void EnsembleStrategy::make_contexts() {
  if (devices_.empty())
    throw InvalidArgument("EnsembleStrategy needs at least one device (one per member)");
  for (size_t i = 0; i < devices_.size(); ++i) {
    for (size_t j = 0; j < i; ++j)
      if (devices_[i] == devices_[j])
        throw InvalidArgument(
            "EnsembleStrategy: device " + devices_[i].to_string() +
            " is listed twice; each member needs its own device (--devices=cpu:N)");
    get_device(devices_[i]);  // NotFound, with the device list, now
    contexts_.push_back(std::make_unique<Context>(this, static_cast<int>(i), devices_[i]));
  }
}

EnsembleStrategy::~EnsembleStrategy() = default;

std::string EnsembleStrategy::name() const {
  std::string s = "EnsembleStrategy(";
  s += std::to_string(num_members());
  s += " member(s)";
  if (extended().num_workers() > 1)
    s += ", members " + std::to_string(first_member()) + ".." +
         std::to_string(first_member() + static_cast<int>(devices_.size()) - 1) + " on worker " +
         std::to_string(extended().worker_rank()) + " of " +
         std::to_string(extended().num_workers());
  s += ":";
  for (const auto& d : devices_) {
    s += ' ';
    s += d.to_string();
  }
  s += ')';
  return s;
}

std::shared_ptr<Variable> EnsembleStrategy::do_create_variable(const VariableSpec& spec) {
  std::vector<Tensor> copies;
  for (size_t m = 0; m < devices_.size(); ++m) {
    // Member g draws from branch g of the initializer's random stream (member 0: the stream
    // itself).
    set_initializer_branch(static_cast<uint64_t>(first_member()) + m);
    Tensor init;
    try {
      init = spec.initializer(spec.shape, spec.dtype, devices_[m]);
    } catch (...) {
      set_initializer_branch(0);
      throw;
    }
    set_initializer_branch(0);
    if (!init.defined() || init.shape() != spec.shape || init.dtype() != spec.dtype)
      throw InvalidArgument("initializer of variable '" + spec.name + "' returned " +
                            init.to_string());
    copies.push_back(init.to(devices_[m]).clone());
  }
  return std::make_shared<EnsembleVariable>(spec, std::move(copies));
}

PerReplica EnsembleStrategy::do_run(const ReplicaFn& fn, const PerReplica& inputs) {
  const size_t n = devices_.size();
  PerReplica out;
  out.values.resize(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::future<void>> done;
  for (size_t m = 0; m < n; ++m) {
    done.push_back(get_device(devices_[m]).submit([&, m] {
      try {
        std::vector<Tensor> in;
        if (!inputs.values.empty())
          for (const auto& t : inputs.values.at(m))
            in.push_back(t.defined() ? t.to(devices_[m]) : t);
        detail::ReplicaThreadScope scope(this, contexts_[m].get());
        out.values[m] = fn(*contexts_[m], in);
      } catch (...) {
        errors[m] = std::current_exception();
      }
    }));
  }
  for (auto& f : done) f.get();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

PerReplica EnsembleStrategy::do_split_batch(const std::vector<Tensor>& batch, int64_t,
                                            const BatchRows&) {
  PerReplica out;
  for (const auto& d : devices_) {
    std::vector<Tensor> mine;
    for (const auto& t : batch) mine.push_back(t.share_to(d));
    out.values.push_back(std::move(mine));
  }
  out.global_rows = batch.empty() ? 0 : batch[0].shape()[0];  // each member's rows
  return out;
}

}  // namespace dtrain
