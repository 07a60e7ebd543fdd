#include "dtrain/model/gradient_tape.h"

#include <unordered_map>
#include <unordered_set>

#include "dtrain/model/ops.h"
#include "dtrain/model/variable.h"
#include "model/op_util.h"

namespace dtrain {

struct GradientTape::Node {
  const char* op;
  std::vector<uint64_t> input_ids;
  std::vector<uint64_t> output_ids;
  std::vector<Shape> output_shapes;  // for zero gradients of outputs nothing flowed into
  std::vector<DeviceSpec> output_devices;
  tape::BackwardFn fn;         // empty: not differentiable (again)
  tape::SumBackwardFn fn_sum;  // or empty: takes its output's gradient as one tensor only
};

namespace {
thread_local std::vector<GradientTape*> t_tapes;
thread_local tape::GradientReadyHook* t_hook = nullptr;
thread_local const std::vector<bool>* t_needed = nullptr;  // the running BackwardFn's inputs
thread_local int t_pause_all = 0;                          // tape::PauseAll guards alive
thread_local uint64_t t_summed = 0;                        // tape_testing::summed_in_backward
thread_local bool t_take_sums = true;                      // tape_testing::take_sums_in_backward

// Sets which inputs the BackwardFn about to run must differentiate, for its duration.
class NeededScope {
 public:
  explicit NeededScope(const std::vector<bool>* needed) : prev_(t_needed) { t_needed = needed; }
  ~NeededScope() { t_needed = prev_; }

