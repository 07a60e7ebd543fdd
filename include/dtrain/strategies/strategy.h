// Strategy: how a model's computation and variables are distributed (TF's tf.distribute.Strategy).
//
//   auto strategy = make_strategy("one_device", options);
//   { auto scope = strategy->scope();       // variables created here belong to the strategy
//     model = build_model(); optimizer = ...; }
//   strategy->run(step_fn, dist_batch);    // step_fn runs once per replica on its device's thread
//
// The public methods check context (cross-replica vs replica) and arguments, then delegate to the
// private virtual hooks of each implementation (TF's Strategy/StrategyExtended split). Model code
// never asks which strategy it runs under.
//
// Thread-safety: scope() is per thread. run() may be called from one thread at a time; it runs
// the replica functions concurrently, one per replica thread.
#pragma once

#include "dtrain/core/export.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/collectives/communicator.h"
#include "dtrain/core/tensor.h"
#include "dtrain/model/variable.h"

namespace dtrain {

class Strategy;
class Dataset;

// Values that differ per replica: values[replica][k] is output k of replica `replica`.
struct DTRAIN_API PerReplica {
  std::vector<std::vector<Tensor>> values;
  // For batches from distribute_dataset: the rows of this step's global batch over all workers
  // (-1 when unknown). compute_average_loss should divide by it.
  int64_t global_rows = -1;
  size_t num_replicas() const { return values.size(); }
};

// What one replica sees inside Strategy::run.
class DTRAIN_API ReplicaContext {
 public:
  virtual ~ReplicaContext() = default;
  virtual Strategy& strategy() const = 0;
  virtual int replica_id_in_sync_group() const = 0;
  virtual int num_replicas_in_sync() const = 0;
  virtual DeviceSpec device() const = 0;
  // Reduces each tensor across all replicas in sync; every replica gets the result (same order
  // of tensors on every replica is required). Returns new tensors on this replica's device.
  virtual std::vector<Tensor> all_reduce(ReduceOp op, const std::vector<Tensor>& values) = 0;
  // Concatenates each replica's tensor along `axis` in replica order.
  virtual Tensor all_gather(const Tensor& value, int axis) = 0;
  // Runs fn once, in cross-replica context, with every replica's argument (TF's merge_call); all
  // replicas block until it has run and then continue. Returns fn's result to every replica.
  virtual std::vector<Tensor> merge_call(
      const std::function<std::vector<Tensor>(Strategy&, const PerReplica&)>& fn,
      const std::vector<Tensor>& args) = 0;
};

// The replica context of the calling thread: inside run() the replica's; outside any strategy
// the default strategy's single replica; nullptr in cross-replica context of a non-default
// strategy (as TF's tf.distribute.get_replica_context()).
DTRAIN_API ReplicaContext* get_replica_context();
// The innermost strategy in scope on this thread, or the default strategy.
DTRAIN_API Strategy& get_strategy();
DTRAIN_API bool has_strategy();  // true when some non-default strategy is in scope

// RAII guard returned by Strategy::scope(); pops the strategy when destroyed.
class DTRAIN_API StrategyScope {
 public:
  explicit StrategyScope(Strategy* s);
  ~StrategyScope();
  StrategyScope(StrategyScope&& o) noexcept : strategy_(o.strategy_) { o.strategy_ = nullptr; }
  StrategyScope(const StrategyScope&) = delete;
  StrategyScope& operator=(const StrategyScope&) = delete;

 private:
  Strategy* strategy_;
};

using ReplicaFn = std::function<std::vector<Tensor>(ReplicaContext& ctx, const std::vector<Tensor>& inputs)>;

class DTRAIN_API Strategy {
 public:
  virtual ~Strategy() = default;
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // Enters this strategy's scope on the calling thread. Entering a scope while another strategy's
  // scope is active throws FailedPrecondition (mixing strategies is an error, as in TF).
  [[nodiscard]] StrategyScope scope();

