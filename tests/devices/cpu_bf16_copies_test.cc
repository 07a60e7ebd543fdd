// The bfloat16 copies ops keeps for the backward pass under mixed_bfloat16 on the CPU device
// (src/model/saved_tensors.cc): what the products keep and read, when the copies are forgotten,
// how they are shared, and the kernels that read them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "devices/cpu/dnnl_util.h"
#include "devices/cpu_test_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "model/op_util.h"

namespace dtrain {
namespace {

// Under mixed_bfloat16 a matrix product (2-D and batched) keeps the bfloat16 copies its kernel
// read for the backward pass: overwriting the float32 operands after the forward pass leaves the
// gradients equal, bit for bit, to the kernel's products on the original operands (natively or
// emulated: the copies are made either way).
TEST(CpuBf16, MatmulsKeepTheBfloat16CopiesTheirProductsRead) {
  // native kernels where oneDNN has them, else the emulated path
  std::optional<MixedBf16> native;
  std::optional<MixedPolicy> emulated;
  if (cpu::bf16_kernel_choice().available)
    native.emplace();
  else
    emulated.emplace();
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  for (const bool batched : {false, true})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        const int64_t bt = 2, m = 17, kk = 33, n = 9;
        const auto shape = [&](int64_t r, int64_t c) {
          return batched ? Shape{bt, r, c} : Shape{r, c};
        };
        const int64_t reps = batched ? bt : 1;
        const auto count = [&](int64_t r, int64_t c) { return static_cast<size_t>(reps * r * c); };
        const Tensor a0 =
            Tensor::from_vector(wave(count(m, kk), 0.37f), ta ? shape(kk, m) : shape(m, kk));
        const Tensor b0 =
            Tensor::from_vector(wave(count(kk, n), 0.71f), tb ? shape(n, kk) : shape(kk, n));
        const Tensor dz = Tensor::from_vector(wave(count(m, n), 1.3f), shape(m, n));
        Tensor a = a0.clone(), b = b0.clone();
        GradientTape tape;
        tape.watch(a);
        tape.watch(b);
        const Tensor z = ops::matmul(a, b, ta, tb);
        const Tensor loss = ops::sum(ops::mul(z, dz));
        std::fill_n(a.data<float>(), a.numel(), 1000.f);  // what the backward pass must not read
        std::fill_n(b.data<float>(), b.numel(), -1000.f);
        const auto g = tape.gradient(loss, {a, b});
        const auto mm = [&](const Tensor& x, const Tensor& y, bool tx, bool ty) {
          return batched ? k.batch_matmul(x, y, tx, ty) : k.matmul(x, y, tx, ty);
        };
        const Tensor ga = ta ? mm(b0, dz, tb, true) : mm(dz, b0, false, !tb);
        const Tensor gb = tb ? mm(dz, a0, true, ta) : mm(a0, dz, !ta, false);
        const std::string where = std::string(batched ? "batched" : "2-D") +
                                  " ta=" + (ta ? "1" : "0") + " tb=" + (tb ? "1" : "0");
        EXPECT_EQ(g[0].to_vector<float>(), ga.to_vector<float>()) << where;
        EXPECT_EQ(g[1].to_vector<float>(), gb.to_vector<float>()) << where;
      }
}

// A recorded forward pass whose tape is dropped without gradient() (an exception mid-step, a
// probe) leaves its bfloat16 copies in the thread's slots; a weight then updated in place keeps
// its id. The next tape must not read the stale copy: its product is that of the new weight.
TEST(CpuBf16, ANewTapeNeverReadsACopyOfAWeightChangedSince) {
  MixedPolicy mixed;
  const Tensor x = Tensor::from_vector(wave(6 * 8, 0.37f), Shape{6, 8});
  Tensor w = Tensor::from_vector(wave(8 * 5, 0.71f), Shape{8, 5});
  {
    GradientTape dropped;
    dropped.watch(w);
    (void)ops::matmul(x, w);  // keeps a bfloat16 copy of w, and never asks for the gradient
  }
  std::fill_n(w.data<float>(), w.numel(), 0.5f);  // in place: the same tensor, the same id
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  const auto expected = [&] {
    return k.matmul(k.cast(x, DType::kBFloat16), k.cast(w, DType::kBFloat16), false, false)
        .to_vector<float>();
  };
  {
    GradientTape tape;
    tape.watch(w);
    EXPECT_EQ(ops::matmul(x, w).to_vector<float>(), expected())
        << "the product read the copy of w made before it changed";
  }
  // The same under an outer tape that is paused (so the inner ones record alone, and make copies):
  // the dropped inner tape's copies go with it.
  GradientTape outer;
  auto paused = outer.stop_recording();
  {
    GradientTape dropped;
    dropped.watch(w);
    (void)ops::matmul(x, w);
  }
  std::fill_n(w.data<float>(), w.numel(), -0.25f);
  GradientTape inner;
  inner.watch(w);
  EXPECT_EQ(ops::matmul(x, w).to_vector<float>(), expected())
      << "under a paused outer tape, the product read the copy of w made before it changed";
}

// Products of one 3-D input (attention's query, key and value projections) keep one bfloat16
// copy of it, not one per product: the copy is the input's, not its 2-D reshape's. The gradients
// are those of the products written on the reshape by hand, bit for bit.
TEST(CpuBf16, ProductsOfOneInputShareItsCopyAcrossTheReshape) {
  MixedPolicy mixed;
  const Tensor x = Tensor::from_vector(wave(2 * 5 * 8, 0.37f), Shape{2, 5, 8});
  const Tensor w1 = Tensor::from_vector(wave(8 * 3, 0.71f), Shape{8, 3});
  const Tensor w2 = Tensor::from_vector(wave(8 * 3, 1.13f), Shape{8, 3});
  const auto grads = [&](bool by_hand) {
    GradientTape tape;
    for (const Tensor* t : {&x, &w1, &w2}) tape.watch(*t);
    const auto product = [&](const Tensor& w) {
      if (!by_hand) return ops::matmul(x, w);
      return ops::reshape(ops::matmul(ops::reshape(x, Shape{10, 8}), w), Shape{2, 5, 3});
    };
    const Tensor y1 = product(w1);
    const Tensor kept = ops::kept_copy_if_made(x);
    const Tensor y2 = product(w2);
    if (!by_hand) {
      EXPECT_EQ(kept.dtype(), DType::kBFloat16) << "no copy kept for the 3-D input itself";
      EXPECT_EQ(ops::kept_copy_if_made(x).id(), kept.id()) << "the second product made another";
    }
    const Tensor loss = ops::sum(ops::add(ops::mul(y1, y1), y2));
    std::vector<std::vector<float>> out;
    for (const Tensor& g : tape.gradient(loss, {x, w1, w2})) out.push_back(g.to_vector<float>());
    return out;
  };
  EXPECT_EQ(grads(false), grads(true));
}

// Every activation's gradient takes a bfloat16 x or y (the kernels' contract under
// mixed_bfloat16, Kernels::hands_off_bfloat16): the same values as from the value widened.
TEST(CpuBf16, ActivationGradientsTakeABfloat16Value) {
  MixedPolicy mixed;
  Kernels& k = get_device(DeviceSpec::cpu(0)).kernels();
  const Tensor v = k.cast(Tensor::from_vector(wave(37, 0.37f), Shape{37}), DType::kBFloat16);
  const Tensor dy = Tensor::from_vector(wave(37, 1.3f), Shape{37});
  for (const UnaryOp op :
       {UnaryOp::kRelu, UnaryOp::kTanh, UnaryOp::kSigmoid, UnaryOp::kGeluErf, UnaryOp::kGeluTanh})
    EXPECT_EQ(k.activation_backward(op, v, dy).to_vector<float>(),
              k.activation_backward(op, k.cast(v, DType::kFloat32), dy).to_vector<float>())
        << "op " << static_cast<int>(op);
  EXPECT_THROW(k.activation_backward(UnaryOp::kTanh, k.cast(v, DType::kFloat64), dy),
               InvalidArgument);
}

}  // namespace
}  // namespace dtrain

