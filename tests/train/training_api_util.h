// The fixture and models training_api_test's files share: a 3-class problem from 4 features, a
// small MLP, and a per-test temporary directory.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/dtrain.h"

namespace dtrain::train_test {

namespace fs = std::filesystem;

class TrainingApi : public ::testing::Test {
 protected:
  void SetUp() override {
    configure_devices({4, 1});
    dir_ = fs::temp_directory_path() /
           ("dtrain_train_api_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  static MirroredOptions on(int n) {
    MirroredOptions o;
    for (int i = 0; i < n; ++i) o.devices.push_back(DeviceSpec::cpu(i));
    return o;
  }
  fs::path dir_;
};

// 3 classes from 4 features, learnable: the class is the argmax of a fixed linear map.
inline Dataset classification(int64_t n, uint64_t seed = 5) {
  Philox rng(seed, 0);
  std::vector<float> x(static_cast<size_t>(n * 4));
  std::vector<int32_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float s[3] = {0, 0, 0};
    for (int j = 0; j < 4; ++j) {
      const float v = 2.f * rng.uniform(static_cast<uint64_t>(i * 4 + j)) - 1.f;
      x[static_cast<size_t>(i * 4 + j)] = v;
      s[0] += v * (j % 2 ? 1.f : -1.f);
      s[1] += v * (j < 2 ? 1.f : -1.f);
      s[2] += v * 0.3f;
    }
    y[static_cast<size_t>(i)] = static_cast<int32_t>(std::max_element(s, s + 3) - s);
  }
  return Dataset::from_tensors(
      {Tensor::from_vector(x, Shape{n, 4}), Tensor::from_vector(y, Shape{n})});
}

inline Sequential mlp(int out = 3) {
  Sequential m;
  m.add(std::make_shared<Dense>(16, Activation::kRelu));
  m.add(std::make_shared<Dense>(out));
  return m;
}

// The test model and its optimizer, made inside `s`'s scope (as user code does).
template <typename MakeOptimizer>
std::pair<Sequential, std::unique_ptr<Optimizer>> build(Strategy& s, MakeOptimizer make_optimizer,
                                                        int outputs = 3) {
  auto scope = s.scope();
  Sequential m = mlp(outputs);
  return {std::move(m), make_optimizer()};
}

// The same after set_global_seed(seed), with a Dropout after it when dropout > 0 (its random state
// goes into checkpoints), built for 4 features.
template <typename MakeOptimizer>
std::pair<Sequential, std::unique_ptr<Optimizer>> build_seeded(Strategy& s, uint64_t seed,
                                                               float dropout,
                                                               MakeOptimizer make_optimizer) {
  auto scope = s.scope();
  set_global_seed(seed);
  Sequential m = mlp();
  if (dropout > 0) m.add(std::make_shared<Dropout>(dropout));
  m.build(Shape{1, 4});
  return {std::move(m), make_optimizer()};
}

inline std::vector<std::vector<float>> weights(Model& m) {
  std::vector<std::vector<float>> w;
  for (const auto& v : m.variables())
    w.push_back(v->value().to(DeviceSpec::cpu()).to_vector<float>());
  return w;
}

}  // namespace dtrain::train_test
