// GradientTape: reverse-mode automatic differentiation, as tf.GradientTape.
//
//   GradientTape tape;                 // records ops on this thread while alive
//   Tensor loss = ops::mean(...);
//   auto grads = tape.gradient(loss, model.trainable_variables());
//
// Trainable variables read inside the tape are watched automatically; other tensors with
// watch(). Backward functions are themselves written with recorded ops, so nesting tapes gives
// higher derivatives (an outer tape records the inner tape's gradient computation, as in TF):
// u'' of a network for a PINN is two nested tapes. Ops whose backward is first-order only
// (convolution, pooling, cross-entropy) record a node that throws Unimplemented if differentiated
// a second time, never a silent zero.
//
// Thread-safety: a tape records only the ops of the thread that created it.
#pragma once

#include <functional>
#include <memory>
#include <unordered_set>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

class Variable;
namespace tape {
class GradientReadyHook;
}

class DTRAIN_API GradientTape {
 public:
  // persistent: gradient() may be called more than once (TF's persistent=True).
  explicit GradientTape(bool persistent = false);
  ~GradientTape();
  GradientTape(const GradientTape&) = delete;
  GradientTape& operator=(const GradientTape&) = delete;

  // Makes the tape follow t (needed for non-variable inputs, e.g. PINN coordinates).
  void watch(const Tensor& t);
  // d target / d source for each source; undefined Tensor where the target does not depend on it
  // (TF's None). output_gradient seeds the backward pass (ones when undefined).
  // Throws FailedPrecondition on a second call of a non-persistent tape.
  std::vector<Tensor> gradient(const Tensor& target, const std::vector<Tensor>& sources,
                               const Tensor& output_gradient = Tensor());
  std::vector<Tensor> gradient(const Tensor& target,
                               const std::vector<std::shared_ptr<Variable>>& variables,
                               const Tensor& output_gradient = Tensor());
  // Stops recording until the returned guard dies (tape.stop_recording()).
  class Pause {
   public:
    explicit Pause(GradientTape* t) : t_(t) { t_->paused_++; }
    ~Pause() { t_->paused_--; }

   private:
    GradientTape* t_;
  };
  Pause stop_recording() { return Pause(this); }

  struct Node;  // one recorded op (gradient_tape.cc)

 private:
  friend struct TapeAccess;
  std::vector<Tensor> compute(const Tensor& target, const std::vector<Tensor>& sources,
                              const Tensor& output_gradient, tape::GradientReadyHook* hook);
  bool persistent_;
  bool used_ = false;
  int paused_ = 0;
  std::unordered_set<uint64_t> watched_;
  std::vector<std::shared_ptr<Node>> nodes_;
};

// Interface ops use to record themselves. Not for model code.
namespace tape {
// Receives each source's gradient the moment the backward pass has finished it, so a strategy can
// start all-reducing a pack of gradients while the rest of backward runs (PyTorch DDP's bucket
// hooks). Installed per thread by the strategy for the duration of a replica step; used only by
// GradientTape::gradient(target, variables) on the outermost tape.
class DTRAIN_API GradientReadyHook {
 public:
  virtual ~GradientReadyHook() = default;
  // grad may be undefined (the target does not depend on that source). `exclusive`: nothing else
  // in the backward pass holds grad's memory (no other pending gradient is the same tensor), so
  // the hook may release it (Tensor::release_memory) once it has taken the values: gradient()
  // then returns that handle without values (ZeRO-2/3: each replica keeps only its part).
  virtual void on_ready(size_t source_index, const Tensor& grad, bool exclusive) = 0;
  // Backward finished; every source was reported.
  virtual void on_done() = 0;
};
// Sets the calling thread's hook (nullptr clears it); returns the previous one.
DTRAIN_API GradientReadyHook* set_gradient_ready_hook(GradientReadyHook* hook);

// Given gradients w.r.t. the outputs (undefined = zero), returns gradients w.r.t. each input
// (undefined = no gradient / not differentiable w.r.t. that input).
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& output_grads)>;
// Inside a BackwardFn: whether the tape running it wants the gradient of input `index` (a watched
// tensor: a variable, a watched input, or the output of a recorded op). An op may skip computing
// the others (return them undefined), as TF and PyTorch skip inputs that need no gradient — the
// data fed to the first layer, say. True outside a backward pass.
DTRAIN_API bool needs_gradient(size_t index);
// True when some active tape on this thread watches one of `inputs`.
DTRAIN_API bool should_record(std::initializer_list<const Tensor*> inputs);
DTRAIN_API bool should_record(const std::vector<Tensor>& inputs);
// How many active tapes on this thread watch one of `inputs`: more than one when an outer tape
// differentiates the backward pass (a gradient penalty), and what an op keeps must then be the
// inputs themselves, not compact copies of them.
DTRAIN_API int recording_tapes(std::initializer_list<const Tensor*> inputs);
DTRAIN_API void record(const char* op, std::vector<Tensor> inputs, std::vector<Tensor> outputs,
                       BackwardFn fn);
// The backward pass of a one-output op given its output's gradient in two parts, dy = a + b (both
// float32, of the output's shape), which it may fuse into its first pass instead of a sum written
// and read again. It must give what the op's BackwardFn gives for ops::add(a, b), also when an
// outer tape records the backward pass (then as recorded ops). The tape passes two parts where the
// output's gradient comes from two readers or more (a residual block's input: its shortcut and its
// first convolution; ops::relu and ops::add_relu take them): with more, a = the sum of all but the
// last in the order they came, b = the last. A source's gradient, or parts that are not both
// float32, it sums first (BackwardFn).
using SumBackwardFn = std::function<std::vector<Tensor>(const Tensor& a, const Tensor& b)>;
DTRAIN_API void record_summing(const char* op, std::vector<Tensor> inputs, const Tensor& output,
                               BackwardFn fn, SumBackwardFn fn_sum);
// While alive, no tape of the calling thread records (recompute_grad's first pass).
class DTRAIN_API PauseAll {
 public:
  PauseAll();
  ~PauseAll();
  PauseAll(const PauseAll&) = delete;
  PauseAll& operator=(const PauseAll&) = delete;
};
// Records an op that is not differentiable (again); differentiating through it throws
// Unimplemented naming `op`.
DTRAIN_API void record_nondifferentiable(const char* op, std::vector<Tensor> inputs,
                                         std::vector<Tensor> outputs);
}  // namespace tape

}  // namespace dtrain
