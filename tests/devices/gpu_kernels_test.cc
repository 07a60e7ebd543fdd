// GPU kernels against the CPU reference: every Kernels method runs on the same random inputs on
// CPU:0 and GPU:0 and the results must agree to float32 rounding (rel/abs ~1e-4); dropout masks
// and casts must agree bit for bit. Also covers the CUDA device itself (allocator copies, worker
// thread, calls from several threads). Every test skips when no CUDA device is visible.
#include <algorithm>

#include "devices/gpu_test_util.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

using namespace gpu_test;

// --- device and allocator ---

TEST(CudaDevice, DescribesItselfAndRunsSubmittedWork) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Device& d = get_device(kGpu);
  EXPECT_EQ(d.spec(), kGpu);
  EXPECT_NE(d.description().find("GPU:0"), std::string::npos) << d.description();
  int ran = 0;
  d.submit([&] { ran = 1; }).get();
  EXPECT_EQ(ran, 1);
  auto f = d.submit([] { throw InvalidArgument("from the worker"); });
  EXPECT_THROW(f.get(), InvalidArgument);
  d.synchronize();
}

TEST(CudaDevice, CopiesRoundTripAndZeros) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor h = random_tensor(Shape{1000, 3}, 1);
  const Tensor g = G(h);
  EXPECT_EQ(g.device(), kGpu);
  expect_bitwise_equal(h, g, "host->gpu->host");
  expect_bitwise_equal(h, g.clone(), "gpu clone");
  const Tensor z = Tensor::zeros(Shape{257}, DType::kFloat32, kGpu);
  for (float v : z.to_vector<float>()) ASSERT_EQ(v, 0.f);
  const Tensor rows = g.slice_rows(10, 20);  // a view at an offset
  expect_bitwise_equal(h.slice_rows(10, 20), rows, "slice_rows");
  EXPECT_EQ(Tensor::scalar(2.5f, kGpu).item(), 2.5f);
}

TEST(CudaDevice, KernelsFromOtherThreads) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor a = random_tensor(Shape{64, 48}, 2), b = random_tensor(Shape{48, 32}, 3);
  const Tensor expect = cpu().matmul(a, b, false, false);
  Tensor from_worker;
  get_device(kGpu).submit([&] { from_worker = gpu().matmul(G(a), G(b), false, false); }).get();
  expect_close(expect, from_worker, 1e-4f, 1e-4f, "worker thread");
  std::vector<Tensor> outs(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < outs.size(); ++i)
    threads.emplace_back([&, i] { outs[i] = gpu().matmul(G(a), G(b), false, false); });
  for (auto& t : threads) t.join();
  for (const Tensor& t : outs) expect_close(expect, t, 1e-4f, 1e-4f, "plain thread");
}

// Kernels::copy_slab (concat, slice, zero padding, the ResNets' shortcuts) through the CUDA
// allocator's copies: bitwise the CPU's, on every axis, and the ops built on it.
TEST(CudaKernels, CopySlabAndTheOpsOnItMatchTheCpu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor a = random_tensor(Shape{2, 3, 4, 5}, 40), b = random_tensor(Shape{2, 3, 2, 5}, 41);
  for (int axis : {0, 1, 2, 3}) {
    Tensor dc = Tensor::zeros(a.shape(), DType::kFloat32, kCpu);
    Tensor dg = Tensor::zeros(a.shape(), DType::kFloat32, kGpu);
    const int64_t n = a.shape()[axis];
    cpu().copy_slab(a, axis, 1, dc, 0, n - 1);
    gpu().copy_slab(G(a), axis, 1, dg, 0, n - 1);
    expect_bitwise_equal(dc, dg, "copy_slab axis " + std::to_string(axis));
  }
  expect_bitwise_equal(ops::concat({a, b}, 2), ops::concat({G(a), G(b)}, 2), "concat");
  expect_bitwise_equal(ops::slice(a, -1, 1, 3), ops::slice(G(a), -1, 1, 3), "slice");
  expect_bitwise_equal(ops::zero_pad2d(a, 1, 2, 0, 3), ops::zero_pad2d(G(a), 1, 2, 0, 3),
                       "zero_pad2d");
}

// --- convolution ---

