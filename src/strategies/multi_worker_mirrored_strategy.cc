#include "dtrain/strategies/multi_worker_mirrored_strategy.h"

#include "collectives/hierarchical/hierarchical_communicator.h"
#include "collectives/mpi/mpi_communicator.h"
#include "collectives/nccl/nccl_local.h"
#include "dtrain/collectives/tcp.h"
#include "dtrain/core/logging.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

using Implementation = CommunicationOptions::Implementation;

// The cross-worker part of MultiWorkerMirrored: the communicators between the workers, used by
// local replica 0 during steps and by the training loop's thread between steps, never both at once.
class CollectiveCrossWorker final : public CrossWorkerOps {
 public:
  CollectiveCrossWorker(std::shared_ptr<CrossWorkerCommunicators> comms, int rank) : comms_(std::move(comms)), rank_(rank) {}
  int num_workers() const override { return comms_->workers; }
  int worker_rank() const override { return rank_; }
  void all_reduce_sum(Tensor& host) override { comms_->host->allreduce(host, ReduceOp::kSum).wait(); }
  void broadcast_from_chief(Tensor& host) override { comms_->host->broadcast(host, 0).wait(); }
  std::unique_ptr<Communicator> span_workers(std::unique_ptr<Communicator> local, int local_replicas) override {
    return make_hierarchical_communicator(std::move(local), comms_, local_replicas);
  }

 private:
  std::shared_ptr<CrossWorkerCommunicators> comms_;
  int rank_;
};

ClusterResolution training_worker(std::optional<ClusterResolution> given, Implementation impl) {
  std::optional<ClusterResolution> c = given ? std::move(given) : resolve_cluster(impl == Implementation::kMpi);
  if (!c)
    throw InvalidArgument("multi_worker_mirrored needs TF_CONFIG: start the job with dtrain-run -np N -- ./prog "
                          "--strategy=multi_worker_mirrored, or set TF_CONFIG on every task, e.g. "
                          "TF_CONFIG='{\"cluster\": {\"worker\": [\"host1:2222\", \"host2:2222\"]}, "
                          "\"task\": {\"type\": \"worker\", \"index\": 0}}'");
  if (!c->is_training_worker())
    throw FailedPrecondition("task " + c->task_name() + " is not a training worker; MultiWorkerMirroredStrategy runs "
                             "on the chief and worker tasks. Start every task through dtrain::run_task(), which "
                             "serves ps tasks and runs the evaluator itself");
  return std::move(*c);
}

// Connects this worker to the others with the implementation `comm` asks for.
StrategyExtended connect_workers(const std::vector<DeviceSpec>& devices, const CommunicationOptions& comm,
                                 ClusterResolution cluster, std::string token) {
  const bool gpus = !devices.empty() && devices[0].type == DeviceType::kCUDA;
  if (comm.implementation == Implementation::kNccl && !gpus)
    throw InvalidArgument("cross-worker NCCL needs GPU devices (--devices=gpu), but this worker's are CPUs; use "
                          "implementation RING (the TCP ring, DTRAIN_COLLECTIVE=ring) for CPU devices");
  auto comms = std::make_shared<CrossWorkerCommunicators>();
  comms->workers = cluster.num_workers();
  comms->timeout = comm.timeout;
  comms->compression = comm.compression;
  CollectiveOptions co;
  co.timeout = comm.timeout;
  if (comm.implementation == Implementation::kMpi) {
    if (!mpi_available()) make_mpi_communicator({});  // throws, saying how to get it
    comms->host = make_mpi_communicator(co);
    if (comms->host->size() != comms->workers || comms->host->rank() != cluster.worker_rank())
      throw Internal("MPI world disagrees with the OpenMPI environment variables");
  } else {
    TcpGroupOptions o;
    o.rank = cluster.worker_rank();
    for (TaskType t : {TaskType::kChief, TaskType::kWorker})
      if (cluster.cluster().has_job(t))
        for (size_t i = 0; i < cluster.cluster().job_tasks(t).size(); ++i) {
          o.addresses.push_back(cluster.cluster().job_tasks(t)[i]);
          o.task_names.push_back(std::string(task_type_name(t)) + ":" + std::to_string(i));
        }
    o.token = resolve_job_token(std::move(token));
    o.connect_timeout = comm.connect_timeout;
    o.collective = co;
    comms->host = connect_tcp_group(o);
    const bool use_nccl = comm.implementation == Implementation::kNccl ||
                          (comm.implementation == Implementation::kAuto && gpus && nccl_available());
    if (use_nccl && comms->workers > 1) {
      comms->device = make_nccl_process_group(devices[0], *comms->host, co);
      DTRAIN_LOG(INFO) << cluster.task_name() << ": gradients cross workers over NCCL (unique id via the TCP rendezvous)";
    }
  }
  DTRAIN_LOG(INFO) << cluster.task_name() << ": " << comms->workers << " workers x " << devices.size()
                   << " local replicas (" << cluster.source() << ")";
  const int rank = cluster.worker_rank();
  return StrategyExtended(std::move(cluster), std::make_shared<CollectiveCrossWorker>(std::move(comms), rank), nullptr);
}

MirroredOptions local_options(MirroredOptions local, const CommunicationOptions& comm) {
  local.bytes_per_pack = comm.bytes_per_pack;
  local.timeout = comm.timeout;
  return local;
}

}  // namespace

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MirroredOptions local, CommunicationOptions comm,
                                                         std::optional<ClusterResolution> cluster, std::string token)
    : MirroredStrategy(local_options(local, comm),
                       connect_workers(mirrored_devices(local), comm,
                                       training_worker(std::move(cluster), comm.implementation), std::move(token))) {}

MultiWorkerMirroredStrategy::~MultiWorkerMirroredStrategy() = default;

std::string MultiWorkerMirroredStrategy::name() const {
  return "MultiWorkerMirroredStrategy(" + cluster().task_name() + " of " + std::to_string(extended().num_workers()) +
         " workers, " + MirroredStrategy::name() + ")";
}

}  // namespace dtrain
