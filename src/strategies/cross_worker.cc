#include "strategies/cross_worker.h"

#include <cstring>

#include "collectives/hierarchical/hierarchical_communicator.h"
#include "collectives/mpi/mpi_communicator.h"
#include "collectives/nccl/nccl_local.h"
#include "dtrain/collectives/tcp.h"
#include "dtrain/core/logging.h"
#include "dtrain/devices/device.h"

namespace dtrain::detail {
namespace {

using Implementation = CommunicationOptions::Implementation;

// The communicators between the workers, used by local replica 0 during steps and by the training
// loop's thread between steps, never both at once.
class CollectiveCrossWorker final : public CrossWorkerOps {
 public:
  CollectiveCrossWorker(std::shared_ptr<CrossWorkerCommunicators> comms, int rank)
      : comms_(std::move(comms)), rank_(rank) {}
  int num_workers() const override { return comms_->workers; }
  int worker_rank() const override { return rank_; }
  void all_reduce_sum(Tensor& host) override {
    comms_->host->allreduce(host, ReduceOp::kSum).wait();
  }
  void broadcast_from_chief(Tensor& host) override { comms_->host->broadcast(host, 0).wait(); }
  void broadcast(Tensor& host, int root) override { comms_->host->broadcast(host, root).wait(); }
  Tensor all_gather(const Tensor& host) override {
    std::vector<int64_t> dims = host.shape().dims();
    if (dims.empty()) throw InvalidArgument("all_gather needs a tensor of rank >= 1, got a scalar");
    dims[0] *= comms_->workers;
    Tensor out = Tensor::empty(Shape(dims), host.dtype());
    comms_->host->allgather(host, out).wait();
    return out;
  }
  std::unique_ptr<Communicator> span_workers(std::unique_ptr<Communicator> local,
                                             int local_replicas) override {
    return make_hierarchical_communicator(std::move(local), comms_, local_replicas);
  }

 private:
  std::shared_ptr<CrossWorkerCommunicators> comms_;
  int rank_;
};

}  // namespace

ClusterResolution training_worker(std::optional<ClusterResolution> given, Implementation impl,
                                  const std::string& strategy) {
  std::optional<ClusterResolution> c =
      given ? std::move(given) : resolve_cluster(impl == Implementation::kMpi);
  if (!c)
    throw InvalidArgument(
        strategy +
        " needs TF_CONFIG: start the job with dtrain-run -np N -- ./prog "
        "--strategy=" +
        strategy +
        ", or set TF_CONFIG on every task, e.g. "
        "TF_CONFIG='{\"cluster\": {\"worker\": [\"host1:2222\", \"host2:2222\"]}, "
        "\"task\": {\"type\": \"worker\", \"index\": 0}}'");
  if (!c->is_training_worker())
    throw FailedPrecondition(
        "task " + c->task_name() + " is not a training worker; " + strategy +
        " runs on the chief and worker tasks. Start every task through dtrain::run_task(), "
        "which serves ps tasks and runs the evaluator itself");
  return std::move(*c);
}

std::shared_ptr<CrossWorkerOps> connect_cross_worker(const std::vector<DeviceSpec>& devices,
                                                     const CommunicationOptions& comm,
                                                     const ClusterResolution& cluster,
                                                     std::string token) {
  const bool gpus = !devices.empty() && devices[0].type == DeviceType::kCUDA;
  if (comm.implementation == Implementation::kNccl && !gpus)
    throw InvalidArgument(
        "cross-worker NCCL needs GPU devices (--devices=gpu), but this worker's are CPUs; use "
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
    const bool use_nccl =
        comm.implementation == Implementation::kNccl ||
        (comm.implementation == Implementation::kAuto && gpus && nccl_available());
    if (use_nccl && comms->workers > 1) {
      comms->device = make_nccl_process_group(devices[0], *comms->host, co);
      DTRAIN_LOG(INFO) << cluster.task_name()
                       << ": gradients cross workers over NCCL (unique id via the TCP rendezvous)";
    }
  }
  DTRAIN_LOG(INFO) << cluster.task_name() << ": " << comms->workers << " workers x "
                   << devices.size() << " local replicas (" << cluster.source() << ")";
  return std::make_shared<CollectiveCrossWorker>(std::move(comms), cluster.worker_rank());
}

}  // namespace dtrain::detail

namespace dtrain {

Tensor CrossWorkerOps::all_gather(const Tensor& host) {
  // Every worker's rows in its own slot of a zero tensor, summed: exact (x + 0 == x), at
  // num_workers() times the bytes of a real all-gather; transports override it.
  if (host.shape().rank() == 0)
    throw InvalidArgument("all_gather needs a tensor of rank >= 1, got a scalar");
  std::vector<int64_t> dims = host.shape().dims();
  dims[0] *= num_workers();
  Tensor out = Tensor::zeros(Shape(dims), host.dtype());
  std::memcpy(
      static_cast<char*>(out.raw_data()) + host.nbytes() * static_cast<size_t>(worker_rank()),
      host.raw_data(), host.nbytes());
  all_reduce_sum(out);
  return out;
}

void CrossWorkerOps::broadcast(Tensor& host, int root) {
  if (root < 0 || root >= num_workers())
    throw InvalidArgument("broadcast: root " + std::to_string(root) + " is not a worker of " +
                          std::to_string(num_workers()));
  if (root == 0) return broadcast_from_chief(host);
  const Tensor flat = host.view(Shape{1, host.numel()});
  const Tensor all = all_gather(flat);
  std::memcpy(host.raw_data(), all.slice_rows(root, root + 1).raw_data(), host.nbytes());
}

}  // namespace dtrain