TEST(GpuKernels, Conv2dForward) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 100;
  for (const ConvCase& c : conv_cases()) {
    const Tensor x = random_tensor(c.x, s++), w = random_tensor(c.w, s++);
    const Tensor b = random_tensor(Shape{c.w[3]}, s++);
    expect_close(cpu().conv2d(x, w, Tensor(), c.p), gpu().conv2d(G(x), G(w), Tensor(), c.p), 1e-4f,
                 1e-4f, "no bias " + conv_name(c));
    expect_close(cpu().conv2d(x, w, b, c.p), gpu().conv2d(G(x), G(w), G(b), c.p), 1e-4f, 1e-4f,
                 "bias " + conv_name(c));
  }
  const Tensor x = random_tensor(Shape{1, 5, 5, 3}, 1), w = random_tensor(Shape{3, 3, 2, 4}, 2);
  EXPECT_THROW(gpu().conv2d(G(x), G(w), Tensor(), {}), InvalidArgument);  // channel mismatch
}

TEST(GpuKernels, Conv2dBackwardInput) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 200;
  for (const ConvCase& c : conv_cases()) {
    const Tensor w = random_tensor(c.w, s++);
    const Tensor y = cpu().conv2d(random_tensor(c.x, s++), w, Tensor(), c.p);
    const Tensor dy = random_tensor(y.shape(), s++);
    expect_close(cpu().conv2d_backward_input(dy, w, c.x, c.p),
                 gpu().conv2d_backward_input(G(dy), G(w), c.x, c.p), 1e-4f, 1e-4f, conv_name(c));
  }
}

TEST(GpuKernels, Conv2dBackwardFilter) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 300;
  for (const ConvCase& c : conv_cases()) {
    const Tensor x = random_tensor(c.x, s++);
    const Tensor y = cpu().conv2d(x, random_tensor(c.w, s++), Tensor(), c.p);
    const Tensor dy = random_tensor(y.shape(), s++);
    Tensor db_c, db_g;
    // Filter gradients sum over N*OH*OW products: scale the tolerance with that count.
    const float atol = 1e-4f * std::sqrt(static_cast<float>(y.numel() / c.w[3]));
    expect_close(cpu().conv2d_backward_filter(x, dy, c.w, c.p, true, &db_c),
                 gpu().conv2d_backward_filter(G(x), G(dy), c.w, c.p, true, &db_g), 1e-4f, atol,
                 "dw " + conv_name(c));
    expect_close(db_c, db_g, 1e-4f, atol, "db " + conv_name(c));
    expect_close(cpu().conv2d_backward_filter(x, dy, c.w, c.p, false, nullptr),
                 gpu().conv2d_backward_filter(G(x), G(dy), c.w, c.p, false, nullptr), 1e-4f, atol,
                 "dw without bias " + conv_name(c));
  }
}

// Training must be bitwise reproducible on a GPU (BackupAndRestore: a run resumed from a backup
// ends bit for bit where an uninterrupted one does), so the convolution gradients must not use
// cuDNN's non-deterministic (atomic) algorithms. The reference CNN's two convolutions, at the
// batch sizes the tests and benchmarks use: every repeat must equal the first bit for bit.
TEST(GpuKernels, Conv2dGradientsAreBitwiseRepeatable) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 400;
  for (int64_t n : {64, 96, 256}) {
    for (const ConvCase& c :
         {ConvCase{Shape{n, 28, 28, 1}, Shape{3, 3, 1, 32}, {}},
          ConvCase{Shape{n, 13, 13, 32}, Shape{3, 3, 32, 64}, {}},
          ConvCase{Shape{n, 14, 14, 64}, Shape{1, 1, 64, 128}, {}},
          ConvCase{Shape{n, 14, 14, 64}, Shape{1, 1, 64, 32}, {2, 2, 0, 0, 0, 0}}}) {
      const Tensor x = G(random_tensor(c.x, s++)), w = G(random_tensor(c.w, s++));
      const Tensor dy = G(random_tensor(gpu().conv2d(x, w, Tensor(), c.p).shape(), s++));
      Tensor db0;
      const Tensor dw0 = gpu().conv2d_backward_filter(x, dy, c.w, c.p, true, &db0).to(kCpu);
      const Tensor dx0 = gpu().conv2d_backward_input(dy, w, c.x, c.p).to(kCpu);
      db0 = db0.to(kCpu);
      for (int rep = 0; rep < 5; ++rep) {
        Tensor db;
        const std::string what = conv_name(c) + " repeat " + std::to_string(rep);
        expect_bitwise_equal(dw0, gpu().conv2d_backward_filter(x, dy, c.w, c.p, true, &db),
                             "dw " + what);
        expect_bitwise_equal(db0, db, "db " + what);
        expect_bitwise_equal(dx0, gpu().conv2d_backward_input(dy, w, c.x, c.p), "dx " + what);
        if (HasFailure()) return;
      }
    }
  }
}

