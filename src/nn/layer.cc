#include "dtrain/nn/layer.h"

#include <algorithm>
#include <functional>

#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/recompute.h"
#include "dtrain/strategies/strategy.h"
#include "nn/graph_node.h"

namespace dtrain {
namespace {

thread_local bool t_build_pass = false;

// Makes throwaway plain variables: a shape pass computes output shapes without making the weights
// of a strategy (they are made when the model is built, under its final names).
class ShapePassCreator final : public VariableCreator {
 public:
  std::string name() const override { return "the functional API's shape pass"; }
  std::shared_ptr<Variable> make_variable(const VariableSpec& spec) override {
    return std::make_shared<PlainVariable>(spec, DeviceSpec::cpu(0));
  }
};

std::vector<int64_t> with_batch(const Shape& s, int64_t batch) {
  std::vector<int64_t> d = s.dims();
  d.insert(d.begin(), batch);
  return d;
}

}  // namespace

Tensor apply_activation(Activation a, const Tensor& x) {
  switch (a) {
    case Activation::kNone:
      return x;
    case Activation::kRelu:
      return ops::relu(x);
    case Activation::kTanh:
      return ops::tanh(x);
    case Activation::kSigmoid:
      return ops::sigmoid(x);
    case Activation::kGelu:
      return ops::gelu(x, false);
    case Activation::kGeluTanh:
      return ops::gelu(x, true);
  }
  return x;
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kNone:
      return "linear";
    case Activation::kRelu:
      return "relu";
    case Activation::kTanh:
      return "tanh";
    case Activation::kSigmoid:
      return "sigmoid";
    case Activation::kGelu:
      return "gelu";
    case Activation::kGeluTanh:
      return "gelu_tanh";
  }
  return "?";
}

namespace detail {
BuildPass::BuildPass() : saved_(t_build_pass) { t_build_pass = true; }
BuildPass::~BuildPass() { t_build_pass = saved_; }
}  // namespace detail

// --- KerasTensor, Input ---

const Shape& KerasTensor::shape() const {
  DTRAIN_CHECK(node_, "shape() of an undefined KerasTensor");
  return node_->shapes.at(static_cast<size_t>(index_));
}
DType KerasTensor::dtype() const {
  DTRAIN_CHECK(node_, "dtype() of an undefined KerasTensor");
  return node_->dtypes.at(static_cast<size_t>(index_));
}
std::string KerasTensor::to_string() const {
  if (!node_) return "(undefined)";
  std::string s = "(None";
  for (int64_t d : shape().dims()) s += ", " + std::to_string(d);
  return s + ")";
}
std::shared_ptr<Layer> KerasTensor::layer() const { return node_ ? node_->layer : nullptr; }

KerasTensor Input(const Shape& shape, std::string name, DType dtype) {
  for (int64_t d : shape.dims())
    if (d < 0)
      throw InvalidArgument("Input '" + name + "': shape " + shape.to_string() +
                            " has a negative dimension; give one example's shape, without the "
                            "batch dimension");
  auto node = std::make_shared<detail::Node>();
  node->id = detail::Node::next_id();
  node->input_name = std::move(name);
  node->shapes = {shape};
  node->dtypes = {dtype};
  return KerasTensor(std::move(node), 0);
}

// --- Layer ---

Layer::Layer(std::string name) : name_(std::move(name)) {
  if (name_.empty() || name_.find('/') != std::string::npos)
    throw InvalidArgument("layer name '" + name_ + "' must be non-empty and contain no '/'");
}

Layer::Layer(Layer&& o) noexcept { *this = std::move(o); }

Layer& Layer::operator=(Layer&& o) noexcept {
  if (this == &o) return *this;
  for (auto& c : children_)
    if (c->parent_ == this) c->parent_ = nullptr;
  name_ = std::move(o.name_);
  built_ = o.built_;
  trainable_ = o.trainable_;
  weights_ = std::move(o.weights_);
  children_ = std::move(o.children_);
  output_shapes_ = std::move(o.output_shapes_);
  recompute_ = o.recompute_;
  shard_parameters_ = o.shard_parameters_;
  parent_ = nullptr;
  for (auto& c : children_)
    if (c->parent_ == &o) c->parent_ = this;
  o.built_ = false;
  o.children_.clear();
  o.weights_.clear();
  return *this;
}

