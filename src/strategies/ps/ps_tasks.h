// Private to the parameter-server strategy: naming and addressing the tasks of a PS job. Every
// task's rank is its index in ClusterSpec::all_addresses() (chief, workers, ps, evaluator), the
// order in which the training workers come first, so a training worker's rank is its worker rank.
#pragma once

#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/collectives/tcp.h"

namespace dtrain::ps {

// "chief:0", "worker:0", ..., "ps:1" in rank order.
std::vector<std::string> task_names(const ClusterSpec& cluster);
// The rank of task `index` of `type`.
int rank_of(const ClusterSpec& cluster, TaskType type, int index);
// Options for this task's connections (rank, addresses, names, token).
TcpGroupOptions group_options(const ClusterResolution& cluster, const std::string& token);

}  // namespace dtrain::ps