// --- pooling ---

TEST(GpuKernels, MaxPool2dForwardAndBackward) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case {
    Shape x;
    Pool2dParams p;
  };
  const std::vector<Case> cases = {
      {Shape{2, 8, 8, 3}, {2, 2, 2, 2, 0, 0, 0, 0}},
      {Shape{2, 7, 9, 4}, {3, 3, 2, 2, 1, 1, 1, 1}},
      {Shape{1, 7, 7, 2}, {2, 2, 2, 2, 0, 1, 0, 1}},  // TF "same" with an odd input
      {Shape{3, 6, 5, 5}, {3, 2, 1, 1, 1, 1, 0, 1}},  // overlapping windows
  };
  uint64_t s = 400;
  for (const Case& c : cases) {
    const Tensor x = random_tensor(c.x, s++);  // continuous values: no ties in a window
    Tensor ws_c, ws_g;
    const Tensor y_c = cpu().max_pool2d(x, c.p, &ws_c);
    const Tensor y_g = gpu().max_pool2d(G(x), c.p, &ws_g);
    expect_close(y_c, y_g, 0.f, 0.f, "forward " + c.x.to_string());
    const Tensor dy = random_tensor(y_c.shape(), s++);
    const Tensor dx_c = cpu().max_pool2d_backward(dy, x, ws_c, c.p);
    expect_close(dx_c, gpu().max_pool2d_backward(G(dy), G(x), ws_g, c.p), 1e-5f, 1e-6f,
                 "backward " + c.x.to_string());
    expect_close(dx_c, gpu().max_pool2d_backward(G(dy), G(x), Tensor(), c.p), 1e-5f, 1e-6f,
                 "backward without workspace " + c.x.to_string());
  }
}

// --- dense algebra ---

TEST(GpuKernels, Matmul) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t m = 17, k = 33, n = 9;
  uint64_t s = 500;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, s++);
      const Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, s++);
      expect_close(cpu().matmul(a, b, ta, tb), gpu().matmul(G(a), G(b), ta, tb), 1e-4f, 1e-4f,
                   std::string("transpose ") + (ta ? "a" : "-") + (tb ? "b" : "-"));
    }
  const Tensor big_a = random_tensor(Shape{256, 512}, s++),
               big_b = random_tensor(Shape{512, 128}, s++);
  expect_close(cpu().matmul(big_a, big_b, false, false),
               gpu().matmul(G(big_a), G(big_b), false, false), 1e-4f, 1e-3f, "256x512x128");
  const Tensor e1 = random_tensor(Shape{4, 0}, s++), e2 = random_tensor(Shape{0, 3}, s++);
  expect_close(cpu().matmul(e1, e2, false, false), gpu().matmul(G(e1), G(e2), false, false), 0.f,
               0.f, "k = 0");
  EXPECT_THROW(gpu().matmul(G(big_a), G(big_a), false, false), InvalidArgument);
}

// --- elementwise ---

TEST(GpuKernels, Unary) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor x = random_tensor(Shape{3, 257}, 600, -3.f, 3.f);
  const Tensor pos = random_tensor(Shape{3, 257}, 601, 0.05f, 4.f);
  for (UnaryOp op : {UnaryOp::kRelu, UnaryOp::kTanh, UnaryOp::kSigmoid, UnaryOp::kNeg,
                     UnaryOp::kExp, UnaryOp::kLog, UnaryOp::kSquare, UnaryOp::kSqrt, UnaryOp::kAbs,
                     UnaryOp::kGeluErf, UnaryOp::kGeluTanh}) {
    const Tensor& in = (op == UnaryOp::kLog || op == UnaryOp::kSqrt) ? pos : x;
    const Tensor g = gpu().unary(op, G(in));
    // The CPU device's log (oneDNN eltwise_log) is off by up to ~3.3e-6 absolute near x = 1
    // (measured on an H100 host: log(0.8403430) = -0.17394514 correctly rounded, CPU
    // -0.17394842), so log gets an absolute tolerance against it; the float64 check below holds
    // the GPU to a few ulp for every op.
    const float atol = op == UnaryOp::kLog ? 1e-5f : 1e-6f;
    expect_close(cpu().unary(op, in), g, 1e-5f, atol, "op " + std::to_string(static_cast<int>(op)));
    const std::vector<float> xs = in.to_vector<float>(), ys = g.to_vector<float>();
    size_t bad = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      const double v = xs[i];
      double r = 0;
      switch (op) {
        case UnaryOp::kRelu:
          r = v > 0 ? v : 0;
          break;
        case UnaryOp::kTanh:
          r = std::tanh(v);
          break;
        case UnaryOp::kSigmoid:
          r = 1.0 / (1.0 + std::exp(-v));
          break;
        case UnaryOp::kNeg:
          r = -v;
          break;
        case UnaryOp::kExp:
          r = std::exp(v);
          break;
        case UnaryOp::kLog:
          r = std::log(v);
          break;
        case UnaryOp::kSquare:
          r = v * v;
          break;
        case UnaryOp::kSqrt:
          r = std::sqrt(v);
          break;
        case UnaryOp::kAbs:
          r = std::fabs(v);
          break;
        case UnaryOp::kGeluErf:
          r = 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
          break;
        case UnaryOp::kGeluTanh:
          r = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
          break;
      }
      if (std::fabs(ys[i] - r) > 1e-6 * std::fabs(r) + 1e-9 && bad++ < 8)
        ADD_FAILURE() << "op " << static_cast<int>(op) << " element " << i << ": x " << xs[i]
                      << " gpu " << ys[i] << " float64 " << r;
    }
    EXPECT_EQ(bad, 0u) << "op " << static_cast<int>(op) << " vs float64";
  }
}

