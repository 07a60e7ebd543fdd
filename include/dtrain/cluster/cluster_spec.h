// ClusterSpec: the tasks of a multi-worker job, as in tf.train.ClusterSpec. Each job ("chief",
// "worker", "ps", "evaluator") is an ordered list of "host:port" addresses; a task is named by its
// job and its index in that list ("worker:1").
//
// A ClusterSpec is always valid: the constructor enforces TensorFlow's rules (at most one chief and
// one evaluator, at least one chief or worker, well-formed host:port addresses, no address used by
// two tasks) and throws InvalidArgument otherwise, so code holding one never re-checks it.
// Thread-safety: an immutable value type; concurrent const use is safe.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/core/export.h"

namespace dtrain {

// The task types TensorFlow allows in TF_CONFIG, in the order TF lists jobs.
enum class TaskType { kChief, kWorker, kPs, kEvaluator };

// "chief", "worker", "ps" or "evaluator". Never throws.
DTRAIN_API const char* task_type_name(TaskType type);
// Parses a TF job name (exact, lower-case as TF writes them). Returns nullopt for anything else.
// Never throws.
DTRAIN_API std::optional<TaskType> task_type_from_name(std::string_view name);

// A parsed "host:port". IPv6 hosts are held without their brackets.
struct DTRAIN_API HostPort {
  std::string host;
  int port = 0;

  // "host:port", or "[host]:port" when the host is an IPv6 address. Never throws.
  std::string to_string() const;
};

// Parses "host0:2222", "10.0.0.1:2222" or "[::1]:2222". Throws InvalidArgument, quoting `address`,
// when the host is empty or has characters a host name cannot have (spaces, a "grpc://" scheme,
// an unbracketed IPv6 address), or the port is missing, not a number, or outside 1-65535.
DTRAIN_API HostPort parse_host_port(const std::string& address);

class DTRAIN_API ClusterSpec {
 public:
  using JobMap = std::map<TaskType, std::vector<std::string>>;

  // The empty cluster: a single-process job that talks to nobody.
  ClusterSpec() = default;
  // Jobs given with no tasks are dropped. Throws InvalidArgument, quoting the offending job or
  // address and showing a valid cluster, when the jobs break a rule listed at the top of this file.
  explicit ClusterSpec(JobMap jobs);

  bool empty() const { return jobs_.empty(); }
  // The jobs that have tasks, in TF order: chief, worker, ps, evaluator. Never throws.
  std::vector<TaskType> jobs() const;
  bool has_job(TaskType job) const { return jobs_.count(job) != 0; }
  // The number of tasks of `job`; 0 when the cluster has no such job. Never throws.
  int num_tasks(TaskType job) const;
  // The addresses of `job` in task order; empty when the cluster has no such job. Never throws.
  const std::vector<std::string>& job_tasks(TaskType job) const;
  // The address of task `index` of `job`. Throws InvalidArgument naming the job and how many tasks
  // it has when the job is absent or `index` is outside [0, num_tasks(job)).
  const std::string& task_address(TaskType job, int index) const;
  // Chief plus workers: the tasks that train under MultiWorkerMirroredStrategy. Never throws.
  int num_training_workers() const;
  // Every task's address in TF order (chief, workers, ps, evaluator). Never throws.
  std::vector<std::string> all_addresses() const;

  const JobMap& as_map() const { return jobs_; }
  // The cluster as the JSON object TF_CONFIG's "cluster" holds, jobs in TF order:
  // {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}. Never throws.
  std::string to_json() const;

  bool operator==(const ClusterSpec& other) const { return jobs_ == other.jobs_; }
  bool operator!=(const ClusterSpec& other) const { return !(*this == other); }

 private:
  JobMap jobs_;
};

}  // namespace dtrain
