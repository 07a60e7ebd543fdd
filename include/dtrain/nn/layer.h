// Layer: the unit models are built from (Keras' keras.layers.Layer, torch::nn::Module). A layer
// creates its weights lazily, on its first call or build(), always through create_variable(), so
// the strategy whose scope is active decides where they live; and it may own sublayers, registered
// by name (torch's register_module), which makes a model a tree:
//
//   class Block : public Layer {
//    public:
//     Block() : Layer("block") {
//       conv = register_layer(std::make_shared<Conv2D>(16, 3, 3), "conv");
//       bn = register_layer(std::make_shared<BatchNormalization>(), "bn");
//     }
//    protected:
//     Tensor call(const Tensor& x, bool training) override {
//       return ops::relu(ops::add(x, (*bn)((*conv)(x), training)));
//     }
//     std::shared_ptr<Conv2D> conv;
//     std::shared_ptr<BatchNormalization> bn;
//   };
//
// variables() is recursive and each variable's name is its path from the root model:
// "block/conv/kernel" (the root model's own name is left out, so a model's checkpoint keys do not
// depend on what the model is called). Sibling names are made unique as Keras does: a second
// "dense" becomes "dense_1".
//
// A layer takes one tensor or several and returns one or several: override call(const Tensor&) or
// call(const std::vector<Tensor>&). Called on KerasTensors (Input()), it records a node of a
// functional graph instead of computing (nn/model.h).
//
// Build models inside strategy.scope(), and build them (model.build(), or fit()) before training:
// building inside run() with more than one replica throws FailedPrecondition.
//
// Thread-safety: after build, operator() may run concurrently on several replica threads. Building
// and registering sublayers are not thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/model/ops.h"
#include "dtrain/model/variable.h"

namespace dtrain {

// kGelu: exact (keras' "gelu"); kGeluTanh: the tanh approximation (GPT-2's).
enum class Activation { kNone, kRelu, kTanh, kSigmoid, kGelu, kGeluTanh };
DTRAIN_API Tensor apply_activation(Activation a, const Tensor& x);
DTRAIN_API const char* activation_name(Activation a);

using VariableList = std::vector<std::shared_ptr<Variable>>;

class Layer;
namespace detail {
struct Node;
}

// A symbolic tensor of the functional API (Keras' KerasTensor): the per-example shape and dtype of
// what a layer will produce, and the graph node that produces it. Made by Input() and by calling a
// layer on KerasTensors; turned into a model by Model(inputs, outputs).
class DTRAIN_API KerasTensor {
 public:
  KerasTensor() = default;
  bool defined() const { return node_ != nullptr; }
  // The shape of one example (the batch dimension left out).
  const Shape& shape() const;
  DType dtype() const;
  // Keras' notation with the batch dimension: "(None, 32, 32, 3)".
  std::string to_string() const;
  // The layer that produced this tensor (nullptr for an Input) and which of its outputs it is.
  std::shared_ptr<Layer> layer() const;
  int output_index() const { return index_; }

  // Made by Input() and by layer calls; the node type is private to the library.
  KerasTensor(std::shared_ptr<detail::Node> node, int index)
      : node_(std::move(node)), index_(index) {}

 private:
  friend class Model;
  std::shared_ptr<detail::Node> node_;
  int index_ = 0;
};

// An input of a functional model: `shape` is one example's (keras.Input(shape=(32, 32, 3))).
// Throws InvalidArgument for a negative dimension.
DTRAIN_API KerasTensor Input(const Shape& shape, std::string name = "input_layer",
                             DType dtype = DType::kFloat32);

// How a pooling layer pools (what a layer before it may fuse with).
struct DTRAIN_API Pool2DSpec {
  int window_h = 2, window_w = 2, stride_h = 2, stride_w = 2;
  ops::Padding padding = ops::Padding::kValid;
};

class DTRAIN_API Layer : public std::enable_shared_from_this<Layer> {
 public:
  explicit Layer(std::string name);
  virtual ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
  // Moves keep the sublayers (`Sequential model = make_model();`); the moved-to layer is a root.
  // Do not move a layer that a model or a functional graph holds.
  Layer(Layer&& o) noexcept;
  Layer& operator=(Layer&& o) noexcept;