Layer::~Layer() {
  for (auto& c : children_)
    if (c->parent_ == this) c->parent_ = nullptr;
}

std::string Layer::child_prefix() const {
  if (!parent_) return is_model() ? "" : name_ + "/";
  return path() + "/";
}

std::string Layer::path() const { return parent_ ? parent_->child_prefix() + name_ : name_; }

void Layer::add_child(const std::shared_ptr<Layer>& layer, const std::string& name) {
  if (!layer) throw InvalidArgument("layer '" + name_ + "': register_layer got a null layer");
  if (built_)
    throw FailedPrecondition("layer '" + name_ + "' is built: register sublayer '" + layer->name() +
                             "' in its constructor, before it is built");
  for (const Layer* a = this; a; a = a->parent_)
    if (a == layer.get())
      throw InvalidArgument("layer '" + layer->name() + "' cannot be a sublayer of itself");
  for (const auto& c : children_)
    if (c == layer) return;
  std::string want = name.empty() ? layer->name_ : name;
  if (want.find('/') != std::string::npos)
    throw InvalidArgument("sublayer name '" + want + "' must not contain '/'");
  auto taken = [&](const std::string& n) {
    for (const auto& c : children_)
      if (c->name_ == n) return true;
    return false;
  };
  if (taken(want)) {
    if (layer->built_)
      throw FailedPrecondition("layer '" + layer->name_ +
                               "' is already built and its name is taken in '" + name_ + "'");
    const std::string base = want;
    int i = 1;
    while (taken(base + "_" + std::to_string(i))) ++i;
    want = base + "_" + std::to_string(i);
  }
  if (!layer->built_) layer->name_ = want;
  if (!layer->parent_) layer->parent_ = this;
  children_.push_back(layer);
}

std::shared_ptr<Layer> Layer::get_layer(const std::string& name) const {
  for (const auto& c : children_)
    if (c->name_ == name) return c;
  return nullptr;
}

void Layer::build(const Shape& input_shape) { build(std::vector<Shape>{input_shape}); }

void Layer::build(const std::vector<Shape>& input_shapes) {
  if (built_) return;
  ReplicaContext* ctx = get_replica_context();
  if (ctx && ctx->num_replicas_in_sync() > 1)
    throw FailedPrecondition("layer '" + name_ + "' is being built inside strategy.run() with " +
                             std::to_string(ctx->num_replicas_in_sync()) +
                             " replicas; call model.build(input_shape) inside strategy.scope() "
                             "before training");
  build_weights(input_shapes);
  built_ = true;
}

void Layer::build_weights(const std::vector<Shape>& input_shapes) {
  if (input_shapes.size() == 1) build_weights(input_shapes[0]);
}

Tensor Layer::call(const Tensor& /*x*/, bool /*training*/) {
  throw InvalidArgument("layer '" + path() + "' (" + class_name() +
                        ") got one input; it takes several, or does not override call()");
}

std::vector<Tensor> Layer::call(const std::vector<Tensor>& xs, bool training) {
  if (xs.size() != 1)
    throw InvalidArgument("layer '" + path() + "' (" + class_name() + ") takes one input, got " +
                          std::to_string(xs.size()));
  return {call(xs[0], training)};
}

namespace {
// In a build pass, a layer computes where its weights are (the primary copy in cross-replica
// context, which need not be the first worker device under CentralStorage).
void move_to_weights(const VariableList& own, std::vector<Tensor>* xs) {
  if (own.empty()) {
    for (auto& x : *xs)
      if (x.device() != xs->front().device()) x = x.to(xs->front().device());
    return;
  }
  const DeviceSpec d = own.front()->value().device();
  for (auto& x : *xs)
    if (x.device() != d) x = x.to(d);
}
std::vector<Shape> per_example(const std::vector<Tensor>& ys) {
  std::vector<Shape> out;
  for (const auto& y : ys) {
    std::vector<int64_t> d = y.shape().dims();
    if (!d.empty()) d.erase(d.begin());
    out.emplace_back(std::move(d));
  }
  return out;
}
}  // namespace

Tensor Layer::operator()(const Tensor& x, bool training) {
  std::vector<Tensor> ys = (*this)(std::vector<Tensor>{x}, training);
  if (ys.size() != 1)
    throw InvalidArgument("layer '" + path() + "' returns " + std::to_string(ys.size()) +
                          " tensors; call it on a list of inputs to get them all");
  return ys[0];
}

