#include <cstdlib>
#include <limits>

#include "cluster/cluster_util.h"
#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain {

using cluster_detail::quote;

ClusterResolution::ClusterResolution(ClusterSpec cluster, TaskType type, int index,
                                     std::string source)
    : cluster_(std::move(cluster)), type_(type), index_(index), source_(std::move(source)) {
  const std::string job = task_type_name(type);
  const std::string where = source_ + ": task " + job + ":" + std::to_string(index);
  if (cluster_.empty())
    throw InvalidArgument(where + " has an empty cluster; list at least one worker, e.g. " +
                          cluster_detail::kClusterExample);
  if (index < 0) throw InvalidArgument(where + " has a negative index; task indices start at 0");
  const int n = cluster_.num_tasks(type);
  // TF lets an evaluator be absent from the cluster: it evaluates checkpoints on its own.
  if (n == 0 && type != TaskType::kEvaluator)
    throw InvalidArgument(where + ": the cluster " + cluster_.to_json() + " has no \"" + job +
                          "\" job; add it or pick a task type the cluster has");
  if (n == 0 && index != 0)
    throw InvalidArgument(where +
                          " is out of range: an evaluator outside the cluster is task "
                          "evaluator:0 (a job has at most one evaluator)");
  if (n > 0 && index >= n)
    throw InvalidArgument(where + " is out of range: job \"" + job + "\" has " + std::to_string(n) +
                          " task(s), indices 0.." + std::to_string(n - 1));
  if (n > 0) address_ = cluster_.task_address(type, index);

  const int chiefs = cluster_.num_tasks(TaskType::kChief);
  num_workers_ = cluster_.num_training_workers();
  is_chief_ = type == TaskType::kChief || (type == TaskType::kWorker && index == 0 && chiefs == 0);
  if (type == TaskType::kChief) worker_rank_ = 0;
  if (type == TaskType::kWorker) worker_rank_ = chiefs + index;
  rendezvous_ = chiefs > 0 ? cluster_.task_address(TaskType::kChief, 0)
                           : cluster_.task_address(TaskType::kWorker, 0);

  if (worker_rank_ >= 0) {
    // Training tasks in rank order; those on this task's host share its machine.
    std::vector<std::string> ranked = cluster_.job_tasks(TaskType::kChief);
    for (const auto& a : cluster_.job_tasks(TaskType::kWorker)) ranked.push_back(a);
    const std::string my_host = cluster_detail::lower(parse_host_port(address_).host);
    int before = 0, same = 0;
    for (int r = 0; r < static_cast<int>(ranked.size()); ++r) {
      if (cluster_detail::lower(parse_host_port(ranked[static_cast<size_t>(r)]).host) != my_host)
        continue;
      if (r < worker_rank_) ++before;
      ++same;
    }
    local_rank_ = before;
    local_size_ = same;
  }
}

ClusterResolution ClusterResolution::from_ranks(int rank, int num_workers,
                                                const std::string& rendezvous_address,
                                                std::string source) {
  if (num_workers < 1)
    throw InvalidArgument(source + ": the job has " + std::to_string(num_workers) +
                          " workers; it needs at least 1");
  if (rank < 0 || rank >= num_workers)
    throw InvalidArgument(source + ": rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(num_workers) + ")");
  const std::string problem = cluster_detail::address_problem(rendezvous_address);
  if (!problem.empty())
    throw InvalidArgument(source + ": the rendezvous address " + problem +
                          "; it is the host:port where rank 0 listens");
  ClusterResolution r;
  r.type_ = TaskType::kWorker;
  r.index_ = rank;
  r.is_chief_ = rank == 0;
  r.num_workers_ = num_workers;
  r.worker_rank_ = rank;
  r.rendezvous_ = rendezvous_address;
  r.source_ = std::move(source);
  if (rank == 0) r.address_ = rendezvous_address;
  return r;
}

std::string ClusterResolution::task_name() const {
  return std::string(task_type_name(type_)) + ":" + std::to_string(index_);
}

void ClusterResolution::set_local_placement(int local_rank, int local_size) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument(source_ + ": local rank " + std::to_string(local_rank) + " of " +
                          std::to_string(local_size) +
                          " is impossible; the local rank must be in [0, local size)");
  local_rank_ = local_rank;
  local_size_ = local_size;
}

std::vector<int> ClusterResolution::replica_ids(int local_devices) const {
  if (local_devices < 1)
    throw InvalidArgument("replica_ids: local_devices is " + std::to_string(local_devices) +
                          "; every worker needs at least one device");
  if (worker_rank_ < 0)
    throw FailedPrecondition("replica_ids: task " + task_name() +
                             " holds no replicas; only the chief and the workers train");
  if (static_cast<long long>(num_workers_) * local_devices > std::numeric_limits<int>::max())
    throw InvalidArgument("replica_ids: " + std::to_string(num_workers_) + " workers x " +
                          std::to_string(local_devices) + " devices overflows a replica id");
  std::vector<int> ids(static_cast<size_t>(local_devices));
  for (int i = 0; i < local_devices; ++i)
    ids[static_cast<size_t>(i)] = worker_rank_ * local_devices + i;
  return ids;
}

