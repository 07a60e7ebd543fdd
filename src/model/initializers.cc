#include "dtrain/model/initializers.h"

#include <cmath>

#include "dtrain/core/random.h"

namespace dtrain::initializers {
namespace {

Initializer from_host(std::function<float(const Philox&, int64_t, const Shape&)> f) {
  const Philox rng = global_next_stream();
  return [rng, f](const Shape& shape, DType dtype, DeviceSpec device) {
    if (dtype != DType::kFloat32)
      throw InvalidArgument(std::string("initializers produce float32 variables, got ") +
                            dtype_name(dtype));
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    const Philox mine = rng.fork(initializer_branch());  // ensemble members draw their own weights
    for (int64_t i = 0; i < shape.numel(); ++i) v[static_cast<size_t>(i)] = f(mine, i, shape);
    return Tensor::from_vector(v, shape, device);
  };
}

}  // namespace

void compute_fans(const Shape& s, double* fan_in, double* fan_out) {
  if (s.rank() < 1) {
    *fan_in = *fan_out = 1;
  } else if (s.rank() == 1) {
    *fan_in = *fan_out = static_cast<double>(s[0]);
  } else if (s.rank() == 2) {
    *fan_in = static_cast<double>(s[0]);
    *fan_out = static_cast<double>(s[1]);
  } else {
    double receptive = 1;
    for (int i = 0; i < s.rank() - 2; ++i) receptive *= static_cast<double>(s[i]);
    *fan_in = receptive * static_cast<double>(s[-2]);
    *fan_out = receptive * static_cast<double>(s[-1]);
  }
}

Initializer zeros() { return constant(0.f); }
Initializer ones() { return constant(1.f); }

Initializer constant(float value) {
  return [value](const Shape& shape, DType dtype, DeviceSpec device) {
    if (dtype != DType::kFloat32)
      throw InvalidArgument(std::string("initializers produce float32 variables, got ") +
                            dtype_name(dtype));
    return Tensor::full(shape, value, device);
  };
}

Initializer glorot_uniform() {
  return from_host([](const Philox& rng, int64_t i, const Shape& s) {
    double fi, fo;
    compute_fans(s, &fi, &fo);
    const float limit = static_cast<float>(std::sqrt(6.0 / (fi + fo)));
    return (2.f * rng.uniform(static_cast<uint64_t>(i)) - 1.f) * limit;
  });
}

Initializer he_normal() {
  return from_host([](const Philox& rng, int64_t i, const Shape& s) {
    double fi, fo;
    compute_fans(s, &fi, &fo);
    const float stddev = static_cast<float>(std::sqrt(2.0 / fi) / 0.87962566103423978);
    // Redraw outside two standard deviations, from further along the same stream.
    const uint64_t n = static_cast<uint64_t>(s.numel());
    for (uint64_t k = 0;; ++k) {
      const float z = rng.normal(static_cast<uint64_t>(i) + k * n);
      if (std::fabs(z) <= 2.f) return z * stddev;
    }
  });
}

Initializer random_uniform(float low, float high) {
  return from_host([low, high](const Philox& rng, int64_t i, const Shape&) {
    return low + (high - low) * rng.uniform(static_cast<uint64_t>(i));
  });
}

Initializer random_normal(float mean, float stddev) {
  return from_host([mean, stddev](const Philox& rng, int64_t i, const Shape&) {
    return mean + stddev * rng.normal(static_cast<uint64_t>(i));
  });
}

}  // namespace dtrain::initializers