TEST(GpuKernels, ActivationBackward) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor x = random_tensor(Shape{5, 61}, 610, -3.f, 3.f);
  const Tensor dy = random_tensor(Shape{5, 61}, 611);
  expect_close(cpu().activation_backward(UnaryOp::kRelu, x, dy),
               gpu().activation_backward(UnaryOp::kRelu, G(x), G(dy)), 1e-6f, 1e-7f, "relu");
  for (UnaryOp op : {UnaryOp::kTanh, UnaryOp::kSigmoid}) {
    const Tensor y = cpu().unary(op, x);
    expect_close(cpu().activation_backward(op, y, dy), gpu().activation_backward(op, G(y), G(dy)),
                 1e-5f, 1e-6f, "op " + std::to_string(static_cast<int>(op)));
  }
  for (UnaryOp op : {UnaryOp::kGeluErf, UnaryOp::kGeluTanh})  // given x
    expect_close(cpu().activation_backward(op, x, dy), gpu().activation_backward(op, G(x), G(dy)),
                 1e-5f, 1e-6f, "op " + std::to_string(static_cast<int>(op)));
  EXPECT_THROW(gpu().activation_backward(UnaryOp::kExp, G(x), G(dy)), InvalidArgument);
}

// The transformer kernels against the CPU's: batched matmul in every transpose, permute of float
// and int32, softmax and log-softmax with gradients, layer norm with gradients, and the embedding
// gather / scatter-add (bitwise: both add in index order).
TEST(GpuKernels, TransformerKernelsMatchTheCpu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 700;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Tensor a = random_tensor(ta ? Shape{3, 17, 5} : Shape{3, 5, 17}, s++);
      const Tensor b = random_tensor(tb ? Shape{3, 9, 17} : Shape{3, 17, 9}, s++);
      expect_close(cpu().batch_matmul(a, b, ta, tb), gpu().batch_matmul(G(a), G(b), ta, tb), 1e-5f,
                   1e-5f, "batch_matmul");
    }
  const Tensor x4 = random_tensor(Shape{2, 5, 3, 7}, s++);
  expect_bitwise_equal(cpu().permute(x4, {0, 2, 1, 3}), gpu().permute(G(x4), {0, 2, 1, 3}),
                       "permute 0213");
  expect_bitwise_equal(cpu().permute(x4, {3, 1, 0, 2}), gpu().permute(G(x4), {3, 1, 0, 2}),
                       "permute 3102");
  const Tensor ids = Tensor::from_vector<int32_t>({3, 0, 3, 1, 4, 3}, Shape{2, 3});
  expect_bitwise_equal(cpu().permute(ids, {1, 0}), gpu().permute(G(ids), {1, 0}), "permute int");
  const Tensor logits = random_tensor(Shape{6, 45}, s++, -4.f, 4.f);
  const Tensor dl = random_tensor(Shape{6, 45}, s++);
  for (bool log : {false, true}) {
    const Tensor y = cpu().softmax(logits, log);
    expect_close(y, gpu().softmax(G(logits), log), 1e-5f, 1e-6f, "softmax");
    expect_close(cpu().softmax_backward(y, dl, log), gpu().softmax_backward(G(y), G(dl), log),
                 1e-4f, 1e-5f, "softmax_backward");
  }
  const Tensor x = random_tensor(Shape{4, 3, 40}, s++, -2.f, 5.f);
  const Tensor gamma = random_tensor(Shape{40}, s++), beta = random_tensor(Shape{40}, s++);
  const LayerNormForward fc = cpu().layer_norm(x, gamma, beta, 1e-5f);
  const LayerNormForward fg = gpu().layer_norm(G(x), G(gamma), G(beta), 1e-5f);
  expect_close(fc.y, fg.y, 1e-4f, 1e-5f, "layer_norm y");
  expect_close(fc.mean, fg.mean, 1e-5f, 1e-6f, "layer_norm mean");
  expect_close(fc.var, fg.var, 1e-4f, 1e-6f, "layer_norm var");
  const Tensor dy = random_tensor(x.shape(), s++);
  const LayerNormBackward bc = cpu().layer_norm_backward(dy, x, gamma, fc.mean, fc.var, 1e-5f);
  const LayerNormBackward bg =
      gpu().layer_norm_backward(G(dy), G(x), G(gamma), G(fc.mean), G(fc.var), 1e-5f);
  expect_close(bc.dx, bg.dx, 1e-3f, 1e-4f, "layer_norm dx");
  expect_close(bc.dgamma, bg.dgamma, 1e-4f, 1e-4f, "layer_norm dgamma");
  expect_close(bc.dbeta, bg.dbeta, 1e-4f, 1e-4f, "layer_norm dbeta");
  {  // GPT-sized: 2,048 rows of 768, where dgamma/dbeta's column sums run in chunks of rows
    const Tensor xl = random_tensor(Shape{2048, 768}, s++, -2.f, 5.f);
    const Tensor gl = random_tensor(Shape{768}, s++), bl = random_tensor(Shape{768}, s++);
    const LayerNormForward fl = cpu().layer_norm(xl, gl, bl, 1e-5f);
    const Tensor dyl = random_tensor(xl.shape(), s++);
    const LayerNormBackward cl = cpu().layer_norm_backward(dyl, xl, gl, fl.mean, fl.var, 1e-5f);
    const LayerNormBackward gl2 =
        gpu().layer_norm_backward(G(dyl), G(xl), G(gl), G(fl.mean), G(fl.var), 1e-5f);
    expect_close(cl.dx, gl2.dx, 1e-3f, 1e-4f, "layer_norm dx, 2048 rows");
    expect_close(cl.dgamma, gl2.dgamma, 1e-4f, 1e-3f, "layer_norm dgamma, 2048 rows");
    expect_close(cl.dbeta, gl2.dbeta, 1e-4f, 1e-3f, "layer_norm dbeta, 2048 rows");
    const LayerNormBackward again =
        gpu().layer_norm_backward(G(dyl), G(xl), G(gl), G(fl.mean), G(fl.var), 1e-5f);
    expect_bitwise_equal(gl2.dgamma, again.dgamma, "layer_norm dgamma repeated");
    expect_bitwise_equal(gl2.dbeta, again.dbeta, "layer_norm dbeta repeated");
  }
  {  // no rows: zero parameter gradients
    const Tensor x0 = random_tensor(Shape{0, 768}, s++), g0 = random_tensor(Shape{768}, s++);
    const Tensor m0 = random_tensor(Shape{0}, s++);
    const LayerNormBackward c0 = cpu().layer_norm_backward(x0, x0, g0, m0, m0, 1e-5f);
    const LayerNormBackward g0b =
        gpu().layer_norm_backward(G(x0), G(x0), G(g0), G(m0), G(m0), 1e-5f);
    expect_close(c0.dgamma, g0b.dgamma, 0.f, 0.f, "layer_norm dgamma, no rows");
    expect_close(c0.dbeta, g0b.dbeta, 0.f, 0.f, "layer_norm dbeta, no rows");
  }
  const Tensor table = random_tensor(Shape{5, 8}, s++);
  expect_bitwise_equal(cpu().gather_rows(table, ids), gpu().gather_rows(G(table), G(ids)),
                       "gather_rows");
  const Tensor g = random_tensor(Shape{2, 3, 8}, s++);
  expect_bitwise_equal(cpu().scatter_add_rows(g, ids, 5), gpu().scatter_add_rows(G(g), G(ids), 5),
                       "scatter_add_rows");
  const Tensor bad = Tensor::from_vector<int32_t>({0, 5}, Shape{2});
  EXPECT_THROW(gpu().gather_rows(G(table), G(bad)), InvalidArgument);
}

