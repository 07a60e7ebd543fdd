// Private to src/strategies: the state behind MirroredStrategy / CentralStorageStrategy.
#pragma once

#include <mutex>
#include <optional>

#include "devices/worker_thread.h"
#include "dtrain/collectives/communicator.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/strategies/strategy_extended.h"

namespace dtrain {

class MirroredReplicaContext;
class ShardedParameters;

// This replica's part of the sum of some float32 tensors over the replicas, from a reduce-scatter
// of them packed into one buffer (padded to a whole number of 64-byte blocks per replica).
struct ScatteredSum {
  Tensor shard;                  // this replica's block of the packed sum
  int64_t padded = 0;            // elements of the packed buffer (shard.numel() x replicas)
  std::vector<int64_t> starts;   // per tensor: its first element in the packed buffer
  std::vector<Tensor> slices;    // per tensor: its elements within `shard`, flat (possibly empty)
  std::vector<int64_t> offsets;  // per tensor: where its slice starts within the tensor
  // Laid out by the fixed partition (sharded update): block r holds part r of every tensor, end to
  // end (partition_range), not the tensors end to end.
  bool partitioned = false;
};

// Fuses gradients into packs as backward produces them and all-reduces each pack on the
// replica's communication thread (see MirroredOptions::bytes_per_pack). When the replicas share
// their variables, or under MirroredOptions::sharding, float32 packs are reduce-scattered instead
// (each replica then updates its part); ZeRO-2/3 release the packed local gradients.
class GradientPacker final : public tape::GradientReadyHook {
 public:
  explicit GradientPacker(MirroredReplicaContext* ctx) : ctx_(ctx) {}
  void reset();
  void on_ready(size_t index, const Tensor& grad, bool exclusive) override;
  void on_done() override;
  // If `grads` are exactly the gradients this packer saw (same tensors, same order), waits for
  // their packs and returns the reduced tensors; otherwise returns false.
  bool take(const std::vector<Tensor>& grads, ReduceOp op, std::vector<Tensor>* out);
  // As take(), for a sharded update: this replica's slices of the sums and where they start.
  bool take_slices(const std::vector<Tensor>& grads, ReplicaContext::UpdateSlices* out);
  bool idle() const { return packs_.empty(); }

 private:
  struct Pack {
    std::vector<size_t> indices;
    std::vector<Tensor> grads;
    std::vector<bool> exclusive;  // per gradient: the tape lets the packer release its memory
    size_t bytes = 0;
    std::future<std::vector<Tensor>> result;  // all-reduced, or
    std::future<ScatteredSum> scattered;      // reduce-scattered
    int64_t first_ready_us = 0;               // timeline: when its first gradient was ready
  };
  // Whether `grads` are exactly the defined gradients seen, in order.
  bool same_as_seen(const std::vector<Tensor>& grads) const;
  void launch(bool last);
  MirroredReplicaContext* ctx_;
  std::vector<Tensor> seen_;  // by source index
  std::vector<Pack> packs_;
  Pack current_;
};

class MirroredReplicaContext final : public ReplicaContext {
 public:
  MirroredReplicaContext(MirroredStrategy* s, MirroredStrategy::Impl* impl, int replica);
  Strategy& strategy() const override;
  int replica_id_in_sync_group() const override;
  int local_replica() const { return replica_; }
  int num_replicas_in_sync() const override;
  DeviceSpec device() const override;
  std::vector<Tensor> all_reduce(ReduceOp op, const std::vector<Tensor>& values) override;
  Tensor all_gather(const Tensor& value, int axis) override;
  std::vector<Tensor> merge_call(
      const std::function<std::vector<Tensor>(Strategy&, const PerReplica&)>& fn,
      const std::vector<Tensor>& args) override;

  // Packs `values` into one buffer per dtype, all-reduces it and returns new tensors (never
  // aliasing the inputs): on the communication thread, or — with `deferred` — on the thread that
  // calls get() (no thread hand-off; used when nothing is left to overlap with).
  std::future<std::vector<Tensor>> all_reduce_async(ReduceOp op, std::vector<Tensor> values,
                                                    bool deferred = false);
  // Packs float32 `values` into one buffer and reduce-scatters it (SUM), on the communication
  // thread or, with `deferred`, on the thread that calls get().
  std::future<ScatteredSum> reduce_scatter_async(std::vector<Tensor> values, bool deferred = false);
  // As reduce_scatter_async, laid out by the fixed partition of a sharded update: this replica's
  // shard holds its part (partition_range) of every tensor.
  // `release` (per value): once packed, its memory is released (Tensor::release_memory): the
  // packing then runs on the calling thread, before the collective is queued.
  std::future<ScatteredSum> reduce_scatter_partitioned_async(std::vector<Tensor> values,
                                                             bool deferred = false,
                                                             std::vector<bool> release = {});
  // Sharding::kParameters: the whole values of variables from every replica's parts (this
  // replica's are `parts`, flat), one all-gather per dtype; new tensors of `shapes`.
  std::future<std::vector<Tensor>> gather_parameters_async(std::vector<Tensor> parts,
                                                           std::vector<Shape> shapes,
                                                           bool deferred);
  // Whether a collective may run on the calling thread: nothing queued on the communication
  // thread (gradient packs, parameter prefetches).
  bool comm_idle() const;
  // The whole sums back from a reduce-scatter (an all-gather of the shards); new tensors.
  std::vector<Tensor> gather_sums(const ScatteredSum& s, const std::vector<Tensor>& like);
  std::optional<UpdateSlices> reduce_scatter_for_update(
      const std::vector<Tensor>& grads,
      const std::vector<std::shared_ptr<Variable>>& vars) override;
  void end_sharded_update() override;
  // Between reduce_scatter_for_update() and end_sharded_update(): shared variables' update() hands
  // this replica the shared copy to write its slices into.
  bool in_sharded_update() const { return sharded_update_; }
  void end_interrupted_update() {
    sharded_update_ = false;
    sharded_vars_.clear();
  }  // a step that failed mid-update
  GradientPacker& packer() { return packer_; }
  Sharding sharding() const;
  size_t bytes_per_pack() const;
  bool shares_variables() const;
  void barrier();

