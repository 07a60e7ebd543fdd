// The legacy cuDNN path of CudaKernels' convolutions (cuda_conv.cc): a problem that no
// graph-API execution plan accepts (cuda_conv_plan.h), or every problem under
// DTRAIN_CUDNN_API=legacy, runs through cuDNN's per-direction calls with an algorithm chosen here.
// Algorithms: cuDNN's heuristics rank candidates; the first that runs is cached per problem.
// Deterministic algorithms come first: cuDNN's non-deterministic ones (backward data ALGO_0,
// backward filter ALGO_0 and ALGO_3 accumulate with atomics) give different bits on every run,
// which breaks bitwise-reproducible training (a run resumed from a backup must end bit for bit
// where an uninterrupted one does). They are tried only when no deterministic algorithm runs.
#include "devices/cuda/cuda_conv_legacy.h"

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_cudnn.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::cuda {
namespace {

// Workspaces above this are skipped in favour of the next candidate algorithm.
constexpr size_t kMaxWorkspaceBytes = size_t{1} << 30;

bool not_supported(cudnnStatus_t st) {
  return CUDNN_STATUS_CATEGORY(st) == CUDNN_STATUS_NOT_SUPPORTED;
}

// A cached choice: the algorithm, plus this flag when it needed cuDNN's default math.
constexpr int kDefaultMathFlag = 0x100;

// Algorithms that multiply transformed operands (Winograd, FFT). On tensor cores those products
// are rounded to TF32 again, so under mixed_bfloat16 they would no longer be exact bfloat16
// products: with tensor cores allowed they are passed over.
bool transforms(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool transforms(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool transforms(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// A candidate algorithm, whether it gives the same bits on every run, and its place in cuDNN's
// ranking (-1: a fallback cuDNN did not rank).
template <typename Algo>
struct Candidate {
  Algo algo;
  bool deterministic;
  int rank;
};

// Runs `run(algo, workspace, bytes)` with the cached choice, else with each candidate in order,
// until one is accepted (cuDNN reports some layout/algorithm combinations as NOT_SUPPORTED only
// at execution). Candidates are first sought with FP32 FMA math; only if none accepts the problem
// does it fall back, with a warning, to cuDNN's default math, which may use TF32 tensor cores.
// With tensor_cores (CudaKernels::tensor_cores()) they are sought with the default math at once,
// passing over Winograd and FFT (transforms()).
// Returns the choice to cache.
template <typename Algo, typename CandidatesFn, typename SizeFn, typename RunFn>
int run_first_supported(CudaContext& ctx, ConvDesc& cd, int cached, bool tensor_cores,
                        CandidatesFn candidates, SizeFn size_of, RunFn run, const char* call,
                        const std::string& problem) {
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  auto attempt = [&](Algo algo) -> bool {
    size_t bytes = 0;
    cudnnStatus_t st = size_of(algo, &bytes);
    if (st != CUDNN_STATUS_SUCCESS || bytes > kMaxWorkspaceBytes) {
      if (st != CUDNN_STATUS_SUCCESS) last = st;
      return false;
    }
    std::shared_ptr<Storage> ws;
    if (bytes > 0) {
      try {
        ws = ctx.scratch(bytes);
      } catch (const Unavailable&) {
        DTRAIN_LOG(DEBUG) << call << ": no memory for a " << bytes
                          << "-byte workspace; trying the next algorithm";
        return false;
      }
    }
    st = run(algo, ws ? ws->data() : nullptr, bytes);
    if (st == CUDNN_STATUS_SUCCESS) return true;
    if (!not_supported(st)) throw_cudnn_error(st, call, __FILE__, __LINE__);
    last = st;
    return false;
  };
  if (cached >= 0) {
    cd.set_math((cached & kDefaultMathFlag) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH);
    if (attempt(static_cast<Algo>(cached & ~kDefaultMathFlag))) return cached;
  }
  if (tensor_cores) {
    cd.set_math(CUDNN_DEFAULT_MATH);
    const std::vector<Candidate<Algo>> list = candidates();
    for (const auto& c : list)
      if (!transforms(c.algo) && attempt(c.algo)) {
        if (!c.deterministic) {
          DTRAIN_LOG(WARNING) << call << ": no deterministic cuDNN algorithm accepts " << problem
                              << "; using non-deterministic algorithm " << static_cast<int>(c.algo)
                              << ", so results may differ bitwise between runs";
        }
        return static_cast<int>(c.algo) | kDefaultMathFlag;
      }
    throw Unimplemented(detail::str_cat(call, ": no cuDNN algorithm accepts ", problem,
                                        " (last status: ", cudnnGetErrorString(last), ")"));
  }
  cd.set_math(CUDNN_FMA_MATH);
  // Logs a fresh choice: at DEBUG when deterministic, else as a warning.
  auto chosen = [&](const std::vector<Candidate<Algo>>& list, const Candidate<Algo>& c,
                    const char* math) {
    if (!c.deterministic) {
      DTRAIN_LOG(WARNING) << call << ": no deterministic cuDNN algorithm accepts " << problem
                          << "; using non-deterministic algorithm " << static_cast<int>(c.algo)
                          << ", so results may differ bitwise between runs";
      return;
    }
    std::string first = "none";
    for (const auto& r : list)
      if (r.rank == 0)
        first = std::to_string(static_cast<int>(r.algo)) +
                (r.deterministic ? "" : " (non-deterministic, passed over)");
    DTRAIN_LOG(DEBUG) << call << ": algorithm " << static_cast<int>(c.algo) << " (deterministic, "
                      << math << ") for " << problem << "; cuDNN ranked first: " << first;
  };
  {
    const std::vector<Candidate<Algo>> list = candidates();
    for (const auto& c : list)
      if (attempt(c.algo)) {
        chosen(list, c, "FMA math");
        return static_cast<int>(c.algo);
      }
  }
  cd.set_math(CUDNN_DEFAULT_MATH);
  const std::vector<Candidate<Algo>> list = candidates();
  for (const auto& c : list) {
    if (attempt(c.algo)) {
      DTRAIN_LOG(WARNING) << call << ": no FP32 (FMA) cuDNN algorithm accepts " << problem
                          << "; using cuDNN's default math, which may use TF32 (about 1e-3 "
                             "relative error)";
      chosen(list, c, "default math");
      return static_cast<int>(c.algo) | kDefaultMathFlag;
    }
  }
  throw Unimplemented(detail::str_cat(call, ": no cuDNN algorithm accepts ", problem,
                                      " (last status: ", cudnnGetErrorString(last), ")"));
}

// cuDNN's ranked candidates that report success, then the fallbacks (algorithms that support NHWC
// float32 in every cuDNN release) as a last resort; all deterministic candidates in that order
// first, then the non-deterministic ones. An algorithm counts as non-deterministic when cuDNN's
// answer says so or `nondeterministic(algo)` does (for the fallbacks, which come without one).
template <typename Perf, typename Algo, typename QueryFn, typename Fallbacks, typename NondetFn>
std::vector<Candidate<Algo>> ranked(QueryFn query, int max_count, const Fallbacks& fallbacks,
                                    NondetFn nondeterministic) {
  std::vector<Perf> perf(static_cast<size_t>(max_count));
  int got = 0;
  // A failed query leaves only the fallbacks, which the caller tries anyway.
  if (query(max_count, &got, perf.data()) != CUDNN_STATUS_SUCCESS) got = 0;
  std::vector<Candidate<Algo>> all;
  auto add = [&](Algo a, bool deterministic, int rank) {
    for (const auto& c : all)
      if (c.algo == a) return;
    all.push_back({a, deterministic && !nondeterministic(a), rank});
  };
  for (int i = 0; i < got; ++i) {
    const Perf& r = perf[static_cast<size_t>(i)];
    if (r.status == CUDNN_STATUS_SUCCESS) add(r.algo, r.determinism == CUDNN_DETERMINISTIC, i);
  }
  for (Algo a : fallbacks) add(a, true, -1);
  std::vector<Candidate<Algo>> out;
  for (const auto& c : all)
    if (c.deterministic) out.push_back(c);
  for (const auto& c : all)
    if (!c.deterministic) out.push_back(c);
  return out;
}

// The descriptors of one convolution problem, shared by its three directions: the (padded) input x,
// the output y, the filter w (KRSC) and the convolution itself.
struct ConvProblem {
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  ConvProblem(const ConvPlanProblem& p, const char* op) {
    x.set_nhwc(p.n, p.h, p.w, p.cin, op);
    y.set_nhwc(p.n, p.oh, p.ow, p.cout, op);
    w.set_krsc(p.cout, p.kh, p.kw, p.cin, op);
    conv.set(static_cast<int>(p.pad_h), static_cast<int>(p.pad_w), static_cast<int>(p.stride_h),
             static_cast<int>(p.stride_w));
  }
};

// What differs between the three directions: cuDNN's types, calls and operand order. run() takes
// the two inputs and the output of that direction (forward: x, w -> y; backward data: w, dy -> dx;
// backward filter: x, dy -> dw).
struct Forward {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  using Algo = cudnnConvolutionFwdAlgo_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static constexpr const char* kCall = "cudnnConvolutionForward";
  static constexpr std::array<Algo, 2> kFallbacks = {
      CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM};
  static bool nondeterministic(Algo) { return false; }
  static cudnnStatus_t query(cudnnHandle_t h, ConvProblem& c, int n, int* got, Perf* perf) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h, c.x.get(), c.w.get(), c.conv.get(), c.y.get(),
                                                  n, got, perf);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, ConvProblem& c, Algo a, size_t* bytes) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, c.x.get(), c.w.get(), c.conv.get(), c.y.get(),
                                                   a, bytes);
  }
  static cudnnStatus_t run(cudnnHandle_t h, ConvProblem& c, const void* x, const void* w, void* y,
                           Algo a, void* ws, size_t bytes) {
    const float alpha = 1.f, beta = 0.f;
    return cudnnConvolutionForward(h, &alpha, c.x.get(), x, c.w.get(), w, c.conv.get(), a, ws,
                                   bytes, &beta, c.y.get(), y);
  }
};

struct BackwardData {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  using Algo = cudnnConvolutionBwdDataAlgo_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static constexpr const char* kCall = "cudnnConvolutionBackwardData";
  static constexpr std::array<Algo, 2> kFallbacks = {CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
                                                     CUDNN_CONVOLUTION_BWD_DATA_ALGO_0};
  static bool nondeterministic(Algo a) { return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0; }
  static cudnnStatus_t query(cudnnHandle_t h, ConvProblem& c, int n, int* got, Perf* perf) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, c.w.get(), c.y.get(), c.conv.get(),
                                                       c.x.get(), n, got, perf);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, ConvProblem& c, Algo a, size_t* bytes) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(h, c.w.get(), c.y.get(), c.conv.get(),
                                                        c.x.get(), a, bytes);
  }
  static cudnnStatus_t run(cudnnHandle_t h, ConvProblem& c, const void* w, const void* dy, void* dx,
                           Algo a, void* ws, size_t bytes) {
    const float alpha = 1.f, beta = 0.f;
    return cudnnConvolutionBackwardData(h, &alpha, c.w.get(), w, c.y.get(), dy, c.conv.get(), a, ws,
                                        bytes, &beta, c.x.get(), dx);
  }
};