// The causal mask and softmax in one kernel (the mask worked out from each row's index): the bits
// of the two kernels it replaces (Kernels' default: the mask made, added, then softmax) on the
// GPU, and the CPU's values within rounding, with more keys than queries, as many, and fewer.
TEST(GpuKernels, CausalSoftmaxIsTheMaskThenSoftmaxBitForBit) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(gpu().fuses_causal_softmax());
  uint64_t s = 970;
  for (const Shape& shape :
       {Shape{2, 3, 37, 37}, Shape{4, 70}, Shape{70, 4}, Shape{2, 12, 64, 64}, Shape{1, 1}}) {
    const Tensor x = random_tensor(shape, s++, -3.f, 3.f);
    const Tensor fused = gpu().causal_softmax(G(x), ops::kMaskValue);
    expect_bitwise_equal(gpu().Kernels::causal_softmax(G(x), ops::kMaskValue), fused,
                         "causal_softmax " + shape.to_string());
    expect_close(ops::softmax(ops::causal_mask(x), -1), fused, 1e-5f, 1e-6f,
                 "causal_softmax " + shape.to_string());
  }
  EXPECT_THROW(gpu().causal_softmax(G(random_tensor(Shape{5}, 980)), ops::kMaskValue),
               InvalidArgument);
}