  // Builds on first use, then runs the layer on one tensor / on several. Throws InvalidArgument
  // when the layer takes another number of inputs, or when shapes do not fit its weights.
  Tensor operator()(const Tensor& x, bool training = false);
  std::vector<Tensor> operator()(const std::vector<Tensor>& xs, bool training = false);
  // Functional API: records a call on symbolic tensors and returns the (only) output. The layer
  // must be owned by a std::shared_ptr (make it with std::make_shared). Its weights are not made
  // here but when the Model is built. Throws InvalidArgument when the shapes do not fit, or when
  // the layer has several outputs (use apply()).
  KerasTensor operator()(const KerasTensor& x);
  KerasTensor operator()(const std::vector<KerasTensor>& xs);
  std::vector<KerasTensor> apply(const std::vector<KerasTensor>& xs);

  const std::string& name() const { return name_; }
  // The layer's path from its root ("conv2_block1/1_conv"); its variables are "<path>/<weight>".
  std::string path() const;
  // The class name summary() shows ("Dense").
  virtual std::string class_name() const { return "Layer"; }
  bool built() const { return built_; }
  // Creates the weights for inputs of `input_shape` (batch dimension included) / `input_shapes`.
  void build(const Shape& input_shape);
  void build(const std::vector<Shape>& input_shapes);

  // Every variable of this layer and its sublayers, depth-first in registration order, each once
  // (a layer used twice is counted once).
  VariableList variables() const;
  // The trainable ones: of trainable weights, in layers that are trainable (a layer set not
  // trainable gives none, whatever its sublayers say, as in Keras); the rest.
  VariableList trainable_variables() const;
  VariableList non_trainable_variables() const;
  // Keras' `layer.trainable = False`: freezes this layer and every sublayer (fine-tuning a base
  // model): their weights leave trainable_variables(), so fit() and the optimizer leave them
  // unchanged (no gradient is applied to them), and a BatchNormalization runs in inference mode
  // (its moving statistics unchanged), as in Keras 2+. Set it before fit() builds the optimizer
  // (Keras: before compile()). Not with Sharding::kParameters (the layer's call throws).
  void set_trainable(bool trainable);
  bool trainable() const { return trainable_; }
  // Direct sublayers, in registration order.
  const std::vector<std::shared_ptr<Layer>>& layers() const { return children_; }
  // The direct sublayer called `name`, or nullptr.
  std::shared_ptr<Layer> get_layer(const std::string& name) const;
  // Number of values in all variables, trainable or not (Keras' count_params()).
  int64_t count_params() const;
  // Per-example output shapes seen when the layer was last built or called on KerasTensors
  // (summary() prints them); empty before.
  const std::vector<Shape>& output_shapes() const { return output_shapes_; }

  // Activation recomputation (TF's tf.recompute_grad, PyTorch's torch.utils.checkpoint): while
  // on, a training call under a recording tape keeps only the layer's inputs, and the backward
  // pass runs the layer again to differentiate it (dtrain/model/recompute.h): the activations
  // inside it are not held between forward and backward. A flag on the layer rather than a
  // wrapper, so variable names, checkpoints and the model's structure do not change with it.
  // Gradients are bitwise the same; Dropout replays its masks and BatchNormalization updates its
  // moving statistics once.
  void set_recompute_grad(bool on) { recompute_ = on; }
  bool recompute_grad() const { return recompute_; }

  // Fully sharded parameters (ZeRO-3; PyTorch FSDP's wrapping of a module, FULL_SHARD): under a
  // strategy with Sharding::kParameters, this layer's trainable variables (its subtree's) are kept
  // as one part per replica between calls; a call in replica context gathers them (one
  // collective; the next layer's gather is prefetched) and releases them after. With
  // recompute_grad on too, nothing keeps the whole values between forward and backward: the
  // backward pass gathers them again (FSDP's reshard_after_forward); without it, the tape holds
  // them until backward. A no-op under other strategies. A flag, so names and checkpoints do not
  // change with it.
  void set_shard_parameters(bool on) { shard_parameters_ = on; }
  bool shard_parameters() const { return shard_parameters_; }