 private:
  MirroredStrategy* strategy_;
  MirroredStrategy::Impl* impl_;
  int replica_;
  // `body` run on this replica's communication thread (after what is queued there), or with
  // `deferred` on the thread that calls get().
  template <typename F>
  auto on_comm_thread(F body, bool deferred) -> std::future<decltype(body())>;
  // A sharded update's end: every replica's updated parts of `vars` into every copy.
  void gather_parts(const std::vector<std::shared_ptr<Variable>>& vars);
  GradientPacker packer_;
  bool sharded_update_ = false;
  std::vector<std::shared_ptr<Variable>> sharded_vars_;  // the update's variables (sharding)
};

// Sharding::kParameters (sharded_parameters.cc): gathers and releases the variables of layers
// marked shard_parameters, per replica, and prefetches the group that followed the one gathered in
// the previous step (FSDP's forward and backward prefetch, by recorded execution order).
class ShardedParameters final : public ParameterGatherer {
 public:
  ShardedParameters(MirroredStrategy* owner, MirroredStrategy::Impl* impl);
  ~ShardedParameters() override;
  void gather(const std::vector<std::shared_ptr<Variable>>& vars) override;
  void release(const std::vector<std::shared_ptr<Variable>>& vars) override;
  // The end of replica `local`'s update: releases what is still gathered (layers run without
  // recompute_grad under a tape), waits for unused prefetches, and keeps this step's order.
  void end_step(MirroredReplicaContext& ctx);
  // After a failed step: forgets prefetches and order (the group is remade).
  void reset();
  bool pending(int local) const;

 private:
  struct Replica;
  MirroredReplicaContext* context() const;
  void start_gather(MirroredReplicaContext& ctx, Replica& r, const Variable* key);
  MirroredStrategy* owner_;
  MirroredStrategy::Impl* impl_;
  std::vector<std::unique_ptr<Replica>> replicas_;  // by local replica
};

struct MirroredStrategy::Impl {
  MirroredOptions options;
  CrossDeviceOps chosen = CrossDeviceOps::kInproc;
  std::vector<DeviceSpec> devices;
  // The other workers of a multi-worker job (null for one process): spans each replica's
  // communicator over the job; replica ids and counts are global.
  std::shared_ptr<CrossWorkerOps> cross;
  bool broadcast_initial = true;  // variables start from the chief's values (multi-worker)
  // Replicas share their ON_WRITE variables' memory and update slices of them (one process, logical
  // CPU devices, MirroredOptions::share_host_variables); fixed at construction.
  bool shared_variables = false;
  int replica_offset = 0;   // this worker's first global replica id
  int global_replicas = 1;  // replicas of the whole job
  // Gradient pack size in bytes (MirroredOptions::bytes_per_pack, or chosen by the number of
  // workers; SIZE_MAX: one pack).
  size_t pack_bytes = size_t{4} << 20;
  std::vector<std::unique_ptr<Communicator>> comms;  // one per replica
  std::vector<std::unique_ptr<WorkerThread>>
      comm_threads;  // one per replica: collectives in FIFO order
  std::vector<std::unique_ptr<MirroredReplicaContext>> contexts;
  // Sharding::kParameters. Shared so that the strategy's variables can tell, through a weak_ptr,
  // that it is gone (its destructor makes them whole again for a model that outlives the strategy).
  std::shared_ptr<ShardedParameters> params;
  // merge_call / all_gather exchange
  std::mutex exchange_mu;
  std::vector<std::vector<Tensor>> exchange;
  std::vector<Tensor> exchange_result;

  // Replica ids and counts from the job's workers in `parts` (none: this process alone).
  void span_workers(const StrategyExtended& parts);
  void make_group();  // (re)creates comms; called at start and after a failed step
  // Returns once what is queued on every replica's communication thread has run: the gradient
  // packs a backward pass launched use the contexts and `comms`, so they must be done before a
  // failed step drops the packs and replaces the group, and before either is destroyed.
  void drain_comm_threads();
};

template <typename F>
auto MirroredReplicaContext::on_comm_thread(F body, bool deferred)
    -> std::future<decltype(body())> {
  using R = decltype(body());
  if (deferred) return std::async(std::launch::deferred, std::move(body));
  auto task = std::make_shared<std::packaged_task<R()>>(std::move(body));
  std::future<R> f = task->get_future();
  impl_->comm_threads[static_cast<size_t>(replica_)]->submit([task] { (*task)(); });
  return f;
}

// Builds the communicators for `devices` with the requested ops; sets *chosen and logs why.
std::vector<std::unique_ptr<Communicator>> make_cross_device_group(
    const std::vector<DeviceSpec>& devices, CrossDeviceOps requested, CollectiveOptions options,
    CrossDeviceOps* chosen);

}  // namespace dtrain
