// MultiWorkerMirroredStrategy: synchronous data parallelism over several processes (TF's
// tf.distribute.MultiWorkerMirroredStrategy). Each worker process mirrors the model on its local
// devices; replicas = workers x local devices. A gradient all-reduce is hierarchical: the local
// replicas reduce in shared memory, local replica 0 all-reduces across workers over the TCP ring
// (authenticated with the job token), and broadcasts the result back to the local replicas.
//
// Initial variables are broadcast from the chief. Datasets batched at the global batch are
// auto-sharded: with DATA (the default for in-memory datasets) every worker reads the same global
// batches and keeps its replicas' rows, so N workers see exactly what one device would; with OFF
// each worker keeps its whole batch and the workers agree to stop when any runs out.
#pragma once

#include <chrono>
#include <memory>
#include <optional>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/export.h"
#include "dtrain/strategies/mirrored_strategy.h"

namespace dtrain {

struct DTRAIN_API CommunicationOptions {
  // kRing: TCP ring between workers (TF_CONFIG / SLURM); kNccl: NCCL between the workers' GPUs, its
  // unique id sent over the authenticated TCP rendezvous (host values still use the ring); kAuto:
  // NCCL for GPU devices when built in, else the ring; kMpi: OpenMPI's collectives under mpirun.
  enum class Implementation { kAuto, kRing, kNccl, kMpi };
  Implementation implementation = Implementation::kAuto;
  // The gradient pack size (MirroredOptions::bytes_per_pack; this one wins when both are set).
  // Unset: auto_bytes_per_pack() of the number of workers.
  std::optional<size_t> bytes_per_pack;
  // Cross-worker gradient compression (the local all-reduce inside a worker stays float32);
  // DTRAIN_COMPRESSION=none|fp16|bf16 sets it for make_strategy.
  Compression compression = Compression::kNone;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(120)};
  // true: every variable starts from the chief's value, broadcast when it is created (a collective:
  // every worker creates the same variables in the same order). false: variables keep their local
  // initial values; for elastic jobs, where a worker that joins later creates its variables alone
  // and elastic::run brings it the state by broadcast instead.
  bool broadcast_initial_values = true;
};

// MirroredStrategy assembled with a cross-worker part (a TCP ring, NCCL or MPI communicator between
// the workers) and this task's cluster context; it adds no behaviour of its own.
class DTRAIN_API MultiWorkerMirroredStrategy : public MirroredStrategy {
 public:
  // cluster: nullopt = resolved from the environment (TF_CONFIG, else SLURM under srun; OpenMPI's
  // variables for kMpi). token: "" = DTRAIN_JOB_TOKEN.
  // Throws InvalidArgument for a missing/malformed TF_CONFIG or a missing token, FailedPrecondition
  // for a ps/evaluator task; DeadlineExceeded / PermissionDenied when the workers cannot all
  // connect.
  explicit MultiWorkerMirroredStrategy(MirroredOptions local = {},
                                       CommunicationOptions communication = {},
                                       std::optional<ClusterResolution> cluster = std::nullopt,
                                       std::string token = "");
  ~MultiWorkerMirroredStrategy() override;
  std::string name() const override;
  const ClusterResolution& cluster() const { return *extended().cluster(); }
  // Same as extended().set_auto_shard_policy().
  void set_auto_shard_policy(AutoShardPolicy p) { extended().set_auto_shard_policy(p); }
  // Elastic training (dtrain/train/elastic.h): closes the connections to the current workers and
  // connects to those of `cluster` (a new membership: other workers, another rank), authenticating
  // with `token`. Variables and optimizer state stay as they are; num_replicas_in_sync(), replica
  // ids and the data shard follow the new membership. Call between steps, on every worker of the
  // new membership. Throws what the constructor throws for connecting; the strategy cannot run
  // until a later reconnect succeeds.
  void reconnect(ClusterResolution cluster, std::string token);

 private:
  CommunicationOptions communication_;
};

}  // namespace dtrain
