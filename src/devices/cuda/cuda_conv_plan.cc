#include "devices/cuda/cuda_conv_plan.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda_testing.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::cuda {
namespace {

constexpr int64_t kMaxWorkspaceBytes = int64_t{1} << 30;  // as the legacy path
constexpr int64_t kUidX = 'x', kUidW = 'w', kUidY = 'y';
// Under DTRAIN_CUDNN_AUTOTUNE=1: at most this many qualifying plans are timed, each this many runs
// after an untimed one.
constexpr size_t kTuneCandidates = 8;
constexpr int kTuneRuns = 3;

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    DTRAIN_CUDNN_CALL(cudnnBackendCreateDescriptor(type, &d_));
  }
  ~Desc() {
    if (d_) (void)cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  cudnnBackendDescriptor_t get() const { return d_; }

  template <typename T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values,
           int64_t count) {
    DTRAIN_CUDNN_CALL(cudnnBackendSetAttribute(d_, name, type, count, values));
  }
  template <typename T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T& value) {
    set(name, type, &value, 1);
  }
  void set(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t o = other.get();
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &o, 1);
  }
  void finalize() { DTRAIN_CUDNN_CALL(cudnnBackendFinalize(d_)); }
  cudnnStatus_t try_finalize() { return cudnnBackendFinalize(d_); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// A 4-D float32 or bfloat16 tensor in cuDNN's logical [N, C, H, W] order with channels-last
// strides.
Desc nhwc_tensor(int64_t uid, int64_t n, int64_t c, int64_t h, int64_t w, int64_t alignment,
                 DType type) {
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t dims[4] = {n, c, h, w};
  const int64_t strides[4] = {h * w * c, 1, w * c, c};
  DTRAIN_CHECK(type == DType::kFloat32 || type == DType::kBFloat16,
               "cuDNN plans take float32 or bfloat16 tensors, not ", dtype_name(type));
  const cudnnDataType_t t_type = type == DType::kBFloat16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, t_type);
  t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims, 4);
  t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides, 4);
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid);
  t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment);
  t.finalize();
  return t;
}

bool has(const std::vector<int>& notes, int note) {
  return std::find(notes.begin(), notes.end(), note) != notes.end();
}

// The largest power of two (up to 16, cuDNN's widest vector access) dividing every address, and
// at least the smallest element's size (2 bytes with a bfloat16 tensor, else 4).
int64_t alignment_of(std::initializer_list<const void*> ptrs, int64_t smallest) {
  int64_t a = 16;
  for (const void* p : ptrs)
    while (a > smallest && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) != 0) a /= 2;
  return a;
}

int64_t type_code(DType t) { return t == DType::kBFloat16 ? 1 : 0; }

std::vector<int64_t> typed_key(ConvDirection d, const ConvPlanProblem& p, bool tensor_cores,
                               ConvTypes types) {
  std::vector<int64_t> key = conv_problem_key(d, p, tensor_cores);
  for (DType t : {types.x, types.w, types.y}) key.push_back(type_code(t));
  return key;
}

const char* direction_name(ConvDirection d) {
  switch (d) {
    case ConvDirection::kForward:
      return "forward";
    case ConvDirection::kBackwardData:
      return "backward data";
    case ConvDirection::kBackwardFilter:
      return "backward filter";
  }
  return "?";
}

}  // namespace

// Every descriptor the plan was built from stays alive with it. Under DTRAIN_CUDNN_AUTOTUNE=1 the
// qualifying plans wait in `candidates` until the first run times them (ConvPlanCache::tune).
struct ConvPlanCache::Plan {
  // An execution plan that qualifies, and what it needs.
  struct Candidate {
    std::unique_ptr<Desc> plan;
    int64_t workspace = 0;
    int64_t engine = -1;  // cuDNN's global engine index (for the log)
  };
  std::vector<Desc> keep;
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;
  std::vector<Candidate> candidates;
  std::string what;  // the problem, for the log
  bool ran = false;  // it has run once: a failure from then on is an error, not "no plan"
};

ConvPlanCache::ConvPlanCache(CudaContext& ctx) : ctx_(ctx) {}
ConvPlanCache::~ConvPlanCache() = default;

