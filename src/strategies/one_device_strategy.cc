#include "dtrain/strategies/one_device_strategy.h"

#include "dtrain/devices/device.h"
#include "strategies/replica_scope.h"
#include "strategies/solo_replica_context.h"

namespace dtrain {

// OneDevice's one replica: replica 0 of a group of one.
class OneDeviceStrategy::Context final : public detail::SoloReplicaContext {
 public:
  Context(Strategy* s, DeviceSpec d) : SoloReplicaContext(s, 0, d) {}
};

OneDeviceStrategy::OneDeviceStrategy(DeviceSpec device) : OneDeviceStrategy(device, false) {}

OneDeviceStrategy::OneDeviceStrategy(DeviceSpec device, bool run_inline)
    : device_(device), run_inline_(run_inline), ctx_(std::make_unique<Context>(this, device)) {
  if (!run_inline) get_device(device);  // fail now, with the device list, if it does not exist
}

OneDeviceStrategy::~OneDeviceStrategy() = default;

std::string OneDeviceStrategy::name() const {
  return "OneDeviceStrategy(" + device_.to_string() + ")";
}

ReplicaContext& OneDeviceStrategy::replica_context() { return *ctx_; }

PerReplica OneDeviceStrategy::do_run(const ReplicaFn& fn, const PerReplica& inputs) {
  std::vector<Tensor> in;
  if (!inputs.values.empty())
    for (const auto& t : inputs.values[0]) in.push_back(t.defined() ? t.to(device_) : t);
  PerReplica out;
  out.values.resize(1);
  auto body = [&] {
    detail::ReplicaThreadScope scope(this, ctx_.get());
    out.values[0] = fn(*ctx_, in);
  };
  if (run_inline_) {
    body();
  } else {
    get_device(device_).submit(body).get();
  }
  return out;
}

std::shared_ptr<Variable> OneDeviceStrategy::do_create_variable(const VariableSpec& spec) {
  return std::make_shared<PlainVariable>(spec, device_);
}

PerReplica OneDeviceStrategy::do_split_batch(const std::vector<Tensor>& batch, int64_t,
                                             const BatchRows&) {
  PerReplica out;
  out.values.emplace_back();
  for (const auto& t : batch) out.values[0].push_back(t.to(device_));
  return out;
}

}  // namespace dtrain
