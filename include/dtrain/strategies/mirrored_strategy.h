// MirroredStrategy: synchronous data parallelism over the devices of one process (TF's
// tf.distribute.MirroredStrategy). One replica per device, each on its device's worker thread;
// variables are mirrored (one copy per device, initialised from replica 0, kept equal on write);
// gradients are all-reduced by the cross-device ops picked for the devices.
//
// Determinism: the in-process all-reduce sums every slice in a fixed order and all replicas get
// bitwise identical results, so with fixed intra-op threads repeated runs are bitwise identical.
#pragma once

#include "dtrain/core/export.h"

#include <functional>
#include <memory>

#include "dtrain/strategies/strategy.h"

namespace dtrain {

class Dataset;

// How replicas' values are combined (TF's cross_device_ops).
enum class CrossDeviceOps {
  kAuto,              // NCCL for GPUs, the in-process collective for CPU devices
  kInproc,            // shared-memory reduce-and-scatter among the replica threads
  kNccl,              // NCCL all-reduce (GPUs; needs a build with NCCL)
  kReduceToOneDevice  // copy to the first device, reduce there, copy back (always works)
};
DTRAIN_API const char* cross_device_ops_name(CrossDeviceOps ops);

struct DTRAIN_API MirroredOptions {
  std::vector<DeviceSpec> devices;            // empty: all GPUs, else CPU:0
  CrossDeviceOps cross_device_ops = CrossDeviceOps::kAuto;
  // Gradients are fused into packs of about this many bytes; a pack's all-reduce starts as soon as
  // the backward pass has produced all of its gradients (overlapping the rest of backward).
  size_t bytes_per_pack = size_t{4} << 20;
  bool overlap_backward = true;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// What a per-replica input pipeline is told (TF's tf.distribute.InputContext).
struct DTRAIN_API InputContext {
  int num_input_pipelines = 1;
  int input_pipeline_id = 0;
  int num_replicas_in_sync = 1;
  // The per-replica batch for a global batch (throws InvalidArgument if not divisible).
  int64_t get_per_replica_batch_size(int64_t global_batch_size) const;
};

class DTRAIN_API MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(MirroredOptions options = {});
  ~MirroredStrategy() override;
  std::string name() const override;
  int num_replicas_in_sync() const override;
  std::vector<DeviceSpec> worker_devices() const override;
  CrossDeviceOps cross_device_ops() const;  // the ops actually chosen

  // One dataset per replica from fn (TF's distribute_datasets_from_function); each must already be
  // batched at the per-replica batch size. Ends when any replica's pipeline ends.
  std::function<bool(PerReplica*)> distribute_datasets_from_function(
      const std::function<Dataset(const InputContext&)>& fn);

  struct Impl;

 protected:
  PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) override;
  std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) override;
  PerReplica do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch) override;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// CentralStorageStrategy (TF's tf.distribute.experimental.CentralStorageStrategy): variables live
// once on the parameter device (the CPU by default); replicas compute on the compute devices with
// copies read at the start of the step; gradients are summed across replicas and applied once,
// to the central copy.
class DTRAIN_API CentralStorageStrategy : public MirroredStrategy {
 public:
  CentralStorageStrategy(MirroredOptions compute, DeviceSpec parameter_device = DeviceSpec::cpu(0));
  std::string name() const override;
  DeviceSpec parameter_device() const { return parameter_device_; }

 protected:
  std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) override;

 private:
  DeviceSpec parameter_device_;
};

}  // namespace dtrain
