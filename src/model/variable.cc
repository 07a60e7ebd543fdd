#include "dtrain/model/variable.h"

#include "dtrain/devices/device.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

void Variable::check_strategy(const char* use) const {
  if (strategy_id_ == 0) return;  // made directly, not through create_variable(): no owner to check
  const uint64_t running = detail::running_strategy_id(nullptr);  // hot path: no name built
  if (running == 0 || running == strategy_id_) return;
  std::string running_name;
  detail::running_strategy_id(&running_name);
  throw FailedPrecondition(
      "variable '" + name() + "' belongs to " + strategy_name_ + " but is " + use +
      " inside the run() of " + running_name +
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