 private:
  const std::vector<bool>* prev_;
};
}  // namespace

struct TapeAccess {
  static bool watches(const GradientTape& t, const Tensor& x) {
    return x.defined() && (x.is_trainable_variable() || t.watched_.count(x.id()) > 0);
  }
  static bool active(const GradientTape& t) { return t.paused_ == 0 && t_pause_all == 0; }
  static void add(GradientTape& t, const std::shared_ptr<GradientTape::Node>& n,
                  const std::vector<Tensor>& inputs) {
    t.nodes_.push_back(n);
    for (uint64_t id : n->output_ids) t.watched_.insert(id);
    // Variables read on the tape become watched sources (TF watches accessed variables).
    for (const Tensor& x : inputs)
      if (x.defined() && x.is_trainable_variable()) t.watched_.insert(x.id());
  }
};

GradientTape::GradientTape(bool persistent) : persistent_(persistent) {
  // The first tape of a step: the bfloat16 copies kept under mixed_bfloat16 (op_util.h) are of
  // tensors read before it, by a tape dropped without gradient(); a weight updated in place since
  // keeps its id, so a copy of it would be stale.
  if (t_tapes.empty()) ops::forget_kept_copies();
  t_tapes.push_back(this);
}

GradientTape::~GradientTape() {
  // Dropped without gradient(): its copies must not outlive it (an outer tape, still recording,
  // would otherwise read a weight's copy after an in-place update of the weight).
  if (!used_) ops::forget_kept_copies();
  for (auto it = t_tapes.begin(); it != t_tapes.end(); ++it)
    if (*it == this) {
      t_tapes.erase(it);
      break;
    }
}

void GradientTape::watch(const Tensor& t) { watched_.insert(t.id()); }

std::vector<Tensor> GradientTape::gradient(const Tensor& target, const std::vector<Tensor>& sources,
                                           const Tensor& output_gradient) {
  return compute(target, sources, output_gradient, nullptr);
}

std::vector<Tensor> GradientTape::compute(const Tensor& target, const std::vector<Tensor>& sources,
                                          const Tensor& output_gradient,
                                          tape::GradientReadyHook* hook) {
  ops::forget_kept_copies();  // the tape's closures hold what the backward pass needs
  if (used_ && !persistent_)
    throw FailedPrecondition(
        "gradient() was already called on this non-persistent GradientTape; construct it with "
        "GradientTape(/*persistent=*/true) to compute several gradients");
  used_ = true;
  Pause pause(this);  // the backward pass is recorded by outer tapes only
  std::unordered_map<uint64_t, Tensor> grads;
  if (output_gradient.defined() && output_gradient.shape() != target.shape())
    throw InvalidArgument("output_gradient shape " + output_gradient.shape().to_string() +
                          " differs from target shape " + target.shape().to_string());
  grads[target.id()] = output_gradient.defined() ? output_gradient : ops::ones_like(target);
  // With a hook: ready_at[k] lists the sources whose gradient is final once node k is processed
  // (k = the earliest node that reads the source).
  std::vector<std::vector<size_t>> ready_at;
  std::vector<bool> reported(sources.size(), false);
  if (hook) {
    std::unordered_map<uint64_t, size_t> first_use;
    for (size_t k = 0; k < nodes_.size(); ++k)
      for (uint64_t id : nodes_[k]->input_ids) first_use.emplace(id, k);
    ready_at.resize(nodes_.size());
    for (size_t i = 0; i < sources.size(); ++i) {
      auto f = first_use.find(sources[i].id());
      if (f != first_use.end()) ready_at[f->second].push_back(i);
    }
  }
  // A non-persistent tape lets go of each node once it is processed: its saved tensors, and the
  // gradients of its outputs (complete by then: every reader of an output was recorded after the
  // node), unless an output is a source. Memory then falls as backward runs, as in PyTorch's
  // autograd, instead of holding every activation and every gradient to the end.
  std::unordered_set<uint64_t> keep;
  std::unordered_map<uint64_t, int> source_count;
  for (const Tensor& s : sources) ++source_count[s.id()];
  // A second gradient of an op's output, held apart instead of summed at once when the op takes
  // its output's gradient in two parts (Node::fn_sum): its backward pass then reads both, and the
  // sum is never written. Only float32 parts of outputs that are not sources (whose gradients the
  // hook and the result read whole). A third part adds the first two and is held apart in turn:
  // the parts are summed in the order they come, as before.
  std::unordered_set<uint64_t> sum_takers;
  if (t_take_sums)
    for (const auto& n : nodes_)
      if (n->fn_sum && n->output_ids.size() == 1 && !source_count.count(n->output_ids[0]))
        sum_takers.insert(n->output_ids[0]);
  std::unordered_map<uint64_t, Tensor> addends;
  if (!persistent_)
    for (const Tensor& s : sources) keep.insert(s.id());
  // Whether nothing else in this backward pass holds `g`'s memory: no other pending gradient is
  // the same tensor (an op may hand its output gradient on unchanged) and the source is listed
  // once.
  // The caller's output_gradient is the caller's: never handed over.
  const uint64_t seed = output_gradient.defined() ? output_gradient.id() : 0;
  auto exclusive = [&](size_t i, const Tensor& g) {
    if (persistent_ || !g.defined() || g.id() == seed || source_count[sources[i].id()] != 1)
      return false;
    int holders = 0;
    for (const auto& [id, t] : grads) holders += t.defined() && t.id() == g.id();
    for (const auto& [id, t] : addends) holders += t.id() == g.id();
    return holders == 1;
  };
  for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it) {
    do {  // `continue` below ends this node's processing
      const Node& n = **it;
      if (hook) {  // report after this node (the loop body below `continue`s, so report first for
                   // k+1)
        const size_t k = static_cast<size_t>(nodes_.rend() - it);  // index of the node after n
        if (k < nodes_.size())
          for (size_t i : ready_at[k]) {
            auto g = grads.find(sources[i].id());
            const Tensor grad = g == grads.end() ? Tensor() : g->second;
            hook->on_ready(i, grad, exclusive(i, grad));
            reported[i] = true;
          }
      }
      std::vector<Tensor> og(n.output_ids.size());
      bool any = false;
      for (size_t j = 0; j < og.size(); ++j) {
        auto g = grads.find(n.output_ids[j]);
        if (g != grads.end()) {
          og[j] = g->second;
          any = true;
        }
      }
      if (!any) continue;
      Tensor second;  // og[0]'s second part, taken as it is by n.fn_sum
      for (size_t j = 0; j < og.size(); ++j) {
        auto p = addends.find(n.output_ids[j]);
        if (p == addends.end()) continue;
        if (og.size() == 1 && n.fn_sum)
          second = p->second;
        else
          og[j] = ops::add(og[j], p->second);
        addends.erase(p);
      }
      if (!n.fn)
        throw Unimplemented(
            std::string("cannot differentiate through '") + n.op +
            "': its gradient is first-order only. Use tanh/sigmoid/matmul/elementwise "
            "ops for models that need higher derivatives");
      for (size_t j = 0; j < og.size(); ++j)
        if (!og[j].defined())
          og[j] = Tensor::zeros(n.output_shapes[j], DType::kFloat32, n.output_devices[j]);
      std::vector<bool> needed(n.input_ids.size());
      for (size_t i = 0; i < needed.size(); ++i)
        needed[i] = n.input_ids[i] != 0 && watched_.count(n.input_ids[i]) > 0;
      std::vector<Tensor> ig;
      {
        NeededScope scope(&needed);
        if (second.defined()) {
          ig = n.fn_sum(og[0], second);
          ++t_summed;
        } else {
          ig = n.fn(og);
        }
      }
      DTRAIN_CHECK(ig.size() == n.input_ids.size(), "backward of ", n.op, " returned ", ig.size(),
                   " gradients for ", n.input_ids.size(), " inputs");
      for (size_t i = 0; i < ig.size(); ++i) {
        // Gradients only flow to what this tape follows (TF: unwatched sources get None).
        if (!ig[i].defined() || !watched_.count(n.input_ids[i])) continue;
        const uint64_t id = n.input_ids[i];
        auto [slot, inserted] = grads.emplace(id, ig[i]);
        if (inserted) continue;
        if (auto p = addends.find(id); p != addends.end()) {  // a third part: the first two summed
          slot->second = ops::add(slot->second, p->second);
          addends.erase(p);
        }
        if (sum_takers.count(id) && slot->second.dtype() == DType::kFloat32 &&
            ig[i].dtype() == DType::kFloat32 && slot->second.shape() == ig[i].shape() &&
            slot->second.device() == ig[i].device()) {
          addends.emplace(id, ig[i]);
        } else {
          // A bfloat16 gradient (a bfloat16 activation's: Conv2D::bfloat16_output) is summed with
          // another in float32.
          const auto wide = [](const Tensor& g) {
            return g.dtype() == DType::kBFloat16 ? ops::cast(g, DType::kFloat32) : g;
          };
          slot->second = ops::add(wide(slot->second), wide(ig[i]));
        }
      }
    } while (false);
    if (!persistent_) {
      for (uint64_t id : (*it)->output_ids)
        if (!keep.count(id)) grads.erase(id);
      for (uint64_t id : (*it)->output_ids) addends.erase(id);
      it->reset();
    }
  }
  std::vector<Tensor> out;
  out.reserve(sources.size());
  for (const Tensor& s : sources) {
    auto g = grads.find(s.id());
    out.push_back(g == grads.end() ? Tensor() : g->second);
  }
  if (hook) {
    for (size_t i = 0; i < sources.size(); ++i)
      if (!reported[i]) hook->on_ready(i, out[i], exclusive(i, out[i]));
    hook->on_done();
  }
  if (!persistent_) {
    nodes_.clear();
    watched_.clear();
  }
  return out;
}

