// The Fashion-MNIST training program shared by examples/fashion_mnist and examples/resnet; each
// gives its defaults (the flags override them).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::examples {

struct ImageClassifierExample {
  std::string title;
  std::string model = "reference_cnn";  // models.h: make_model
  int epochs = 5;
  int64_t batch_size = 64;
  float learning_rate = 1e-3f;
  std::string optimizer = "adam";
  std::string lr_schedule;  // empty: constant
  bool augment = false;
};

int image_classifier_main(int argc, char** argv, const ImageClassifierExample& example);

}  // namespace dtrain::examples