struct BackwardFilter {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  using Algo = cudnnConvolutionBwdFilterAlgo_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static constexpr const char* kCall = "cudnnConvolutionBackwardFilter";
  static constexpr std::array<Algo, 2> kFallbacks = {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
                                                     CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0};
  static bool nondeterministic(Algo a) {
    return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
  }
  static cudnnStatus_t query(cudnnHandle_t h, ConvProblem& c, int n, int* got, Perf* perf) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, c.x.get(), c.y.get(), c.conv.get(),
                                                         c.w.get(), n, got, perf);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, ConvProblem& c, Algo a, size_t* bytes) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, c.x.get(), c.y.get(), c.conv.get(),
                                                          c.w.get(), a, bytes);
  }
  static cudnnStatus_t run(cudnnHandle_t h, ConvProblem& c, const void* x, const void* dy, void* dw,
                           Algo a, void* ws, size_t bytes) {
    const float alpha = 1.f, beta = 0.f;
    return cudnnConvolutionBackwardFilter(h, &alpha, c.x.get(), x, c.y.get(), dy, c.conv.get(), a,
                                          ws, bytes, &beta, c.w.get(), dw);
  }
};

// Runs direction D of problem `c` on (a, b) -> out with the cached algorithm choice, else the first
// of cuDNN's ranked candidates that accepts it (run_first_supported). Returns the choice to cache.
template <typename D>
int convolve(CudaContext& ctx, ConvProblem& c, int cached, bool tensor_cores, const void* a,
             const void* b, void* out, const std::string& problem) {
  using Algo = typename D::Algo;
  auto lock = ctx.lock_cudnn();
  cudnnHandle_t h = ctx.cudnn();
  return run_first_supported<Algo>(
      ctx, c.conv, cached, tensor_cores,
      [&] {
        return ranked<typename D::Perf, Algo>(
            [&](int n, int* got, typename D::Perf* perf) { return D::query(h, c, n, got, perf); },
            D::kCount, D::kFallbacks, [](Algo a) { return D::nondeterministic(a); });
      },
      [&](Algo algo, size_t* bytes) { return D::workspace(h, c, algo, bytes); },
      [&](Algo algo, void* ws, size_t bytes) { return D::run(h, c, a, b, out, algo, ws, bytes); },
      D::kCall, problem);
}

}  // namespace

int legacy_convolve(CudaContext& ctx, ConvDirection d, const ConvPlanProblem& p, int cached,
                    bool tensor_cores, const void* a, const void* b, void* out, const char* op,
                    const std::string& problem) {
  ConvProblem c(p, op);
  switch (d) {
    case ConvDirection::kForward:
      return convolve<Forward>(ctx, c, cached, tensor_cores, a, b, out, problem);
    case ConvDirection::kBackwardData:
      return convolve<BackwardData>(ctx, c, cached, tensor_cores, a, b, out, problem);
    case ConvDirection::kBackwardFilter:
      return convolve<BackwardFilter>(ctx, c, cached, tensor_cores, a, b, out, problem);
  }
  throw Internal("legacy_convolve: unknown direction");
}

}  // namespace dtrain::cuda
