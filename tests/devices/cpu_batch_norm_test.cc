// Batch norm in training on the CPU device: its own loops on the bfloat16 copy that ops keep under
// mixed_bfloat16 against oneDNN's float32 kernels, their AVX-512 chunks against their portable
// form, and the operands both paths refuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu_test_util.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/devices/kernels.h"

namespace dtrain {
namespace {

// Batch norm in training on the bfloat16 copy ops keep (the CPU's own loops) against oneDNN's
// float32 kernels on the same values, rounded: forward (with and without ReLU), mean, variance and
// the three gradients agree to float32's rounding of the sums. With ReLU the backward pass finds
// the zeros where the forward pass put them (dy = 1: dbeta counts the positive outputs exactly),
// and 2 threads give what 1 gives, bit for bit. 40 channels (not a multiple of a vector), 286 rows
// (blocks of 128, the last partial), a mean far from 0.
TEST(CpuBatchNorm, ReadsTheBfloat16CopyAsFloat32ReadsTheRoundedValues) {
  const Shape xs{2, 13, 11, 40};
  const int64_t c = 40, m = xs.numel() / c;
  std::vector<float> xv = wave(static_cast<size_t>(xs.numel()), 0.37f);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = 3.f + 0.5f * xv[i] + 0.01f * (i % 40);
  for (float& v : xv) v = bf16_to_float(float_to_bf16(v));
  const Tensor x = Tensor::from_vector(xv, xs);
  std::vector<float> gv = wave(40, 0.9f), bv = wave(40, 1.7f);
  for (float& v : gv) v = 1.f + 0.5f * v;  // (every channel then has outputs either side of 0)
  for (float& v : bv) v *= 0.2f;
  const Tensor gamma = Tensor::from_vector(gv, Shape{c}), beta = Tensor::from_vector(bv, Shape{c}),
               dy = Tensor::from_vector(wave(static_cast<size_t>(xs.numel()), 1.3f), xs);
  cpu::CpuKernels one(DeviceSpec::cpu(0), 1), two(DeviceSpec::cpu(0), 2);
  const auto close = [](const Tensor& got, const Tensor& want, double tol, const char* what) {
    const auto g = got.to_vector<float>(), w = want.to_vector<float>();
    ASSERT_EQ(g.size(), w.size()) << what;
    double scale = 0, err = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      scale = std::max(scale, std::abs(static_cast<double>(w[i])));
      err = std::max(err, std::abs(static_cast<double>(g[i]) - w[i]));
    }
    EXPECT_LE(err, tol * scale) << what << ": largest error " << err << " against " << scale;
  };
  for (const bool relu : {false, true}) {
    SCOPED_TRACE(relu ? "with ReLU" : "without ReLU");
    Tensor ref_mask, mask, mask2;
    const BatchNormForward ref =
        relu ? one.batch_norm_relu_training(x, gamma, beta, 1e-3f, &ref_mask)
             : one.batch_norm_training(x, gamma, beta, 1e-3f);
    MixedBf16 policy;
    const Tensor x16 = one.cast(x, DType::kBFloat16);
    const BatchNormForward f = relu ? one.batch_norm_relu_training(x16, gamma, beta, 1e-3f, &mask)
                                    : one.batch_norm_training(x16, gamma, beta, 1e-3f);
    const BatchNormForward f2 = relu ? two.batch_norm_relu_training(x16, gamma, beta, 1e-3f, &mask2)
                                     : two.batch_norm_training(x16, gamma, beta, 1e-3f);
    close(f.y, ref.y, 2e-5, "y");
    close(f.mean, ref.mean, 1e-6, "mean");
    close(f.var, ref.var, 1e-5, "var");
    const auto bwd = [&](cpu::CpuKernels& k, const Tensor& xk, const Tensor& g,
                         const BatchNormForward& fk, const Tensor& mk) {
      return relu ? k.batch_norm_relu_backward(g, xk, gamma, fk.mean, fk.var, 1e-3f, mk)
                  : k.batch_norm_backward(g, xk, gamma, fk.mean, fk.var, 1e-3f);
    };
    const BatchNormBackward rb = bwd(one, x, dy, ref, ref_mask), b = bwd(one, x16, dy, f, mask),
                            b2 = bwd(two, x16, dy, f2, mask2);
    close(b.dx, rb.dx, 1e-4, "dx");
    close(b.dgamma, rb.dgamma, 1e-4, "dgamma");
    close(b.dbeta, rb.dbeta, 1e-5, "dbeta");
    for (const auto& [a, z] : {std::pair{f.y, f2.y},
                               {f.mean, f2.mean},
                               {f.var, f2.var},
                               {b.dx, b2.dx},
                               {b.dgamma, b2.dgamma},
                               {b.dbeta, b2.dbeta}})
      EXPECT_EQ(a.to_vector<float>(), z.to_vector<float>()) << "1 thread against 2";
    if (!relu) continue;
    const Tensor ones = Tensor::from_vector(std::vector<float>(xv.size(), 1.f), xs);
    const auto counted = bwd(one, x16, ones, f, mask).dbeta.to_vector<float>();
    const auto y = f.y.to_vector<float>();
    std::vector<float> positive(static_cast<size_t>(c), 0.f);
    for (size_t i = 0; i < y.size(); ++i) positive[i % 40] += y[i] > 0.f ? 1.f : 0.f;
    EXPECT_EQ(counted, positive);
    EXPECT_GT(*std::min_element(positive.begin(), positive.end()), 0.f);
    EXPECT_LT(*std::max_element(positive.begin(), positive.end()), static_cast<float>(m));
    EXPECT_THROW(one.batch_norm_relu_backward(dy, x16, gamma, f.mean, f.var, 1e-3f, ref_mask),
                 InvalidArgument);  // oneDNN's bitmask for a float32 x, not this x's [2, C]
    // Per-channel operands of another length are refused on both paths, not read past their end.
    const Tensor short_gamma = Tensor::from_vector(std::vector<float>(39, 1.f), Shape{39});
    for (const Tensor& xk : {x, x16}) {
      EXPECT_THROW(one.batch_norm_training(xk, short_gamma, beta, 1e-3f), InvalidArgument);
      EXPECT_THROW(one.batch_norm_backward(dy, xk, gamma, f.mean, short_gamma, 1e-3f),
                   InvalidArgument);
    }
  }
}

// Operands batch norm would read past their end are refused on both paths (float32 and the
// bfloat16 copy), and x without channels gives empty results instead of a division by zero (found
// by a second reading of the kernels): dy of another shape (oneDNN's float32 kernel read x's size
// from it), a ReLU mask of the other path or another type, x of shape [..., 0]. Also that a NaN
// gives the fused ReLU's 0 on both paths.
TEST(CpuBatchNorm, RefusesOperandsItWouldReadPastAndHandlesNoChannels) {
  cpu::CpuKernels k(DeviceSpec::cpu(0), 1);
  const Shape xs{2, 3, 5, 8};
  const Tensor x = Tensor::from_vector(wave(static_cast<size_t>(xs.numel()), 0.37f), xs);
  const Tensor dy = Tensor::from_vector(wave(static_cast<size_t>(xs.numel()), 0.53f), xs);
  const Tensor gamma = Tensor::from_vector(std::vector<float>(8, 1.f), Shape{8}),
               beta = Tensor::from_vector(std::vector<float>(8, 0.f), Shape{8});
  const Tensor short_dy = Tensor::from_vector(std::vector<float>(8, 1.f), Shape{1, 8});
  const BatchNormForward f = k.batch_norm_training(x, gamma, beta, 1e-3f);
  EXPECT_THROW(k.batch_norm_backward(short_dy, x, gamma, f.mean, f.var, 1e-3f), InvalidArgument);
  Tensor mask32;
  const BatchNormForward fr = k.batch_norm_relu_training(x, gamma, beta, 1e-3f, &mask32);
  EXPECT_THROW(k.batch_norm_relu_backward(short_dy, x, gamma, fr.mean, fr.var, 1e-3f, mask32),
               InvalidArgument);
  {
    MixedBf16 policy;
    const Tensor x16 = k.cast(x, DType::kBFloat16);
    Tensor mask;
    const BatchNormForward f16 = k.batch_norm_relu_training(x16, gamma, beta, 1e-3f, &mask);
    EXPECT_THROW(k.batch_norm_backward(short_dy, x16, gamma, f16.mean, f16.var, 1e-3f),
                 InvalidArgument);
    const Tensor mask_int = Tensor::from_vector(std::vector<int32_t>(16, 0), Shape{2, 8});
    EXPECT_THROW(k.batch_norm_relu_backward(dy, x16, gamma, f16.mean, f16.var, 1e-3f, mask_int),
                 InvalidArgument);
    EXPECT_NO_THROW(k.batch_norm_relu_backward(dy, x16, gamma, f16.mean, f16.var, 1e-3f, mask));
    // The bfloat16 path's [2, C] handed to the float32 path, whose bitmask for these 30 x 8 values
    // is 30 bytes: as many bytes would pass, so the shape is checked too.
    EXPECT_THROW(k.batch_norm_relu_backward(dy, x, gamma, fr.mean, fr.var, 1e-3f, mask),
                 InvalidArgument);
  }
  {  // A NaN makes its channel's statistics NaN; the fused ReLU gives 0 there on both paths, as
     // oneDNN's float32 kernel and ops::relu do (the bfloat16 path gave NaN).
    std::vector<float> xv = x.to_vector<float>();
    xv[5] = std::numeric_limits<float>::quiet_NaN();
    const Tensor xn = Tensor::from_vector(xv, xs);
    Tensor m32, m16;
    const std::vector<float> y32 =
        k.batch_norm_relu_training(xn, gamma, beta, 1e-3f, &m32).y.to_vector<float>();
    MixedBf16 policy;
    const std::vector<float> y16 =
        k.batch_norm_relu_training(k.cast(xn, DType::kBFloat16), gamma, beta, 1e-3f, &m16)
            .y.to_vector<float>();
    for (size_t i = 5; i < y32.size(); i += 8) {
      EXPECT_EQ(y32[i], 0.f) << i;
      EXPECT_EQ(y16[i], 0.f) << i;
    }
  }
  const Shape none{2, 3, 5, 0};
  const Tensor x0 = Tensor::from_vector(std::vector<float>{}, none),
               c0 = Tensor::from_vector(std::vector<float>{}, Shape{0});
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bfloat16 copy" : "float32");
    std::optional<MixedBf16> policy;
    if (bf16) policy.emplace();
    const Tensor xk = bf16 ? k.cast(x0, DType::kBFloat16) : x0;
    Tensor mask;
    const BatchNormForward f0 = k.batch_norm_relu_training(xk, c0, c0, 1e-3f, &mask);
    EXPECT_EQ(f0.y.shape(), none);
    EXPECT_EQ(f0.mean.shape(), Shape{0});
    const BatchNormBackward b0 =
        k.batch_norm_relu_backward(x0, xk, c0, f0.mean, f0.var, 1e-3f, mask);
    EXPECT_EQ(b0.dx.shape(), none);
    EXPECT_EQ(b0.dgamma.shape(), Shape{0});
    EXPECT_EQ(k.batch_norm_training(xk, c0, c0, 1e-3f).var.shape(), Shape{0});
  }
  EXPECT_EQ(k.batch_norm_inference(x0, c0, c0, c0, c0, 1e-3f).shape(), none);
}

