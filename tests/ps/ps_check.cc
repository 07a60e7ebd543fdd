// A worker program for the parameter-server tests, run through dtrain-run as a real job.
//   ps_check counter <pushes>   each worker pushes a gradient of -1 to a zero scalar <pushes> times
//                               (SGD, lr 1); the chief prints {"value": V} once every worker is
//                               done.
//   ps_check stale <k> <pushes> <ms>  as counter, with max_staleness k; worker 1 sleeps <ms> per
//   step;
//                               every worker prints {"worker": i, "seconds": its time}
//   ps_check shards             creates variables under three partitioners and prints, as JSON,
//                               where each shard lives, its shape, and whether it reads back whole.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"
#include "dtrain/strategies/parameter_server_strategy.h"

namespace {

dtrain::Initializer arange() {
  return [](const dtrain::Shape& shape, dtrain::DType, dtrain::DeviceSpec) {
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
    return dtrain::Tensor::from_vector(v, shape);
  };
}

// A scalar "counter" variable, zero-initialised, on the parameter servers.
std::shared_ptr<dtrain::Variable> zero_scalar(dtrain::Strategy& strategy) {
  auto scope = strategy.scope();
  dtrain::VariableSpec spec;
  spec.name = "counter";
  spec.shape = dtrain::Shape{};
  spec.initializer = dtrain::initializers::zeros();
  return dtrain::create_variable(spec);
}

// Every worker pushes `pushes` times; worker 1 sleeps `sleep_ms` per step. Each prints its time.
int stale(int max_staleness, int pushes, int sleep_ms) {
  dtrain::ParameterServerOptions o;
  o.max_staleness = max_staleness;
  dtrain::ParameterServerStrategy strategy(o);
  const std::shared_ptr<dtrain::Variable> var = zero_scalar(strategy);
  const int me = strategy.cluster().worker_rank();
  dtrain::SGD sgd(1.0f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < pushes; ++i)
    strategy.run([&](dtrain::ReplicaContext&,
                     const std::vector<dtrain::Tensor>&) -> std::vector<dtrain::Tensor> {
      if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      sgd.apply_gradients({dtrain::Tensor::scalar(-1.f)}, {var});
      return {};
    });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"worker\": %d, \"seconds\": %.3f}\n", me, secs);
  std::fflush(stdout);
  strategy.finish_training();
  return 0;
}

int counter(int pushes) {
  dtrain::ParameterServerStrategy strategy;
  const std::shared_ptr<dtrain::Variable> var = zero_scalar(strategy);
  dtrain::SGD sgd(1.0f);
  for (int i = 0; i < pushes; ++i)
    strategy.run([&](dtrain::ReplicaContext&,
                     const std::vector<dtrain::Tensor>&) -> std::vector<dtrain::Tensor> {
      sgd.apply_gradients({dtrain::Tensor::scalar(-1.f)}, {var});
      return {};
    });
  strategy.finish_training();
  if (strategy.extended().is_chief())
    std::printf("{\"value\": %.1f, \"global_step\": %lld}\n",
                static_cast<double>(var->value().item()),
                static_cast<long long>(strategy.global_step()));
  return 0;
}

int shards() {
  struct Case {
    const char* name;
    dtrain::Partitioner partitioner;
    dtrain::Shape shape;
  };
  const Case cases[] = {
      {"fixed3", dtrain::fixed_shards_partitioner(3), dtrain::Shape{10, 4}},
      {"min_size", dtrain::min_size_partitioner(64, 4),
       dtrain::Shape{10, 4}},  // 160 B: 2 shards of >= 64 B
      {"max_size", dtrain::max_size_partitioner(48, 0),
       dtrain::Shape{10, 4}},  // 16 B rows: 3 rows max -> 4 shards
      {"scalar", dtrain::fixed_shards_partitioner(3), dtrain::Shape{}},
  };
  std::string out = "{";
  for (const Case& c : cases) {
    dtrain::ParameterServerOptions o;
    o.partitioner = c.partitioner;
    dtrain::ParameterServerStrategy strategy(o);
    std::shared_ptr<dtrain::Variable> var;
    {
      auto scope = strategy.scope();
      dtrain::VariableSpec spec;
      spec.name = c.name;
      spec.shape = c.shape;
      spec.initializer = arange();
      var = dtrain::create_variable(spec);
    }
    auto* sv = dynamic_cast<dtrain::ShardedVariable*>(var.get());
    if (!sv) {
      std::fprintf(stderr, "not a ShardedVariable\n");
      return 1;
    }
    const std::vector<float> whole = var->value().to_vector<float>();
    bool exact = whole.size() == static_cast<size_t>(c.shape.numel());
    for (size_t i = 0; exact && i < whole.size(); ++i) exact = whole[i] == static_cast<float>(i);
    out += std::string(out.size() > 1 ? ", " : "") + "\"" + c.name +
           "\": {\"whole\": " + (exact ? "true" : "false") + ", \"shards\": [";
    size_t offset = 0;
    for (int s = 0; s < sv->num_shards(); ++s) {
      const dtrain::Tensor t = sv->read_shard(s);
      const std::vector<float> v = t.to_vector<float>();
      bool match = t.shape() == sv->shard_shape(s);
      for (size_t i = 0; match && i < v.size(); ++i) match = v[i] == whole[offset + i];
      offset += v.size();
      out += std::string(s ? ", " : "") + "{\"task\": \"" + sv->shard_task(s) +
             "\", \"shape\": \"" + sv->shard_shape(s).to_string() +
             "\", \"match\": " + (match ? "true" : "false") + "}";
    }
    out += "]}";
  }
  std::printf("%s}\n", out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // Started as a ps task (dtrain-run gives every task the same command): serve.
    if (auto cluster = dtrain::from_environment();
        cluster && cluster->task_type() == dtrain::TaskType::kPs) {
      dtrain::serve_parameter_server(*cluster);
      return 0;
    }
    if (argc >= 3 && std::strcmp(argv[1], "counter") == 0) return counter(std::atoi(argv[2]));
    if (argc >= 2 && std::strcmp(argv[1], "shards") == 0) return shards();
    if (argc >= 5 && std::strcmp(argv[1], "stale") == 0)
      return stale(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
    std::fprintf(stderr, "usage: ps_check counter <pushes> | stale <k> <pushes> <ms> | shards\n");
    return 2;
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