std::vector<Tensor> GradientTape::gradient(const Tensor& target,
                                           const std::vector<std::shared_ptr<Variable>>& variables,
                                           const Tensor& output_gradient) {
  std::vector<Tensor> sources;
  sources.reserve(variables.size());
  for (const auto& v : variables) sources.push_back(v->value());
  if (used_ && !persistent_) return gradient(target, sources, output_gradient);  // throws
  // The strategy's hook sees variable gradients of the outermost tape only (a training step).
  tape::GradientReadyHook* hook = t_tapes.size() == 1 && t_tapes[0] == this ? t_hook : nullptr;
  return compute(target, sources, output_gradient, hook);
}

namespace tape {

GradientReadyHook* set_gradient_ready_hook(GradientReadyHook* hook) {
  GradientReadyHook* prev = t_hook;
  t_hook = hook;
  return prev;
}

bool needs_gradient(size_t index) {
  return !t_needed || (index < t_needed->size() && (*t_needed)[index]);
}

bool should_record(std::initializer_list<const Tensor*> inputs) {
  for (GradientTape* t : t_tapes) {
    if (!TapeAccess::active(*t)) continue;
    for (const Tensor* x : inputs)
      if (TapeAccess::watches(*t, *x)) return true;
  }
  return false;
}

int recording_tapes(std::initializer_list<const Tensor*> inputs) {
  int n = 0;
  for (GradientTape* t : t_tapes) {
    if (!TapeAccess::active(*t)) continue;
    for (const Tensor* x : inputs)
      if (TapeAccess::watches(*t, *x)) {
        ++n;
        break;
      }
  }
  return n;
}

bool should_record(const std::vector<Tensor>& inputs) {
  for (GradientTape* t : t_tapes) {
    if (!TapeAccess::active(*t)) continue;
    for (const Tensor& x : inputs)
      if (TapeAccess::watches(*t, x)) return true;
  }
  return false;
}

namespace {
void record_node(const char* op, std::vector<Tensor>& inputs, std::vector<Tensor>& outputs,
                 BackwardFn fn, SumBackwardFn fn_sum = nullptr) {
  std::shared_ptr<GradientTape::Node> node;
  for (GradientTape* t : t_tapes) {
    if (!TapeAccess::active(*t)) continue;
    bool watched = false;
    for (const Tensor& x : inputs) watched = watched || TapeAccess::watches(*t, x);
    if (!watched) continue;
    if (!node) {
      node = std::make_shared<GradientTape::Node>();
      node->op = op;
      for (const Tensor& x : inputs) node->input_ids.push_back(x.defined() ? x.id() : 0);
      for (const Tensor& y : outputs) node->output_ids.push_back(y.id());
      for (const Tensor& y : outputs) {
        node->output_shapes.push_back(y.shape());
        node->output_devices.push_back(y.device());
      }
      node->fn = std::move(fn);
      node->fn_sum = std::move(fn_sum);
    }
    TapeAccess::add(*t, node, inputs);
  }
}
}  // namespace

PauseAll::PauseAll() { ++t_pause_all; }
PauseAll::~PauseAll() { --t_pause_all; }

void record(const char* op, std::vector<Tensor> inputs, std::vector<Tensor> outputs,
            BackwardFn fn) {
  record_node(op, inputs, outputs, std::move(fn));
}

void record_summing(const char* op, std::vector<Tensor> inputs, const Tensor& output, BackwardFn fn,
                    SumBackwardFn fn_sum) {
  std::vector<Tensor> outputs{output};
  record_node(op, inputs, outputs, std::move(fn), std::move(fn_sum));
}

void record_nondifferentiable(const char* op, std::vector<Tensor> inputs,
                              std::vector<Tensor> outputs) {
  record_node(op, inputs, outputs, nullptr);
}

}  // namespace tape
}  // namespace dtrain

namespace dtrain::tape_testing {
uint64_t summed_in_backward() { return t_summed; }
void take_sums_in_backward(bool on) { t_take_sums = on; }
}  // namespace dtrain::tape_testing
