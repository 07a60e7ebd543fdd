// recompute_grad (recompute.h): the first pass runs with every tape of the thread paused and logs
// the layers' random draws; the recorded node keeps only the inputs and, on the backward pass,
// replays the function under a fresh tape that reads the log back.
#include "dtrain/model/recompute.h"

#include <utility>

#include "dtrain/core/error.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "dtrain/model/variable.h"

namespace dtrain {
namespace {

// The draws of one recomputed call: logged on the first pass, read back on the replay.
struct DrawLog {
  std::vector<uint64_t> draws;
  size_t next = 0;
};

thread_local DrawLog* t_logging = nullptr;    // the first pass of a recomputed call
thread_local DrawLog* t_replaying = nullptr;  // its replay

template <class T>
class Swap {
 public:
  Swap(T& slot, T value) : slot_(slot), saved_(std::exchange(slot, value)) {}
  ~Swap() { slot_ = saved_; }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;

 private:
  T& slot_;
  T saved_;
};

}  // namespace

namespace recompute {
bool replaying() { return t_replaying != nullptr; }

uint64_t replayed_draw(const std::function<uint64_t()>& fresh) {
  if (t_replaying != nullptr) {
    if (t_replaying->next >= t_replaying->draws.size())
      throw Internal(
          "recompute_grad: the replay drew more random numbers than the first pass; the "
          "recomputed function must make the same calls both times");
    return t_replaying->draws[t_replaying->next++];
  }
  const uint64_t v = fresh();
  if (t_logging != nullptr) t_logging->draws.push_back(v);
  return v;
}
}  // namespace recompute

std::vector<Tensor> recompute_grad(const RecomputeFn& f, const std::vector<Tensor>& inputs,
                                   const std::vector<std::shared_ptr<Variable>>& variables) {
  return recompute_grad(f, inputs, variables, RecomputeHooks{});
}

std::vector<Tensor> recompute_grad(const RecomputeFn& f, const std::vector<Tensor>& inputs,
                                   const std::vector<std::shared_ptr<Variable>>& variables,
                                   RecomputeHooks hooks) {
  if (!f) throw InvalidArgument("recompute_grad: the function is empty");
  std::vector<Tensor> watched = inputs;
  for (const auto& v : variables) {
    if (!v) throw InvalidArgument("recompute_grad: a null variable");
    watched.push_back(v->value());
  }
  if (!tape::should_record(watched) || recompute::replaying()) return f(inputs);

  auto log = std::make_shared<DrawLog>();
  std::vector<Tensor> outputs;
  {
    tape::PauseAll pause;  // nothing of f's is kept for the backward pass
    Swap<DrawLog*> logging(t_logging, log.get());
    outputs = f(inputs);
  }
  const size_t n_in = inputs.size();
  tape::record("recompute_grad", watched, outputs,
               [f, log, watched, n_in, hooks](const std::vector<Tensor>& output_grads) {
                 std::vector<Tensor> in(watched.begin(), watched.begin() + static_cast<long>(n_in));
                 std::vector<size_t> wanted;  // which of `watched` the outer tape needs
                 for (size_t i = 0; i < watched.size(); ++i)
                   if (tape::needs_gradient(i)) wanted.push_back(i);
                 std::vector<Tensor> grads(watched.size());
                 if (wanted.empty()) return grads;
                 if (hooks.before_replay) hooks.before_replay();
                 struct After {
                   const std::function<void()>& fn;
                   ~After() {
                     if (fn) fn();
                   }
                 } after{hooks.after_replay};
                 GradientTape inner;
                 for (const Tensor& x : in) inner.watch(x);
                 std::vector<Tensor> ys;
                 {
                   log->next = 0;
                   Swap<DrawLog*> replay(t_replaying, log.get());
                   ys = f(in);
                 }
                 if (ys.size() != output_grads.size())
                   throw Internal("recompute_grad: the replay returned " +
                                  std::to_string(ys.size()) + " outputs, the first pass " +
                                  std::to_string(output_grads.size()));
                 // One target: the outputs weighted by their incoming gradients (for one output,
                 // the gradient seeded directly, so the result is bitwise what the unrecomputed
                 // graph gives).
                 Tensor target, seed;
                 if (ys.size() == 1) {
                   target = ys[0];
                   seed = output_grads[0];
                 } else {
                   for (size_t j = 0; j < ys.size(); ++j) {
                     const Tensor term = ops::sum(ops::mul(ys[j], output_grads[j]));
                     target = target.defined() ? ops::add(target, term) : term;
                   }
                 }
                 std::vector<Tensor> sources;
                 for (size_t i : wanted) sources.push_back(watched[i]);
                 const std::vector<Tensor> g = inner.gradient(target, sources, seed);
                 for (size_t k = 0; k < wanted.size(); ++k) grads[wanted[k]] = g[k];
                 return grads;
               });
  return outputs;
}

}  // namespace dtrain
