// The CPU device's streaming-store passes (src/devices/cpu/cpu_stream.h: sums, residual sums with
// their ReLU, ReLU gradients whose output is 4 MB or more) against the oneDNN primitives they
// replace, bit for bit: random values with zeros of both signs, NaNs, infinities and denormals
// mixed in, outputs at every alignment (the peeled head) and lengths that leave a tail; the ReLU
// gradient also on a bfloat16 y (the copy ops keep) against oneDNN on it widened, and of a gradient
// in two parts (relu_grad_of_sum) against oneDNN's sum then ReLU gradient. And through the kernels
// of devices of one to three threads (a part per thread), at the size where the device takes them.
#include "devices/cpu/cpu_stream.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "model/op_util.h"

namespace dtrain::cpu {
namespace {

std::vector<float> values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  const float specials[] = {0.f,
                            -0.f,
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min(),
                            1e-39f};
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = rng() % 7 == 0 ? specials[rng() % 8] : u(rng);
  return v;
}

// oneDNN's primitives, as CpuKernels ran them before: binary add (with a ReLU post-op) and the
// ReLU's backward pass, on 1-D f32 memory.
void onednn_binary(const float* a, const float* b, float* c, int64_t n, bool relu) {
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const memory::desc md({n}, dt::f32, tag::a);
  dnnl::primitive_attr attr;
  if (relu) {
    dnnl::post_ops po;
    po.append_eltwise(1.f, algorithm::eltwise_relu, 0.f, 0.f);
    attr.set_post_ops(po);
  }
  dnnl::binary::primitive_desc pd({algorithm::binary_add, md, md, md}, attr, eng);
  dnnl::binary(pd).execute(s, {{DNNL_ARG_SRC_0, memory(md, eng, const_cast<float*>(a))},
                               {DNNL_ARG_SRC_1, memory(md, eng, const_cast<float*>(b))},
                               {DNNL_ARG_DST, memory(md, eng, c)}});
  s.wait();
}

void onednn_relu_grad(const float* y, const float* dy, float* dx, int64_t n) {
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const memory::desc md({n}, dt::f32, tag::a);
  dnnl::eltwise_forward::primitive_desc hint(
      {prop_kind::forward_training, algorithm::eltwise_relu, md, 0.f, 0.f}, eng);
  dnnl::eltwise_backward::primitive_desc pd({algorithm::eltwise_relu, md, md, 0.f, 0.f}, eng, hint);
  dnnl::eltwise_backward(pd).execute(s,
                                     {{DNNL_ARG_SRC, memory(md, eng, const_cast<float*>(y))},
                                      {DNNL_ARG_DIFF_DST, memory(md, eng, const_cast<float*>(dy))},
                                      {DNNL_ARG_DIFF_SRC, memory(md, eng, dx)}});
  s.wait();
}

// Bitwise equal (a NaN equal to a NaN of the same bits); the first difference is reported.
void expect_same_bits(const float* got, const float* want, int64_t n, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t g, w;
    std::memcpy(&g, got + i, 4);
    std::memcpy(&w, want + i, 4);
    if (g != w && !(std::isnan(got[i]) && std::isnan(want[i]))) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << " (0x" << std::hex << g
                    << "), oneDNN gives " << want[i] << " (0x" << w << ")";
      return;
    }
  }
}

// On AVX-512, AVX2 (where the CPU has them) and scalar stores alike.
std::vector<StreamIsa> isas() {
  std::vector<StreamIsa> v = {StreamIsa::kNone};
  if (__builtin_cpu_supports("avx2")) v.push_back(StreamIsa::kAvx2);
  if (__builtin_cpu_supports("avx512f")) v.push_back(StreamIsa::kAvx512);
  return v;
}

