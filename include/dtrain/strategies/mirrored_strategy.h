// MirroredStrategy: synchronous data parallelism over the devices of one process (TF's
// tf.distribute.MirroredStrategy). One replica per device, each on its device's worker thread;
// variables are mirrored (one copy per device, initialised from replica 0, kept equal on write;
// on logical CPU devices one shared copy, see MirroredOptions::share_host_variables); gradients
// are all-reduced by the cross-device ops picked for the devices.
//
// Determinism: the in-process all-reduce sums every slice in a fixed order and all replicas get
// bitwise identical results, so with fixed intra-op threads repeated runs are bitwise identical.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "dtrain/core/export.h"
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

// Sharding of the optimizer's work across replicas (ZeRO, Rajbhandari et al. 2020; DeepSpeed's
// stages). Gradient packs are reduce-scattered during backward, so each replica receives its part
// of the summed gradients (UpdatePartition), applies the optimizer to its part of every variable
// and keeps slots for that part alone, and the updated parts are all-gathered: one reduce-scatter
// plus one all-gather, the bytes of one all-reduce. kOptimizerState (ZeRO-1, DeepSpeed's stage 1)
// keeps the whole local gradients backward returns until the update; kGradients (ZeRO-2, FSDP's
// SHARD_GRAD_OP) releases each one once it is packed (tape.gradient() then returns handles
// without values: pass them to apply_gradients unchanged). Slot memory per replica falls as 1/N.
// kParameters (ZeRO-3, FSDP's FULL_SHARD) is kGradients plus: the trainable variables of layers
// marked Layer::set_shard_parameters are kept as one part per replica between that layer's calls,
// gathered for each call (the next layer's gather prefetched) and released after; an update writes
// the parts alone. Variables of other layers stay whole.
enum class Sharding { kNone = 0, kOptimizerState = 1, kGradients = 2, kParameters = 3 };
DTRAIN_API const char* sharding_name(Sharding s);
// "none"/"0", "optimizer_state"/"1", "gradients"/"2", "parameters"/"3" (the --sharding flag,
// DTRAIN_SHARDING);
// throws InvalidArgument naming the valid values.
DTRAIN_API Sharding parse_sharding(const std::string& name);

// The gradient pack size for an all-reduce across `workers` processes: 512 KiB a worker, at least
// 4 MiB and at most 64 MiB (Horovod's fusion threshold). Each pack pays 2 (workers - 1) ring-step
// latencies, so the more workers, the larger a pack must be for its bytes to outweigh them; and a
// pack must be small enough that the last one, sent after the backward pass, stays short. A fixed
// 4 MiB was best for the 2-8 workers measured here (docs/scaling-performance.md) but, by the step
// simulator (dtrain-bench simulate), gave ResNet-50 26% scaling efficiency instead of 75% at
// 1,024 GPUs (128 hosts of 8, 100 Gbit/s; 75% with this rule). Simulated for ResNet-50 and GPT-2
// small on 2-128 hosts of 8 GPUs at 10-100 Gbit/s, the rule is within 2.5 points of the best fixed
// size of 1-256 MB in every case (docs/scaling-performance.md).
DTRAIN_API size_t auto_bytes_per_pack(int workers);

struct DTRAIN_API MirroredOptions {
  std::vector<DeviceSpec> devices;  // empty: all GPUs, else CPU:0
  CrossDeviceOps cross_device_ops = CrossDeviceOps::kAuto;
  // Gradients are fused into packs of about this many bytes; a pack's all-reduce starts as soon as
  // the backward pass has produced all of its gradients (overlapping the rest of backward). 0: one
  // pack. Unset: auto_bytes_per_pack() of the number of workers (processes) the all-reduce spans,
  // chosen again when an elastic job changes size (DTRAIN_BYTES_PER_PACK for make_strategy).
  std::optional<size_t> bytes_per_pack;
  bool overlap_backward = true;
  // Logical CPU devices of one process (Mirrored, not multi-worker): every replica's copy of a
  // variable (synchronized on write) is one block of host memory, so the weights and optimizer
  // slots are cached once, not once per replica. Gradients are reduce-scattered instead of
  // all-reduced, each replica applies the optimizer to its slice of every variable, and a barrier
  // ends the update. Results are bitwise those of separate copies. false: one copy per device.
  bool share_host_variables = true;
  // Sharded optimizer state and gradients (see Sharding); turns share_host_variables off.
  Sharding sharding = Sharding::kNone;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

class DTRAIN_API MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(MirroredOptions options = {});
  ~MirroredStrategy() override;
  std::string name() const override;
  int num_replicas_in_sync() const override;
  std::vector<DeviceSpec> worker_devices() const override;
  CrossDeviceOps cross_device_ops() const;  // the ops actually chosen
  // Whether new variables start from the chief's value (multi-worker jobs; see
  // CommunicationOptions::broadcast_initial_values).
  bool broadcast_initial_values() const;
  // With MirroredOptions::sharding: this worker's replicas' parts (none without sharding).
  std::optional<UpdatePartition> update_partition() const override;
  Sharding sharding() const;
  // The gradient pack size in use, in bytes: MirroredOptions::bytes_per_pack, or
  // auto_bytes_per_pack() of the workers the job has now; SIZE_MAX: one pack.
  size_t bytes_per_pack() const;

  struct Impl;

 protected:
  // Mirrored over the local devices plus the other workers of a job: each replica's communicator is
  // spanned across workers by `cross_worker`, replica ids are global (worker rank x local devices +
  // local index), variables start from the chief's values, and datasets are sharded by the
  // extended() policy. `parts` must hold `cross_worker` and the task's cluster.
  MirroredStrategy(MirroredOptions options, StrategyExtended parts);
  PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) override;
  std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) override;
  PerReplica do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch,
                            const BatchRows& rows) override;
  std::optional<std::pair<int64_t, int64_t>> do_input_rows(int64_t global_batch) const override;
  // Replaces the cross-worker part and cluster context (a new membership of an elastic job): closes
  // the current cross-worker connections, then assembles what `connect` returns; replica ids and
  // counts follow the new worker rank and count, and every replica's communicator is rebuilt;
  // variables and their values stay. Call between steps only. When `connect` throws, the strategy
  // cannot run until a later reassemble succeeds.
  void reassemble(const std::function<StrategyExtended()>& connect);
  // Whether variables created from now on start from the chief's value (broadcast at creation, the
  // default for multi-worker jobs).
  void set_broadcast_initial_values(bool on);

 private:
  std::unique_ptr<Impl> impl_;
};

// The devices a MirroredOptions names: its devices, else every GPU, else CPU:0. Throws NotFound for
// a device that does not exist and InvalidArgument for one listed twice.
DTRAIN_API std::vector<DeviceSpec> mirrored_devices(const MirroredOptions& options);

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