bool ConvPlanCache::enabled() {
  static const bool on = [] {
    const char* v = std::getenv("DTRAIN_CUDNN_API");
    if (!v || !*v || std::strcmp(v, "graph") == 0) return true;
    if (std::strcmp(v, "legacy") == 0) return false;
    throw InvalidArgument(detail::str_cat(
        "DTRAIN_CUDNN_API=", v, " is not a cuDNN API; use graph (the default) or legacy"));
  }();
  return on;
}

bool ConvPlanCache::autotune() {
  static const bool on =
      env_switch("DTRAIN_CUDNN_AUTOTUNE", false,
                 "1 times the qualifying cuDNN engines at each convolution's first run and keeps "
                 "the fastest, 0 (the default) takes the heuristics' first");
  return on;
}

bool ConvPlanCache::deterministic() {
  static const bool on = env_switch(
      "DTRAIN_CUDNN_DETERMINISTIC", true,
      "1 (the default) runs only cuDNN engines that give the same bits every run, 0 also those "
      "that sum with atomics in any order (PyTorch's and TensorFlow's default)");
  return on;
}

std::vector<int64_t> conv_problem_key(ConvDirection d, const ConvPlanProblem& p,
                                      bool tensor_cores) {
  return {static_cast<int64_t>(d),
          p.n,
          p.h,
          p.w,
          p.cin,
          p.kh,
          p.kw,
          p.cout,
          p.oh,
          p.ow,
          p.pad_h,
          p.pad_w,
          p.stride_h,
          p.stride_w,
          tensor_cores ? 1 : 0};
}

std::shared_ptr<ConvPlanCache::Plan> ConvPlanCache::plan_for(ConvDirection d,
                                                             const ConvPlanProblem& p,
                                                             int64_t alignment, bool tensor_cores,
                                                             ConvTypes types) {
  std::vector<int64_t> key = typed_key(d, p, tensor_cores, types);
  key.push_back(alignment);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
  }
  std::shared_ptr<Plan> plan = build(d, p, alignment, tensor_cores, types);
  std::lock_guard<std::mutex> lock(mu_);
  if (!plan) none_.insert(typed_key(d, p, tensor_cores, types));
  return plans_.emplace(key, std::move(plan)).first->second;
}

