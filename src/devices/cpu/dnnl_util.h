// Private helpers shared by the oneDNN-backed CPU kernels. Not a public header.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>

#include "devices/cpu/cpu_kernels.h"

namespace dtrain::cpu {

using dnnl::memory;
// The oneDNN names every CPU kernel file uses, declared once here.
using dnnl::algorithm;
using dnnl::prop_kind;
using tag = memory::format_tag;
using dt = memory::data_type;

// Hands DTRAIN_MAX_CPU_ISA (core/cpu_isa.h) to oneDNN as its maximal instruction set, once,
// before the first engine: unless ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA is set (oneDNN reads
// those itself). A bad value throws InvalidArgument; an ISA oneDNN can no longer change (a kernel
// already dispatched) is reported once as a warning. True when oneDNN was capped.
bool cap_onednn_isa();
// Whether oneDNN's effective instruction set (capped as above first) includes `isa`:
// dnnl_cpu_isa_t is a set of bits (avx2 0x7, avx512_core 0x27, avx512_core_amx 0x3e7), so each
// set holds the sets below it in oneDNN's order but not avx2_vnni (0x407) and avx512_core.
bool onednn_isa_has(dnnl::cpu_isa isa);

struct CpuKernels::State {
  const bool isa_capped = cap_onednn_isa();  // first: before the engine
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  uint64_t uid;
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<void>> cache;
  int threads;  // the device's intra-op threads

  explicit State(int threads);
  // The calling thread's stream on this engine (CPU streams execute on the calling thread); sets
  // the calling thread's OpenMP thread count to the device's. The calling thread's stream for this
  // engine, with the OpenMP thread count set for a primitive of `work` units (elements touched;
  // matmul: m n k / 8): the device's threads, or 1 below kSerialWork, where starting a team costs
  // more than the op (a 32-wide MLP runs 8x faster on 2 cores serially).
  static constexpr int64_t kSerialWork = 65536;
  dnnl::stream& stream(int64_t work = INT64_MAX);
  // Sets the calling thread's OpenMP thread count as stream(work) does.
  void set_threads(int64_t work) const;

  // Returns the cached object for `key`, building it with make() on first use, under the thread
  // count stream(work) gives: pass the work the primitive will execute with. oneDNN 2.6 fixes
  // many kernels' thread count when the primitive is made (its matmul and convolutions read
  // omp_get_max_threads() then), so a primitive made on a thread a small op had left at 1 ran on
  // one thread ever after: ResNet-50 on one 2-thread device 7-8% slower.
  template <typename T>
  std::shared_ptr<T> get(const std::string& key, const std::function<std::shared_ptr<T>()>& make,
                         int64_t work = INT64_MAX) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = cache.find(key);
      if (it != cache.end()) return std::static_pointer_cast<T>(it->second);
    }
    set_threads(work);
    std::shared_ptr<T> made = make();  // primitive creation can take milliseconds: not under lock
    std::lock_guard<std::mutex> lock(mu);
    cache.emplace(key, made);
    return made;
  }
};

// A cached matmul primitive (CpuKernels::matmul, batch_matmul, the Winograd products).
struct MatmulPrimitive {
  dnnl::matmul prim;
};

// Runs part(offset, count) over [0, n) in `parts` contiguous parts on as many OpenMP threads, each
// a multiple of `align` elements but the last, which takes the rest (parts may be empty).
void for_each_part(int parts, int64_t n, int64_t align,
                   const std::function<void(int64_t, int64_t)>& part);

inline memory::dims dims_of(const Shape& s) {
  if (s.rank() == 0) return {1};
  return memory::dims(s.dims().begin(), s.dims().end());
}

// Dense row-major descriptor of any rank.
inline memory::desc plain_md(const memory::dims& dims,
                             memory::data_type dt = memory::data_type::f32) {
  memory::dims strides(dims.size());
  memory::dim s = 1;
  for (size_t i = dims.size(); i-- > 0;) {
    strides[i] = s;
    s *= dims[i];
  }
  return memory::desc(dims, dt, strides);
}

inline memory mem(const memory::desc& md, const dnnl::engine& eng, const Tensor& t) {
  return memory(md, eng, t.raw_data());
}

// "key:1,2,3;" builder for cache keys.
inline void key_dims(std::string& k, const memory::dims& d) {
  for (auto v : d) {
    k += std::to_string(v);
    k += ',';
  }
  k += ';';
}

// dnnl::reorder(from, to) on st's stream (its threads for `work` units), but for a widening of
// bfloat16 to float32 where oneDNN has no bfloat16 (below avx512_core: an AVX2 CPU, or
// DTRAIN_MAX_CPU_ISA). There oneDNN's reorder is its reference implementation ("simple:any"):
// 56 of 69 s of ResNet-50's mixed bfloat16 step under an AVX2 cap (2026-11-29). Then dtrain's own
// widening (bf16_to_floats) writes `to` directly where the layouts match, else a float32 copy in
// from's layout (scratch on `dev`), which a float32 reorder (JIT) brings into to's.
void convert(CpuKernels::State& st, memory from, memory to, DeviceSpec dev,
             int64_t work = INT64_MAX);