int ClusterResolution::num_replicas_in_sync(int local_devices) const {
  if (local_devices < 1)
    throw InvalidArgument("num_replicas_in_sync: local_devices is " +
                          std::to_string(local_devices) +
                          "; every worker needs at least one device");
  if (static_cast<long long>(num_workers_) * local_devices > std::numeric_limits<int>::max())
    throw InvalidArgument("num_replicas_in_sync: " + std::to_string(num_workers_) + " workers x " +
                          std::to_string(local_devices) + " devices overflows an int");
  return num_workers_ * local_devices;
}

std::string ClusterResolution::to_string() const {
  std::string s = task_name() + " (";
  if (worker_rank_ >= 0)
    s += "rank " + std::to_string(worker_rank_) + " of " + std::to_string(num_workers_);
  else
    s += "no rank, " + std::to_string(num_workers_) + " workers";
  s += is_chief_ ? ", chief" : "";
  s += ", rendezvous " + rendezvous_ + ", local " + std::to_string(local_rank_) + " of " +
       std::to_string(local_size_) + ", from " + source_ + ")";
  return s;
}

ClusterResolution explicit_cluster(std::vector<std::string> workers, int rank) {
  const int n = static_cast<int>(workers.size());
  if (n == 0)
    throw InvalidArgument(
        "explicit_cluster: the worker list is empty; pass every worker's host:port, e.g. "
        "{\"host0:2222\", \"host1:2222\"}");
  if (rank < 0 || rank >= n)
    throw InvalidArgument("explicit_cluster: rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(n) + ") for the " + std::to_string(n) + " workers " +
                          ClusterSpec({{TaskType::kWorker, workers}}).to_json());
  ClusterSpec spec({{TaskType::kWorker, std::move(workers)}});
  return ClusterResolution(std::move(spec), TaskType::kWorker, rank, "explicit");
}

std::vector<int> gpus_for_local_rank(int local_rank, int local_size, int num_gpus) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument("gpus_for_local_rank: local rank " + std::to_string(local_rank) + " of " +
                          std::to_string(local_size) + " is impossible; it must be in [0, " +
                          "local size)");
  if (num_gpus < 0)
    throw InvalidArgument("gpus_for_local_rank: num_gpus is " + std::to_string(num_gpus));
  if (local_size > num_gpus)
    throw InvalidArgument(
        "gpus_for_local_rank: " + std::to_string(local_size) + " tasks on this machine share " +
        std::to_string(num_gpus) + " GPU(s), and each needs its own; start at most " +
        std::to_string(num_gpus) + " task(s) per machine (srun --ntasks-per-node=" +
        std::to_string(num_gpus) + ", mpirun -npernode " + std::to_string(num_gpus) +
        ", or fewer hosts in TF_CONFIG), or train on CPU devices (--devices cpu:N)");
  const int per_rank = num_gpus / local_size;
  if (num_gpus % local_size != 0 && local_rank == 0) {
    DTRAIN_LOG(WARNING) << "gpus_for_local_rank: " << num_gpus << " GPUs do not split evenly over "
                        << local_size << " local tasks; GPUs " << per_rank * local_size << ".."
                        << num_gpus - 1 << " stay idle so every worker has " << per_rank
                        << " replica(s)";
  }
  std::vector<int> gpus;
  for (int k = 0; k < per_rank; ++k) gpus.push_back(local_rank + k * local_size);
  return gpus;
}

std::optional<ClusterResolution> resolve_cluster(bool mpi) {
  // The MPI transport wires the ranks itself; the resolution still wants a rendezvous address,
  // which nothing dials.
  if (mpi) return resolve_openmpi("127.0.0.1:1");
  if (std::optional<ClusterResolution> tf = from_environment()) return tf;
  if (std::getenv("SLURM_PROCID")) return resolve_slurm();  // srun without TF_CONFIG
  return std::nullopt;
}

std::string resolve_job_token(std::string token) {
  if (token.empty()) {
    const char* env = std::getenv("DTRAIN_JOB_TOKEN");
    token = env ? env : "";
  }
  if (token.empty())
    throw InvalidArgument(
        "DTRAIN_JOB_TOKEN is not set: every task of a multi-process job must share a secret token "
        "(dtrain-run generates one; or export DTRAIN_JOB_TOKEN=$(openssl rand -hex 32) on every "
        "task)");
  return token;
}

}  // namespace dtrain