std::vector<Tensor> Layer::operator()(const std::vector<Tensor>& xs, bool training) {
  // An op's shape error names the innermost layer it came from ("layer 'encoder/dense' (Dense):
  // matmul: inner dimensions differ: ..."); outer layers pass it on as it is.
  try {
    return call_checked(xs, training);
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    const std::string body = m.rfind("InvalidArgument: ", 0) == 0 ? m.substr(17) : m;
    if (body.rfind("layer '", 0) == 0 || path().empty()) throw;
    throw InvalidArgument("layer '" + path() + "' (" + class_name() + "): " + body);
  }
}

std::vector<Tensor> Layer::call_checked(const std::vector<Tensor>& xs, bool training) {
  if (!built_) {
    std::vector<Shape> shapes;
    for (const auto& x : xs) shapes.push_back(x.shape());
    build(shapes);
  }
  if (!t_build_pass && shard_parameters_) return call_gathered(xs, training);
  if (recompute_ && training && !t_build_pass)
    return ::dtrain::recompute_grad(
        [this, training](const std::vector<Tensor>& in) { return call(in, training); }, xs,
        trainable_variables());
  if (!t_build_pass) return call(xs, training);
  std::vector<Tensor> moved = xs;
  move_to_weights(weights_, &moved);
  std::vector<Tensor> ys = call(moved, training);
  output_shapes_ = per_example(ys);
  return ys;
}

std::vector<Tensor> Layer::call_gathered(const std::vector<Tensor>& xs, bool training) {
  const VariableList vars = trainable_variables();
  for (const auto& v : variables())
    if (v->parameter_gatherer() && std::find(vars.begin(), vars.end(), v) == vars.end())
      throw Unimplemented("layer '" + path() + "' is frozen (set_trainable(false)) but its " +
                          "variable '" + v->name() + "' is sharded (Sharding::kParameters): " +
                          "freeze layers under Sharding::kNone or kOptimizerState, or keep them " +
                          "trainable");
  // The variables the strategy can keep sharded (float32, made under a sharding strategy); the
  // others of the layer stay whole.
  std::shared_ptr<ParameterGatherer> gatherer;  // alive for this call
  VariableList sharded;
  for (const auto& v : vars)
    if (std::shared_ptr<ParameterGatherer> g = v->parameter_gatherer();
        g && (!gatherer || g == gatherer)) {
      gatherer = std::move(g);
      sharded.push_back(v);
    }
  auto plain = [this, training](const std::vector<Tensor>& in) { return call(in, training); };
  if (!gatherer) {
    if (recompute_ && training) return ::dtrain::recompute_grad(plain, xs, vars);
    return call(xs, training);
  }
  std::vector<Tensor> watched = xs;
  for (const auto& v : vars) watched.push_back(v->value());
  const bool recording = training && tape::should_record(watched);
  gatherer->gather(sharded);
  // Released when the call returns, unless a tape keeps the gathered values for the backward
  // pass (no recompute_grad): then the strategy releases them at the end of the update.
  struct Release {
    ParameterGatherer* g;  // (`gatherer` outlives it)
    const VariableList* v;
    ~Release() {
      if (v) g->release(*v);
    }
  } release{gatherer.get(), recording && !recompute_ ? nullptr : &sharded};
  // The backward pass's replay gathers again (FSDP's backward). A tape may run it after the
  // strategy is gone: then the variables are whole again (ParameterGatherer) and need nothing.
  if (recompute_ && training) {
    const std::weak_ptr<ParameterGatherer> weak = gatherer;
    return ::dtrain::recompute_grad(plain, xs, vars,
                                    RecomputeHooks{[weak, sharded] {
                                                     if (auto g = weak.lock()) g->gather(sharded);
                                                   },
                                                   [weak, sharded] {
                                                     if (auto g = weak.lock()) g->release(sharded);
                                                   }});
  }
  return call(xs, training);
}

KerasTensor Layer::operator()(const KerasTensor& x) { return (*this)(std::vector<KerasTensor>{x}); }

KerasTensor Layer::operator()(const std::vector<KerasTensor>& xs) {
  std::vector<KerasTensor> out = apply(xs);
  if (out.size() != 1)
    throw InvalidArgument("layer '" + name_ + "' has " + std::to_string(out.size()) +
                          " outputs; use layer.apply(inputs) to get them all");
  return out[0];
}