// Called with the cuDNN lock held (run() takes it first).
std::shared_ptr<ConvPlanCache::Plan> ConvPlanCache::build(ConvDirection d, const ConvPlanProblem& p,
                                                          int64_t alignment, bool tensor_cores,
                                                          ConvTypes types) {
  cudnnHandle_t handle = ctx_.cudnn();
  auto plan = std::make_shared<Plan>();
  plan->keep.push_back(nhwc_tensor(kUidX, p.n, p.cin, p.h, p.w, alignment, types.x));
  plan->keep.push_back(nhwc_tensor(kUidW, p.cout, p.cin, p.kh, p.kw, alignment, types.w));
  plan->keep.push_back(nhwc_tensor(kUidY, p.n, p.cout, p.oh, p.ow, alignment, types.y));
  const Desc& x = plan->keep[0];
  const Desc& w = plan->keep[1];
  const Desc& y = plan->keep[2];

  Desc conv(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t spatial = 2, dilation[2] = {1, 1}, stride[2] = {p.stride_h, p.stride_w},
                pad[2] = {p.pad_h, p.pad_w};
  conv.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, f32);
  conv.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, mode);
  conv.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, spatial);
  conv.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, dilation, 2);
  conv.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, stride, 2);
  conv.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, pad, 2);
  conv.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, pad, 2);
  conv.finalize();

  const float alpha = 1.f, beta = 0.f;
  std::unique_ptr<Desc> op;
  switch (d) {
    case ConvDirection::kForward:
      op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, alpha);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, beta);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, conv);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, y);
      break;
    case ConvDirection::kBackwardData:
      op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_TYPE_FLOAT, alpha);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, CUDNN_TYPE_FLOAT, beta);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, conv);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, x);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, w);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, y);
      break;
    case ConvDirection::kBackwardFilter:
      op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_TYPE_FLOAT, alpha);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, CUDNN_TYPE_FLOAT, beta);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, conv);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, x);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, w);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, y);
      break;
  }
  const std::string what = detail::str_cat(
      "convolution ", direction_name(d), " x [", p.n, ", ", p.h, ", ", p.w, ", ", p.cin, "] w [",
      p.kh, ", ", p.kw, ", ", p.cin, ", ", p.cout, "] stride ", p.stride_h, "x", p.stride_w,
      " padding ", p.pad_h, "x", p.pad_w, " (", dtype_name(types.x), ", ", dtype_name(types.w),
      ", ", dtype_name(types.y), ")");
  // A combination of types cuDNN does not take may already fail here (bfloat16 inputs with a
  // float32 output, say): then there is no plan, as when no engine qualifies.
  if (const cudnnStatus_t st = op->try_finalize(); st != CUDNN_STATUS_SUCCESS) {
    DTRAIN_LOG(DEBUG) << what << ": cuDNN refused the operation (" << cudnnGetErrorString(st)
                      << "); no qualifying engine";
    return nullptr;
  }
  Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, *op);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle);
  if (const cudnnStatus_t st = graph.try_finalize(); st != CUDNN_STATUS_SUCCESS) {
    DTRAIN_LOG(DEBUG) << what << ": cuDNN refused the operation graph (" << cudnnGetErrorString(st)
                      << "); no qualifying engine";
    return nullptr;
  }
  for (const cudnnBackendHeurMode_t heur_mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, heur_mode);
    if (heur.try_finalize() != CUDNN_STATUS_SUCCESS) continue;
    int64_t count = 0;
    if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr) != CUDNN_STATUS_SUCCESS ||
        count <= 0)
      continue;
    std::vector<Desc> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      raw.push_back(configs.back().get());
    }
    int64_t got = 0;
    DTRAIN_CUDNN_CALL(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                               raw.data()));
    for (int64_t i = 0; i < got; ++i) {
      Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
      cudnnBackendDescriptor_t e = engine.get();
      int64_t n = 0;
      if (cudnnBackendGetAttribute(configs[static_cast<size_t>(i)].get(),
                                   CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                   &n, &e) != CUDNN_STATUS_SUCCESS)
        continue;
      cudnnBackendNumericalNote_t numerical[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
      cudnnBackendBehaviorNote_t behavior[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
      int64_t nn = 0, nb = 0;
      if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                   CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &nn,
                                   numerical) != CUDNN_STATUS_SUCCESS ||
          cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                                   CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &nb,
                                   behavior) != CUDNN_STATUS_SUCCESS)
        continue;
      std::vector<int> notes(numerical, numerical + nn), behaviors(behavior, behavior + nb);
      // Tensor cores on float32 data are TF32: allowed only when the caller allows them. Inputs
      // converted to float16 or bfloat16 are never allowed (as PyTorch's engine filter). With
      // tensor cores, engines that multiply transformed operands (FFT, Winograd) are passed over:
      // their products are rounded to TF32 again, so mixed_bfloat16's would not be exact.
      const bool transformed = has(notes, CUDNN_NUMERICAL_NOTE_FFT) ||
                               has(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD) ||
                               has(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4) ||
                               has(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6) ||
                               has(notes, CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13);
      if ((!tensor_cores && has(notes, CUDNN_NUMERICAL_NOTE_TENSOR_CORE)) ||
          (tensor_cores && transformed) || has(notes, CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) ||
          has(notes, CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION) ||
          (deterministic() && has(notes, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC)) ||
          has(behaviors, CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION))
        continue;
      auto exec = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      exec->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle);
      exec->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[static_cast<size_t>(i)]);
      if (exec->try_finalize() != CUDNN_STATUS_SUCCESS) continue;
      int64_t ws = 0;
      if (cudnnBackendGetAttribute(exec->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                   CUDNN_TYPE_INT64, 1, &n, &ws) != CUDNN_STATUS_SUCCESS ||
          ws < 0 || ws > kMaxWorkspaceBytes)
        continue;
      int64_t global = -1;
      (void)cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                     &global);
      DTRAIN_LOG(DEBUG) << what << ": cuDNN engine " << global
                        << (tensor_cores ? " (TF32 allowed, heuristics " : " (heuristics ")
                        << (heur_mode == CUDNN_HEUR_MODE_A ? "A" : "fallback") << ", rank " << i
                        << ", workspace " << ws << " bytes, tensor cores "
                        << (has(notes, CUDNN_NUMERICAL_NOTE_TENSOR_CORE) ? "yes" : "no") << ")";
      // The fallback list repeats engines of mode A's: each is timed once.
      if (global >= 0 && std::any_of(plan->candidates.begin(), plan->candidates.end(),
                                     [&](const Plan::Candidate& c) { return c.engine == global; }))
        continue;
      plan->candidates.push_back({std::move(exec), ws, global});
      plan->keep.push_back(std::move(engine));
      if (!autotune() || plan->candidates.size() == kTuneCandidates) break;
    }
    // The configs stay alive with the plans made from them.
    for (auto& c : configs) plan->keep.push_back(std::move(c));
    if (!plan->candidates.empty() && (!autotune() || plan->candidates.size() == kTuneCandidates))
      break;
  }
  if (!plan->candidates.empty()) {
    plan->keep.push_back(std::move(conv));
    plan->keep.push_back(std::move(*op));
    plan->keep.push_back(std::move(graph));
    plan->what = what;
    if (plan->candidates.size() == 1) {  // nothing to time: the heuristics' first
      plan->plan = std::move(plan->candidates[0].plan);
      plan->workspace = plan->candidates[0].workspace;
      plan->candidates.clear();
    }
    return plan;
  }
  DTRAIN_LOG(DEBUG) << what
                    << ": no qualifying deterministic cuDNN engine in the graph API; the caller "
                       "falls back";
  return nullptr;
}

