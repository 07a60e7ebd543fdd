#include "dtrain/model/initializers.h"

#include <cmath>

#include "dtrain/core/random.h"

namespace dtrain::initializers {
namespace {

// An initializer that fills a host vector and copies it to the device: `fill(rng, shape, v)` writes
// all shape.numel() values of v, element i from element i of the stream (so the values depend only
// on the seed, the stream and i).
Initializer from_host(std::function<void(const Philox&, const Shape&, std::vector<float>&)> fill) {
  const Philox rng = global_next_stream();
  return [rng, fill](const Shape& shape, DType dtype, DeviceSpec device) {
    if (dtype != DType::kFloat32)
      throw InvalidArgument(std::string("initializers produce float32 variables, got ") +
                            dtype_name(dtype));
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    const Philox mine = rng.fork(initializer_branch());  // ensemble members draw their own weights
    if (!v.empty()) fill(mine, shape, v);
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
  return from_host([](const Philox& rng, const Shape& s, std::vector<float>& v) {
    double fi, fo;
    compute_fans(s, &fi, &fo);
    const float limit = static_cast<float>(std::sqrt(6.0 / (fi + fo)));
    rng.uniform_fill(0, static_cast<int64_t>(v.size()), v.data());
    for (float& x : v) x = (2.f * x - 1.f) * limit;
  });
}

Initializer he_normal() {
  return from_host([](const Philox& rng, const Shape& s, std::vector<float>& v) {
    double fi, fo;
    compute_fans(s, &fi, &fo);
    const float stddev = static_cast<float>(std::sqrt(2.0 / fi) / 0.87962566103423978);
    const uint64_t n = v.size();
    rng.normal_fill(0, static_cast<int64_t>(n), v.data());
    for (uint64_t i = 0; i < n; ++i) {
      // Redraw outside two standard deviations, from further along the same stream.
      float z = v[i];
      for (uint64_t k = 1; std::fabs(z) > 2.f; ++k) z = rng.normal(i + k * n);
      v[i] = z * stddev;
    }
  });
}

Initializer random_uniform(float low, float high) {
  return from_host([low, high](const Philox& rng, const Shape&, std::vector<float>& v) {
    rng.uniform_fill(0, static_cast<int64_t>(v.size()), v.data());
    for (float& x : v) x = low + (high - low) * x;
  });
}

Initializer random_normal(float mean, float stddev) {
  return from_host([mean, stddev](const Philox& rng, const Shape&, std::vector<float>& v) {
    rng.normal_fill(0, static_cast<int64_t>(v.size()), v.data());
    for (float& x : v) x = mean + stddev * x;
  });
}

}  // namespace dtrain::initializers
