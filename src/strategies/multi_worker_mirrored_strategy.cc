#include "dtrain/strategies/multi_worker_mirrored_strategy.h"

#include <cstdlib>

#include "collectives/mpi/mpi_communicator.h"
#include "collectives/nccl/nccl_local.h"
#include "collectives/reduction.h"
#include "dtrain/collectives/tcp.h"
#include "dtrain/core/logging.h"
#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"
#include "strategies/ps/ps_tasks.h"

namespace dtrain {

// The cross-worker communicator (TCP). Used by local replica 0 during steps and by the main
// thread between steps — never by both at once.
struct MultiWorkerMirroredStrategy::Cross {
  std::unique_ptr<Communicator> comm;
  // NCCL between the workers' first GPUs (unique id sent over `comm`): carries device tensors
  // without staging them through host memory. Null for CPU devices and RING/MPI.
  std::unique_ptr<Communicator> device_comm;
  int workers = 1;
  int local = 1;
};

namespace {

Tensor to_host(const Tensor& t) { return t.device().host_accessible() ? t : t.to(DeviceSpec::cpu()); }

// Local shared-memory reduction, then local replica 0 across workers, then local broadcast.
class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(std::unique_ptr<Communicator> local, std::shared_ptr<MultiWorkerMirroredStrategy::Cross> cross)
      : local_(std::move(local)), cross_(std::move(cross)) {}
  int rank() const override { return cross_->comm->rank() * cross_->local + local_->rank(); }
  int size() const override { return cross_->workers * cross_->local; }

  Work allreduce(Tensor& t, ReduceOp op) override {
    const ReduceOp partial = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    local_->allreduce(t, partial).wait();
    if (local_->rank() == 0) {
      if (cross_->device_comm && !t.device().host_accessible()) {
        cross_->device_comm->allreduce(t, partial).wait();
      } else {
        Tensor h = to_host(t);
        cross_->comm->allreduce(h, partial).wait();
        if (h.raw_data() != t.raw_data()) t.copy_from(h);
      }
    }
    local_->broadcast(t, 0).wait();
    if (op == ReduceOp::kMean) {
      if (t.device().host_accessible()) {
        collectives::scale_for_mean(t.raw_data(), static_cast<size_t>(t.numel()), t.dtype(), size());
      } else {
        t.copy_from(kernels_for(t).affine(t, 1.f / static_cast<float>(size()), 0.f));
      }
    }
    return Work::completed();
  }
  Work barrier() override {
    local_->barrier().wait();
    if (local_->rank() == 0) cross_->comm->barrier().wait();
    local_->barrier().wait();
    return Work::completed();
  }
  Work broadcast(Tensor& t, int root) override {
    if (root != 0) throw Unimplemented("hierarchical broadcast supports root 0 (the chief's first replica)");
    if (local_->rank() == 0) {
      if (cross_->device_comm && !t.device().host_accessible()) {
        cross_->device_comm->broadcast(t, 0).wait();
      } else {
        Tensor h = to_host(t);
        cross_->comm->broadcast(h, 0).wait();
        if (h.raw_data() != t.raw_data()) t.copy_from(h);
      }
    }
    return local_->broadcast(t, 0);
  }
  Work reduce(Tensor& t, int root, ReduceOp op) override {
    if (root != 0) throw Unimplemented("hierarchical reduce supports root 0");
    Tensor copy = t.clone();
    allreduce(copy, op);
    if (rank() == 0) t.copy_from(copy);
    return Work::completed();
  }
  Work allgather(const Tensor&, Tensor&) override {
    throw Unimplemented("MultiWorkerMirroredStrategy's replica contexts gather with merge_call; "
                        "use connect_tcp_group() directly for a cross-worker allgather");
  }
  Work reduce_scatter(const Tensor&, Tensor&, ReduceOp) override {
    throw Unimplemented("MultiWorkerMirroredStrategy does not reduce-scatter; use connect_tcp_group() directly");
  }
  void abort(const std::string& reason) override {
    local_->abort(reason);
    cross_->comm->abort(reason);
    if (cross_->device_comm) cross_->device_comm->abort(reason);
  }

