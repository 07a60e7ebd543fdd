// Strategy: how a model's computation and variables are distributed (TF's tf.distribute.Strategy).
//
//   auto strategy = make_strategy("one_device", options);
//   { auto scope = strategy->scope();       // variables created here belong to the strategy
//     model = build_model(); optimizer = ...; }
//   strategy->run(step_fn, dist_batch);    // step_fn runs once per replica on its device's thread
//
// The public methods check context (cross-replica vs replica) and arguments, then delegate to the
// protected do_* of each implementation. What a training loop needs beyond this API (chief, cross-
// worker sums, sync or async, data sharding, job step) is in strategy.extended(), assembled from
// parts (strategy_extended.h). Model code never asks which strategy it runs under.
//
// Thread-safety: scope() is per thread. run() may be called from one thread at a time; it runs
// the replica functions concurrently, one per replica thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/collectives/communicator.h"
#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"
#include "dtrain/model/variable.h"
#include "dtrain/strategies/strategy_extended.h"

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

  // The optimizer's update divided among the replicas, where the replicas of a strategy share each
  // variable's memory (Mirrored on logical CPU devices, see MirroredOptions::share_host_variables).
  // For gradients of `vars` (all defined, in the same order on every replica) returns this
  // replica's part of their sum over replicas: for each gradient a flat slice (possibly empty) and
  // the flat element of its variable where that slice starts; the replicas' slices cover every
  // element once. Returns nullopt where each replica updates its own copy with all_reduce's sum
  // (every other strategy, or a variable whose copies are not shared); the decision is the same
  // on every replica. After a result, the caller updates each variable through Variable::update,
  // which hands this replica the shared copy, writes only its slices, and then calls
  // end_sharded_update(), which returns when every replica has written its slices.
  // Collective: every replica calls both, or neither.
  //
  // Under a strategy with an update_partition() (sharded optimizer state, ZeRO), every update goes
  // this way: the slices are then the replica's fixed part of each variable (partition_range), and
  // end_sharded_update() all-gathers the updated parts into every replica's copy.
  struct UpdateSlices {
    std::vector<Tensor> grads;     // per gradient: this replica's slice of the sum, flat
    std::vector<int64_t> offsets;  // per gradient: the slice's first element in the variable
  };
  virtual std::optional<UpdateSlices> reduce_scatter_for_update(
      const std::vector<Tensor>& grads, const std::vector<std::shared_ptr<Variable>>& vars) {
    (void)grads;
    (void)vars;
    return std::nullopt;
  }
  virtual void end_sharded_update() {}
};

// Sharded optimizer state (ZeRO stages 1 and 2; MirroredOptions::sharding): the optimizer's update
// is divided among the replicas in sync by a fixed partition of every variable: replica r of N
// updates, and keeps optimizer slots for, the flat elements partition_range(numel, r, N) of each
// variable. The same partition whatever the shard count is how checkpoints move between shard
// counts.
struct DTRAIN_API UpdatePartition {
  int num_parts = 1;             // N: the replicas in sync over the whole job
  std::vector<int> local_parts;  // per local replica: its part (its replica id in the sync group)
  std::vector<DeviceSpec> devices;  // per local replica: where its part's slots live
};
// The flat elements [first, second) of a variable of `count` elements that part `part` of `parts`
// holds: [count * part / parts, count * (part + 1) / parts).
inline std::pair<int64_t, int64_t> partition_range(int64_t count, int part, int parts) {
  return {count * part / parts, count * (part + 1) / parts};
}

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
  StrategyScope(StrategyScope&& o) noexcept
      : strategy_(o.strategy_), creator_scope_(std::move(o.creator_scope_)) {
    o.strategy_ = nullptr;
  }
  StrategyScope(const StrategyScope&) = delete;
  StrategyScope& operator=(const StrategyScope&) = delete;

 private:
  Strategy* strategy_;
  VariableCreatorScope creator_scope_;  // the strategy as this thread's variable creator
};

using ReplicaFn =
    std::function<std::vector<Tensor>(ReplicaContext& ctx, const std::vector<Tensor>& inputs)>;

// What a per-replica input pipeline is told (TF's tf.distribute.InputContext).
struct DTRAIN_API InputContext {
  int num_input_pipelines = 1;
  int input_pipeline_id = 0;
  int num_replicas_in_sync = 1;
  // The per-replica batch for a global batch (throws InvalidArgument if not divisible).
  int64_t get_per_replica_batch_size(int64_t global_batch_size) const;
};

// What experimental_distribute_values_from_function tells fn (TF's tf.distribute.ValueContext).
struct DTRAIN_API ValueContext {
  int replica_id_in_sync_group = 0;
  int num_replicas_in_sync = 1;
};

// A strategy is the variable creator its scope() installs (model/variable.h): variables made
// inside the scope are this strategy's, and its run() refuses any other strategy's.
class DTRAIN_API Strategy : public VariableCreator {
 public:
  ~Strategy() override;
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // Enters this strategy's scope on the calling thread. Entering a scope while another strategy's
  // scope is active throws FailedPrecondition (mixing strategies is an error, as in TF).
  [[nodiscard]] StrategyScope scope();