TEST(CpuStream, EveryPassEqualsItsOneDnnPrimitiveBitForBit) {
  // Lengths with tails; outputs offset by 0..15 floats from a 64-byte boundary, so that the peeled
  // head takes 0..15 elements.
  for (const StreamIsa isa : isas())
    for (const int64_t n : {int64_t{1} << 20, (int64_t{1} << 20) + 13, int64_t{1234567}}) {
      const std::vector<float> a = values(static_cast<size_t>(n), 1),
                               b = values(static_cast<size_t>(n), 2);
      for (int off : {0, 1, 5, 15}) {
        SCOPED_TRACE("isa " + std::to_string(static_cast<int>(isa)) + ", n " + std::to_string(n) +
                     ", output offset " + std::to_string(off));
        std::vector<float> got(static_cast<size_t>(n) + 64), want(static_cast<size_t>(n));
        float* out =
            got.data() + ((64 - reinterpret_cast<uintptr_t>(got.data()) % 64) % 64) / 4 + off;
        stream_add(a.data(), b.data(), out, n, isa);
        onednn_binary(a.data(), b.data(), want.data(), n, false);
        expect_same_bits(out, want.data(), n, "add");
        stream_add_relu(a.data(), b.data(), out, n, isa);
        onednn_binary(a.data(), b.data(), want.data(), n, true);
        expect_same_bits(out, want.data(), n, "add_relu");
        // With its bfloat16 copy in the same pass (at an offset of its own): the same output, and
        // the copy float_to_bf16's bits of it.
        std::vector<uint16_t> got16(static_cast<size_t>(n) + 64);
        uint16_t* out16 = got16.data() +
                          ((64 - reinterpret_cast<uintptr_t>(got16.data()) % 64) % 64) / 2 +
                          2 * off;
        stream_add_relu_rounded(a.data(), b.data(), out, out16, n, isa);
        expect_same_bits(out, want.data(), n, "add_relu with its bfloat16 copy");
        for (int64_t i = 0; i < n; ++i)
          if (out16[i] != float_to_bf16(want[static_cast<size_t>(i)])) {
            ADD_FAILURE() << "add_relu's bfloat16 copy: element " << i << " is 0x" << std::hex
                          << out16[i] << ", float_to_bf16 gives 0x"
                          << float_to_bf16(want[static_cast<size_t>(i)]);
            break;
          }
        stream_relu_grad(a.data(), b.data(), out, n, isa);
        onednn_relu_grad(a.data(), b.data(), want.data(), n);
        expect_same_bits(out, want.data(), n, "relu_grad");
        // y as a bfloat16 copy: as oneDNN on the copy widened (a's top 16 bits: NaNs, infinities,
        // zeros of both signs and a denormal survive the truncation).
        std::vector<uint16_t> a16(static_cast<size_t>(n));
        std::vector<float> a_wide(static_cast<size_t>(n));
        for (size_t i = 0; i < a16.size(); ++i) {
          uint32_t bits;
          std::memcpy(&bits, &a[i], 4);
          a16[i] = static_cast<uint16_t>(bits >> 16);
          bits &= 0xFFFF0000u;
          std::memcpy(&a_wide[i], &bits, 4);
        }
        stream_relu_grad(a16.data(), b.data(), out, n, isa);
        onednn_relu_grad(a_wide.data(), b.data(), want.data(), n);
        expect_same_bits(out, want.data(), n, "relu_grad on bfloat16 y");
        // The ReLU gradient of a gradient in two parts, b + c, the sum never stored: as oneDNN's
        // add then its ReLU backward, with y float32 and a bfloat16 copy.
        const std::vector<float> c = values(static_cast<size_t>(n), 3);
        std::vector<float> sum(static_cast<size_t>(n));
        onednn_binary(b.data(), c.data(), sum.data(), n, false);
        stream_relu_grad_sum(a.data(), b.data(), c.data(), out, n, isa);
        onednn_relu_grad(a.data(), sum.data(), want.data(), n);
        expect_same_bits(out, want.data(), n, "relu_grad of a sum");
        stream_relu_grad_sum(a16.data(), b.data(), c.data(), out, n, isa);
        onednn_relu_grad(a_wide.data(), sum.data(), want.data(), n);
        expect_same_bits(out, want.data(), n, "relu_grad of a sum on bfloat16 y");
      }
    }
}

