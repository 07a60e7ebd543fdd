// EnsembleStrategy: every local device holds its own member of an ensemble. The model code is the
// same as under any strategy (scope() and create_variable): each variable gets one copy per member,
// member m's drawn from branch m of its initializer's random stream (branch 0 is the stream itself,
// so an ensemble of one equals OneDeviceStrategy bit for bit). fit() gives every
// member its own shuffle of all the training data (seed + m) at the full batch size and all-reduces
// nothing; each member is its own sync group of one (num_replicas_in_sync() == 1;
// replica_id_in_sync_group() is the member index). predict() returns the members' mean and
// predict_ensemble() every member with the mean and spread; checkpoints hold every member.
//
// Members as workers: under dtrain-run -np W (a TF_CONFIG with W training workers), every worker
// process holds the members of its own devices, numbered across the job (worker w's local member i
// is member w * L + i; every worker must have the same number L of devices). Members never talk
// while they train; the workers meet only to agree on stopping, to sum the logged losses and
// metrics, to gather predictions (every worker gets every member's) and to write checkpoints (the
// chief writes every member's variables). W workers x L devices give the same members, bit for bit,
// as one process with W * L devices.
//
// Thread-safety: as every Strategy (run() from one thread at a time).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/export.h"
#include "dtrain/core/random.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

class DTRAIN_API EnsembleStrategy : public Strategy {
 public:
  // One member per device (cpu:N splits the CPU into N logical devices). Throws InvalidArgument for
  // no devices or a device listed twice; NotFound for one that does not exist.
  explicit EnsembleStrategy(std::vector<DeviceSpec> devices);
  // Members across the training workers of `cluster` (a job of one worker is the same as the
  // constructor above). Connects to the other workers as MultiWorkerMirrored does (the TCP ring
  // with the job token, or MPI). Throws FailedPrecondition when the workers have different numbers
  // of devices (naming them), and what the connection throws (DeadlineExceeded, PermissionDenied).
  EnsembleStrategy(std::vector<DeviceSpec> devices, ClusterResolution cluster,
                   CommunicationOptions communication = {}, std::string token = "");
  ~EnsembleStrategy() override;
  std::string name() const override;
  int num_replicas_in_sync() const override { return 1; }
  std::vector<DeviceSpec> worker_devices() const override { return devices_; }
  // Members in the whole job, and the job-wide number of this process's first member.
  int num_members() const { return static_cast<int>(devices_.size()) * extended().num_workers(); }
  int first_member() const { return static_cast<int>(devices_.size()) * extended().worker_rank(); }

  class Context;

 protected:
  PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) override;
  std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) override;
  // Every member gets the whole batch (evaluation: each member on every example).
  PerReplica do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch,
                            const BatchRows& rows) override;

 private:
  void make_contexts();
  std::vector<DeviceSpec> devices_;
  std::vector<std::unique_ptr<Context>> contexts_;
};

}  // namespace dtrain
