// DeviceSpec names a device ("CPU:0", "GPU:1") without depending on the devices layer, so that a
// Tensor can say where its memory lives. Plain value type.
#pragma once

#include <string>

#include "dtrain/core/export.h"

namespace dtrain {

enum class DeviceType { kCPU, kCUDA };

struct DTRAIN_API DeviceSpec {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static DeviceSpec cpu(int i = 0) { return {DeviceType::kCPU, i}; }
  static DeviceSpec gpu(int i = 0) { return {DeviceType::kCUDA, i}; }
  // Parses "CPU:0", "cpu", "GPU:1", "cuda:1" (case-insensitive). Throws InvalidArgument.
  static DeviceSpec parse(const std::string& s);
  std::string to_string() const;
  // True when the CPU can dereference this device's memory (all logical CPU devices share host
  // RAM).
  bool host_accessible() const { return type == DeviceType::kCPU; }
  bool operator==(const DeviceSpec& o) const { return type == o.type && index == o.index; }
  bool operator!=(const DeviceSpec& o) const { return !(*this == o); }
};

}  // namespace dtrain