  // Random state a checkpoint keeps (Dropout: calls per local replica so far); -1 when none.
  virtual int64_t rng_calls() const { return -1; }
  virtual void set_rng_calls(int64_t /*calls*/) {}

  // Fusion, offered by the layer itself rather than found by a container: a max-pooling layer
  // describes its pooling, an activation layer its activation; a layer that can run together with
  // the layer after it (when nothing else reads its output) returns that combined call on its own
  // inputs, or an empty function. Containers run the pair through it once both are built (Conv2D
  // with ReLU followed by max pooling: one op; Add followed by a ReLU: one op).
  virtual std::optional<Pool2DSpec> max_pool_spec() const { return std::nullopt; }
  virtual std::optional<Activation> activation_spec() const { return std::nullopt; }
  using FusedCall = std::function<Tensor(const std::vector<Tensor>& xs, bool training)>;
  virtual FusedCall fuse_with_next(const Layer& /*next*/) { return {}; }

 protected:
  // Make the weights; override the one-input form, or the several-inputs form (whose default hands
  // a single input to the one-input form).
  virtual void build_weights(const Shape& /*input_shape*/) {}
  virtual void build_weights(const std::vector<Shape>& input_shapes);
  // The computation; override one of them. The several-inputs default hands a single input to the
  // one-input form; the one-input default throws (a layer that needs several inputs).
  virtual Tensor call(const Tensor& x, bool training);
  virtual std::vector<Tensor> call(const std::vector<Tensor>& xs, bool training);
  std::shared_ptr<Variable> add_weight(
      const std::string& name, const Shape& shape, Initializer init, bool trainable = true,
      VariableSynchronization sync = VariableSynchronization::kAuto,
      VariableAggregation agg = VariableAggregation::kNone);
  // Makes `layer` a sublayer, named `name` (empty: the layer's own name), made unique among the
  // siblings as Keras does ("dense", "dense_1"). Registering the same layer again returns it.
  // Returns the layer. Throws FailedPrecondition once this layer is built, and InvalidArgument for
  // a null layer or a layer that is an ancestor of this one.
  template <class L>
  std::shared_ptr<L> register_layer(std::shared_ptr<L> layer, const std::string& name = "") {
    add_child(layer, name);
    return layer;
  }
  // A model's sublayers are named from the model down: its own name is not part of the path.
  virtual bool is_model() const { return false; }

 private:
  friend class Model;
  void add_child(const std::shared_ptr<Layer>& layer, const std::string& name);
  std::string child_prefix() const;
  void collect_variables(VariableList* out, std::vector<const Layer*>* seen) const;
  // Layers of this subtree not yet built (so a shape pass can undo exactly what it built).
  void collect_unbuilt(std::vector<Layer*>* out);
  void unbuild();
  // operator() of a layer with shard_parameters(): gathers its variables around the call.
  std::vector<Tensor> call_gathered(const std::vector<Tensor>& xs, bool training);
  std::vector<Tensor> call_checked(const std::vector<Tensor>& xs, bool training);

  std::string name_;
  bool built_ = false;
  bool trainable_ = true;
  VariableList weights_;
  std::vector<std::shared_ptr<Layer>> children_;
  Layer* parent_ = nullptr;  // the first layer that registered this one; cleared when it dies
  bool recompute_ = false;
  bool shard_parameters_ = false;
  std::vector<Shape> output_shapes_;
};

namespace detail {
// While alive, layers called on this thread move their inputs to their weights' device (a build
// or shape pass in cross-replica context, where a variable reads as its primary copy) and record
// their output shapes.
class DTRAIN_API BuildPass {
 public:
  BuildPass();
  ~BuildPass();
  BuildPass(const BuildPass&) = delete;
  BuildPass& operator=(const BuildPass&) = delete;

 private:
  bool saved_;
};
}  // namespace detail

}  // namespace dtrain