  virtual std::string name() const = 0;
  // Replicas in sync over the whole job (all workers).
  virtual int num_replicas_in_sync() const = 0;
  // Whether this process should log, print progress and write files (true unless multi-worker).
  virtual bool is_chief() const { return true; }
  // Sums host values over every worker of the job (identity for single-process strategies); call
  // from cross-replica context, the same number of times on every worker.
  virtual std::vector<double> sum_across_workers(std::vector<double> values) { return values; }
  // The devices replicas run on, in replica order (local replicas only).
  virtual std::vector<DeviceSpec> worker_devices() const = 0;

  // Asynchronous strategies (ParameterServer) have each worker train on its own part of the
  // data: fit() keeps shard `index` of `count` of the training set. Synchronous strategies split
  // every global batch in distribute_dataset instead and return {1, 0}.
  struct InputShard {
    int count = 1, index = 0;
  };
  virtual InputShard input_shard() const { return {}; }
  // The job-wide step count kept by asynchronous strategies (restored with checkpoints), which
  // fit() trains up to; -1 when the strategy keeps none (fit counts its own steps).
  virtual int64_t job_step() const { return -1; }
  // fit() calls this once when training ends, before the final evaluation: an asynchronous
  // chief waits there for the other workers and writes its final checkpoint.
  virtual void on_training_end() {}

  // Calls fn once per local replica with that replica's inputs (inputs.values[r]; an empty
  // PerReplica gives every replica no inputs). Rethrows the first replica's exception after all
  // replicas have finished. Throws FailedPrecondition when called from inside a replica.
  PerReplica run(const ReplicaFn& fn, const PerReplica& inputs = {});
  // Reduces per-replica values across replicas (axis = nullopt) or across replicas and `axis`
  // (e.g. MEAN over axis 0 divides by the total number of examples). Returns tensors on the
  // first worker device.
  std::vector<Tensor> reduce(ReduceOp op, const PerReplica& values, std::optional<int> axis = std::nullopt);
  // Concatenates per-replica values along `axis` in replica order (TF's strategy.gather), on the
  // first worker device. Replicas may contribute 0 rows.
  std::vector<Tensor> gather(const PerReplica& values, int axis = 0);
  // Splits a dataset batched at the global batch size into per-replica batches on each replica's
  // device. The returned function yields the next PerReplica and returns false at the end.
  // global_batch_size 0 = the leading dimension of the first batch.
  std::function<bool(PerReplica*)> distribute_dataset(const Dataset& dataset,
                                                      int64_t global_batch_size = 0);

  // Called by dtrain::create_variable for the innermost strategy in scope.
  std::shared_ptr<Variable> create_variable(const VariableSpec& spec);

 protected:
  Strategy() = default;
  virtual PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) = 0;
  virtual std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) = 0;
  // Splits one global batch (components with the global batch as leading dim) per replica.
  virtual PerReplica do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch) = 0;
  // Multi-worker strategies combine the local reduction with the other workers' (SUM, and the
  // example counts for MEAN). Default: nothing to combine.
  virtual void reduce_across_workers(std::vector<Tensor>& /*sums*/, std::vector<int64_t>& /*counts*/) {}
  // Called by distribute_dataset for every step: multi-worker strategies make all workers agree to
  // stop when any one runs out of data. Returns whether this step runs.
  virtual bool agree_on_next(bool have_batch) { return have_batch; }
};

// How TF's rebatching splits `rows` (<= global_batch) over replicas: each takes up to
// ceil(global_batch / num_replicas) rows in replica order, so a last batch of 6 at global batch 8
// on 2 replicas is 4/2 and on 4 replicas 2/2/2/0. Replicas may get 0 rows.
DTRAIN_API std::vector<int64_t> split_batch_sizes(int64_t rows, int64_t global_batch, int num_replicas);

}  // namespace dtrain
