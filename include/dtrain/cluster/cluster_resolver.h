// Cluster resolution: turns a launcher's description of a multi-worker job into a
// ClusterResolution, the cluster plus this task plus the facts TensorFlow derives from them (who is
// chief, how many workers train, this task's rank, where the rendezvous is). Sources, like TF's
// cluster resolvers:
//   TF_CONFIG      resolve_tf_config(json), from_environment()
//   SLURM (srun)   resolve_slurm(port_base)
//   OpenMPI        resolve_openmpi(rendezvous_address)
//   a host list    explicit_cluster(workers, rank)
// Resolution only reads and checks; connecting to the peers is the rendezvous' job.
//
// TensorFlow's rules, as in tf.distribute's multi_worker_util:
//   - the chief is the "chief" task when the cluster has a chief job, else worker 0;
//   - the workers that train are the chief plus the "worker" tasks (MultiWorkerMirroredStrategy);
//     their ranks are 0 for the chief, then the workers in order; ps and evaluator have no rank;
//   - the rendezvous is on the chief's address (chief:0 if present, else worker:0);
//   - replica ids are worker rank x local devices + local device index.
// Thread-safety: ClusterResolution is a value type (concurrent const use is safe). Resolvers that
// read the environment call getenv and must not run concurrently with setenv/unsetenv.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_spec.h"
#include "dtrain/core/export.h"

namespace dtrain {

class DTRAIN_API ClusterResolution {
 public:
  // This task is task `index` of job `type` in `cluster`; `source` says where that came from
  // ("TF_CONFIG", "SLURM", ...) for messages. Local placement (local rank and size) is derived from
  // the hosts of the training tasks: tasks whose addresses have the same host share a machine.
  // Throws InvalidArgument when the job is not in the cluster (an evaluator may be absent, as TF
  // allows), when `index` is negative, or when it is out of range for its job.
  ClusterResolution(ClusterSpec cluster, TaskType type, int index, std::string source = "explicit");

  // A job whose launcher gives ranks but no addresses (mpirun): worker `rank` of `num_workers`,
  // worker 0 being chief, peers meeting at `rendezvous_address`. cluster() is empty and
  // has_addresses() false; the peers learn each other's addresses at the rendezvous.
  // Throws InvalidArgument when rank is outside [0, num_workers) or the address is malformed.
  static ClusterResolution from_ranks(int rank, int num_workers,
                                      const std::string& rendezvous_address,
                                      std::string source = "explicit");

  const ClusterSpec& cluster() const { return cluster_; }
  bool has_addresses() const { return !cluster_.empty(); }
  TaskType task_type() const { return type_; }
  int task_index() const { return index_; }
  // "worker:1", for log prefixes and messages.
  std::string task_name() const;
  // This task's own "host:port"; empty when the cluster does not list it (from_ranks, or an
  // evaluator absent from the cluster).
  const std::string& task_address() const { return address_; }

  bool is_chief() const { return is_chief_; }
  // True for the chief and the workers: the tasks that hold replicas and join the collectives.
  bool is_training_worker() const { return worker_rank_ >= 0; }
  // Chief plus workers, whatever this task's type.
  int num_workers() const { return num_workers_; }
  // 0 for the chief, then the workers in order; -1 for ps and evaluator tasks.
  int worker_rank() const { return worker_rank_; }
  // The chief's address (chief:0, else worker:0), where every task meets the others.
  const std::string& rendezvous_address() const { return rendezvous_; }

  // This task's index among the tasks on its machine, and their number. Set by the SLURM and
  // OpenMPI resolvers from the launcher's variables; otherwise derived from the hosts in the
  // cluster (compared literally: "localhost" and "127.0.0.1" count as different machines).
  // ps and evaluator tasks are given 0 of 1.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // Throws InvalidArgument unless 0 <= local_rank < local_size.
  void set_local_placement(int local_rank, int local_size);

  const std::string& source() const { return source_; }

  // The global replica ids of this task's replicas: worker_rank() * local_devices + i for
  // i in [0, local_devices). Every worker must use the same number of local devices.
  // Throws InvalidArgument when local_devices < 1, FailedPrecondition for ps and evaluator tasks.
  std::vector<int> replica_ids(int local_devices) const;
  // num_workers() * local_devices. Throws InvalidArgument when local_devices < 1.
  int num_replicas_in_sync(int local_devices) const;

  // One line for logs: "worker:1 (rank 1 of 3, chief worker:0 at host0:2222, local 0 of 1, from
  // TF_CONFIG)".
  std::string to_string() const;

 private:
  ClusterResolution() = default;

