#include "dtrain/model/optimizers.h"

#include <cstdio>
#include <sstream>

#include "dtrain/devices/device.h"
#include "dtrain/model/initializers.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

Optimizer::Optimizer(float lr) : lr_(lr) {
  if (!(lr > 0.f)) throw InvalidArgument("learning rate must be > 0, got " + std::to_string(lr));
}

std::vector<std::shared_ptr<Variable>>& Optimizer::slots_for(const Variable* v) {
  // Caller holds mu_.
  auto it = slots_.find(v);
  if (it != slots_.end()) return it->second;
  std::vector<std::shared_ptr<Variable>> s;
  for (int i = 0; i < num_slots(); ++i) {
    VariableSpec spec;
    spec.name = v->name() + "/slot" + std::to_string(i);
    spec.shape = v->shape();
    spec.initializer = initializers::zeros();
    spec.trainable = false;
    s.push_back(create_variable(spec));
  }
  return slots_.emplace(v, std::move(s)).first->second;
}

void Optimizer::build(const std::vector<std::shared_ptr<Variable>>& vars) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& v : vars)
    if (!v->updates_remotely()) slots_for(v.get());
}

int64_t Optimizer::iterations() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = steps_.find(0);
  return it == steps_.end() ? 0 : it->second;
}

std::vector<std::shared_ptr<Variable>> Optimizer::slot_variables() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Variable>> out;
  for (const auto& [v, s] : slots_) out.insert(out.end(), s.begin(), s.end());
  return out;
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
  std::vector<Tensor> g = grads;
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
  const int replica = ctx ? ctx->replica_id_in_sync_group() : 0;
  int64_t step;
  std::vector<std::vector<std::shared_ptr<Variable>>*> slot_lists;
  {
    std::lock_guard<std::mutex> lock(mu_);
    step = ++steps_[replica];
    for (const auto& v : vars) slot_lists.push_back(v->updates_remotely() ? nullptr : &slots_for(v.get()));
  }
  std::string remote_config;
  for (size_t i = 0; i < vars.size(); ++i) {
    if (!g[i].defined()) continue;
    const Tensor& grad = g[i];
    if (!slot_lists[i]) {  // the variable lives on a parameter server, which applies the update
      if (remote_config.empty()) remote_config = config();
      vars[i]->apply_remote_update(remote_config, grad);
      continue;
    }
    vars[i]->update([&](Tensor& value, size_t copy) {
      std::vector<Tensor> slots;
      for (const auto& s : *slot_lists[i]) slots.push_back(s->device_values().at(copy));
      update(value, grad.device() == value.device() ? grad : grad.to(value.device()), slots, step);
    });
  }
}

namespace {

std::string format_floats(const std::string& name, std::initializer_list<double> values) {
  std::string out = name;
  char buf[32];
  for (double v : values) {
    std::snprintf(buf, sizeof(buf), " %.9g", v);
    out += buf;
  }
  return out;
}

}  // namespace

std::unique_ptr<Optimizer> Optimizer::from_config(const std::string& config) {
  std::istringstream in(config);
  std::string name;
  in >> name;
  std::vector<double> v;
  double x;
  while (in >> x) v.push_back(x);
  const bool clean = in.eof();
  auto bad = [&](const char* want) {
    return InvalidArgument("malformed optimizer config '" + config + "': expected " + want);
  };
  if (name == "sgd") {
    if (!clean || v.size() != 3) throw bad("'sgd <lr> <momentum> <nesterov 0|1>'");
    return std::make_unique<SGD>(static_cast<float>(v[0]), static_cast<float>(v[1]), v[2] != 0);
  }
  if (name == "adam") {
    if (!clean || v.size() != 4) throw bad("'adam <lr> <beta1> <beta2> <epsilon>'");
    return std::make_unique<Adam>(static_cast<float>(v[0]), static_cast<float>(v[1]), static_cast<float>(v[2]),
                                  static_cast<float>(v[3]));
  }
  throw bad("an optimizer name: sgd or adam");
}

std::string SGD::config() const { return format_floats("sgd", {lr_, momentum_, nesterov_ ? 1.0 : 0.0}); }

std::string Adam::config() const { return format_floats("adam", {lr_, beta1_, beta2_, epsilon_}); }

SGD::SGD(float lr, float momentum, bool nesterov) : Optimizer(lr), momentum_(momentum), nesterov_(nesterov) {
  if (momentum < 0.f || momentum >= 1.f)
    throw InvalidArgument("SGD momentum must be in [0, 1), got " + std::to_string(momentum));
}

void SGD::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t) {
  kernels_for(value).sgd_update(value, grad, slots.empty() ? nullptr : &slots[0], lr_, momentum_, nesterov_);
}

Adam::Adam(float lr, float beta1, float beta2, float epsilon)
    : Optimizer(lr), beta1_(beta1), beta2_(beta2), epsilon_(epsilon) {}

void Adam::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step) {
  kernels_for(value).adam_update(value, slots[0], slots[1], grad, lr_, beta1_, beta2_, epsilon_, step);
}

}  // namespace dtrain