namespace {

// The pointers of one call, and its workspace.
Desc variant_pack(void* x, void* w, void* y, void* workspace) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  const int64_t uids[3] = {kUidX, kUidW, kUidY};
  void* ptrs[3] = {x, w, y};
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids, 3);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs, 3);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace);
  pack.finalize();
  return pack;
}

// Destroys a CUDA event with its owner.
struct Event {
  cudaEvent_t e = nullptr;
  Event() { DTRAIN_CUDA_CALL(cudaEventCreate(&e)); }
  ~Event() {
    if (e) (void)cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

}  // namespace

// Called with the cuDNN lock held, on the call's own buffers (the outputs are written again by the
// plan kept, after). A plan that fails to run is passed over; when all do, the heuristics' first is
// kept, and its own run reports the failure.
void ConvPlanCache::tune(Plan& plan, void* x, void* w, void* y) {
  cudaStream_t stream = ctx_.stream();
  Event start, stop;
  size_t best = 0;
  float best_ms = -1.f, first_ms = -1.f;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Plan::Candidate& c = plan.candidates[i];
    std::shared_ptr<Storage> ws;
    try {  // a workspace that does not fit now passes the plan over, as PyTorch does
      if (c.workspace > 0) ws = ctx_.scratch(static_cast<size_t>(c.workspace));
    } catch (const Unavailable& e) {
      DTRAIN_LOG(DEBUG) << plan.what << ": cuDNN engine " << c.engine
                        << " passed over: " << e.what();
      continue;
    }
    const Desc pack = variant_pack(x, w, y, ws ? ws->data() : nullptr);
    bool ok = cudnnBackendExecute(ctx_.cudnn(), c.plan->get(), pack.get()) == CUDNN_STATUS_SUCCESS;
    DTRAIN_CUDA_CALL(cudaEventRecord(start.e, stream));
    for (int r = 0; ok && r < kTuneRuns; ++r)
      ok = cudnnBackendExecute(ctx_.cudnn(), c.plan->get(), pack.get()) == CUDNN_STATUS_SUCCESS;
    DTRAIN_CUDA_CALL(cudaEventRecord(stop.e, stream));
    DTRAIN_CUDA_CALL(cudaEventSynchronize(stop.e));
    float ms = 0.f;
    DTRAIN_CUDA_CALL(cudaEventElapsedTime(&ms, start.e, stop.e));
    ms /= kTuneRuns;
    DTRAIN_LOG(DEBUG) << plan.what << ": cuDNN engine " << c.engine << " "
                      << (ok ? detail::str_cat(ms, " ms a run") : std::string("failed"));
    if (!ok) {
      (void)cudaGetLastError();  // so that the next kernel's launch check does not report it
      continue;
    }
    if (i == 0) first_ms = ms;
    if (best_ms < 0.f || ms < best_ms) best = i, best_ms = ms;
  }
  if (best_ms < 0.f)
    DTRAIN_LOG(DEBUG) << plan.what << ": no cuDNN engine ran while autotuning; keeping the "
                      << "heuristics' first";
  else
    DTRAIN_LOG(DEBUG) << plan.what << ": autotuned to cuDNN engine " << plan.candidates[best].engine
                      << " (" << best_ms << " ms a run; the "
                      << "heuristics' first "
                      << (first_ms < 0.f ? std::string("failed") : detail::str_cat(first_ms, " ms"))
                      << ")";
  plan.plan = std::move(plan.candidates[best].plan);
  plan.workspace = plan.candidates[best].workspace;
  plan.candidates.clear();
}

