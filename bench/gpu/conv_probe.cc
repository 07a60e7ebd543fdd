// conv_probe: how fast cuDNN runs ResNet-50's convolutions in each layout, math mode and algorithm,
// against the algorithm cuDNN's heuristics (what dtrain's CUDA device picks) rank first.
//
// For every distinct convolution of Keras' ResNet50 at batch N (default 32) and each direction
// (forward, backward data, backward filter), layout (NHWC as dtrain keeps activations, NCHW as
// PyTorch does) and math (FMA = float32 exactly, TF32 = cuDNN's default math, tensor cores):
// cudnnFind*AlgorithmEx times every algorithm on the GPU; one JSON line per problem gives the
// heuristic's first deterministic choice and its time, the fastest deterministic algorithm, the
// fastest of all, and the count of that convolution in the network. A summary line sums a step.
//   conv_probe [--batch N] [--math fma|tf32|both] [--layout nhwc|nchw|both]
// Built with the CUDA build (tools/CMakeLists.txt); run by bench/gpu/profile.sh on a GPU machine.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define DK(x)                                                                                  \
  do {                                                                                         \
    cudnnStatus_t s_ = (x);                                                                    \
    if (s_ != CUDNN_STATUS_SUCCESS) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudnnGetErrorString(s_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Conv {
  const char* name;
  int h, w, cin, k, stride, pad, cout, count;  // input h x w x cin, k x k window
};

// Keras ResNet50 (bias on, stride on the first 1x1 of a stage's first block, 3x3 "same").
std::vector<Conv> resnet50() {
  return {
      {"conv1 7x7/2", 230, 230, 3, 7, 2, 0, 64, 1},
      {"s2 1x1 64->256 (proj)", 56, 56, 64, 1, 1, 0, 256, 1},
      {"s2 1x1 64->64", 56, 56, 64, 1, 1, 0, 64, 1},
      {"s2 3x3 64", 56, 56, 64, 3, 1, 1, 64, 3},
      {"s2 1x1 64->256", 56, 56, 64, 1, 1, 0, 256, 3},
      {"s2 1x1 256->64", 56, 56, 256, 1, 1, 0, 64, 2},
      {"s3 1x1/2 256->512 (proj)", 56, 56, 256, 1, 2, 0, 512, 1},
      {"s3 1x1/2 256->128", 56, 56, 256, 1, 2, 0, 128, 1},
      {"s3 3x3 128", 28, 28, 128, 3, 1, 1, 128, 4},
      {"s3 1x1 128->512", 28, 28, 128, 1, 1, 0, 512, 4},
      {"s3 1x1 512->128", 28, 28, 512, 1, 1, 0, 128, 3},
      {"s4 1x1/2 512->1024 (proj)", 28, 28, 512, 1, 2, 0, 1024, 1},
      {"s4 1x1/2 512->256", 28, 28, 512, 1, 2, 0, 256, 1},
      {"s4 3x3 256", 14, 14, 256, 3, 1, 1, 256, 6},
      {"s4 1x1 256->1024", 14, 14, 256, 1, 1, 0, 1024, 6},
      {"s4 1x1 1024->256", 14, 14, 1024, 1, 1, 0, 256, 5},
      {"s5 1x1/2 1024->2048 (proj)", 14, 14, 1024, 1, 2, 0, 2048, 1},
      {"s5 1x1/2 1024->512", 14, 14, 1024, 1, 2, 0, 512, 1},
      {"s5 3x3 512", 7, 7, 512, 3, 1, 1, 512, 3},
      {"s5 1x1 512->2048", 7, 7, 512, 1, 1, 0, 2048, 3},
      {"s5 1x1 2048->512", 7, 7, 2048, 1, 1, 0, 512, 2},
  };
}

struct Result {
  double host_us = -1;      // host time of one workspace query + call of the heuristic's choice
  int heuristic_algo = -1;  // first deterministic algorithm the v7 heuristic ranks that succeeds
  float heuristic_ms = -1;  // its time from the Find call
  int best_det_algo = -1;
  float best_det_ms = -1;
  int best_algo = -1;
  float best_ms = -1;
};

template <typename Perf>
void fold(const Perf* found, int got, const std::vector<int>& heuristic_order,
          const std::vector<bool>& heuristic_det, Result* r) {
  for (int i = 0; i < got; ++i) {
    const Perf& p = found[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.time < 0) continue;
    const int a = static_cast<int>(p.algo);
    if (r->best_ms < 0 || p.time < r->best_ms) r->best_ms = p.time, r->best_algo = a;
    if (p.determinism == CUDNN_DETERMINISTIC && (r->best_det_ms < 0 || p.time < r->best_det_ms))
      r->best_det_ms = p.time, r->best_det_algo = a;
  }
  for (size_t k = 0; k < heuristic_order.size(); ++k) {
    if (!heuristic_det[k]) continue;
    for (int i = 0; i < got; ++i)
      if (static_cast<int>(found[i].algo) == heuristic_order[k] &&
          found[i].status == CUDNN_STATUS_SUCCESS && found[i].time >= 0) {
        r->heuristic_algo = heuristic_order[k];
        r->heuristic_ms = found[i].time;
        return;
      }
  }
}

// Host microseconds per call of fn (20 calls after 2 untimed; the GPU's own time is not counted
// unless the launch queue fills).
template <typename Fn>
double host_us(Fn fn) {
  for (int i = 0; i < 2; ++i) fn();
  CK(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) fn();
  const auto t1 = std::chrono::steady_clock::now();
  CK(cudaDeviceSynchronize());
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / 20;
}

}  // namespace

int main(int argc, char** argv) {
  int batch = 32;
  std::string math_arg = "both", layout_arg = "both";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch"))
      batch = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--math"))
      math_arg = argv[i + 1];
    else if (!std::strcmp(argv[i], "--layout"))
      layout_arg = argv[i + 1];
    else {
      std::fprintf(
          stderr,
          "usage: conv_probe [--batch N] [--math fma|tf32|both] [--layout nhwc|nchw|both]\n");
      return 2;
    }
  }
  cudnnHandle_t h;
  DK(cudnnCreate(&h));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"gpu\": \"%s\", \"cudnn\": %zu, \"batch\": %d}\n", prop.name, cudnnGetVersion(),
              batch);
  const size_t ws_bytes = size_t{1} << 30;  // dtrain's workspace cap
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  std::vector<std::pair<std::string, cudnnTensorFormat_t>> layouts;
  if (layout_arg != "nchw") layouts.push_back({"nhwc", CUDNN_TENSOR_NHWC});
  if (layout_arg != "nhwc") layouts.push_back({"nchw", CUDNN_TENSOR_NCHW});
  std::vector<std::pair<std::string, cudnnMathType_t>> maths;
  if (math_arg != "tf32") maths.push_back({"fma", CUDNN_FMA_MATH});
  if (math_arg != "fma") maths.push_back({"tf32", CUDNN_DEFAULT_MATH});
  const char* dirs[3] = {"fwd", "bwd_data", "bwd_filter"};
  // totals[layout][math][dir][heuristic, best_det, best] in ms per step
  double totals[2][2][3][3] = {};
  for (const Conv& c : resnet50()) {
    const int oh = (c.h + 2 * c.pad - c.k) / c.stride + 1,
              ow = (c.w + 2 * c.pad - c.k) / c.stride + 1;
    const size_t xb = size_t(batch) * c.h * c.w * c.cin * 4,
                 yb = size_t(batch) * oh * ow * c.cout * 4,
                 wb = size_t(c.k) * c.k * c.cin * c.cout * 4;
    void *x, *y, *w;
    CK(cudaMalloc(&x, xb));
    CK(cudaMalloc(&y, yb));
    CK(cudaMalloc(&w, wb));
    CK(cudaMemset(x, 0, xb));
    CK(cudaMemset(y, 0, yb));
    CK(cudaMemset(w, 0, wb));
    for (size_t li = 0; li < layouts.size(); ++li)
      for (size_t mi = 0; mi < maths.size(); ++mi) {
        cudnnTensorDescriptor_t xd, yd;
        cudnnFilterDescriptor_t wd;
        cudnnConvolutionDescriptor_t cd;
        DK(cudnnCreateTensorDescriptor(&xd));
        DK(cudnnCreateTensorDescriptor(&yd));
        DK(cudnnCreateFilterDescriptor(&wd));
        DK(cudnnCreateConvolutionDescriptor(&cd));
        const cudnnTensorFormat_t f = layouts[li].second;
        DK(cudnnSetTensor4dDescriptor(xd, f, CUDNN_DATA_FLOAT, batch, c.cin, c.h, c.w));
        DK(cudnnSetTensor4dDescriptor(yd, f, CUDNN_DATA_FLOAT, batch, c.cout, oh, ow));
        DK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, f, c.cout, c.cin, c.k, c.k));
        DK(cudnnSetConvolution2dDescriptor(cd, c.pad, c.pad, c.stride, c.stride, 1, 1,
                                           CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
        DK(cudnnSetConvolutionMathType(cd, maths[mi].second));
        for (int d = 0; d < 3; ++d) {
          Result r;
          std::vector<int> order;
          std::vector<bool> det;
          int got = 0;
          if (d == 0) {
            cudnnConvolutionFwdAlgoPerf_t hp[16], fp[16];
            DK(cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, 16, &got, hp));
            for (int i = 0; i < got; ++i)
              if (hp[i].status == CUDNN_STATUS_SUCCESS)
                order.push_back(hp[i].algo),
                    det.push_back(hp[i].determinism == CUDNN_DETERMINISTIC);
            DK(cudnnFindConvolutionForwardAlgorithmEx(h, xd, x, wd, w, cd, yd, y, 16, &got, fp, ws,
                                                      ws_bytes));
            fold(fp, got, order, det, &r);
            if (r.heuristic_algo >= 0)
              r.host_us = host_us([&] {
                size_t b = 0;
                const auto a = static_cast<cudnnConvolutionFwdAlgo_t>(r.heuristic_algo);
                DK(cudnnGetConvolutionForwardWorkspaceSize(h, xd, wd, cd, yd, a, &b));
                const float one = 1.f, zero = 0.f;
                DK(cudnnConvolutionForward(h, &one, xd, x, wd, w, cd, a, ws, b, &zero, yd, y));
              });
          } else if (d == 1) {
            cudnnConvolutionBwdDataAlgoPerf_t hp[16], fp[16];
            DK(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, wd, yd, cd, xd, 16, &got, hp));
            for (int i = 0; i < got; ++i)
              if (hp[i].status == CUDNN_STATUS_SUCCESS)
                order.push_back(hp[i].algo),
                    det.push_back(hp[i].determinism == CUDNN_DETERMINISTIC && hp[i].algo != 0);
            DK(cudnnFindConvolutionBackwardDataAlgorithmEx(h, wd, w, yd, y, cd, xd, x, 16, &got, fp,
                                                           ws, ws_bytes));
            fold(fp, got, order, det, &r);
            if (r.heuristic_algo >= 0)
              r.host_us = host_us([&] {
                size_t b = 0;
                const auto a = static_cast<cudnnConvolutionBwdDataAlgo_t>(r.heuristic_algo);
                DK(cudnnGetConvolutionBackwardDataWorkspaceSize(h, wd, yd, cd, xd, a, &b));
                const float one = 1.f, zero = 0.f;
                DK(cudnnConvolutionBackwardData(h, &one, wd, w, yd, y, cd, a, ws, b, &zero, xd, x));
              });
          } else {
            cudnnConvolutionBwdFilterAlgoPerf_t hp[16], fp[16];
            DK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, xd, yd, cd, wd, 16, &got, hp));
            for (int i = 0; i < got; ++i)
              if (hp[i].status == CUDNN_STATUS_SUCCESS)
                order.push_back(hp[i].algo),
                    det.push_back(hp[i].determinism == CUDNN_DETERMINISTIC && hp[i].algo != 0 &&
                                  hp[i].algo != 3);
            DK(cudnnFindConvolutionBackwardFilterAlgorithmEx(h, xd, x, yd, y, cd, wd, w, 16, &got,
                                                             fp, ws, ws_bytes));
            fold(fp, got, order, det, &r);
            if (r.heuristic_algo >= 0)
              r.host_us = host_us([&] {
                size_t b = 0;
                const auto a = static_cast<cudnnConvolutionBwdFilterAlgo_t>(r.heuristic_algo);
                DK(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd, yd, cd, wd, a, &b));
                const float one = 1.f, zero = 0.f;
                DK(cudnnConvolutionBackwardFilter(h, &one, xd, x, yd, y, cd, a, ws, b, &zero, wd,
                                                  w));
              });
          }
          std::printf(
              "{\"conv\": \"%s\", \"count\": %d, \"layout\": \"%s\", \"math\": \"%s\", \"dir\": "
              "\"%s\", \"host_us\": %.1f, \"heuristic_algo\": %d, \"heuristic_ms\": %.4f, "
              "\"best_det_algo\": %d, "
              "\"best_det_ms\": %.4f, \"best_algo\": %d, \"best_ms\": %.4f}\n",
              c.name, c.count, layouts[li].first.c_str(), maths[mi].first.c_str(), dirs[d],
              r.host_us, r.heuristic_algo, r.heuristic_ms, r.best_det_algo, r.best_det_ms,
              r.best_algo, r.best_ms);
          std::fflush(stdout);
          const size_t L = layouts[li].first == "nhwc" ? 0 : 1,
                       M = maths[mi].first == "fma" ? 0 : 1;
          totals[L][M][d][0] += c.count * r.heuristic_ms;
          totals[L][M][d][1] += c.count * r.best_det_ms;
          totals[L][M][d][2] += c.count * r.best_ms;
        }
        cudnnDestroyTensorDescriptor(xd);
        cudnnDestroyTensorDescriptor(yd);
        cudnnDestroyFilterDescriptor(wd);
        cudnnDestroyConvolutionDescriptor(cd);
      }
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(w));
  }
  for (int L = 0; L < 2; ++L)
    for (int M = 0; M < 2; ++M) {
      double s[3] = {0, 0, 0};
      for (int d = 0; d < 3; ++d)
        for (int k = 0; k < 3; ++k) s[k] += totals[L][M][d][k];
      if (s[2] == 0) continue;
      std::printf(
          "{\"summary\": true, \"layout\": \"%s\", \"math\": \"%s\", \"step_ms_heuristic\": %.2f, "
          "\"step_ms_best_deterministic\": %.2f, \"step_ms_best\": %.2f, \"fwd_ms_heuristic\": "
          "%.2f, "
          "\"bwd_data_ms_heuristic\": %.2f, \"bwd_filter_ms_heuristic\": %.2f}\n",
          L == 0 ? "nhwc" : "nchw", M == 0 ? "fma" : "tf32", s[0], s[1], s[2], totals[L][M][0][0],
          totals[L][M][1][0], totals[L][M][2][0]);
    }
  CK(cudaFree(ws));
  cudnnDestroy(h);
  return 0;
}
