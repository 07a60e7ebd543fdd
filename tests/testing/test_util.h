// Shared helpers for dtrain's unit tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/core/random.h"
#include "dtrain/core/tensor.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/initializers.h"
#include "dtrain/model/ops.h"
#include "dtrain/model/variable.h"
#include "dtrain/strategies/make_strategy.h"

namespace dtrain::testing {

// Every test process uses two logical CPU devices with one thread each.
inline void use_two_cpus() { configure_devices({2, 1}); }

// The strategy `name` on cpu:0, or on cpu:0 and cpu:1 for every strategy but one_device.
inline std::unique_ptr<Strategy> strategy_on_cpus(const std::string& name) {
  StrategyOptions o;
  o.devices = {DeviceSpec::cpu(0)};
  if (name != "one_device") o.devices.push_back(DeviceSpec::cpu(1));
  return make_strategy(name, o);
}

// n windows of t tokens of a repeating sequence over `vocab` ids, and their targets (each window
// shifted by one): a language-modelling task whose next token follows from the current one.
inline std::vector<Tensor> repeating_sequences(int64_t n, int64_t t, int32_t vocab) {
  std::vector<int32_t> x, y;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < t; ++k) {
      x.push_back(static_cast<int32_t>((i + k) % vocab));
      y.push_back(static_cast<int32_t>((i + k + 1) % vocab));
    }
  return {Tensor::from_vector<int32_t>(x, Shape{n, t}),
          Tensor::from_vector<int32_t>(y, Shape{n, t})};
}

// A non-trainable float32 variable of shape [1] holding v, with the given aggregation and
// synchronization.
inline VariableSpec scalar_spec(const std::string& name, float v, VariableAggregation agg,
                                VariableSynchronization sync = VariableSynchronization::kAuto) {
  VariableSpec s{name, Shape{1}, DType::kFloat32, initializers::constant(v)};
  s.aggregation = agg;
  s.synchronization = sync;
  s.trainable = false;
  return s;
}

inline Tensor random_tensor(const Shape& s, uint64_t stream, float lo = -1.f, float hi = 1.f,
                            DeviceSpec dev = DeviceSpec::cpu()) {
  Philox rng(1234, stream);
  std::vector<float> v(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = lo + (hi - lo) * rng.uniform(i);
  return Tensor::from_vector(v, s, dev);
}

// Values bounded away from zero (for relu/abs/log kinks): |x| in [0.1, 1].
inline Tensor away_from_zero(const Shape& s, uint64_t stream) {
  Philox rng(99, stream);
  std::vector<float> v(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    const float m = 0.1f + 0.9f * rng.uniform(2 * i);
    v[i] = rng.uniform(2 * i + 1) < 0.5f ? -m : m;
  }
  return Tensor::from_vector(v, s);
}

inline void expect_near(const std::vector<float>& a, const std::vector<float>& b, float tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tol) << "element " << i;
}

using OpFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Checks the tape's gradient of L = sum(f(inputs) * R) (R fixed random) against central
// differences in every element (at most `max_elems` per input) of each input marked in `check`.
inline void check_gradients(const OpFn& f, std::vector<Tensor> inputs, std::vector<bool> check,
                            float eps = 1e-3f, float tol = 2e-3f, int max_elems = 48) {
  std::vector<Tensor> analytic;
  Tensor r;
  {
    GradientTape tape;
    for (auto& x : inputs) tape.watch(x);
    Tensor y = f(inputs);
    r = random_tensor(y.shape(), 777);
    analytic = tape.gradient(ops::sum(ops::mul(y, r)), inputs);
  }
  const std::vector<float> rv = r.to_vector<float>();
  auto objective = [&] {
    const std::vector<float> y = f(inputs).to_vector<float>();
    double s = 0;
    for (size_t k = 0; k < y.size(); ++k) s += static_cast<double>(y[k]) * rv[k];
    return s;
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!check[i]) continue;
    ASSERT_TRUE(analytic[i].defined()) << "no gradient for input " << i;
    ASSERT_EQ(analytic[i].shape(), inputs[i].shape()) << "input " << i;
    const std::vector<float> a = analytic[i].to_vector<float>();
    float* x = inputs[i].data<float>();
    const int64_t n = inputs[i].numel();
    const int64_t stride = std::max<int64_t>(1, n / max_elems);
    for (int64_t j = 0; j < n; j += stride) {
      const float saved = x[j];
      x[j] = saved + eps;
      const double lp = objective();
      x[j] = saved - eps;
      const double lm = objective();
      x[j] = saved;
      const double numeric = (lp - lm) / (2.0 * eps);
      EXPECT_NEAR(a[static_cast<size_t>(j)], numeric, tol * std::max(1.0, std::fabs(numeric)))
          << "input " << i << " element " << j;
    }
  }
}

}  // namespace dtrain::testing
