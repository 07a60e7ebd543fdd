// Maps the --strategy flag to an implementation.
#pragma once

#include "dtrain/core/export.h"

#include <memory>
#include <string>
#include <vector>

#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/strategies/parameter_server_strategy.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

struct DTRAIN_API StrategyOptions {
  // Replica devices, from parse_devices_flag(); empty = CPU:0.
  std::vector<DeviceSpec> devices;
  // mirrored / central_storage: cross-device ops, pack size, overlap, timeout (devices ignored).
  MirroredOptions mirrored;
  // parameter_server: partitioner, staleness bound, checkpoints, timeouts.
  ParameterServerOptions parameter_server;
};

// The --strategy values this build accepts, e.g. {"default", "one_device"}.
DTRAIN_API std::vector<std::string> strategy_names();
// Throws InvalidArgument naming the valid values for an unknown name, and for a device list the
// strategy cannot use (e.g. one_device with two devices).
DTRAIN_API std::unique_ptr<Strategy> make_strategy(const std::string& name, const StrategyOptions& options);

}  // namespace dtrain
