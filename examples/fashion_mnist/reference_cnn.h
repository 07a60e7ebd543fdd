// The reference CNN of the Fashion-MNIST example (also used by the equivalence tests):
// Conv2D(32, 3x3, valid)+ReLU, MaxPool 2x2, Conv2D(64, 3x3, valid)+ReLU, MaxPool 2x2, Flatten,
// Dense(128)+ReLU, Dense(10). No strategy-specific code: build it inside strategy.scope().
#pragma once

#include <memory>

#include "dtrain/nn/layers.h"

namespace dtrain::examples {

inline Sequential reference_cnn() {
  Sequential m;
  m.add(std::make_shared<Conv2D>(32, 3, 3, Activation::kRelu, ops::Padding::kValid, 1, true,
                                 "conv1"));
  m.add(std::make_shared<MaxPool2D>(2, 2, ops::Padding::kValid, "pool1"));
  m.add(std::make_shared<Conv2D>(64, 3, 3, Activation::kRelu, ops::Padding::kValid, 1, true,
                                 "conv2"));
  m.add(std::make_shared<MaxPool2D>(2, 2, ops::Padding::kValid, "pool2"));
  m.add(std::make_shared<Flatten>());
  m.add(std::make_shared<Dense>(128, Activation::kRelu, true, "dense1"));
  m.add(std::make_shared<Dense>(10, Activation::kNone, true, "logits"));
  return m;
}

}  // namespace dtrain::examples
