// OneDeviceStrategy: everything on one device (TF's tf.distribute.OneDeviceStrategy). Variables
// are plain variables on the device; run() executes the replica function on the device's worker
// thread; inputs are copied to the device.
#pragma once

#include <memory>

#include "dtrain/core/export.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

class DTRAIN_API OneDeviceStrategy : public Strategy {
 public:
  explicit OneDeviceStrategy(DeviceSpec device);
  ~OneDeviceStrategy() override;
  std::string name() const override;
  int num_replicas_in_sync() const override { return 1; }
  std::vector<DeviceSpec> worker_devices() const override { return {device_}; }
  DeviceSpec device() const { return device_; }
  class Context;
  ReplicaContext& replica_context();

 protected:
  // run_inline: execute replica functions on the calling thread (the default strategy).
  OneDeviceStrategy(DeviceSpec device, bool run_inline);
  PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) override;
  std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) override;
  PerReplica do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch,
                            const BatchRows& rows) override;

 private:
  DeviceSpec device_;
  bool run_inline_;
  std::unique_ptr<Context> ctx_;
};

}  // namespace dtrain
