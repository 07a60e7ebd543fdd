#include "dtrain/model/initializers.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/usable_cores.h"
#include "dtrain/core/random.h"

namespace dtrain::initializers {
namespace {

// How a random initializer fills: `fill(rng, shape, first, count, out)` writes elements
// [first, first + count) of the tensor to out[0, count), element i from element i of the stream, so
// the values depend only on the seed, the stream and i, never on how the tensor is cut.
using RangeFill = std::function<void(const Philox&, const Shape&, int64_t, int64_t, float*)>;

// An initializer that fills a host vector and copies it to the device. Tensors of a million
// elements and more are filled in ranges by up to 8 threads (one per usable core): GPT-2's 124 M
// normals took 6 s on one thread (double-precision log and cos per element).
Initializer from_host(RangeFill fill) {
  const Philox rng = global_next_stream();
  return [rng, fill](const Shape& shape, DType dtype, DeviceSpec device) {
    if (dtype != DType::kFloat32)
      throw InvalidArgument(std::string("initializers produce float32 variables, got ") +
                            dtype_name(dtype));
    const int64_t n = shape.numel();
    std::vector<float> v(static_cast<size_t>(n));
    const Philox mine = rng.fork(initializer_branch());  // ensemble members draw their own weights
    constexpr int64_t kPerThread = int64_t{1} << 19;
    const int threads = static_cast<int>(std::min<int64_t>(
        {detail::usable_cores(), 8, n >= (int64_t{1} << 20) ? n / kPerThread : 1}));
    if (threads <= 1) {
      if (n > 0) fill(mine, shape, 0, n, v.data());
    } else {
      // Ranges start at multiples of 4, so that no Philox block is split between two of them. The
      // calling thread fills range 0; when a thread cannot be started, it fills that range too.
      const int64_t per = (n / threads + 3) / 4 * 4;
      auto range = [&](int t) {
        const int64_t first = std::min(n, t * per);
        const int64_t count = t == threads - 1 ? n - first : std::min(per, n - first);
        if (count > 0) fill(mine, shape, first, count, v.data() + first);
      };
      std::vector<std::thread> pool;
      std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
      std::vector<int> left;  // ranges no thread took
      for (int t = 1; t < threads; ++t) {
        try {
          pool.emplace_back([&, t] {
            try {
              range(t);
            } catch (...) {
              errors[static_cast<size_t>(t)] = std::current_exception();
            }
          });
        } catch (const std::system_error&) {
          left.push_back(t);
        }
      }
      try {
        range(0);
        for (int t : left) range(t);
      } catch (...) {
        errors[0] = std::current_exception();
      }
      for (auto& th : pool) th.join();
      for (const auto& e : errors)
        if (e) std::rethrow_exception(e);
    }
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
  return from_host([](const Philox& rng, const Shape& s, int64_t first, int64_t count, float* v) {
    double fi, fo;
    compute_fans(s, &fi, &fo);
    const float limit = static_cast<float>(std::sqrt(6.0 / (fi + fo)));
    rng.uniform_fill(static_cast<uint64_t>(first), count, v);
    for (int64_t j = 0; j < count; ++j) v[j] = (2.f * v[j] - 1.f) * limit;
  });
}

Initializer he_normal() { return variance_scaling(2.0, "fan_in", "truncated_normal"); }

Initializer variance_scaling(double scale, const std::string& mode,
                             const std::string& distribution) {
  if (!(scale > 0))
    throw InvalidArgument("variance_scaling: scale must be > 0, got " + std::to_string(scale));
  if (mode != "fan_in" && mode != "fan_out" && mode != "fan_avg")
    throw InvalidArgument("variance_scaling: mode '" + mode +
                          "' is not one of fan_in, fan_out, fan_avg");
  if (distribution != "truncated_normal" && distribution != "untruncated_normal" &&
      distribution != "uniform")
    throw InvalidArgument("variance_scaling: distribution '" + distribution +
                          "' is not one of truncated_normal, untruncated_normal, uniform");
  const int m = mode == "fan_in" ? 0 : mode == "fan_out" ? 1 : 2;
  const int d = distribution == "truncated_normal"     ? 0
                : distribution == "untruncated_normal" ? 1
                                                       : 2;
  return from_host(
      [scale, m, d](const Philox& rng, const Shape& s, int64_t first, int64_t count, float* v) {
        double fi, fo;
        compute_fans(s, &fi, &fo);
        const double n = m == 0 ? fi : m == 1 ? fo : (fi + fo) / 2;
        if (d == 2) {
          const float limit = static_cast<float>(std::sqrt(3.0 * scale / n));
          rng.uniform_fill(static_cast<uint64_t>(first), count, v);
          for (int64_t j = 0; j < count; ++j) v[j] = (2.f * v[j] - 1.f) * limit;
          return;
        }
        const float stddev = static_cast<float>(d == 0 ? std::sqrt(scale / n) / 0.87962566103423978
                                                       : std::sqrt(scale / n));
        rng.normal_fill(static_cast<uint64_t>(first), count, v);
        if (d == 1) {
          for (int64_t j = 0; j < count; ++j) v[j] *= stddev;
          return;
        }
        const uint64_t total = static_cast<uint64_t>(s.numel());
        for (int64_t j = 0; j < count; ++j) {
          // Redraw outside two standard deviations, from further along the same stream.
          const uint64_t i = static_cast<uint64_t>(first + j);
          float z = v[j];
          for (uint64_t k = 1; !(std::fabs(z) <= 2.f); ++k) z = rng.normal(i + k * total);
          v[j] = z * stddev;
        }
      });
}

Initializer random_uniform(float low, float high) {
  return from_host(
      [low, high](const Philox& rng, const Shape&, int64_t first, int64_t count, float* v) {
        rng.uniform_fill(static_cast<uint64_t>(first), count, v);
        for (int64_t j = 0; j < count; ++j) v[j] = low + (high - low) * v[j];
      });
}

Initializer random_normal(float mean, float stddev) {
  return from_host(
      [mean, stddev](const Philox& rng, const Shape&, int64_t first, int64_t count, float* v) {
        rng.normal_fill(static_cast<uint64_t>(first), count, v);
        for (int64_t j = 0; j < count; ++j) v[j] = mean + stddev * v[j];
      });
}

}  // namespace dtrain::initializers
