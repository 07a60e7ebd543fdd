// ParameterServerStrategy: asynchronous data parallelism with variables on parameter-server
// processes (TF's ParameterServerStrategy, in the between-graph form where every worker runs its
// own training loop).
//
// A job has `ps` tasks, which run serve_parameter_server() (the same training binary started with
// a ps task does so from run_task(), or the dtrain-ps tool), and workers (chief = the `chief`
// task, else worker 0). Variables created in scope() live on the parameter servers, placed
// round-robin; a Partitioner splits large ones along axis 0 into shards spread over the servers,
// and model code uses the resulting ShardedVariable like any other. The optimizer's update runs on
// the server that holds the variable (Variable::apply_remote_update), atomically per shard, with
// the slots (Adam's m and v, momentum) kept there too.
//
// Each step of run() pulls every variable (one request per server, all servers at once), runs the
// step on the worker's device, and pushes the gradients (again one request per server). Workers
// never wait for each other, except for the optional staleness bound. The chief initialises the
// variables (or restores them from the newest checkpoint in checkpoint_dir), counts the job's
// global step, and writes checkpoints; the others wait for the chief's variables. A worker that
// dies does not stop the job; one that restarts rejoins with the current values. A parameter
// server that dies makes every worker fail with Unavailable naming it; relaunching the job
// restores the servers from the last checkpoint.
//
// Thread-safety: as Strategy. The servers serve any number of workers concurrently.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/export.h"
#include "dtrain/strategies/one_device_strategy.h"

namespace dtrain {

// How many shards (along axis 0) a variable of `shape`/`dtype` gets with `num_ps` servers.
// Results are clamped to [1, shape[0]] (scalars are never split).
using Partitioner = std::function<int(const Shape& shape, DType dtype, int num_ps)>;
// TF's FixedShardsPartitioner: exactly `num_shards` shards.
DTRAIN_API Partitioner fixed_shards_partitioner(int num_shards);
// TF's MinSizePartitioner: as many shards as keep each at least min_shard_bytes, at most
// max_shards.
DTRAIN_API Partitioner min_size_partitioner(int64_t min_shard_bytes = 256 << 10,
                                            int max_shards = 1);
// TF's MaxSizePartitioner: the fewest shards that keep each at most max_shard_bytes (at most
// max_shards when > 0).
DTRAIN_API Partitioner max_size_partitioner(int64_t max_shard_bytes, int max_shards = 0);
// Rows of each shard when `rows` are split into `shards` (the first rows % shards get one more).
DTRAIN_API std::vector<int64_t> shard_rows(int64_t rows, int shards);

// A variable split along axis 0 over parameter servers. value() is the whole variable.
class DTRAIN_API ShardedVariable : public Variable {
 public:
  using Variable::Variable;
  virtual int num_shards() const = 0;
  // "ps:1": the task holding shard i.
  virtual std::string shard_task(int i) const = 0;
  virtual Shape shard_shape(int i) const = 0;
  // Shard i as its server holds it now.
  virtual Tensor read_shard(int i) const = 0;
};

struct DTRAIN_API ParameterServerOptions {
  Partitioner partitioner;  // empty: every variable whole on one server
  int max_staleness = -1;   // >= 0: a worker waits while it is more steps ahead of the slowest
  std::string
      checkpoint_dir;  // empty: no checkpoints (make_strategy: DTRAIN_CHECKPOINT_DIR overrides)
  int64_t checkpoint_every =
      200;  // global steps between the chief's checkpoints (and one at the end)
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};           // per request
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(120)};  // reaching the servers
  std::chrono::milliseconds join_timeout{std::chrono::minutes(30)};  // chief waiting for workers
};

class DTRAIN_API ParameterServerStrategy : public OneDeviceStrategy {
 public:
  // cluster: nullopt = resolved from the environment (TF_CONFIG). token: "" = DTRAIN_JOB_TOKEN.
  // extended() is asynchronous: each worker reads its own shard of the data and fit() trains up to
  // the job's global step. Throws InvalidArgument for a cluster without ps tasks,
  // FailedPrecondition for a ps or evaluator task (run_task() serves those), InvalidArgument for a
  // missing token; DeadlineExceeded / PermissionDenied when the servers cannot be reached.
  explicit ParameterServerStrategy(ParameterServerOptions options = {},
                                   DeviceSpec device = DeviceSpec::cpu(),
                                   std::optional<ClusterResolution> cluster = std::nullopt,
                                   std::string token = "");
  ~ParameterServerStrategy() override;
  std::string name() const override;
  const ClusterResolution& cluster() const;
  // The job's step count (pushes applied, restored from checkpoints), as last seen by this worker.
  int64_t global_step() const;
  // Chief: writes a checkpoint of every variable with its optimizer slots now. Returns its path.
  // Throws FailedPrecondition without a checkpoint_dir or on a non-chief worker.
  std::string save_checkpoint();
  // Ends this worker's training (extended().on_training_end() calls it): tells ps:0 this worker is
  // done; the chief then waits for the other workers and writes the final checkpoint.
  void finish_training();

  struct Impl;

 protected:
  PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) override;
  std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) override;

 private:
  std::shared_ptr<Impl> impl_;  // variables hold weak references
};

// Runs a parameter server for task `cluster` (a ps task) until SIGTERM/SIGINT, then returns.
// Throws InvalidArgument when the task is not a ps task, Unavailable when its address cannot be
// bound.
DTRAIN_API void serve_parameter_server(const ClusterResolution& cluster, std::string token = "");

}  // namespace dtrain
