#include "dtrain/cluster/cluster_spec.h"

#include "cluster/cluster_util.h"
#include "dtrain/core/error.h"

namespace dtrain {

using cluster_detail::quote;

namespace {
constexpr TaskType kTfOrder[] = {TaskType::kChief, TaskType::kWorker, TaskType::kPs,
                                 TaskType::kEvaluator};
}  // namespace

const char* task_type_name(TaskType type) {
  switch (type) {
    case TaskType::kChief:
      return "chief";
    case TaskType::kWorker:
      return "worker";
    case TaskType::kPs:
      return "ps";
    case TaskType::kEvaluator:
      return "evaluator";
  }
  return "unknown";
}

std::optional<TaskType> task_type_from_name(std::string_view name) {
  for (TaskType t : kTfOrder)
    if (name == task_type_name(t)) return t;
  return std::nullopt;
}

std::string HostPort::to_string() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

HostPort parse_host_port(const std::string& address) {
  HostPort hp;
  const std::string problem = cluster_detail::address_problem(address, &hp);
  if (!problem.empty()) throw InvalidArgument("address " + problem);
  return hp;
}

ClusterSpec::ClusterSpec(JobMap jobs) {
  for (auto it = jobs.begin(); it != jobs.end();) {
    if (it->second.empty())
      it = jobs.erase(it);
    else
      ++it;
  }
  const std::string problem = cluster_detail::cluster_problem(jobs);
  if (!problem.empty())
    throw InvalidArgument("cluster spec: " + problem +
                          ". A valid cluster: " + cluster_detail::kClusterExample);
  jobs_ = std::move(jobs);
}

std::vector<TaskType> ClusterSpec::jobs() const {
  std::vector<TaskType> out;
  for (TaskType t : kTfOrder)
    if (has_job(t)) out.push_back(t);
  return out;
}

int ClusterSpec::num_tasks(TaskType job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : static_cast<int>(it->second.size());
}

const std::vector<std::string>& ClusterSpec::job_tasks(TaskType job) const {
  static const std::vector<std::string> kNone;
  auto it = jobs_.find(job);
  return it == jobs_.end() ? kNone : it->second;
}

const std::string& ClusterSpec::task_address(TaskType job, int index) const {
  const int n = num_tasks(job);
  if (n == 0)
    throw InvalidArgument("task_address: the cluster has no \"" + std::string(task_type_name(job)) +
                          "\" job; its jobs are " + to_json());
  if (index < 0 || index >= n)
    throw InvalidArgument("task_address: index " + std::to_string(index) +
                          " is out of range: job \"" + task_type_name(job) + "\" has " +
                          std::to_string(n) + " task(s), indices 0.." + std::to_string(n - 1));
  return jobs_.at(job)[static_cast<size_t>(index)];
}

int ClusterSpec::num_training_workers() const {
  return num_tasks(TaskType::kChief) + num_tasks(TaskType::kWorker);
}

std::vector<std::string> ClusterSpec::all_addresses() const {
  std::vector<std::string> out;
  for (TaskType t : jobs())
    for (const auto& a : jobs_.at(t)) out.push_back(a);
  return out;
}

std::string ClusterSpec::to_json() const {
  std::string s = "{";
  for (TaskType t : jobs()) {
    if (s.size() > 1) s += ", ";
    s += '"';
    s += task_type_name(t);
    s += "\": [";
    const auto& tasks = jobs_.at(t);
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (i) s += ", ";
      // Addresses are validated (printable ASCII, no quotes), so quote() escapes nothing here.
      s += quote(tasks[i], tasks[i].size());
    }
    s += "]";
  }
  return s + "}";
}

}  // namespace dtrain