 private:
  std::unique_ptr<Communicator> local_;
  std::shared_ptr<MultiWorkerMirroredStrategy::Cross> cross_;
};

ClusterResolution resolve_cluster(std::optional<ClusterResolution> given, CommunicationOptions::Implementation impl) {
  if (given) return *given;
  // MPI wires the ranks itself; the resolver still wants a rendezvous address, which nothing uses.
  if (impl == CommunicationOptions::Implementation::kMpi) return resolve_openmpi("127.0.0.1:1");
  std::optional<ClusterResolution> env = from_environment();
  if (!env && std::getenv("SLURM_PROCID")) return resolve_slurm();  // srun without TF_CONFIG
  if (!env)
    throw InvalidArgument("multi_worker_mirrored needs TF_CONFIG: start the job with dtrain-run -np N -- ./prog "
                          "--strategy=multi_worker_mirrored, or set TF_CONFIG on every task, e.g. "
                          "TF_CONFIG='{\"cluster\": {\"worker\": [\"host1:2222\", \"host2:2222\"]}, "
                          "\"task\": {\"type\": \"worker\", \"index\": 0}}'");
  return *env;
}

}  // namespace

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MirroredOptions local, CommunicationOptions comm,
                                                         std::optional<ClusterResolution> cluster, std::string token)
    : MirroredStrategy([&] {
        local.bytes_per_pack = comm.bytes_per_pack;
        local.timeout = comm.timeout;
        return local;
      }()),
      cluster_(resolve_cluster(std::move(cluster), comm.implementation)),
      cross_(std::make_shared<Cross>()) {
  if (!cluster_.is_training_worker())
    throw InvalidArgument("task " + cluster_.task_name() + " is not a training worker; MultiWorkerMirroredStrategy "
                          "runs on the chief and worker tasks (ps and evaluator tasks belong to other strategies)");
  Impl& m = impl();
  const bool gpus = !m.devices.empty() && m.devices[0].type == DeviceType::kCUDA;
  if (comm.implementation == CommunicationOptions::Implementation::kNccl && !gpus)
    throw InvalidArgument("cross-worker NCCL needs GPU devices (--devices=gpu), but this worker's are CPUs; use "
                          "implementation RING (the TCP ring, DTRAIN_COLLECTIVE=ring) for CPU devices");
  const bool use_nccl = comm.implementation == CommunicationOptions::Implementation::kNccl ||
                        (comm.implementation == CommunicationOptions::Implementation::kAuto && gpus && nccl_available());
  cross_->workers = cluster_.num_workers();
  cross_->local = static_cast<int>(m.devices.size());
  if (comm.implementation == CommunicationOptions::Implementation::kMpi) {
    if (!mpi_available()) make_mpi_communicator({});  // throws, saying how to get it
    CollectiveOptions co;
    co.timeout = comm.timeout;
    cross_->comm = make_mpi_communicator(co);
    if (cross_->comm->size() != cross_->workers || cross_->comm->rank() != cluster_.worker_rank())
      throw Internal("MPI world disagrees with the OpenMPI environment variables");
    finish_setup();
    return;
  }
  token = ps::job_token(std::move(token));
  TcpGroupOptions o;
  o.rank = cluster_.worker_rank();
  for (TaskType t : {TaskType::kChief, TaskType::kWorker})
    if (cluster_.cluster().has_job(t))
      for (size_t i = 0; i < cluster_.cluster().job_tasks(t).size(); ++i) {
        o.addresses.push_back(cluster_.cluster().job_tasks(t)[i]);
        o.task_names.push_back(std::string(task_type_name(t)) + ":" + std::to_string(i));
      }
  o.token = token;
  o.connect_timeout = comm.connect_timeout;
  o.collective.timeout = comm.timeout;
  cross_->comm = connect_tcp_group(o);
  if (use_nccl && cross_->workers > 1) {
    CollectiveOptions co;
    co.timeout = comm.timeout;
    cross_->device_comm = make_nccl_process_group(m.devices[0], *cross_->comm, co);
    DTRAIN_LOG(INFO) << cluster_.task_name() << ": gradients cross workers over NCCL (unique id via the TCP rendezvous)";
  }
  finish_setup();
}

void MultiWorkerMirroredStrategy::finish_setup() {
  Impl& m = impl();
  m.replica_offset = cluster_.worker_rank() * cross_->local;
  m.global_replicas = cross_->workers * cross_->local;
  auto cross = cross_;
  Impl* impl_ptr = &m;
  m.on_group_made = [impl_ptr, cross] {
    for (auto& c : impl_ptr->comms) c = std::make_unique<HierarchicalCommunicator>(std::move(c), cross);
  };
  m.on_group_made();
  DTRAIN_LOG(INFO) << cluster_.task_name() << ": " << cross_->workers << " workers x " << cross_->local
                   << " local replicas (" << cluster_.source() << ")";
}

