// mixed_bfloat16 on the CPU (dnnl_util.h): whether oneDNN's bfloat16 kernels run (they exist, and
// they measure faster than float32's here; DTRAIN_BF16_KERNELS), and the rounding of the emulated
// path.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {
// Tests' override of the choice: 0 none, 1 emulated, 2 native (where oneDNN has the kernels).
std::atomic<int> g_force_bf16{0};
// Tests' override of bf16_kernels_amx: -1 none, else the answer.
std::atomic<int> g_force_amx{-1};

bool probe_bf16_kernels() {
  (void)cap_onednn_isa();
  try {
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    const memory::desc src({1, 16, 4, 4}, dt::bf16, tag::nhwc),
        wei({16, 16, 3, 3}, dt::bf16, tag::any);
    const memory::desc dst({1, 16, 2, 2}, dt::f32, tag::nhwc);
    dnnl::convolution_forward::primitive_desc pd({prop_kind::forward_training,
                                                  algorithm::convolution_direct,
                                                  src,
                                                  wei,
                                                  dst,
                                                  {1, 1},
                                                  {0, 0},
                                                  {0, 0}},
                                                 eng);
    const memory::desc a({4, 16}, dt::bf16, tag::ab), b({16, 4}, dt::bf16, tag::ab),
        c({4, 4}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc mm(dnnl::matmul::desc(a, b, c), eng);
    return true;
  } catch (const dnnl::error&) {
    return false;  // dnnl_unimplemented: no bfloat16 kernel for this CPU
  }
}

// Seconds of the fastest of 3 runs (after one) of a 512 x 512 x 512 product with operands of
// `type`.
double time_square_matmul(dt type) {
  constexpr int64_t n = 512;
  (void)cap_onednn_isa();
  const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const memory::desc ab({n, n}, type, tag::ab), c({n, n}, dt::f32, tag::ab);
  dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ab, ab, c), eng));
  std::vector<float> bytes(static_cast<size_t>(n * n * 3), 0.5f);  // a, b (any type) and c
  memory am(ab, eng, bytes.data()), bm(ab, eng, bytes.data() + n * n),
      cm(c, eng, bytes.data() + 2 * n * n);
  double best = 1e30;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, t);
  }
  return best;
}

Bf16KernelChoice choose_once() {
  const char* env = std::getenv("DTRAIN_BF16_KERNELS");
  const std::string requested = env ? env : "auto";
  const bool available = probe_bf16_kernels();
  double speed = 0;
  if (available && requested == "auto") {
    try {
      speed = time_square_matmul(dt::f32) / time_square_matmul(dt::bf16);
    } catch (const dnnl::error&) {
      speed = 0;
    }
  }
  return decide_bf16_kernels(requested, available, speed);
}
}  // namespace

Bf16KernelChoice decide_bf16_kernels(const std::string& requested, bool available,
                                     double bf16_speed) {
  Bf16KernelChoice c;
  c.available = available;
  c.bf16_speed = bf16_speed;
  if (requested != "auto" && requested != "native" && requested != "emulated")
    throw InvalidArgument("DTRAIN_BF16_KERNELS=" + requested +
                          ": expected auto (the default: oneDNN's bfloat16 kernels unless they "
                          "measure slower than float32 on this CPU), native or emulated");
  if (!available) {
    c.native = false;
    c.why = "oneDNN has no bfloat16 kernels for this CPU (they need AVX-512)";
  } else if (requested == "emulated") {
    c.native = false;
    c.why = "DTRAIN_BF16_KERNELS=emulated";
  } else if (requested == "native") {
    c.native = true;
  } else if (bf16_speed > 0 && bf16_speed < kBf16MinSpeed) {
    c.native = false;
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2fx", bf16_speed);
    c.why = std::string("oneDNN's bfloat16 matmul ran at ") + ratio +
            " float32's speed on this CPU (DTRAIN_BF16_KERNELS=native runs it anyway)";
  } else {
    c.native = true;
  }
  return c;
}

const Bf16KernelChoice& bf16_kernel_choice() {
  static const Bf16KernelChoice choice = choose_once();
  return choice;
}

bool mixed_bf16() { return precision_policy() == Precision::kMixedBFloat16; }

bool bf16_kernels_native() {
  switch (g_force_bf16.load(std::memory_order_relaxed)) {
    case 1:
      return false;
    case 2:
      return bf16_kernel_choice().available;
    default:
      return bf16_kernel_choice().native;
  }
}

memory::data_type kernel_input_type() {
  return mixed_bf16() && bf16_kernels_native() ? dt::bf16 : dt::f32;
}

bool bf16_kernels_amx() {
  const int forced = g_force_amx.load(std::memory_order_relaxed);
  if (forced >= 0) return forced != 0;
  static const bool amx = onednn_isa_has(dnnl::cpu_isa::avx512_core_amx);
  return amx;
}

void force_bf16_amx_for_testing(int amx) { g_force_amx.store(amx < 0 ? -1 : amx != 0); }

void force_bf16_emulation_for_testing(bool on) { g_force_bf16.store(on ? 1 : 0); }
void force_bf16_native_for_testing(bool on) { g_force_bf16.store(on ? 2 : 0); }

namespace {
inline uint32_t rounded_bf16_bits(uint32_t x) {
  const uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
  return (x & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u
                                         : r;  // NaN: bfloat16's quiet NaN, as float_to_bf16
}
}  // namespace

// Built for AVX2 beside the baseline: copy-speed passes over the operands (two loops, so that
// each vectorises without a check that the pointers overlap).
DTRAIN_TARGET_CLONES("avx2", "default") void round_to_bf16(float* p, size_t n) {
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  for (size_t i = 0; i < n; ++i) u[i] = rounded_bf16_bits(u[i]);
}

DTRAIN_TARGET_CLONES("avx2", "default")
void round_to_bf16(const float* __restrict src, float* __restrict dst, size_t n) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (size_t i = 0; i < n; ++i) out[i] = rounded_bf16_bits(in[i]);
}
}  // namespace dtrain::cpu