std::vector<KerasTensor> Layer::apply(const std::vector<KerasTensor>& xs) {
  std::shared_ptr<Layer> self = weak_from_this().lock();
  if (!self)
    throw InvalidArgument("layer '" + name_ +
                          "' is called on KerasTensors but is not owned by a std::shared_ptr: "
                          "make it with std::make_shared so that the model can keep it");
  if (xs.empty()) throw InvalidArgument("layer '" + name_ + "' called on no inputs");
  std::vector<Tensor> zeros;
  for (const auto& x : xs) {
    if (!x.defined()) throw InvalidArgument("layer '" + name_ + "' called on an undefined input");
    zeros.push_back(Tensor::zeros(Shape(with_batch(x.shape(), 1)), x.dtype()));
  }
  // A pass on one zero example gives the output shapes (and the layer's error, if they do not
  // fit); whatever it built is unbuilt after, so weights are made once, under their final names,
  // when the model is built.
  std::vector<Layer*> unbuilt;
  collect_unbuilt(&unbuilt);
  std::vector<Tensor> ys;
  try {
    ShapePassCreator creator;
    VariableCreatorScope scope(&creator);
    detail::BuildPass pass;
    ys = (*this)(zeros, false);
  } catch (...) {
    for (Layer* l : unbuilt) l->unbuild();
    throw;
  }
  for (Layer* l : unbuilt) l->unbuild();
  auto node = std::make_shared<detail::Node>();
  node->id = detail::Node::next_id();
  node->layer = self;
  node->inputs = xs;
  node->shapes = per_example(ys);
  for (const auto& y : ys) node->dtypes.push_back(y.dtype());
  output_shapes_ = node->shapes;
  std::vector<KerasTensor> out;
  for (size_t i = 0; i < ys.size(); ++i) out.push_back(KerasTensor(node, static_cast<int>(i)));
  return out;
}

void Layer::collect_unbuilt(std::vector<Layer*>* out) {
  if (!built_) out->push_back(this);
  for (auto& c : children_) c->collect_unbuilt(out);
}

void Layer::unbuild() {
  built_ = false;
  weights_.clear();
}

VariableList Layer::variables() const {
  VariableList out;
  std::vector<const Layer*> seen;
  collect_variables(&out, &seen);
  return out;
}

void Layer::collect_variables(VariableList* out, std::vector<const Layer*>* seen) const {
  if (std::find(seen->begin(), seen->end(), this) != seen->end()) return;
  seen->push_back(this);
  for (const auto& w : weights_)
    if (std::find(out->begin(), out->end(), w) == out->end()) out->push_back(w);
  for (const auto& c : children_) c->collect_variables(out, seen);
}

VariableList Layer::trainable_variables() const {
  VariableList out;
  if (!trainable_) return out;
  // The variables of trainable layers: a frozen sublayer's subtree is left out.
  std::vector<const Layer*> seen;
  const std::function<void(const Layer&)> walk = [&](const Layer& l) {
    if (!l.trainable_ || std::find(seen.begin(), seen.end(), &l) != seen.end()) return;
    seen.push_back(&l);
    for (const auto& w : l.weights_)
      if (w->trainable() && std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
    for (const auto& c : l.children_) walk(*c);
  };
  walk(*this);
  return out;
}

VariableList Layer::non_trainable_variables() const {
  const VariableList trainable = trainable_variables();
  VariableList out;
  for (auto& v : variables())
    if (std::find(trainable.begin(), trainable.end(), v) == trainable.end()) out.push_back(v);
  return out;
}

void Layer::set_trainable(bool trainable) {
  trainable_ = trainable;
  for (const auto& c : children_) c->set_trainable(trainable);
}

int64_t Layer::count_params() const {
  int64_t n = 0;
  for (const auto& v : variables()) n += v->shape().numel();
  return n;
}

std::shared_ptr<Variable> Layer::add_weight(const std::string& name, const Shape& shape,
                                            Initializer init, bool trainable,
                                            VariableSynchronization sync, VariableAggregation agg) {
  VariableSpec spec;
  spec.name = path() + "/" + name;
  spec.shape = shape;
  spec.initializer = std::move(init);
  spec.trainable = trainable;
  spec.synchronization = sync;
  spec.aggregation = agg;
  auto v = create_variable(spec);
  weights_.push_back(v);
  return v;
}

}  // namespace dtrain
