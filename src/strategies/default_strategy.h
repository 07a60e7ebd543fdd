// The strategy in effect when no scope is active: one replica on CPU:0 that runs replica
// functions inline on the calling thread (TF's default strategy).
#pragma once

#include "dtrain/strategies/one_device_strategy.h"

namespace dtrain {

class DefaultStrategy final : public OneDeviceStrategy {
 public:
  DefaultStrategy() : OneDeviceStrategy(DeviceSpec::cpu(0), /*run_inline=*/true) {}
  std::string name() const override { return "DefaultStrategy"; }
};

}  // namespace dtrain
