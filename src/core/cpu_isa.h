// The instruction sets dtrain's own vector loops may use (internal): what the CPU has, capped by
// DTRAIN_MAX_CPU_ISA, as oneDNN's ONEDNN_MAX_CPU_ISA caps oneDNN's kernels, with oneDNN's names in
// oneDNN's order. For running the narrower paths on a wider CPU: the tests run the CPU kernels'
// tests again under avx2 and sse41, so that an AVX-512 machine checks the paths an AVX2-only one
// takes; and the CPU device hands the cap to oneDNN (unless ONEDNN_MAX_CPU_ISA is set), so that one
// variable gives a whole process an older CPU's kernels.
#pragma once

namespace dtrain::detail {

// In oneDNN's order (dnnl_cpu_isa_t: sse41 < avx < avx2 < avx512_core < avx512_core_vnni <
// avx512_core_bf16 < avx512_core_amx). kAll: no cap. avx2_vnni counts as avx2, and oneDNN is then
// capped at avx2 (its own avx2_vnni kernels left out: dtrain's float kernels use no VNNI).
enum class CpuIsa {
  kSse41,
  kAvx,
  kAvx2,
  kAvx512Core,
  kAvx512CoreVnni,
  kAvx512CoreBf16,
  kAvx512CoreAmx,
  kAll
};

// DTRAIN_MAX_CPU_ISA (read once, any case: sse41, avx, avx2, avx2_vnni, avx512_core,
// avx512_core_vnni, avx512_core_bf16, avx512_core_amx, all); kAll when unset or empty. Any other
// value throws InvalidArgument naming the accepted ones.
CpuIsa max_cpu_isa();
// One of those names (any case) as a CpuIsa; InvalidArgument as above otherwise.
CpuIsa parse_cpu_isa(const char* name);
// DTRAIN_MAX_CPU_ISA's value as given (nullptr when unset or empty), for oneDNN.
const char* max_cpu_isa_setting();

// What dtrain's own loops choose between.
enum class CpuFeature {
  kSse42,    // crc32 (TFRecord checksums): avx and up (SSE4.2 is above sse41)
  kAvxF16c,  // float16 conversions: avx2 and up (F16C is not part of AVX)
  kAvx2Fma,  // AVX2 with FMA: avx2 and up
  kAvx512f,  // AVX-512 F: avx512_core and up
};
// Whether this CPU has feature f and DTRAIN_MAX_CPU_ISA allows it (found once, at first use: call
// it where the choice is made; it is an array lookup after the first call).
bool cpu_supports(CpuFeature f);

}  // namespace dtrain::detail
