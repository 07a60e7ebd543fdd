#include "strategies/ps/ps_tasks.h"

#include "dtrain/core/error.h"

namespace dtrain::ps {

std::vector<std::string> task_names(const ClusterSpec& cluster) {
  std::vector<std::string> out;
  for (TaskType t : cluster.jobs())
    for (int i = 0; i < cluster.num_tasks(t); ++i)
      out.push_back(std::string(task_type_name(t)) + ":" + std::to_string(i));
  return out;
}

int rank_of(const ClusterSpec& cluster, TaskType type, int index) {
  int rank = 0;
  for (TaskType t : cluster.jobs()) {
    if (t == type) return rank + index;
    rank += cluster.num_tasks(t);
  }
  throw InvalidArgument(std::string("the cluster has no ") + task_type_name(type) + " job");
}

TcpGroupOptions group_options(const ClusterResolution& cluster, const std::string& token) {
  TcpGroupOptions o;
  o.addresses = cluster.cluster().all_addresses();
  o.task_names = task_names(cluster.cluster());
  o.rank = rank_of(cluster.cluster(), cluster.task_type(), cluster.task_index());
  o.token = token;
  return o;
}

}  // namespace dtrain::ps