// The ReLU gradient's rule at every pair of special values, on the paths below the streaming size
// (oneDNN's primitive; relu_grad_of_sum as its sum then that): y <= 0 ? 0 * dy : dy, so a NaN y
// passes dy on, a NaN or infinite dy at y <= 0 gives NaN and a negative one -0. The CUDA device's
// kernels follow it (gpu_training_kernels_test ReluGradOfSumIsAddThenReluGrad, against these).
TEST(CpuStream, TheReluGradientsRuleAtSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const float specials[] = {1.f, 0.f, -0.f, -1.f, nan, 2.f, -inf, inf, 1e-39f, -1e-39f};
  std::vector<float> yv, dv, want;
  for (float y : specials)
    for (float d : specials) {
      yv.push_back(y);
      dv.push_back(d);
      want.push_back(y <= 0.f ? 0.f * d : d);
    }
  const int64_t n = static_cast<int64_t>(yv.size());
  const std::unique_ptr<Device> device = make_cpu_device(0, 1, /*pin=*/false);
  Kernels& k = device->kernels();
  const Tensor y = Tensor::from_vector(yv, Shape{n}), dy = Tensor::from_vector(dv, Shape{n});
  const Tensor zero = Tensor::zeros(Shape{n}, DType::kFloat32, device->spec());
  expect_same_bits(k.activation_backward(UnaryOp::kRelu, y, dy).data<float>(), want.data(), n,
                   "activation_backward(kRelu)");
  // dy + 0: the same but -0 + 0 = +0
  for (size_t i = 0; i < want.size(); ++i) {
    const float d = dv[i] + 0.f;
    want[i] = yv[i] <= 0.f ? 0.f * d : d;
  }
  expect_same_bits(k.relu_grad_of_sum(y, dy, zero).data<float>(), want.data(), n,
                   "relu_grad_of_sum");
  std::vector<float> got(want.size());
  stream_relu_grad_sum(yv.data(), dv.data(), zero.data<float>(), got.data(), n, StreamIsa::kNone);
  expect_same_bits(got.data(), want.data(), n, "the streaming pass's scalar form");
}

// Through the kernels of a CPU device of one, two and three threads (a streaming pass runs in a
// part per thread), at 4 MB (where the device streams) and just below.
TEST(CpuStream, TheKernelsOfADeviceGiveTheSameBitsWithAnyThreads) {
  int run = 0;
  for (const int threads : {1, 2, 3})
    for (const int64_t n : {kStreamBytes / 4, kStreamBytes / 4 - 1, kStreamBytes / 4 + 7}) {
      const std::unique_ptr<Device> device = make_cpu_device(0, threads, /*pin=*/false);
      Kernels& k = device->kernels();
      SCOPED_TRACE(std::to_string(threads) + " threads, n " + std::to_string(n));
      EXPECT_EQ(stream_pass(n), stream_isa() != StreamIsa::kNone && n * 4 >= kStreamBytes);
      // (values of their own for each run, so that an output block reused from an earlier run
      // cannot hold this one's results where a part was left unwritten)
      const uint32_t seed = static_cast<uint32_t>(++run);
      const std::vector<float> av = values(static_cast<size_t>(n), seed),
                               bv = values(static_cast<size_t>(n), seed + 100);
      const Tensor a = Tensor::from_vector(av, Shape{n}), b = Tensor::from_vector(bv, Shape{n});
      std::vector<float> want(static_cast<size_t>(n));
      onednn_binary(av.data(), bv.data(), want.data(), n, false);
      expect_same_bits(k.binary(BinaryOp::kAdd, a, b).data<float>(), want.data(), n, "binary add");
      onednn_binary(av.data(), bv.data(), want.data(), n, true);
      expect_same_bits(k.add_relu(a, b).data<float>(), want.data(), n, "add_relu");
      {  // with the bfloat16 copy of its output (what ops keeps under mixed_bfloat16)
        Tensor copy;
        const Tensor c = k.add_relu(a, b, &copy);
        expect_same_bits(c.data<float>(), want.data(), n, "add_relu with a copy");
        EXPECT_EQ(copy.defined(), stream_pass(n));  // (else ops rounds a copy itself)
        if (copy.defined()) {
          const auto* cv = static_cast<const uint16_t*>(copy.raw_data());
          int64_t differ = 0;
          for (int64_t i = 0; i < n; ++i)
            differ += cv[i] != float_to_bf16(want[static_cast<size_t>(i)]);
          EXPECT_EQ(differ, 0) << "of " << n << " elements of add_relu's bfloat16 copy";
        }
      }
      onednn_relu_grad(av.data(), bv.data(), want.data(), n);
      expect_same_bits(k.activation_backward(UnaryOp::kRelu, a, b).data<float>(), want.data(), n,
                       "relu backward");
      // y a bfloat16 copy (under mixed_bfloat16): read as it is where the pass streams, widened
      // below; the same bits as oneDNN on the widened copy either way.
      set_precision_policy(Precision::kMixedBFloat16);
      const Tensor a16 = k.cast(a, DType::kBFloat16);
      const Tensor a_wide = k.cast(a16, DType::kFloat32);
      const Tensor dx = k.activation_backward(UnaryOp::kRelu, a16, b);
      // The ReLU gradient of b + c (one pass where it streams, add then relu_grad below).
      const std::vector<float> cv = values(static_cast<size_t>(n), seed + 200);
      const Tensor c = Tensor::from_vector(cv, Shape{n});
      const Tensor dx_sum16 = k.relu_grad_of_sum(a16, b, c);
      set_precision_policy(Precision::kFloat32);
      onednn_relu_grad(a_wide.data<float>(), bv.data(), want.data(), n);
      expect_same_bits(dx.data<float>(), want.data(), n, "relu backward on a bfloat16 y");
      std::vector<float> sum(static_cast<size_t>(n));
      onednn_binary(bv.data(), cv.data(), sum.data(), n, false);
      onednn_relu_grad(a_wide.data<float>(), sum.data(), want.data(), n);
      expect_same_bits(dx_sum16.data<float>(), want.data(), n, "relu_grad_of_sum, bfloat16 y");
      onednn_relu_grad(av.data(), sum.data(), want.data(), n);
      expect_same_bits(k.relu_grad_of_sum(a, b, c).data<float>(), want.data(), n,
                       "relu_grad_of_sum");
    }
}