  ClusterSpec cluster_;
  TaskType type_ = TaskType::kWorker;
  int index_ = 0;
  std::string address_;
  bool is_chief_ = false;
  int num_workers_ = 0;
  int worker_rank_ = -1;
  std::string rendezvous_;
  int local_rank_ = 0;
  int local_size_ = 1;
  std::string source_;
};

// --- TF_CONFIG -------------------------------------------------------------------------------
// Parses a TF_CONFIG string: {"cluster": {"chief": [...], "worker": [...], "ps": [...],
// "evaluator": [...]}, "task": {"type": "worker", "index": 0}}. Other top-level keys
// ("environment", "rpc_layer") are ignored, as TF does. Every malformed config (not JSON, not an
// object, "cluster" or "task" missing or of the wrong type, unknown job or task type, index
// missing, not an integer, negative or out of range, a job that is not a list of strings, a bad or
// duplicate host:port, more than one chief or evaluator, a task type absent from the cluster, an
// empty cluster) throws InvalidArgument quoting the offending part and showing a valid TF_CONFIG.
DTRAIN_API ClusterResolution resolve_tf_config(const std::string& json);

// Reads the TF_CONFIG environment variable. Returns nullopt when it is unset or blank: not a
// multi-worker job, as in TF. Throws what resolve_tf_config throws.
DTRAIN_API std::optional<ClusterResolution> from_environment();

// The TF_CONFIG of task `index` of job `type` in `cluster`, for a launcher to hand to its
// processes (resolve_tf_config reads it back). Throws what the ClusterResolution constructor
// throws.
DTRAIN_API std::string make_tf_config(const ClusterSpec& cluster, TaskType type, int index);

// --- SLURM -----------------------------------------------------------------------------------
inline constexpr int kDefaultSlurmPortBase = 23456;

// Resolves the task srun started: all tasks form the "worker" job (worker 0 is chief, as in TF's
// SlurmClusterResolver), task SLURM_PROCID of SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), placed on
// the nodes of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) with SLURM_STEP_TASKS_PER_NODE (else
// SLURM_TASKS_PER_NODE; else an even split) tasks each, by SLURM_DISTRIBUTION (block, the default,
// or cyclic). The tasks of one node listen on consecutive ports from `port_base`.
// Throws FailedPrecondition when not under srun (SLURM_PROCID or the task count unset) or when
// SLURM_LOCALID disagrees with the computed placement; InvalidArgument, quoting the variable, when
// a variable is malformed or they disagree (counts, node numbers), or port_base + tasks per node
// leaves 1-65535; Unimplemented for the plane and arbitrary distributions.
DTRAIN_API ClusterResolution resolve_slurm(int port_base = kDefaultSlurmPortBase);

// Expands a SLURM host list: "node[01-04,07]" -> node01 node02 node03 node04 node07,
// "a[1-2],b3" -> a1 a2 b3, "x[8-10]" -> x8 x9 x10 (the width of a range's first number is kept as
// zero-padding), "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2. Throws InvalidArgument quoting the list on
// unbalanced or nested brackets, empty names, descending or non-numeric ranges, or more than
// 1,048,576 hosts.
DTRAIN_API std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist);

// Expands SLURM's tasks-per-node: "2(x3),1" -> 2 2 2 1. Throws InvalidArgument quoting the string
// when it is malformed or a count is below 1.
DTRAIN_API std::vector<int> parse_slurm_tasks_per_node(const std::string& tasks_per_node);

// --- OpenMPI ---------------------------------------------------------------------------------
// Resolves the process mpirun started: worker OMPI_COMM_WORLD_RANK of OMPI_COMM_WORLD_SIZE, local
// placement from OMPI_COMM_WORLD_LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_SIZE (0 of 1, with a WARNING
// line, when mpirun did not set them). MPI does not say where
// the tasks run, so the caller names the rendezvous "host:port" (rank 0 must run on that host).
// The result comes from ClusterResolution::from_ranks. Throws FailedPrecondition when not under
// mpirun (rank or size unset); InvalidArgument, quoting it, for a malformed variable or address.
DTRAIN_API ClusterResolution resolve_openmpi(const std::string& rendezvous_address);

// --- Explicit --------------------------------------------------------------------------------
// Task `rank` of a cluster whose only job is "worker" = `workers` (worker 0 is chief).
// Throws InvalidArgument for an empty list, a bad or duplicate address, or rank out of range.
DTRAIN_API ClusterResolution explicit_cluster(std::vector<std::string> workers, int rank);

// --- The one resolver every strategy, run_task() and the tools use -------------------------------
// This process's task, resolved once: TF_CONFIG when set; else SLURM's variables under srun (a
// SLURM_PROCID without TF_CONFIG); with `mpi`, OpenMPI's variables under mpirun (ranks only; the
// MPI transport wires the peers itself). Returns nullopt when none is set: a single-process job.
// Throws what the chosen resolver throws (InvalidArgument quoting a malformed variable).
DTRAIN_API std::optional<ClusterResolution> resolve_cluster(bool mpi = false);
// The job's shared secret: `token` when given, else DTRAIN_JOB_TOKEN. Throws InvalidArgument saying
// how to set it when both are empty (multi-process jobs authenticate every connection with it).
DTRAIN_API std::string resolve_job_token(std::string token = "");

// --- Device pinning --------------------------------------------------------------------------
// The GPUs a process with local rank `local_rank` of `local_size` should use on a machine with
// `num_gpus` GPUs: GPUs are dealt to the local ranks round-robin, the same number to each (rank r
// gets r, r + local_size, ...), so with as many ranks as GPUs each rank gets one. GPUs left over
// when num_gpus is not a multiple of local_size stay idle (local rank 0 logs that at WARNING).
// Throws InvalidArgument when local_rank is outside [0, local_size) or local_size exceeds num_gpus
// (the message says how to start fewer tasks per machine or use CPU devices).
DTRAIN_API std::vector<int> gpus_for_local_rank(int local_rank, int local_size, int num_gpus);

}  // namespace dtrain