MultiWorkerMirroredStrategy::~MultiWorkerMirroredStrategy() = default;

std::string MultiWorkerMirroredStrategy::name() const {
  return "MultiWorkerMirroredStrategy(" + cluster_.task_name() + " of " + std::to_string(cross_->workers) +
         " workers, " + MirroredStrategy::name() + ")";
}

bool MultiWorkerMirroredStrategy::is_chief() const { return cluster_.is_chief(); }

void MultiWorkerMirroredStrategy::set_auto_shard_policy(AutoShardPolicy p) {
  if (p == AutoShardPolicy::kFile)
    throw InvalidArgument("AutoShardPolicy::kFile shards by input files, and dtrain datasets are in memory; use kData or kOff");
  policy_ = p == AutoShardPolicy::kAuto ? AutoShardPolicy::kData : p;
}

std::vector<double> MultiWorkerMirroredStrategy::sum_across_workers(std::vector<double> values) {
  if (cross_->workers == 1 || values.empty()) return values;
  Tensor t = Tensor::from_vector<double>(values, Shape{static_cast<int64_t>(values.size())});
  cross_->comm->allreduce(t, ReduceOp::kSum).wait();
  return t.to_vector<double>();
}

std::shared_ptr<Variable> MultiWorkerMirroredStrategy::do_create_variable(const VariableSpec& spec) {
  std::shared_ptr<Variable> v = MirroredStrategy::do_create_variable(spec);
  if (cross_->workers > 1) {  // every worker starts from the chief's values
    Tensor h = v->device_values()[0].to(DeviceSpec::cpu()).clone();
    cross_->comm->broadcast(h, 0).wait();
    for (Tensor copy : v->device_values()) copy.copy_from(h);  // handles alias the variable's memory
  }
  return v;
}

PerReplica MultiWorkerMirroredStrategy::do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch) {
  if (policy_ == AutoShardPolicy::kOff) {
    PerReplica out = MirroredStrategy::do_split_batch(batch, global_batch);
    out.global_rows = static_cast<int64_t>(sum_across_workers({static_cast<double>(batch.empty() ? 0 : batch[0].shape()[0])})[0]);
    return out;
  }
  // DATA: every worker reads the same global batch and keeps its own replicas' rows.
  const int64_t rows = batch.empty() ? 0 : batch[0].shape()[0];
  const int total = num_replicas_in_sync();
  const std::vector<int64_t> sizes = split_batch_sizes(rows, std::max(global_batch, rows), total);
  int64_t begin = 0;
  for (int r = 0; r < impl().replica_offset; ++r) begin += sizes[static_cast<size_t>(r)];
  PerReplica out;
  out.values.resize(static_cast<size_t>(cross_->local));
  for (int r = 0; r < cross_->local; ++r) {
    const int64_t n = sizes[static_cast<size_t>(impl().replica_offset + r)];
    for (const auto& t : batch)
      out.values[static_cast<size_t>(r)].push_back(t.slice_rows(begin, begin + n).share_to(worker_devices()[static_cast<size_t>(r)]));
    begin += n;
  }
  out.global_rows = rows;
  return out;
}

void MultiWorkerMirroredStrategy::reduce_across_workers(std::vector<Tensor>& sums, std::vector<int64_t>& counts) {
  if (cross_->workers == 1) return;
  for (Tensor& s : sums) {
    Tensor h = s.to(DeviceSpec::cpu()).clone();
    cross_->comm->allreduce(h, ReduceOp::kSum).wait();
    s = h.to(s.device());
  }
  std::vector<double> c(counts.begin(), counts.end());
  c = sum_across_workers(c);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int64_t>(c[i]);
}

bool MultiWorkerMirroredStrategy::agree_on_next(bool have_batch) {
  if (cross_->workers == 1 || policy_ != AutoShardPolicy::kOff) return have_batch;  // DATA: same batches everywhere
  const double ready = sum_across_workers({have_batch ? 1.0 : 0.0})[0];
  if (have_batch && ready < cross_->workers) {
    DTRAIN_LOG(INFO) << "another worker ran out of data: all workers stop together";
  }
  return ready == cross_->workers;
}

}  // namespace dtrain
