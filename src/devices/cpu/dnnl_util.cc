// The CPU device's oneDNN helpers declared in dnnl_util.h that are not templates: errors, the
// instruction-set cap handed to oneDNN, the split of a pass into per-thread parts, and the bfloat16
// widening that stands in for oneDNN's reference reorder.
#include "devices/cpu/dnnl_util.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/cpu_isa.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/logging.h"

namespace dtrain::cpu {

[[noreturn]] void rethrow_dnnl(const char* op, const dnnl::error& e) {
  throw Internal(std::string("oneDNN failed in ") + op + ": " + e.what() + " (status " +
                 std::to_string(static_cast<int>(e.status)) + ")");
}

bool cap_onednn_isa() {
  static const bool capped = [] {
    const char* setting = detail::max_cpu_isa_setting();
    const detail::CpuIsa cap = detail::max_cpu_isa();  // a bad value throws here
    if (!setting || std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA"))
      return false;
    using I = detail::CpuIsa;
    const dnnl::cpu_isa isa = cap == I::kSse41            ? dnnl::cpu_isa::sse41
                              : cap == I::kAvx            ? dnnl::cpu_isa::avx
                              : cap == I::kAvx2           ? dnnl::cpu_isa::avx2
                              : cap == I::kAvx512Core     ? dnnl::cpu_isa::avx512_core
                              : cap == I::kAvx512CoreVnni ? dnnl::cpu_isa::avx512_core_vnni
                              : cap == I::kAvx512CoreBf16 ? dnnl::cpu_isa::avx512_core_bf16
                              : cap == I::kAvx512CoreAmx  ? dnnl::cpu_isa::avx512_core_amx
                                                          : dnnl::cpu_isa::all;
    if (dnnl_set_max_cpu_isa(static_cast<dnnl_cpu_isa_t>(isa)) == dnnl_success) return true;
    DTRAIN_LOG(WARNING) << "DTRAIN_MAX_CPU_ISA=" << setting
                        << " caps dtrain's own loops, but oneDNN had already chosen its "
                           "instruction set; set ONEDNN_MAX_CPU_ISA too";
    return false;
  }();
  return capped;
}

void for_each_part(int parts, int64_t n, int64_t align,
                   const std::function<void(int64_t, int64_t)>& part) {
  const int64_t per = (n / parts + align - 1) / align * align;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
  for (int i = 0; i < parts; ++i) {
    const int64_t first = std::min(n, i * per),
                  last = i + 1 == parts ? n : std::min(n, first + per);
    if (last > first) part(first, last - first);
  }
}

bool onednn_isa_has(dnnl::cpu_isa isa) {
  (void)cap_onednn_isa();
  const auto want = static_cast<unsigned>(isa);
  return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & want) == want;
}

void convert(CpuKernels::State& st, memory from, memory to, DeviceSpec dev, int64_t work) {
  // oneDNN's JIT reorders take bfloat16 from avx512_core up.
  static const bool jit_bf16 = onednn_isa_has(dnnl::cpu_isa::avx512_core);
  const memory::desc fd = from.get_desc(), td = to.get_desc();
  if (jit_bf16 || fd.data_type() != dt::bf16 || td.data_type() != dt::f32) {
    // (The stream first: it sets the thread count, which oneDNN's reorder fixes when it is made.)
    dnnl::stream& stream = st.stream(work);
    dnnl::reorder(from, to).execute(stream, from, to);
    return;
  }
  // The same layout in float32: element k of the buffer stays element k, so the whole buffer
  // (padding included) widens as one run.
  memory::desc wide = fd;
  wide.data.data_type = dnnl_f32;
  const auto n = static_cast<int64_t>(fd.get_size() / 2);
  Tensor copy;
  float* out = static_cast<float*>(to.get_data_handle());
  if (!(wide == td)) {
    copy = scratch(wide.get_size(), dev);
    out = static_cast<float*>(copy.raw_data());
  }
  const auto* in = static_cast<const uint16_t*>(from.get_data_handle());
  for_each_part(
      n < CpuKernels::State::kSerialWork ? 1 : st.threads, n, 16,
      [&](int64_t b, int64_t len) { bf16_to_floats(in + b, out + b, static_cast<size_t>(len)); });
  if (copy.defined()) {
    memory m(wide, st.engine, copy.raw_data());
    dnnl::stream& stream = st.stream(work);
    dnnl::reorder(m, to).execute(stream, m, to);
  }
}

}  // namespace dtrain::cpu
