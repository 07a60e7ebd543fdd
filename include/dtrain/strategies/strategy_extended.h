// StrategyExtended: what a training loop needs to know about a strategy beyond the user-facing API
// (TF's tf.distribute.StrategyExtended, reached the same way: `strategy.extended()`). Model code
// never needs it; fit(), callbacks, checkpoint writers and tools do.
//
// A strategy is assembled from parts, not inherited hooks, and extended() is where they show:
//   - the cluster context: who this process is in the job (a ClusterResolution; none for a
//     single-process strategy), resolved once, before the strategy is built;
//   - the cross-worker ops: reductions over every worker of a multi-worker job (none for a single
//     process); MultiWorkerMirrored is Mirrored plus this part;
//   - the training policy: synchronous or asynchronous, which shard of the data this worker reads,
//     the job-wide step of an asynchronous job, and what happens when training ends.
//
// Thread-safety: the accessors are safe from any thread; sum_across_workers() and on_training_end()
// are collective (or wait for other workers) and are called from the training loop's thread only,
// the same number of times on every worker.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/collectives/communicator.h"
#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

// How a multi-worker job's datasets are split (TF's tf.data.experimental.AutoShardPolicy).
// DATA: every worker reads the same global batches and keeps its replicas' rows; OFF: each worker
// keeps its whole batches and the workers stop together when any runs out.
enum class AutoShardPolicy { kAuto, kData, kFile, kOff };

// Which part of the training data this worker reads: shard `index` of `count`.
struct DTRAIN_API InputShard {
  int count = 1, index = 0;
};

// The other workers of a multi-worker job, as the strategies' shared code needs them.
class DTRAIN_API CrossWorkerOps {
 public:
  virtual ~CrossWorkerOps() = default;
  virtual int num_workers() const = 0;
  virtual int worker_rank() const = 0;
  // Sums `host` (a CPU tensor) over every worker, in place. Collective: same order on every worker.
  // Throws what the transport throws (DeadlineExceeded, Unavailable naming the lost worker).
  virtual void all_reduce_sum(Tensor& host) = 0;
  // Replaces `host` with worker 0's value. Collective.
  virtual void broadcast_from_chief(Tensor& host) = 0;
  // Replaces `host` with worker `root`'s value (the same shape and dtype on every worker).
  // Collective. The default all-gathers (num_workers() times the bytes); the TCP ring and MPI
  // override it.
  virtual void broadcast(Tensor& host, int root);
  // Every worker's `host` (a CPU tensor of rank >= 1, the same shape and dtype on every worker)
  // concatenated along axis 0 in worker order. Collective. The default sums zero tensors holding
  // each worker's rows in its slot (exact: x + 0 == x) at num_workers() times the bytes of a real
  // all-gather; the TCP ring and MPI override it.
  virtual Tensor all_gather(const Tensor& host);
  // Extends the communicator of one local replica (of `local_replicas` in this process) to span
  // every replica of the job: reduce locally, cross workers, broadcast locally.
  virtual std::unique_ptr<Communicator> span_workers(std::unique_ptr<Communicator> local,
                                                     int local_replicas) = 0;
};

// What a training loop does differently under a strategy; the default is synchronous training with
// every worker reading the same global batches.
class DTRAIN_API TrainingPolicy {
 public:
  virtual ~TrainingPolicy() = default;
  // false: workers train on their own data shards without waiting for each other (ParameterServer).
  virtual bool synchronous() const { return true; }
  virtual InputShard input_shard() const { return {}; }
  // The job-wide step count an asynchronous job trains up to and restores with its checkpoints;
  // nullopt when the training loop counts its own steps.
  virtual std::optional<int64_t> job_step() const { return std::nullopt; }
  // Called once when training ends, before the final evaluation: an asynchronous chief waits for
  // the other workers there and writes its final checkpoint.
  virtual void on_training_end() {}
  // true: the local replicas are independent models (EnsembleStrategy's members): no gradient is
  // all-reduced, each replica reads its own shuffle of all the data with the full batch, losses are
  // averaged over them, and predictions gather every member.
  virtual bool independent_replicas() const { return false; }
};

class DTRAIN_API StrategyExtended {
 public:
  // A single-process, synchronous strategy: no cluster, no cross-worker ops, the default policy.
  StrategyExtended();
  StrategyExtended(std::optional<ClusterResolution> cluster,
                   std::shared_ptr<CrossWorkerOps> cross_worker,
                   std::shared_ptr<TrainingPolicy> policy);

  // This task in its job; nullptr for a single-process strategy.
  const ClusterResolution* cluster() const { return cluster_ ? &*cluster_ : nullptr; }
  // Whether this process logs, prints progress and writes files: the chief of a job, or the only
  // process.
  bool is_chief() const;
  // The training workers of the job (chief + workers; 1 for a single process), and this one's rank
  // among them (0 for the chief, a single process, and tasks that do not train).
  int num_workers() const;
  int worker_rank() const;
  // The cross-worker ops of a multi-worker strategy; nullptr otherwise.
  CrossWorkerOps* cross_worker() const { return cross_worker_.get(); }
  const std::shared_ptr<CrossWorkerOps>& shared_cross_worker() const { return cross_worker_; }

  // Sums host values over every worker of a synchronous multi-worker job; the identity where
  // workers do not synchronize (a single process, or an asynchronous job whose workers each report
  // their own).
  std::vector<double> sum_across_workers(std::vector<double> values);
  // every worker's `host` concatenated along axis 0 (CrossWorkerOps::all_gather); `host` itself
  // for a single process. Collective.
  Tensor gather_across_workers(const Tensor& host);
  // Sums tensors and example counts over every worker (Strategy::reduce's cross-worker step).
  // Collective.
  void reduce_across_workers(std::vector<Tensor>& sums, std::vector<int64_t>& counts);
  // Called by distribute_dataset before every step: under AutoShardPolicy OFF the workers agree to
  // stop when any one has run out of data. Returns whether this step runs. Collective when it
  // matters.
  bool agree_on_next(bool have_batch);

  bool synchronous() const { return policy_->synchronous(); }
  InputShard input_shard() const { return policy_->input_shard(); }
  std::optional<int64_t> job_step() const { return policy_->job_step(); }
  void on_training_end() { policy_->on_training_end(); }
  bool independent_replicas() const { return policy_->independent_replicas(); }

  AutoShardPolicy auto_shard_policy() const { return auto_shard_; }
  // kAuto becomes kData. Throws InvalidArgument for kFile (dtrain datasets are in memory).
  void set_auto_shard_policy(AutoShardPolicy policy);

 private:
  std::optional<ClusterResolution> cluster_;
  std::shared_ptr<CrossWorkerOps> cross_worker_;
  std::shared_ptr<TrainingPolicy> policy_;
  AutoShardPolicy auto_shard_ = AutoShardPolicy::kData;
};

}  // namespace dtrain
