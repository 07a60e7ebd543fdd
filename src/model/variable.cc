#include "dtrain/model/variable.h"

#include <atomic>

#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

std::atomic<uint64_t> g_next_creator_id{1};
thread_local std::vector<VariableCreator*> t_creators;
thread_local const VariableCreator* t_running = nullptr;

// What creates variables when no creator is on the stack: one plain copy on CPU:0.
class DefaultCreator final : public VariableCreator {
 public:
  std::string name() const override {
    return "the default strategy (it was made outside every strategy.scope())";
  }
  std::shared_ptr<Variable> make_variable(const VariableSpec& spec) override {
    return std::make_shared<PlainVariable>(spec, DeviceSpec::cpu(0));
  }
};

VariableCreator& default_creator() {
  static auto* c = new DefaultCreator();  // leaked: variables may outlive main
  return *c;
}

}  // namespace

VariableCreator::VariableCreator() : id_(g_next_creator_id.fetch_add(1)) {}

VariableCreatorScope::VariableCreatorScope(VariableCreator* creator)
    : depth_(static_cast<int64_t>(t_creators.size())) {
  if (!creator) throw InvalidArgument("VariableCreatorScope: the creator is null");
  t_creators.push_back(creator);
}

VariableCreatorScope::~VariableCreatorScope() {
  if (depth_ >= 0 && static_cast<int64_t>(t_creators.size()) > depth_)
    t_creators.resize(static_cast<size_t>(depth_));
}

VariableCreator* current_variable_creator() {
  return t_creators.empty() ? nullptr : t_creators.back();
}

std::shared_ptr<Variable> create_variable(const VariableSpec& spec) {
  if (!spec.initializer)
    throw InvalidArgument("variable '" + spec.name +
                          "' has no initializer; set VariableSpec::initializer");
  for (int64_t d : spec.shape.dims())
    if (d < 0)
      throw InvalidArgument("variable '" + spec.name +
                            "' has a negative dimension: " + spec.shape.to_string());
  VariableCreator& creator = t_creators.empty() ? default_creator() : *t_creators.back();
  std::shared_ptr<Variable> v = creator.make_variable(spec);
  v->set_strategy(creator.instance_id(), creator.name());
  return v;
}

namespace detail {
const VariableCreator* set_running_creator(const VariableCreator* creator) {
  const VariableCreator* previous = t_running;
  t_running = creator;
  return previous;
}
const VariableCreator* running_creator() { return t_running; }
}  // namespace detail

void Variable::check_strategy(const char* use) const {
  if (strategy_id_ == 0) return;  // made directly, not through create_variable(): no owner to check
  if (!t_running || t_running->instance_id() == strategy_id_) return;
  throw FailedPrecondition(
      "variable '" + name() + "' belongs to " + strategy_name_ + " but is " + use +
      " inside the run() of " + t_running->name() +
      ": a variable is only usable under the strategy that made it. Build the model and the "
      "optimizer inside the training strategy's scope ({ auto scope = strategy.scope(); "
      "model = ...; optimizer = ...; }) and train them with that strategy");
}

void Variable::apply_remote_update(const std::string&, const Tensor&) {
  throw Internal("apply_remote_update called on variable '" + name() +
                 "', which is updated locally");
}

PlainVariable::PlainVariable(VariableSpec spec, DeviceSpec device) : Variable(std::move(spec)) {
  Tensor init = spec_.initializer(spec_.shape, spec_.dtype, device);
  if (init.shape() != spec_.shape || init.dtype() != spec_.dtype)
    throw InvalidArgument("initializer of variable '" + spec_.name + "' returned " +
                          init.to_string() + ", expected shape " + spec_.shape.to_string());
  value_ = init.device() == device ? init.clone() : init.to(device);
  value_.set_trainable_variable(spec_.trainable);
}

namespace {
void check_same(const Variable& v, const Tensor& t, const char* op) {
  if (t.shape() != v.shape() || t.dtype() != v.dtype())
    throw InvalidArgument(std::string(op) + " on variable '" + v.name() + "' of shape " +
                          v.shape().to_string() + " with " + t.to_string());
}
}  // namespace

void PlainVariable::do_assign(const Tensor& v) {
  check_same(*this, v, "assign");
  value_.copy_from(v);
}

void PlainVariable::do_assign_add(const Tensor& d) {
  check_same(*this, d, "assign_add");
  value_.copy_from(kernels_for(value_).binary(BinaryOp::kAdd, value_, d.to(value_.device())));
}

void PlainVariable::do_assign_sub(const Tensor& d) {
  check_same(*this, d, "assign_sub");
  value_.copy_from(kernels_for(value_).binary(BinaryOp::kSub, value_, d.to(value_.device())));
}

}  // namespace dtrain