namespace dtrain::cpu {
namespace {

// cpu::convert, which widens bfloat16 to float32 with dtrain's own loop where oneDNN's reorders
// have no bfloat16 JIT (below avx512_core: run under DTRAIN_MAX_CPU_ISA=avx2 by ctest's
// cpu_bf16_test@avx2; elsewhere it is oneDNN's reorder itself), gives every value exactly widened
// (its 16 bits on top of 16 zeros: NaN payloads and signed zeros kept, as oneDNN's JIT reorder
// keeps them; its reference reorder, which convert replaces, turned -0 into +0) in to's layout:
// the same layout, a transposed one, NHWC to NCHW and to a blocked layout (a copy widened in
// from's layout, then reordered). The expected values: widened by hand in from's layout, then
// moved by a float32 reorder.
TEST(CpuBf16, ConvertWidensBfloat16Exactly) {
  CpuKernels::State st(1);
  const std::vector<std::pair<memory::desc, memory::desc>> cases = {
      {memory::desc({37, 53}, dt::bf16, tag::ab), memory::desc({37, 53}, dt::f32, tag::ab)},
      {memory::desc({37, 53}, dt::bf16, tag::ba), memory::desc({37, 53}, dt::f32, tag::ab)},
      {memory::desc({2, 19, 5, 7}, dt::bf16, tag::nhwc),
       memory::desc({2, 19, 5, 7}, dt::f32, tag::nhwc)},
      {memory::desc({2, 19, 5, 7}, dt::bf16, tag::nhwc),
       memory::desc({2, 19, 5, 7}, dt::f32, tag::nchw)},
      {memory::desc({2, 19, 5, 7}, dt::bf16, tag::nhwc),
       memory::desc({2, 19, 5, 7}, dt::f32, tag::nChw8c)},
      {memory::desc({300, 1000}, dt::bf16, tag::ab), memory::desc({300, 1000}, dt::f32, tag::ab)},
  };
  for (const auto& [from_d, to_d] : cases) {
    const size_t n = from_d.get_size() / 2;
    std::vector<uint16_t> bits(n);
    for (size_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(i * 2654435761u >> 7);
    const uint16_t specials[] = {0x7fc0, 0xff80, 0x7f80, 0x0001, 0x8000, 0x0000, 0x8001};
    for (size_t i = 0; i < n && i < std::size(specials); ++i) bits[i * 3 % n] = specials[i];
    std::vector<uint32_t> wide(n);
    for (size_t i = 0; i < n; ++i) wide[i] = uint32_t{bits[i]} << 16;
    memory::desc wide_d = from_d;
    wide_d.data.data_type = dnnl_f32;
    std::vector<uint32_t> got(to_d.get_size() / 4, 0xdeadbeef), want(to_d.get_size() / 4, 1);
    convert(st, memory(from_d, st.engine, bits.data()), memory(to_d, st.engine, got.data()),
            DeviceSpec::cpu(0));
    memory wm(wide_d, st.engine, wide.data()), w(to_d, st.engine, want.data());
    dnnl::reorder(wm, w).execute(st.stream(), wm, w);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i] && differ++ < 4)
        ADD_FAILURE() << "element " << i << ": 0x" << std::hex << got[i] << ", exactly widened 0x"
                      << want[i];
    EXPECT_EQ(differ, 0u) << "from " << from_d.dims()[0] << "x" << from_d.dims()[1] << ", "
                          << from_d.get_size() << " bytes, to " << to_d.get_size() << " bytes";
  }
}

}  // namespace
}  // namespace dtrain::cpu
