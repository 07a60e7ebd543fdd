// Private to src/strategies: a replica that is a sync group of its own. all_reduce and all_gather
// are the identity on its device, merge_call runs fn on its own argument. OneDeviceStrategy's
// replica and each EnsembleStrategy member are one.
#pragma once

#include "dtrain/strategies/strategy.h"

namespace dtrain::detail {

class SoloReplicaContext : public ReplicaContext {
 public:
  SoloReplicaContext(Strategy* s, int replica_id, DeviceSpec d)
      : strategy_(s), replica_id_(replica_id), device_(d) {}
  Strategy& strategy() const override { return *strategy_; }
  int replica_id_in_sync_group() const override { return replica_id_; }
  int num_replicas_in_sync() const override { return 1; }
  DeviceSpec device() const override { return device_; }
  std::vector<Tensor> all_reduce(ReduceOp, const std::vector<Tensor>& values) override {
    std::vector<Tensor> out;  // SUM and MEAN over one replica are the identity
    for (const auto& v : values) out.push_back(v.to(device_));
    return out;
  }
  Tensor all_gather(const Tensor& value, int) override { return value.to(device_); }
  std::vector<Tensor> merge_call(
      const std::function<std::vector<Tensor>(Strategy&, const PerReplica&)>& fn,
      const std::vector<Tensor>& args) override {
    return fn(*strategy_, PerReplica{{args}});
  }

 private:
  Strategy* strategy_;
  int replica_id_;
  DeviceSpec device_;
};

}  // namespace dtrain::detail
