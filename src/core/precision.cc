#include "dtrain/core/precision.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "dtrain/core/error.h"

namespace dtrain {
namespace {
std::atomic<Precision> g_policy{Precision::kFloat32};
std::atomic<bool> g_tf32{false};
// A function's static, so that a call from another file's static initializer finds it set.
std::atomic<bool>& winograd_flag() {
  static std::atomic<bool> flag{[] {
    const char* v = std::getenv("DTRAIN_CPU_CONV_WINOGRAD");
    return !(v && std::strcmp(v, "0") == 0);
  }()};
  return flag;
}
}  // namespace

void enable_winograd_convolutions(bool enabled) {
  winograd_flag().store(enabled, std::memory_order_relaxed);
}

bool winograd_convolutions_enabled() { return winograd_flag().load(std::memory_order_relaxed); }

void enable_tensor_float_32_execution(bool enabled) {
  g_tf32.store(enabled, std::memory_order_relaxed);
}

bool tensor_float_32_execution_enabled() { return g_tf32.load(std::memory_order_relaxed); }

void set_precision_policy(Precision p) { g_policy.store(p, std::memory_order_relaxed); }

Precision precision_policy() { return g_policy.load(std::memory_order_relaxed); }

Precision parse_precision(const std::string& name) {
  if (name == "fp32" || name == "float32") return Precision::kFloat32;
  if (name == "bf16" || name == "mixed_bfloat16") return Precision::kMixedBFloat16;
  throw InvalidArgument("unknown precision '" + name +
                        "'; valid: fp32 (float32), bf16 (mixed_bfloat16)");
}

const char* precision_name(Precision p) {
  return p == Precision::kMixedBFloat16 ? "mixed_bfloat16" : "float32";
}

}  // namespace dtrain
