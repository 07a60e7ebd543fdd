#include "dtrain/strategies/multi_worker_mirrored_strategy.h"

#include "dtrain/devices/device.h"
#include "strategies/cross_worker.h"

namespace dtrain {
namespace {

using Implementation = CommunicationOptions::Implementation;

// Mirrored assembled with the cross-worker part and this task's cluster context.
StrategyExtended connect_workers(const std::vector<DeviceSpec>& devices,
                                 const CommunicationOptions& comm, ClusterResolution cluster,
                                 std::string token) {
  std::shared_ptr<CrossWorkerOps> cross =
      detail::connect_cross_worker(devices, comm, cluster, std::move(token));
  return StrategyExtended(std::move(cluster), std::move(cross), nullptr);
}

MirroredOptions local_options(MirroredOptions local, const CommunicationOptions& comm) {
  if (comm.bytes_per_pack) local.bytes_per_pack = comm.bytes_per_pack;
  local.timeout = comm.timeout;
  return local;
}

}  // namespace

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MirroredOptions local,
                                                         CommunicationOptions comm,
                                                         std::optional<ClusterResolution> cluster,
                                                         std::string token)
    : MirroredStrategy(
          local_options(local, comm),
          connect_workers(mirrored_devices(local), comm,
                          detail::training_worker(std::move(cluster), comm.implementation,
                                                  "multi_worker_mirrored"),
                          std::move(token))),
      communication_(comm) {
  set_broadcast_initial_values(comm.broadcast_initial_values);
}

void MultiWorkerMirroredStrategy::reconnect(ClusterResolution cluster, std::string token) {
  if (!cluster.is_training_worker())
    throw FailedPrecondition("MultiWorkerMirroredStrategy::reconnect: " + cluster.task_name() +
                             " does not train");
  reassemble([&] {
    return connect_workers(worker_devices(), communication_, std::move(cluster), std::move(token));
  });
}

MultiWorkerMirroredStrategy::~MultiWorkerMirroredStrategy() = default;

std::string MultiWorkerMirroredStrategy::name() const {
  return "MultiWorkerMirroredStrategy(" + cluster().task_name() + " of " +
         std::to_string(extended().num_workers()) + " workers, " + MirroredStrategy::name() + ")";
}

}  // namespace dtrain
