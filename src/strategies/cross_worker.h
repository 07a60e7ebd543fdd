// The cross-worker part of the multi-process strategies (MultiWorkerMirrored, Ensemble across
// workers): connects this training worker to the others and wraps the communicators as the
// CrossWorkerOps a StrategyExtended is assembled with. Private to src.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/strategies/strategy_extended.h"

namespace dtrain::detail {

// The cluster to train in: `given`, else resolved from the environment (OpenMPI's variables for
// kMpi). Throws InvalidArgument when there is none (naming `strategy` and how to start a job) and
// FailedPrecondition for a task that does not train.
ClusterResolution training_worker(std::optional<ClusterResolution> given,
                                  CommunicationOptions::Implementation impl,
                                  const std::string& strategy);

// Connects to the other training workers of `cluster` (TCP ring with the job token, or MPI; NCCL
// between the workers' first GPUs when `devices` are GPUs and `comm` allows it). Throws what the
// transport throws (DeadlineExceeded naming the workers that never connected, PermissionDenied).
std::shared_ptr<CrossWorkerOps> connect_cross_worker(const std::vector<DeviceSpec>& devices,
                                                     const CommunicationOptions& comm,
                                                     const ClusterResolution& cluster,
                                                     std::string token);

}  // namespace dtrain::detail