TEST(GpuKernels, BinaryWithBroadcasting) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {Shape{4, 5}, Shape{4, 5}},       {Shape{4, 5}, Shape{5}},
      {Shape{5}, Shape{4, 5}},          {Shape{4, 1}, Shape{1, 5}},
      {Shape{2, 3, 4}, Shape{3, 1}},    {Shape{}, Shape{2, 3}},
      {Shape{2, 3}, Shape{}},           {Shape{2, 1, 3, 1, 2}, Shape{1, 4, 1, 5, 1}},
      {Shape{6, 1, 7}, Shape{6, 5, 7}}, {Shape{3, 1, 1, 2, 1, 2, 1, 2, 3}, Shape{2, 1, 2, 1, 2, 1}},
  };
  uint64_t s = 700;
  for (const auto& [sa, sb] : shapes)
    for (BinaryOp op : {BinaryOp::kAdd, BinaryOp::kSub, BinaryOp::kMul, BinaryOp::kDiv,
                        BinaryOp::kMax, BinaryOp::kMin}) {
      const Tensor a = random_tensor(sa, s++);
      // Keep divisors away from zero.
      const Tensor b =
          op == BinaryOp::kDiv ? random_tensor(sb, s++, 0.5f, 2.f) : random_tensor(sb, s++);
      expect_close(
          cpu().binary(op, a, b), gpu().binary(op, G(a), G(b)), 1e-6f, 1e-7f,
          sa.to_string() + " op" + std::to_string(static_cast<int>(op)) + " " + sb.to_string());
    }
  EXPECT_THROW(
      gpu().binary(BinaryOp::kAdd, G(random_tensor(Shape{3}, 1)), G(random_tensor(Shape{4}, 2))),
      InvalidArgument);
}

// The float4 paths of the memory-bound kernels (16-byte-aligned arrays, sizes and channel counts
// multiple of 4) against the CPU: the other tests' odd sizes take the scalar paths.
TEST(GpuKernels, VectorizedElementwiseKernelsMatchTheCpu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor x = random_tensor(Shape{2, 6, 5, 16}, 900, -3.f, 3.f);
  const Tensor dy = random_tensor(Shape{2, 6, 5, 16}, 901);
  for (UnaryOp op : {UnaryOp::kRelu, UnaryOp::kGeluTanh, UnaryOp::kSigmoid})
    expect_close(cpu().unary(op, x), gpu().unary(op, G(x)), 1e-5f, 1e-6f,
                 "unary " + std::to_string(static_cast<int>(op)));
  for (UnaryOp op : {UnaryOp::kRelu, UnaryOp::kGeluErf})
    expect_close(cpu().activation_backward(op, x, dy), gpu().activation_backward(op, G(x), G(dy)),
                 1e-5f, 1e-6f, "activation_backward " + std::to_string(static_cast<int>(op)));
  for (BinaryOp op : {BinaryOp::kAdd, BinaryOp::kMul, BinaryOp::kMax})
    expect_close(cpu().binary(op, x, dy), gpu().binary(op, G(x), G(dy)), 1e-6f, 1e-7f,
                 "binary " + std::to_string(static_cast<int>(op)));
  // The bias add after a convolution (16 output channels).
  const Tensor w = random_tensor(Shape{3, 3, 16, 16}, 902), b = random_tensor(Shape{16}, 903);
  expect_close(cpu().conv2d(x, w, b, {1, 1, 1, 1, 1, 1}),
               gpu().conv2d(G(x), G(w), G(b), {1, 1, 1, 1, 1, 1}), 1e-4f, 1e-4f, "conv bias");
}