// The AVX-512 form of the bfloat16 loops (channels in chunks of 64 and 16 held in registers over a
// block's rows; the rest portable) gives the portable loops' bits exactly: every output of the
// forward and backward passes, with and without ReLU, float32 and bfloat16 outputs, on 1 and 2
// threads. Channel counts cover each path: 85 = 64 + 16 + 5, 16, 2048 (32 chunks of 64) and 8
// (portable alone); 154 rows are a full block of 128 and a partial one. NaNs in a 64-chunk, a
// 16-chunk and the tail make their channels' statistics NaN (ReLU's 0, dx's 0x7fc0 in bfloat16);
// a fifth of the channels have gamma 0 and a third beta -0, so that y is +-0 (ReLU's boundary).
TEST(CpuBatchNorm, Avx512ChunksGiveThePortableLoopsBitsExactly) {
  if (!cpu_testing::batch_norm_loops_avx512())
    GTEST_SKIP() << "the loops' AVX-512 form does not run here (no AVX-512, or DTRAIN_MAX_CPU_ISA)";
  struct Portable {
    Portable() { cpu_testing::force_portable_batch_norm_loops(true); }
    ~Portable() { cpu_testing::force_portable_batch_norm_loops(false); }
  };
  const auto bits = [](const Tensor& t) {
    const auto* p = static_cast<const unsigned char*>(t.raw_data());
    return std::vector<unsigned char>(p,
                                      p + t.numel() * static_cast<int64_t>(dtype_size(t.dtype())));
  };
  MixedBf16 policy;
  for (const int64_t c : {85, 16, 2048, 8})
    for (const int threads : {1, 2}) {
      SCOPED_TRACE("channels " + std::to_string(c) + ", threads " + std::to_string(threads));
      cpu::CpuKernels k(DeviceSpec::cpu(0), threads);
      const Shape xs{2, 7, 11, c};
      std::vector<float> xv = wave(static_cast<size_t>(xs.numel()), 0.37f);
      for (size_t i = 0; i < xv.size(); ++i)
        xv[i] = 1.5f + xv[i] + 0.01f * static_cast<float>(i % 7);
      for (const size_t ch : {5, 70, 82})
        if (static_cast<int64_t>(ch) < c) xv[static_cast<size_t>(c) * 3 + ch] = NAN;
      std::vector<float> gv = wave(static_cast<size_t>(c), 0.9f), bv(static_cast<size_t>(c), 0.f);
      for (size_t j = 0; j < gv.size(); ++j) {
        bv[j] = j % 3 ? 0.2f * gv[j] : -0.f;
        if (j % 5 == 1) gv[j] = 0.f;  // y = 0 (x - mean) + beta: +-0 at ReLU's boundary
      }
      const Tensor x = k.cast(Tensor::from_vector(xv, xs), DType::kBFloat16);
      const Tensor gamma = Tensor::from_vector(gv, Shape{c}),
                   beta = Tensor::from_vector(bv, Shape{c});
      const Tensor dy = Tensor::from_vector(wave(static_cast<size_t>(xs.numel()), 1.3f), xs);
      for (const bool relu : {false, true})
        for (const DType out : {DType::kFloat32, DType::kBFloat16}) {
          // (bfloat16 y is ReLU's alone: without it, a bfloat16 dx and float32 y)
          SCOPED_TRACE(std::string(relu ? "ReLU, " : "") + dtype_name(out) + " outputs");
          auto run = [&] {
            Tensor mask;
            BatchNormForward f = relu
                                     ? k.batch_norm_relu_training(x, gamma, beta, 1e-3f, &mask, out)
                                     : k.batch_norm_training(x, gamma, beta, 1e-3f);
            // The statistics as the forward pass made them, fixed, so that the two backward passes
            // get the same operands (they do anyway when the forward passes agree).
            BatchNormBackward b =
                relu ? k.batch_norm_relu_backward(dy, x, gamma, f.mean, f.var, 1e-3f, mask, out)
                     : k.batch_norm_backward(dy, x, gamma, f.mean, f.var, 1e-3f, out);
            return std::vector<std::vector<unsigned char>>{
                bits(f.y), bits(f.mean), bits(f.var), bits(b.dx), bits(b.dgamma), bits(b.dbeta)};
          };
          const auto fast = run();
          std::vector<std::vector<unsigned char>> portable;
          {
            Portable p;
            portable = run();
          }
          const char* names[] = {"y", "mean", "var", "dx", "dgamma", "dbeta"};
          for (size_t i = 0; i < fast.size(); ++i) EXPECT_TRUE(fast[i] == portable[i]) << names[i];
        }
    }
  EXPECT_TRUE(cpu_testing::batch_norm_loops_avx512()) << "the portable loops were left forced";
}

}  // namespace
}  // namespace dtrain
