#include "dtrain/core/device_spec.h"

#include <algorithm>
#include <cctype>

#include "dtrain/core/error.h"

namespace dtrain {

DeviceSpec DeviceSpec::parse(const std::string& s) {
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const auto colon = lower.find(':');
  const std::string kind = lower.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string idx = lower.substr(colon + 1);
    if (idx.empty() || !std::all_of(idx.begin(), idx.end(), ::isdigit))
      throw InvalidArgument("bad device '" + s +
                            "': the index after ':' must be a number, e.g. GPU:0");
    index = std::stoi(idx);
  }
  if (kind == "cpu") return cpu(index);
  if (kind == "gpu" || kind == "cuda") return gpu(index);
  throw InvalidArgument("bad device '" + s + "': expected CPU:<n> or GPU:<n>, e.g. CPU:0");
}

std::string DeviceSpec::to_string() const {
  return std::string(type == DeviceType::kCPU ? "CPU:" : "GPU:") + std::to_string(index);
}

}  // namespace dtrain