// A scratch float tensor of at least `bytes` bytes (oneDNN's reordered weights, workspaces).
inline Tensor scratch(size_t bytes, DeviceSpec dev) {
  return Tensor::empty(Shape{static_cast<int64_t>((bytes + 3) / 4)}, DType::kFloat32, dev);
}

// Rethrows a dnnl::error as ours, naming the primitive.
[[noreturn]] void rethrow_dnnl(const char* op, const dnnl::error& e);

// mixed_bfloat16 (core/precision.h) on the CPU. oneDNN 2.x has bfloat16 convolution and matmul
// kernels only on x86 CPUs with AVX-512 (found once, by creating a small bfloat16 convolution).
// Where they run ("native") the kernels read bfloat16 copies of their inputs; otherwise
// ("emulated") the inputs are rounded to bfloat16 in float32 memory and the float32 kernels run
// them: the same numerics (bfloat16 operands, float32 accumulation; in 3x3 layers Winograd's
// float32 rounding on top, cpu_conv_prims.cc) at float32's speed less the rounding. Having the
// kernels is not enough: on a 2-core Xeon VM (model 207, AVX-512 BF16, no AMX) oneDNN 2.6's
// bfloat16 matmul runs at half float32's rate (76 against 134-152 GFLOP/s), where a Zen 4 EPYC runs
// it at 1.95x. So by default (DTRAIN_BF16_KERNELS=auto) the first use times one 512^3 product each
// way and runs the emulated path where bfloat16 measures under kBf16MinSpeed of float32;
// DTRAIN_BF16_KERNELS=native or emulated decides instead.
constexpr double kBf16MinSpeed = 0.8;
struct Bf16KernelChoice {
  bool available = false;  // oneDNN has bfloat16 kernels on this CPU
  bool native = false;     // mixed_bfloat16 runs them
  double bf16_speed = 0;   // bfloat16 matmul's speed over float32's (0: not measured)
  std::string why;         // why not native (empty when native)
};
// The choice for DTRAIN_BF16_KERNELS=`requested` (auto, native, emulated; else InvalidArgument).
Bf16KernelChoice decide_bf16_kernels(const std::string& requested, bool available,
                                     double bf16_speed);
const Bf16KernelChoice& bf16_kernel_choice();  // this process's, made at the first call
bool mixed_bf16();                             // the policy is mixed_bfloat16
bool bf16_kernels_native();  // mixed_bfloat16 runs oneDNN's bfloat16 kernels (the choice, or a
                             // test's override)
// Whether oneDNN's bfloat16 kernels here are its AMX ones (the effective instruction set, under
// ONEDNN_MAX_CPU_ISA / DTRAIN_MAX_CPU_ISA, is avx512_core_amx), or a test's override: which of
// GPT-2's output-layer products CpuKernels::matmul runs in blocks.
bool bf16_kernels_amx();
// oneDNN's data type for a dtype; undef for those it has none for (float64, int64).
inline memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return memory::data_type::f32;
    case DType::kFloat16:
      return memory::data_type::f16;
    case DType::kBFloat16:
      return memory::data_type::bf16;
    case DType::kInt32:
      return memory::data_type::s32;
    default:
      return memory::data_type::undef;
  }
}

memory::data_type kernel_input_type();  // bf16 under mixed_bfloat16 with native kernels, else f32
// Rounds n floats to the nearest bfloat16 (ties to even, as oneDNN's reorder), in place; or from
// src into dst in the same pass (a rounded copy without a copy first).
void round_to_bf16(float* p, size_t n);
void round_to_bf16(const float* src, float* dst, size_t n);  // src, dst apart
// Tests: run mixed_bfloat16 as on a CPU without bfloat16 kernels, or on the bfloat16 kernels
// where oneDNN has them whatever they measured (false: back to the choice).
void force_bf16_emulation_for_testing(bool on);
void force_bf16_native_for_testing(bool on);
// Tests: bf16_kernels_amx() answers `amx` (0: no, 1: yes; -1: back to the CPU's answer).
void force_bf16_amx_for_testing(int amx);
// Tests: how many products CpuKernels::matmul has run on the bfloat16 kernels in column blocks of
// C (AMX) and in dense blocks of A (without AMX), over the process so far, every thread.
struct Bf16BlockedProducts {
  int64_t column_blocks = 0, dense_a_blocks = 0;
};
Bf16BlockedProducts bf16_blocked_products_for_testing();

}  // namespace dtrain::cpu
