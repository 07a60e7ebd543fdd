// The smallest program a dtrain user writes: a model built in a strategy's scope and trained with
// fit() on two logical CPU devices, and a typed error caught across the library boundary.
#include <cstdio>
#include <vector>

#include "dtrain/dtrain.h"

int main() {
  const std::vector<dtrain::DeviceSpec> devices = dtrain::parse_devices_flag("cpu:2");
  try {
    dtrain::make_strategy("no_such_strategy", {});
    std::puts("FAIL: an unknown strategy was accepted");
    return 1;
  } catch (const dtrain::InvalidArgument& e) {
    std::printf("typed error across the library boundary: %s\n", e.what());
  }

  // y = 1 when x0 + x1 > 0, else 0: separable, so a small MLP learns it in a few epochs.
  const int64_t n = 512;
  std::vector<float> x(static_cast<size_t>(n) * 2);
  std::vector<int32_t> y(static_cast<size_t>(n));
  dtrain::Philox rng(7, 0);
  for (int64_t i = 0; i < n; ++i) {
    const float a = rng.uniform(static_cast<uint64_t>(2 * i)) * 2 - 1;
    const float b = rng.uniform(static_cast<uint64_t>(2 * i + 1)) * 2 - 1;
    x[static_cast<size_t>(2 * i)] = a;
    x[static_cast<size_t>(2 * i + 1)] = b;
    y[static_cast<size_t>(i)] = a + b > 0 ? 1 : 0;
  }
  auto data = dtrain::Dataset::from_tensor_slices(
      {dtrain::Tensor::from_vector<float>(x, dtrain::Shape{n, 2}),
       dtrain::Tensor::from_vector<int32_t>(y, dtrain::Shape{n})});

  dtrain::StrategyOptions options;
  options.devices = devices;
  auto strategy = dtrain::make_strategy("mirrored", options);
  dtrain::Sequential model;
  std::unique_ptr<dtrain::Optimizer> optimizer;
  {
    auto scope = strategy->scope();
    model.add(std::make_unique<dtrain::Dense>(16, dtrain::Activation::kRelu));
    model.add(std::make_unique<dtrain::Dense>(2));
    optimizer = std::make_unique<dtrain::Adam>(0.05f);
  }
  dtrain::FitOptions fit;
  fit.epochs = 5;
  fit.global_batch_size = 64;
  const dtrain::History h = dtrain::fit(*strategy, model, *optimizer, data, &data, fit);
  std::printf("replicas %d, loss %.4f -> %.4f, accuracy %.3f\n", strategy->num_replicas_in_sync(),
              h.epoch_loss.front(), h.epoch_loss.back(), h.test_accuracy);
  if (strategy->num_replicas_in_sync() != 2 || !(h.epoch_loss.back() < h.epoch_loss.front()) ||
      h.test_accuracy < 0.9) {
    std::puts("FAIL: training did not converge");
    return 1;
  }
  std::puts("consumer OK");
  return 0;
}
