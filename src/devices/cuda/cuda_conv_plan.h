// cuDNN's graph (backend) API for the three directions of a 2-D convolution: one execution plan per
// problem, built once and cached, then run with a variant pack per call.
//
// Why not the legacy calls (cudnnConvolutionForward & co.) alone: in cuDNN 9 each legacy call
// rebuilds what a plan holds, 100-740 us of host time per call measured on an H200 (bench/gpu/
// conv_probe, 73 ms per ResNet-50 step at batch 32, as much as the step's whole GPU time), so the
// GPU waited for the host. PyTorch and TensorFlow cache plans the same way.
//
// The engine is the first of cuDNN's heuristics (mode A, then the fallback list) that is
// deterministic (unless DTRAIN_CUDNN_DETERMINISTIC=0), uses no tensor cores (float32 stays float32:
// no TF32) unless the caller allows them (TF32 switched on, or mixed_bfloat16:
// CudaKernels::tensor_cores()), never converts its inputs to a narrower type than TF32, needs no
// runtime compilation and a workspace of at most 1 GiB; the choice depends only on the problem, so
// a run and its resumption pick the same engine (bitwise-repeatable training). When none qualifies,
// or DTRAIN_CUDNN_API=legacy is set, the caller uses the legacy path (cuda_conv.cc).
//
// DTRAIN_CUDNN_AUTOTUNE=1 (PyTorch's cudnn.benchmark, TensorFlow's default autotuning): the first
// run of each problem times up to 8 qualifying plans on its own buffers and keeps the fastest.
// Every plan is still deterministic, so one process repeats itself bit for bit; but the timing
// decides, so two runs may pick different engines and differ in the last bits.
// DTRAIN_CUDNN_DETERMINISTIC=0 (PyTorch's cudnn.deterministic=False, its default): engines whose
// sums use atomics qualify too; then no two runs need give the same bits.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "devices/cuda/cuda_context.h"
#include "dtrain/core/dtype.h"

namespace dtrain::cuda {

enum class ConvDirection { kForward = 0, kBackwardData = 1, kBackwardFilter = 2 };

// The problem as cuDNN sees it: NHWC x [n, h, w, cin] (already explicitly padded when padding was
// asymmetric), KRSC filter [cout, kh, kw, cin], NHWC y [n, oh, ow, cout], symmetric padding.
struct ConvPlanProblem {
  int64_t n, h, w, cin, kh, kw, cout, oh, ow;
  int64_t pad_h, pad_w, stride_h, stride_w;
};

// The element types of the three tensors in cuDNN's roles (x or dx, w or dw, y or dy): float32,
// or bfloat16 (mixed_bfloat16's operands, and an output handed on in bfloat16). Engines for
// bfloat16 data accumulate in float32 (engines that reduce in lower precision are passed over).
struct ConvTypes {
  DType x = DType::kFloat32, w = DType::kFloat32, y = DType::kFloat32;
};

// Direction d of problem p as a cache key (with whether tensor cores may run): the plans' and the
// legacy algorithm choices' (cuda_conv_legacy.h).
std::vector<int64_t> conv_problem_key(ConvDirection d, const ConvPlanProblem& p, bool tensor_cores);

class ConvPlanCache {
 public:
  explicit ConvPlanCache(CudaContext& ctx);
  ~ConvPlanCache();
  ConvPlanCache(const ConvPlanCache&) = delete;
  ConvPlanCache& operator=(const ConvPlanCache&) = delete;

  // Runs direction d of problem p on device pointers x, w and y (forward writes y from x and w;
  // backward data writes x from w and y = dy; backward filter writes w from x and y = dy).
  // tensor_cores allows engines that run float32 data on tensor cores as TF32 (plans are cached
  // apart for the two). Returns false, doing nothing, when the graph API is off or has no
  // qualifying engine for the problem, or its plan fails at its first run (both remembered: the
  // next call returns false at once). Throws on a cuDNN failure of a plan that has run before.
  // `types`: the pointers' element types (plans are cached apart for each).
  bool run(ConvDirection d, const ConvPlanProblem& p, void* x, void* w, void* y, bool tensor_cores,
           ConvTypes types = {});

  // False when run() already found no qualifying engine for direction d of p with these types (at
  // any alignment), or the graph API is off: callers skip converting operands for it.
  bool may_run(ConvDirection d, const ConvPlanProblem& p, bool tensor_cores, ConvTypes types);

  // Whether DTRAIN_CUDNN_API is unset or "graph" (read once); "legacy" turns the plans off.
  static bool enabled();
  // Whether DTRAIN_CUDNN_AUTOTUNE=1 (read once; anything but unset, 0 or 1 throws).
  static bool autotune();
  // False under DTRAIN_CUDNN_DETERMINISTIC=0 (read once): engines whose sums use atomics, in an
  // order that changes from run to run, qualify too, as in PyTorch (cudnn.deterministic=False,
  // its default) and TensorFlow; for comparisons with them. True by default: every engine gives
  // the same bits in every run.
  static bool deterministic();

 private:
  struct Plan;
  std::shared_ptr<Plan> plan_for(ConvDirection d, const ConvPlanProblem& p, int64_t alignment,
                                 bool tensor_cores, ConvTypes types);
  std::shared_ptr<Plan> build(ConvDirection d, const ConvPlanProblem& p, int64_t alignment,
                              bool tensor_cores, ConvTypes types);
  // Times plan's candidates on these buffers and keeps the fastest.
  void tune(Plan& plan, void* x, void* w, void* y);

  CudaContext& ctx_;
  std::mutex mu_;
  std::map<std::vector<int64_t>, std::shared_ptr<Plan>> plans_;  // null: no qualifying engine
  std::set<std::vector<int64_t>> none_;  // plans_' null entries' keys without the alignment
};

}  // namespace dtrain::cuda