// A residual block's relu(a + b) in one kernel: the two kernels' values bit for bit (float4 and
// scalar paths), and the CPU's within rounding; shapes that differ are refused by name.
TEST(GpuKernels, AddReluIsAddThenRelu) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint64_t s = 950;
  for (const Shape& shape : {Shape{2, 6, 5, 16}, Shape{3, 7, 5}, Shape{1}}) {
    const Tensor a = random_tensor(shape, s++, -2.f, 2.f), b = random_tensor(shape, s++);
    const Tensor y = gpu().add_relu(G(a), G(b));
    expect_bitwise_equal(gpu().unary(UnaryOp::kRelu, gpu().binary(BinaryOp::kAdd, G(a), G(b))), y,
                         "add_relu " + shape.to_string());
    expect_close(cpu().add_relu(a, b), y, 1e-6f, 1e-7f, "add_relu " + shape.to_string());
  }
  try {
    gpu().add_relu(G(random_tensor(Shape{4, 4}, 960)), G(random_tensor(Shape{4, 2}, 961)));
    FAIL() << "add_relu took [4, 4] and [4, 2]";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("add_relu"), std::string::npos) << e.what();
  }
}

TEST(GpuKernels, Affine) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Tensor x = random_tensor(Shape{1001}, 800);
  expect_close(cpu().affine(x, -2.5f, 0.75f), gpu().affine(G(x), -2.5f, 0.75f), 1e-6f, 1e-6f);
}

TEST(GpuKernels, Reduce) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case {
    Shape shape;
    std::vector<std::vector<int>> axes;
  };
  const std::vector<Case> cases = {
      {Shape{3, 4, 5}, {{}, {0}, {1}, {2}, {0, 1}, {0, 2}, {1, 2}, {0, 1, 2}}},
      {Shape{64, 1000}, {{0}, {1}, {0, 1}}},
      {Shape{2, 3, 4, 5, 6}, {{1, 3}, {0, 2, 4}, {4}, {0}}},
      {Shape{1, 7, 1, 3}, {{0}, {0, 2}, {1, 3}}},
      {Shape{20000}, {{0}}},
      {Shape{3000, 7}, {{0}}},
      {Shape{3, 0, 4}, {{1}, {0, 2}}},
  };
  uint64_t s = 900;
  for (const Case& c : cases) {
    const Tensor x = random_tensor(c.shape, s++);
    for (const auto& axes : c.axes)
      for (bool keep : {false, true})
        for (ReductionKind kind :
             {ReductionKind::kSum, ReductionKind::kMean, ReductionKind::kMax}) {
          int64_t count = 1;
          for (int a : axes) count *= c.shape[a];
          const float atol = 1e-4f * std::sqrt(static_cast<float>(std::max<int64_t>(count, 1)));
          std::string axes_s;
          for (int a : axes) axes_s += std::to_string(a) + ",";
          expect_close(cpu().reduce(kind, x, axes, keep), gpu().reduce(kind, G(x), axes, keep),
                       1e-4f, atol,
                       c.shape.to_string() + " axes {" + axes_s + "} keep " + std::to_string(keep) +
                           " kind " + std::to_string(static_cast<int>(kind)));
        }
  }
  EXPECT_THROW(gpu().reduce(ReductionKind::kSum, G(random_tensor(Shape{2, 3}, 1)), {2}, false),
               InvalidArgument);
}

