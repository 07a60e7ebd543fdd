// Model: a layer that training accepts (fit, evaluate, predict, predict_ensemble, Checkpoint,
// callbacks, elastic::run, SidecarEvaluator, the Horovod API). Made in one of Keras' three ways:
//
//   // functional: Input -> layer calls -> Model(inputs, outputs)
//   auto conv = std::make_shared<Conv2D>(16, 3, 3, Activation::kRelu);
//   auto shortcut = std::make_shared<Conv2D>(16, 1, 1);
//   auto add = std::make_shared<Add>();
//   auto flatten = std::make_shared<Flatten>();
//   auto dense = std::make_shared<Dense>(10);
//   KerasTensor in = Input({28, 28, 1});
//   KerasTensor x = (*conv)(in);
//   KerasTensor y = (*add)({x, (*shortcut)(x)});
//   Model model(in, (*dense)((*flatten)(y)));
//
//   // subclassed: make the layers in the constructor, override call()
//   class Net : public Model {
//    public:
//     Net() : Model("net") { fc = register_layer(std::make_shared<Dense>(10), "fc"); }
//    protected:
//     Tensor call(const Tensor& x, bool training) override { return (*fc)(ops::flatten(x)); }
//     std::shared_ptr<Dense> fc;
//   };
//
//   // a stack: Sequential (below)
//
// Build inside strategy.scope() (model.build(...), or let fit() do it), so that the strategy makes
// the weights. A functional model knows its input shapes; the others are built from one example's
// shape, by running a zero example through call().
//
// Thread-safety: as Layer. summary() may run at any time after build.
#pragma once

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/nn/layer.h"

namespace dtrain {

class DTRAIN_API Model : public Layer {
 public:
  // For subclasses: register layers in the constructor and override call() (the one-tensor form,
  // or the several-tensors form for `num_inputs` > 1 inputs or several outputs). Throws
  // InvalidArgument for num_inputs < 1.
  explicit Model(std::string name = "model", int num_inputs = 1);
  // Functional: every output must be computed from `inputs` only. Throws InvalidArgument for an
  // empty list, an undefined tensor, an output that needs an Input not in `inputs`, or the same
  // Input twice.
  Model(std::vector<KerasTensor> inputs, std::vector<KerasTensor> outputs,
        std::string name = "functional");
  Model(const KerasTensor& input, const KerasTensor& output, std::string name = "functional")
      : Model(std::vector<KerasTensor>{input}, std::vector<KerasTensor>{output}, std::move(name)) {}
  Model(const KerasTensor& input, std::vector<KerasTensor> outputs, std::string name = "functional")
      : Model(std::vector<KerasTensor>{input}, std::move(outputs), std::move(name)) {}

  std::string class_name() const override { return functional() ? "Functional" : "Model"; }
  bool functional() const { return !graph_inputs_.empty(); }

  using Layer::build;
  // A functional model's build: its Input shapes at batch 1. Throws FailedPrecondition for a model
  // that is not functional (give it the input shape).
  void build();

  // Inputs the model takes (a subclass says in its constructor) and outputs it returns (a
  // subclass: as many as its call() returned when the model was built; 1 before).
  int num_inputs() const;
  int num_outputs() const;
  // The names of the outputs: the layers that produce them (functional); else "output", or
  // "output_1", "output_2", ... for several, as Keras names them.
  // fit() names per-output losses and metrics after them when there are several.
  std::vector<std::string> output_names() const;
  const std::vector<KerasTensor>& inputs() const { return graph_inputs_; }
  const std::vector<KerasTensor>& outputs() const { return graph_outputs_; }

  // Keras' table: each layer (name and class), its output shape, its parameter count (and, for a
  // functional model, the layers it reads), then the totals. Call after build.
  void summary(std::ostream& out) const;
  void summary() const;  // to stdout

 protected:
  bool is_model() const override { return true; }
  // Builds the sublayers by running a zero example through call().
  void build_weights(const std::vector<Shape>& input_shapes) override;
  // Functional: runs the graph. Others: the several-inputs form hands one input to the one-input
  // form, which a subclass overrides.
  Tensor call(const Tensor& x, bool training) override;
  std::vector<Tensor> call(const std::vector<Tensor>& xs, bool training) override;
  // Called at the end of build, once every sublayer is built (Sequential plans its fusions here).
  virtual void after_build() {}

 private:
  void plan_fusions();
  std::vector<Tensor> run_graph(const std::vector<Tensor>& xs, bool training);
  int subclass_inputs_ = 1;
  std::vector<KerasTensor> graph_inputs_, graph_outputs_;
  std::vector<std::shared_ptr<detail::Node>> nodes_;  // layer nodes in topological order
  // Fusion plan over nodes_: fused_into_[i] >= 0 when node i runs inside that later node.
  std::vector<int> fused_into_;
  std::vector<FusedCall> fused_call_;  // by the node that runs the pair
};

// A linear stack of layers (keras.Sequential), each taking the previous one's output. Layer names
// are made unique as Keras does ("dense", "dense_1"), so variable names ("dense_1/kernel") identify
// a weight in checkpoints.
class DTRAIN_API Sequential : public Model {
 public:
  Sequential() : Model("sequential") {}
  explicit Sequential(std::vector<std::shared_ptr<Layer>> layers);
  std::string class_name() const override { return "Sequential"; }
  // Throws FailedPrecondition after build() or for a layer that is already built and whose name
  // is taken; InvalidArgument for a null layer.
  Sequential& add(std::shared_ptr<Layer> layer);

 protected:
  Tensor call(const Tensor& x, bool training) override;
  void after_build() override;

 private:
  std::vector<FusedCall> fused_;  // fused_[i]: layer i runs together with layer i + 1
};

}  // namespace dtrain