bool ConvPlanCache::may_run(ConvDirection d, const ConvPlanProblem& p, bool tensor_cores,
                            ConvTypes types) {
  if (!enabled()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return none_.count(typed_key(d, p, tensor_cores, types)) == 0;
}

namespace {
std::atomic<bool> g_fail_first_runs{false};   // cuda_testing::fail_first_conv_plan_runs
std::atomic<int64_t> g_failed_first_runs{0};  // plans that fell back at their first run
}  // namespace

bool ConvPlanCache::run(ConvDirection d, const ConvPlanProblem& p, void* x, void* w, void* y,
                        bool tensor_cores, ConvTypes types) {
  if (!enabled()) return false;
  (void)autotune();  // a bad DTRAIN_CUDNN_AUTOTUNE is reported at the first convolution
  (void)deterministic();
  auto lock = ctx_.lock_cudnn();
  const bool narrow =
      types.x == DType::kBFloat16 || types.w == DType::kBFloat16 || types.y == DType::kBFloat16;
  const int64_t alignment = alignment_of({x, w, y}, narrow ? 2 : 4);
  const std::shared_ptr<Plan> plan = plan_for(d, p, alignment, tensor_cores, types);
  if (!plan) return false;
  if (!plan->candidates.empty()) tune(*plan, x, w, y);
  std::shared_ptr<Storage> ws;
  if (plan->workspace > 0) ws = ctx_.scratch(static_cast<size_t>(plan->workspace));
  const Desc pack = variant_pack(x, w, y, ws ? ws->data() : nullptr);
  const cudnnStatus_t status =
      !plan->ran && g_fail_first_runs.load()
          ? CUDNN_STATUS_NOT_SUPPORTED
          : cudnnBackendExecute(ctx_.cudnn(), plan->plan->get(), pack.get());
  if (status == CUDNN_STATUS_SUCCESS) {
    plan->ran = true;
    return true;
  }
  // A plan cuDNN finalized but will not run at its first launch (NOT_SUPPORTED, or EXECUTION_FAILED
  // in a context that is still sound; the legacy search treats that as "try the next") is
  // remembered as no plan, as plan_for() does when no engine qualifies, and the caller takes its
  // fallback. Anything else is an error: a bad parameter (a dtrain fault), an allocation or
  // internal failure, a plan that ran before, or a sticky CUDA error of an earlier kernel (which
  // cudaGetLastError cannot clear).
  const int group = static_cast<int>(status) / 1000 * 1000;
  bool fallback = !plan->ran && group == CUDNN_STATUS_NOT_SUPPORTED;
  if (!plan->ran && group == CUDNN_STATUS_EXECUTION_FAILED) {
    (void)cudaGetLastError();  // a launch error of this call: cleared, unless sticky
    fallback = cudaPeekAtLastError() == cudaSuccess;
  }
  if (!fallback) DTRAIN_CUDNN_CALL(status);
  (void)cudaGetLastError();
  g_failed_first_runs.fetch_add(1);
  DTRAIN_LOG(WARNING) << plan->what << ": cuDNN's plan failed at its first run ("
                      << cudnnGetErrorString(status) << "); this problem runs without it";
  std::vector<int64_t> key = typed_key(d, p, tensor_cores, types);
  std::lock_guard<std::mutex> guard(mu_);
  none_.insert(key);
  key.push_back(alignment);
  plans_[key] = nullptr;
  return false;
}

}  // namespace dtrain::cuda

namespace dtrain::cuda_testing {
void fail_first_conv_plan_runs(bool on) { cuda::g_fail_first_runs = on; }
int64_t conv_plans_failed_at_first_run() { return cuda::g_failed_first_runs.load(); }
}  // namespace dtrain::cuda_testing