TEST(GpuKernels, Cast) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  std::vector<float> v = {0.f,   -0.f,     1.f,     -2.5f,    0.5f,        1.5f,
                          2.5f,  -3.5f,    65504.f, 1e6f,     -1e6f,       1e-6f,
                          6e-8f, 3.14159f, 1e-30f,  123.456f, 1.00390625f, 1.01171875f};
  const Tensor rnd = random_tensor(Shape{999}, 1000, -300.f, 300.f);
  for (float f : rnd.to_vector<float>()) v.push_back(f);
  const Tensor x = Tensor::from_vector(v, Shape{static_cast<int64_t>(v.size())}, kCpu);
  for (DType to : {DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kInt32, DType::kInt64,
                   DType::kFloat32}) {
    const Tensor c = cpu().cast(x, to), g = gpu().cast(G(x), to);
    // The CPU device's oneDNN float32 -> float16 reorder turns -0 into +0; the GPU keeps the
    // sign, as the host's float_to_f16 does (checked bit for bit below).
    const bool f16 = to == DType::kFloat16;
    expect_bitwise_equal(c, g, std::string("float32 -> ") + dtype_name(to), f16);
    if (to == DType::kFloat32) continue;
    expect_bitwise_equal(cpu().cast(c, DType::kFloat32), gpu().cast(g, DType::kFloat32),
                         std::string(dtype_name(to)) + " -> float32", f16);
  }
  // Narrowing to 16 bits is bit for bit the host's conversion (src/core/dtype.cc), signed zeros,
  // subnormals, overflow and ties included.
  {
    auto bits16 = [](const Tensor& t) {
      const Tensor h = t.to(kCpu);
      std::vector<uint16_t> out(static_cast<size_t>(h.numel()));
      std::memcpy(out.data(), h.raw_data(), out.size() * sizeof(uint16_t));
      return out;
    };
    const std::vector<uint16_t> h = bits16(gpu().cast(G(x), DType::kFloat16));
    const std::vector<uint16_t> b = bits16(gpu().cast(G(x), DType::kBFloat16));
    size_t bad = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      if (h[i] != float_to_f16(v[i]) && bad++ < 8)
        ADD_FAILURE() << "float32 -> float16 of " << v[i] << ": gpu " << h[i] << " host "
                      << float_to_f16(v[i]);
      if (b[i] != float_to_bf16(v[i]) && bad++ < 8)
        ADD_FAILURE() << "float32 -> bfloat16 of " << v[i] << ": gpu " << b[i] << " host "
                      << float_to_bf16(v[i]);
    }
    EXPECT_EQ(bad, 0u) << "GPU narrowing vs the host's float_to_f16 / float_to_bf16";
  }
  // The CPU device has no direct float16 <-> bfloat16 / int32 reorders; going through float32
  // is exact for these inputs, so the GPU's direct casts must match the two-step CPU result.
  const Tensor h = cpu().cast(x, DType::kFloat16);
  expect_bitwise_equal(cpu().cast(cpu().cast(h, DType::kFloat32), DType::kBFloat16),
                       gpu().cast(G(h), DType::kBFloat16), "float16 -> bfloat16");
  const Tensor d = cpu().cast(x, DType::kFloat64);
  expect_bitwise_equal(cpu().cast(d, DType::kFloat16), gpu().cast(G(d), DType::kFloat16),
                       "float64 -> float16");
  const Tensor i = Tensor::from_vector<int32_t>({0, 1, -7, 2048, 16777217, -2147483647}, Shape{6});
  for (DType to : {DType::kFloat32, DType::kFloat64, DType::kInt64})
    expect_bitwise_equal(cpu().cast(i, to), gpu().cast(G(i), to),
                         std::string("int32 -> ") + dtype_name(to));
  const Tensor small = Tensor::from_vector<int32_t>({0, 1, -7, 2048, 2049, -65504}, Shape{6});
  expect_bitwise_equal(cpu().cast(cpu().cast(small, DType::kFloat32), DType::kFloat16),
                       gpu().cast(G(small), DType::kFloat16), "int32 -> float16");
  const Tensor big =
      Tensor::from_vector<int64_t>({0, -3, (int64_t{1} << 53) + 1, -(int64_t{1} << 40)}, Shape{4});
  for (DType to : {DType::kFloat32, DType::kFloat64})
    expect_bitwise_equal(cpu().cast(big, to), gpu().cast(G(big), to),
                         std::string("int64 -> ") + dtype_name(to));
  // Out-of-range float/int64 -> int32 conversions are undefined in C++, so only in-range values.
  const Tensor fits = Tensor::from_vector<int64_t>({0, -3, 2147483647, -2147483647}, Shape{4});
  expect_bitwise_equal(cpu().cast(fits, DType::kInt32), gpu().cast(G(fits), DType::kInt32),
                       "int64 -> int32");
}

TEST(GpuKernels, Fill) {
  if (dtrain::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Tensor c = Tensor::empty(Shape{3, 333}, DType::kFloat32, kCpu);
  Tensor g = G(c);
  cpu().fill(c, -1.25f);
  gpu().fill(g, -1.25f);
  expect_bitwise_equal(c, g);
}

}  // namespace
}  // namespace dtrain
