#include "dtrain/strategies/make_strategy.h"

#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/strategies/one_device_strategy.h"
#include "dtrain/strategies/parameter_server_strategy.h"
#include "dtrain/core/logging.h"
#include <cstdlib>

#include "strategies/default_strategy.h"

namespace dtrain {

std::vector<std::string> strategy_names() {
  return {"default", "one_device", "mirrored", "central_storage", "multi_worker_mirrored", "parameter_server"};
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, const StrategyOptions& options) {
  const std::vector<DeviceSpec> devices =
      options.devices.empty() ? std::vector<DeviceSpec>{DeviceSpec::cpu(0)} : options.devices;
  if (name == "default") return std::make_unique<DefaultStrategy>();
  if (name == "one_device") {
    if (devices.size() != 1)
      throw InvalidArgument("--strategy=one_device uses exactly one device but --devices gave " +
                            std::to_string(devices.size()) + "; pass --devices=cpu or --devices=gpu:0");
    return std::make_unique<OneDeviceStrategy>(devices[0]);
  }
  if (name == "mirrored" || name == "central_storage") {
    MirroredOptions m = options.mirrored;
    m.devices = options.devices;  // empty: all GPUs, else CPU:0
    if (name == "mirrored") return std::make_unique<MirroredStrategy>(m);
    return std::make_unique<CentralStorageStrategy>(m, DeviceSpec::cpu(0));
  }
  if (name == "multi_worker_mirrored") {
    MirroredOptions m = options.mirrored;
    m.devices = options.devices;
    CommunicationOptions c;
    c.bytes_per_pack = m.bytes_per_pack;
    if (const char* impl = std::getenv("DTRAIN_COLLECTIVE")) {  // ring (default) or mpi
      const std::string v = impl;
      if (v == "mpi") c.implementation = CommunicationOptions::Implementation::kMpi;
      else if (v == "nccl") c.implementation = CommunicationOptions::Implementation::kNccl;
      else if (v == "ring") c.implementation = CommunicationOptions::Implementation::kRing;
      else if (!v.empty())
        throw InvalidArgument("DTRAIN_COLLECTIVE='" + v + "': valid values are ring (TCP), nccl (GPUs; the default "
                              "for GPU devices) and mpi (OpenMPI, when launched by mpirun)");
    }
    if (const char* t = std::getenv("DTRAIN_RENDEZVOUS_TIMEOUT")) {  // seconds
      const int secs = std::atoi(t);
      if (secs < 1) throw InvalidArgument(std::string("DTRAIN_RENDEZVOUS_TIMEOUT='") + t + "' must be a positive number of seconds");
      c.connect_timeout = std::chrono::seconds(secs);
    }
    return std::make_unique<MultiWorkerMirroredStrategy>(m, c);  // cluster from TF_CONFIG, token from DTRAIN_JOB_TOKEN
  }
  if (name == "parameter_server") {
    auto cluster = from_environment();
    if (cluster && cluster->task_type() == TaskType::kPs) {
      // The same binary started as a ps task serves variables until told to stop (as TF's
      // tf.distribute.Server(...).join()), and the process ends there.
      serve_parameter_server(*cluster);
      std::exit(0);
    }
    if (devices.size() != 1)
      throw InvalidArgument("--strategy=parameter_server trains on one device per worker but --devices gave " +
                            std::to_string(devices.size()) + "; pass --devices=cpu or --devices=gpu:0");
    return std::make_unique<ParameterServerStrategy>(options.parameter_server, devices[0], std::move(cluster));
  }
  std::string valid;
  for (const auto& n : strategy_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw InvalidArgument("unknown --strategy '" + name + "'; valid values: " + valid);
}

}  // namespace dtrain
