// DTRAIN_MAX_CPU_ISA (src/core/cpu_isa.h): its names, and that each of dtrain's own vector loops
// and oneDNN keep under it. ctest runs this binary unset and again under avx2 and sse41 (with the
// CPU kernels' tests: tests/CMakeLists.txt), so each run checks the cap it is given.
#include "core/cpu_isa.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "core/box_muller.h"
#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu/cpu_stream.h"
#include "dtrain/core/error.h"
#include "dtrain/core/tensor.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"

namespace dtrain::detail {
namespace {

TEST(CpuIsa, TakesOneDnnsNamesInAnyCase) {
  EXPECT_EQ(parse_cpu_isa("sse41"), CpuIsa::kSse41);
  EXPECT_EQ(parse_cpu_isa("AVX"), CpuIsa::kAvx);
  EXPECT_EQ(parse_cpu_isa("Avx2"), CpuIsa::kAvx2);
  EXPECT_EQ(parse_cpu_isa("avx2_vnni"), CpuIsa::kAvx2);
  EXPECT_EQ(parse_cpu_isa("AVX512_CORE"), CpuIsa::kAvx512Core);
  EXPECT_EQ(parse_cpu_isa("avx512_core_vnni"), CpuIsa::kAvx512CoreVnni);
  EXPECT_EQ(parse_cpu_isa("avx512_core_bf16"), CpuIsa::kAvx512CoreBf16);
  EXPECT_EQ(parse_cpu_isa("avx512_core_amx"), CpuIsa::kAvx512CoreAmx);
  EXPECT_EQ(parse_cpu_isa("ALL"), CpuIsa::kAll);
  EXPECT_LT(CpuIsa::kAvx2, CpuIsa::kAvx512Core);
  for (const char* bad : {"avx512", "avx-2", "", "sse4.2"}) {
    try {
      (void)parse_cpu_isa(bad);
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("DTRAIN_MAX_CPU_ISA=" + std::string(bad) + " "), std::string::npos) << m;
      EXPECT_NE(m.find("avx512_core_bf16"), std::string::npos) << m;  // the accepted names
    }
  }
}

// The cap this process runs under (from its environment), and each loop's choice against it.
TEST(CpuIsa, EveryVectorLoopAndOneDnnKeepUnderTheCap) {
  const char* setting = std::getenv("DTRAIN_MAX_CPU_ISA");
  const CpuIsa cap = max_cpu_isa();
  EXPECT_EQ(cap, setting && *setting ? parse_cpu_isa(setting) : CpuIsa::kAll);
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(cpu_supports(CpuFeature::kAvx512f), has512 && cap >= CpuIsa::kAvx512Core);
  EXPECT_EQ(cpu_supports(CpuFeature::kAvx2Fma), has2 && cap >= CpuIsa::kAvx2);
  EXPECT_EQ(cpu_supports(CpuFeature::kAvxF16c), __builtin_cpu_supports("f16c") &&
                                                    __builtin_cpu_supports("avx") &&
                                                    cap >= CpuIsa::kAvx2);
  EXPECT_EQ(cpu_supports(CpuFeature::kSse42),
            __builtin_cpu_supports("sse4.2") && cap >= CpuIsa::kAvx);

  const std::string bm = box_muller_path();
  if (cap < CpuIsa::kAvx512Core) {
    EXPECT_NE(bm, "avx512");
  }
  if (cap < CpuIsa::kAvx2) {
    EXPECT_EQ(bm, "scalar");
  }
  const cpu::StreamIsa stream = cpu::stream_isa();
  if (cap < CpuIsa::kAvx512Core) {
    EXPECT_NE(stream, cpu::StreamIsa::kAvx512);
  }
  if (cap < CpuIsa::kAvx2) {
    EXPECT_EQ(stream, cpu::StreamIsa::kNone);
  }
  // The loops built for AVX-512 beside their portable form (no target_clones: its ifunc cannot
  // see the cap).
  const std::string adam = cpu_testing::adam_loop_isa();
  EXPECT_EQ(adam, cpu_supports(CpuFeature::kAvx512f)   ? "avx512"
                  : cpu_supports(CpuFeature::kAvx2Fma) ? "avx2"
                                                       : "portable");
  EXPECT_EQ(cpu_testing::batch_norm_loops_avx512(), cpu_supports(CpuFeature::kAvx512f));

  // oneDNN, once the CPU device has run a primitive: every instruction set bit it dispatches to
  // is one the cap's has (dnnl_cpu_isa_t's values are nested bit sets).
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  const Tensor a = Tensor::from_vector(std::vector<float>(64 * 64, 0.5f), Shape{64, 64});
  (void)k.matmul(a, a, false, false);
  const auto effective = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const unsigned allowed = cap == CpuIsa::kSse41  ? 0x1u
                           : cap == CpuIsa::kAvx  ? 0x3u
                           : cap == CpuIsa::kAvx2 ? 0x7u
                                                  : ~0u;
  EXPECT_EQ(effective & ~allowed, 0u) << "oneDNN dispatches to 0x" << std::hex << effective
                                      << " under DTRAIN_MAX_CPU_ISA=" << (setting ? setting : "");
  if (cap == CpuIsa::kAll && has512) {
    EXPECT_NE(effective & 0x20u, 0u) << "uncapped AVX-512";
  }
}

}  // namespace
}  // namespace dtrain::detail
