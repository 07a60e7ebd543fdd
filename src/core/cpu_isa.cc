#include "core/cpu_isa.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <string>

#include "dtrain/core/error.h"

namespace dtrain::detail {
namespace {

struct Name {
  const char* name;
  CpuIsa isa;
};
constexpr Name kNames[] = {
    {"sse41", CpuIsa::kSse41},
    {"avx", CpuIsa::kAvx},
    {"avx2", CpuIsa::kAvx2},
    {"avx2_vnni", CpuIsa::kAvx2},
    {"avx512_core", CpuIsa::kAvx512Core},
    {"avx512_core_vnni", CpuIsa::kAvx512CoreVnni},
    {"avx512_core_bf16", CpuIsa::kAvx512CoreBf16},
    {"avx512_core_amx", CpuIsa::kAvx512CoreAmx},
    {"all", CpuIsa::kAll},
};

}  // namespace

CpuIsa parse_cpu_isa(const char* v) {
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const Name& n : kNames)
    if (s == n.name) return n.isa;
  std::string names;
  for (const Name& n : kNames) names += std::string(names.empty() ? "" : ", ") + n.name;
  throw InvalidArgument("DTRAIN_MAX_CPU_ISA=" + std::string(v) +
                        " is not an instruction set dtrain knows; use one of " + names +
                        " (oneDNN's ONEDNN_MAX_CPU_ISA names, any case), or unset it");
}

const char* max_cpu_isa_setting() {
  const char* v = std::getenv("DTRAIN_MAX_CPU_ISA");
  return v && *v ? v : nullptr;
}

CpuIsa max_cpu_isa() {
  static const CpuIsa cap = [] {
    const char* v = max_cpu_isa_setting();
    return v ? parse_cpu_isa(v) : CpuIsa::kAll;
  }();
  return cap;
}

bool cpu_supports(CpuFeature f) {
  // Found once, at first use (a bad DTRAIN_MAX_CPU_ISA throws, and is read again next time).
  static const std::array<bool, 4> has = [] {
    const CpuIsa cap = max_cpu_isa();  // a bad value is reported on every machine
    std::array<bool, 4> h{};
#if defined(__x86_64__)
    __builtin_cpu_init();  // in case this runs in a static initializer before libgcc's own
    h[static_cast<size_t>(CpuFeature::kSse42)] =
        cap >= CpuIsa::kAvx && __builtin_cpu_supports("sse4.2");
    h[static_cast<size_t>(CpuFeature::kAvxF16c)] =
        cap >= CpuIsa::kAvx2 && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    h[static_cast<size_t>(CpuFeature::kAvx2Fma)] =
        cap >= CpuIsa::kAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    h[static_cast<size_t>(CpuFeature::kAvx512f)] =
        cap >= CpuIsa::kAvx512Core && __builtin_cpu_supports("avx512f");
#else
    (void)cap;
#endif
    return h;
  }();
  return has[static_cast<size_t>(f)];
}

}  // namespace dtrain::detail
