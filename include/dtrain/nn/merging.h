// Keras' merging layers, for functional models: each takes two or more tensors.
//   Add: the elementwise sum (shapes broadcast as numpy's); Multiply: the product;
//   Concatenate: joined along `axis` (default the last, channels in NHWC).
// Each throws InvalidArgument, naming the layer and the shapes, for one input or shapes that do
// not fit.
#pragma once

#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/nn/layer.h"

namespace dtrain {

class DTRAIN_API Add : public Layer {
 public:
  explicit Add(std::string name = "add") : Layer(std::move(name)) {}
  std::string class_name() const override { return "Add"; }
  // Add followed by a ReLU activation layer (a residual block's end) runs as ops::add_relu: one
  // pass over the data, and the sum is not stored.
  FusedCall fuse_with_next(const Layer& next) override;

 protected:
  using Layer::call;
  std::vector<Tensor> call(const std::vector<Tensor>& xs, bool training) override;
};

class DTRAIN_API Multiply : public Layer {
 public:
  explicit Multiply(std::string name = "multiply") : Layer(std::move(name)) {}
  std::string class_name() const override { return "Multiply"; }

 protected:
  using Layer::call;
  std::vector<Tensor> call(const std::vector<Tensor>& xs, bool training) override;
};

class DTRAIN_API Concatenate : public Layer {
 public:
  explicit Concatenate(int axis = -1, std::string name = "concatenate")
      : Layer(std::move(name)), axis_(axis) {}
  std::string class_name() const override { return "Concatenate"; }

 protected:
  using Layer::call;
  std::vector<Tensor> call(const std::vector<Tensor>& xs, bool training) override;

 private:
  int axis_;
};

}  // namespace dtrain
