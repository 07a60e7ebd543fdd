// `dtrain-bench peak`: the machine's practical compute limit, for judging how far a model's
// training is from it: square matrix products through dtrain's CPU kernels (oneDNN's matmul
// primitive), float32 and mixed bfloat16 (bfloat16 operands, float32 accumulation: AMX or AVX-512
// BF16 where the CPU has them), on --threads threads, GFLOP/s (2 n^3 per product), median of --reps
// after warm-up. With
// --images-per-sec and --gflop-per-image it also prints the share of the peak a training run
// reaches. The memory-bound limit beside it: a sum of two --stream-mb tensors into a third through
// the device's kernels, as a residual sum or a gradient's (the streaming-store loop from 4 MB, a
// part per device thread; DTRAIN_CPU_STREAM_STORES=0 for oneDNN's binary add), GB/s of the three
// streams (a normal store's read for ownership not counted). With
// --conv-batches, ResNet-50's four 3x3 layer shapes through conv2d and its two gradients (a tape
// over sum(conv2d(x, w))), with Winograd convolutions off and on (precision.h): ms per layer, the
// median of --reps. The kernels' own limit beside dtrain's products: oneDNN's matmul on operands
// already in its types and its chosen weight layout (benchdnn's way of timing a GEMM: no reorder,
// no rounding pass timed; AMX tiles where the CPU has them), which is what the core can do.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <dnnl.hpp>
#include <string>

#include "bench_util.h"
#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"

namespace dtrain::bench {
namespace {

double gemm_gflops(int64_t n, int reps) {
  const Tensor a = Tensor::full(Shape{n, n}, 0.5f), b = Tensor::full(Shape{n, n}, 0.25f);
  for (int i = 0; i < 2; ++i) ops::matmul(a, b);  // warm-up: primitive creation, pages
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor c = ops::matmul(a, b);
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) /
         median(secs) / 1e9;
}

// GFLOP/s of oneDNN's matmul alone on one thread's engine: n x n operands of `type` (bfloat16 or
// float32), the weights in the layout the kernel asks for (tag::any: a blocked, VNNI-packed one on
// AMX), float32 out; median of `reps` after two warm-up runs. The operands' values do not matter.
double kernel_gemm_gflops(int64_t n, dnnl::memory::data_type type, int reps) {
  using dnnl::memory;
  const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const memory::desc a({n, n}, type, memory::format_tag::ab),
      b({n, n}, type, memory::format_tag::any),
      c({n, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), eng);
  const dnnl::matmul prim(pd);
  memory am(pd.src_desc(), eng), bm(pd.weights_desc(), eng), cm(pd.dst_desc(), eng);
  for (memory* m : {&am, &bm})  // zeros: no denormal or NaN slows the kernel down
    std::fill_n(static_cast<char*>(m->get_data_handle()), m->get_desc().get_size(), 0);
  std::vector<double> secs;
  for (int i = 0; i < reps + 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
    if (i >= 2)
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) /
         median(secs) / 1e9;
}

// GB/s of c = a + b over tensors of `mb` MB each, three streams counted; median of `reps` after
// warm-up (c's block then comes from the allocator's cache: no page faults are timed).
double stream_gbs(double mb, int reps) {
  const int64_t n = static_cast<int64_t>(mb * 1e6 / 4);
  const Tensor a = Tensor::full(Shape{n}, 0.5f), b = Tensor::full(Shape{n}, 0.25f);
  for (int i = 0; i < 2; ++i) ops::add(a, b);
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor c = ops::add(a, b);
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 3.0 * 4.0 * static_cast<double>(n) / median(secs) / 1e9;
}

// ms of one 3x3, stride-1, same-padded c -> c convolution layer on [n, hw, hw, c]: forward, the
// input's gradient and the filter's (and the loss's sum), median of `reps` after warm-up.
double conv_layer_ms(int64_t n, int64_t hw, int64_t c, bool winograd, int reps) {
  struct Setting {  // the caller's setting again, however this returns
    bool was = winograd_convolutions_enabled();
    ~Setting() { enable_winograd_convolutions(was); }
  } restore;
  enable_winograd_convolutions(winograd);
  const Tensor x = Tensor::full(Shape{n, hw, hw, c}, 0.5f);
  const Tensor w = Tensor::full(Shape{3, 3, c, c}, 0.01f);
  auto layer = [&] {
    Tensor xv = x, wv = w;
    GradientTape tape;
    tape.watch(xv);
    tape.watch(wv);
    const Tensor loss = ops::sum(ops::conv2d(xv, wv, Tensor(), 1, 1, ops::Padding::kSame));
    return tape.gradient(loss, {xv, wv});
  };
  for (int i = 0; i < 2; ++i) layer();
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    layer();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 1e3 * median(secs);
}

void conv_lines(const PeakArgs& a) {
  struct Layer {
    int64_t hw, c;
  };
  for (const int64_t n : a.conv_batches)
    for (const Layer l : {Layer{56, 64}, Layer{28, 128}, Layer{14, 256}, Layer{7, 512}}) {
      const double direct = conv_layer_ms(n, l.hw, l.c, false, a.reps);
      const double wino = conv_layer_ms(n, l.hw, l.c, true, a.reps);
      const std::string what = "conv 3x3 " + std::to_string(l.hw) + "x" + std::to_string(l.hw) +
                               "x" + std::to_string(l.c) + ", batch " + std::to_string(n);
      // (Winograd "on" runs the direct convolution where it does not apply: the 7x7 layer.)
      std::printf("%-34s Winograd off %8.1f ms, on %8.1f ms (%.2fx)\n", what.c_str(), direct, wino,
                  direct / wino);
      if (a.json)
        std::printf("%s\n", nlohmann::json{{"benchmark", "peak_conv"},
                                           {"hw", l.hw},
                                           {"channels", l.c},
                                           {"batch", n},
                                           {"threads", a.threads},
                                           {"direct_ms", direct},
                                           {"winograd_ms", wino},
                                           {"cpu", cpu_model()}}
                                .dump()
                                .c_str());
    }
}

// One product's line, "<what>, n = <n>   <GFLOP/s>", and with --json its object (`benchmark`:
// peak for dtrain's products, peak_kernel for oneDNN's alone; precision p 0 float32, 1 bfloat16).
void print_gemm(const PeakArgs& a, const char* benchmark, const char* what, int p, int64_t n,
                double gflops) {
  std::printf("%-34s %12.1f\n", (std::string(what) + ", n = " + std::to_string(n)).c_str(), gflops);
  if (a.json)
    std::printf("%s\n", nlohmann::json{{"benchmark", benchmark},
                                       {"precision", p == 0 ? "fp32" : "bf16"},
                                       {"n", n},
                                       {"threads", a.threads},
                                       {"gflops", gflops},
                                       {"cpu", cpu_model()}}
                            .dump()
                            .c_str());
}

}  // namespace