  std::string name() const override = 0;
  // Replicas in sync over the whole job (all workers).
  virtual int num_replicas_in_sync() const = 0;
  // The devices replicas run on, in replica order (local replicas only).
  virtual std::vector<DeviceSpec> worker_devices() const = 0;
  // The parts this strategy is assembled from: cluster context, cross-worker ops, training policy.
  StrategyExtended& extended() { return extended_; }
  const StrategyExtended& extended() const { return extended_; }

  // Calls fn once per local replica with that replica's inputs (inputs.values[r]; an empty
  // PerReplica gives every replica no inputs). Rethrows the first replica's exception after all
  // replicas have finished. Throws FailedPrecondition when called from inside a replica, and when
  // fn touches a variable that belongs to another strategy (or to none: made outside every scope).
  PerReplica run(const ReplicaFn& fn, const PerReplica& inputs = {});
  // Reduces per-replica values across replicas (axis = nullopt) or across replicas and `axis`
  // (e.g. MEAN over axis 0 divides by the total number of examples), over every worker of the job.
  // Returns tensors on the first worker device.
  std::vector<Tensor> reduce(ReduceOp op, const PerReplica& values,
                             std::optional<int> axis = std::nullopt);
  // Concatenates per-replica values along `axis` in replica order (TF's strategy.gather), on the
  // first worker device. Replicas may contribute 0 rows.
  std::vector<Tensor> gather(const PerReplica& values, int axis = 0);
  // Splits a dataset batched at the global batch size into per-replica batches on each replica's
  // device. The returned function yields the next PerReplica and returns false at the end.
  // global_batch_size 0 = the leading dimension of the first batch. The function uses this strategy
  // (as TF's distributed dataset does): call it only while the strategy lives.
  std::function<bool(PerReplica*)> distribute_dataset(const Dataset& dataset,
                                                      int64_t global_batch_size = 0);
  // One dataset per local replica from fn (TF's distribute_datasets_from_function, per replica):
  // fn gets the replica's InputContext (pipelines = workers x local replicas, id = this replica's
  // pipeline: worker rank x local replicas + local index)
  // and returns a dataset batched at the per-replica batch size. Ends when any replica's ends.
  std::function<bool(PerReplica*)> distribute_datasets_from_function(
      const std::function<Dataset(const InputContext&)>& fn);
  // Per-replica values from fn, called once per local replica with its ValueContext; each value is
  // placed on its replica's device (TF's experimental_distribute_values_from_function).
  PerReplica experimental_distribute_values_from_function(
      const std::function<std::vector<Tensor>(const ValueContext&)>& fn);

  // Called by dtrain::create_variable for the innermost strategy in scope (the variable then
  // remembers this strategy, so that run() can refuse it under another one).
  std::shared_ptr<Variable> make_variable(const VariableSpec& spec) override {
    return do_create_variable(spec);
  }
  // Where the optimizer's update and slots are divided among the replicas (sharded optimizer state,
  // ZeRO): the partition; nullopt where every replica updates whole variables (the default).
  virtual std::optional<UpdatePartition> update_partition() const { return std::nullopt; }

 protected:
  Strategy();
  // Strategies made of more than the single-process parts install them here, in their constructor.
  void assemble(StrategyExtended parts) { extended_ = std::move(parts); }
  virtual PerReplica do_run(const ReplicaFn& fn, const PerReplica& inputs) = 0;
  virtual std::shared_ptr<Variable> do_create_variable(const VariableSpec& spec) = 0;
  // Where `batch` sits in its global batch: it holds rows [first, first + its rows) of a global
  // batch of `total` rows (total < 0: `batch` is the whole global batch).
  struct BatchRows {
    int64_t first = 0;
    int64_t total = -1;
  };
  // Splits one global batch (components with the global batch as leading dim), or the rows of it
  // that do_input_rows() asked for, per local replica.
  virtual PerReplica do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch,
                                    const BatchRows& rows) = 0;
  // The rows [first, last) of every global batch of `global_batch` rows that this process's
  // replicas take, when that is not all of them (multi-worker DATA sharding): distribute_dataset()
  // then has the input pipeline copy only those rows. nullopt: every row.
  virtual std::optional<std::pair<int64_t, int64_t>> do_input_rows(int64_t /*global_batch*/) const {
    return std::nullopt;
  }

 private:
  StrategyExtended extended_;
};

// How TF's rebatching splits `rows` (<= global_batch) over replicas: each takes up to
// ceil(global_batch / num_replicas) rows in replica order, so a last batch of 6 at global batch 8
// on 2 replicas is 4/2 and on 4 replicas 2/2/2/0. Replicas may get 0 rows.
DTRAIN_API std::vector<int64_t> split_batch_sizes(int64_t rows, int64_t global_batch,
                                                  int num_replicas);

}  // namespace dtrain