// ops::add_relu under mixed_bfloat16 with one tape on a one-thread device, at 4 MB: the residual
// sum's pass also writes the bfloat16 copy the op keeps (Kernels::add_relu's `rounded`), which the
// ReLU's backward pass reads and the next convolution shares. That copy is y rounded to nearest
// even, and the gradient is the incoming one where the copy is > 0, times zero elsewhere (-0 for a
// negative gradient, NaN for a NaN), as oneDNN's ReLU backward gives it. (The copy, not y: a y
// below bfloat16's smallest subnormal, 2^-133, is a zero there, as a Keras layer's bfloat16 output
// would be; y = denorm_min is among the values.)
TEST(CpuStream, TheResidualSumsKeptCopyIsItsOutputRounded) {
  configure_devices({1, 1});
  const int64_t n = kStreamBytes / 4 + 5;
  std::vector<float> av = values(static_cast<size_t>(n), 5), bv = values(static_cast<size_t>(n), 6);
  for (float* v : {av.data(), bv.data()})  // finite values: the gradient check below
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(v[i])) v[i] = 0.5f;
  const Tensor a = Tensor::from_vector(av, Shape{n}), b = Tensor::from_vector(bv, Shape{n});
  const std::vector<float> gv = values(static_cast<size_t>(n), 7);
  const Tensor g = Tensor::from_vector(gv, Shape{n});
  set_precision_policy(Precision::kMixedBFloat16);
  struct Reset {
    ~Reset() {
      ops::forget_kept_copies();
      set_precision_policy(Precision::kFloat32);
    }
  } reset;
  GradientTape tape;
  tape.watch(a);
  const Tensor y = ops::add_relu(a, b);
  ASSERT_EQ(y.dtype(), DType::kFloat32);
  const Tensor kept = ops::kept_copy_if_made(y);
  ASSERT_EQ(kept.dtype(), DType::kBFloat16) << "no bfloat16 copy kept for the backward pass";
  const float* yv = y.data<float>();
  const auto* kv = static_cast<const uint16_t*>(kept.raw_data());
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += kv[i] != float_to_bf16(yv[i]);
  EXPECT_EQ(differ, 0) << "of " << n << " elements of the kept copy";
  const std::vector<float> da = tape.gradient(y, {a}, g)[0].to_vector<float>();
  differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = gv[static_cast<size_t>(i)];
    const float want = bf16_to_float(kv[i]) > 0.f ? gi : gi * 0.f;
    const bool d = std::memcmp(&da[static_cast<size_t>(i)], &want, 4) != 0 &&
                   !(std::isnan(da[static_cast<size_t>(i)]) && std::isnan(want));
    differ += d;
  }
  EXPECT_EQ(differ, 0) << "of " << n << " gradient elements";
}

}  // namespace
}  // namespace dtrain::cpu