int peak_bench(const PeakArgs& a) {
  configure_devices({1, a.threads});
  std::printf("%s; %d thread(s)\n", cpu_description().c_str(), a.threads);
  std::printf("%-34s %12s\n", "matmul n x n x n", "GFLOP/s");
  double best[2] = {0, 0};
  for (int p = 0; p < 2; ++p) {
    set_precision_policy(p == 0 ? Precision::kFloat32 : Precision::kMixedBFloat16);
    for (int64_t n : a.sizes) {
      const double g = gemm_gflops(n, a.reps);
      best[p] = std::max(best[p], g);
      print_gemm(a, "peak", p == 0 ? "float32" : "mixed bfloat16", p, n, g);
    }
  }
  set_precision_policy(Precision::kFloat32);
  // The kernels alone (oneDNN uses the OpenMP threads configure_devices set).
  double kernel_best[2] = {0, 0};
  for (int p = 0; p < 2; ++p)
    for (int64_t n : a.sizes) {
      double g = 0;
      try {
        g = kernel_gemm_gflops(
            n, p == 0 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16, a.reps);
      } catch (const dnnl::error&) {  // no bfloat16 kernel on this CPU (AVX2 only)
        std::printf("%-34s %12s\n", "oneDNN bfloat16 matmul", "none");
        break;
      }
      kernel_best[p] = std::max(kernel_best[p], g);
      print_gemm(a, "peak_kernel", p == 0 ? "oneDNN alone, float32" : "oneDNN alone, bfloat16", p,
                 n, g);
    }
  if (a.stream_mb > 0) {
    const double gbs = stream_gbs(a.stream_mb, a.reps);
    std::printf(
        "%-34s %12.1f\n",
        ("memory: c = a + b, 3 x " + std::to_string(static_cast<int>(a.stream_mb)) + " MB, GB/s")
            .c_str(),
        gbs);
    if (a.json)
      std::printf("%s\n", nlohmann::json{{"benchmark", "peak"},
                                         {"stream_mb", a.stream_mb},
                                         {"threads", a.threads},
                                         {"gbs", gbs},
                                         {"cpu", cpu_model()}}
                              .dump()
                              .c_str());
  }
  conv_lines(a);
  std::printf("peak: float32 %.1f GFLOP/s, mixed bfloat16 %.1f GFLOP/s (%.2fx)\n", best[0], best[1],
              best[1] / best[0]);
  if (kernel_best[1] > 0)
    std::printf(
        "kernels' limit (oneDNN alone): float32 %.1f GFLOP/s, bfloat16 %.1f GFLOP/s (%.2fx)\n",
        kernel_best[0], kernel_best[1], kernel_best[1] / kernel_best[0]);
  if (a.images_per_sec > 0 && a.gflop_per_image > 0) {
    const double reached = a.images_per_sec * a.gflop_per_image;
    std::printf(
        "a run of %.3f images/sec at %.1f GFLOP an image: %.1f GFLOP/s = %.1f%% of the "
        "float32 peak, %.1f%% of the bfloat16 one\n",
        a.images_per_sec, a.gflop_per_image, reached, 100 * reached / best[0],
        100 * reached / best[1]);
    if (kernel_best[1] > 0)
      std::printf("  and %.1f%% of the kernels' float32 limit, %.1f%% of their bfloat16 one\n",
                  100 * reached / kernel_best[0], 100 * reached / kernel_best[1]);
  }
  return 0;
}

}  // namespace dtrain::bench
