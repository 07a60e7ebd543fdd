// Trains the reference CNN on Fashion-MNIST under the strategy picked by --strategy.
// The model and training code below contain no strategy-specific branch.
//
//   ./fashion_mnist --strategy=one_device --epochs=5
//   ./fashion_mnist --strategy=one_device --devices=cpu --threads=1 --steps=300 --json
#include <CLI/CLI.hpp>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "dtrain/dtrain.h"
#include "reference_cnn.h"

namespace {
std::atomic<bool> g_stop{false};  // SIGTERM to the evaluator task: finish the newest checkpoint, exit
}  // namespace


int main(int argc, char** argv) {
  CLI::App app{"Train the reference CNN on Fashion-MNIST with dtrain"};
  std::string strategy_name = "one_device", devices_flag = "cpu", data_dir;
  int epochs = 5, threads = 0, warmup = 5;
  int64_t steps = 0, batch = 64;
  float lr = 1e-3f;
  uint64_t seed = 42;
  bool json = false;
  std::string valid;
  for (const auto& n : dtrain::strategy_names()) valid += (valid.empty() ? "" : ", ") + n;
  app.add_option("--strategy", strategy_name, "distribution strategy: " + valid)->capture_default_str();
  app.add_option("--devices", devices_flag, "cpu, cpu:N (N logical CPU devices), gpu, gpu:0,1, auto")->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads per CPU device (0 = cores / devices)")->check(CLI::NonNegativeNumber);
  app.add_option("--epochs", epochs, "epochs to train")->check(CLI::PositiveNumber)->capture_default_str();
  bool no_eval = false;
  app.add_flag("--no-eval", no_eval, "skip the test-set evaluation (benchmarks)");
  app.add_option("--steps", steps, "train this many steps instead of whole epochs (0 = off)")->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", batch, "global batch size (split over replicas)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", lr, "Adam learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", seed, "seed for weights, shuffling and dropout")->capture_default_str();
  app.add_option("--data-dir", data_dir, "Fashion-MNIST IDX directory (default $DTRAIN_DATA_DIR, then /usr/share/datasets/fashion-mnist)");
  app.add_option("--warmup", warmup, "steps excluded from images/sec")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  dtrain::ParameterServerOptions ps;
  int ps_shards = 0;
  app.add_option("--checkpoint-dir", ps.checkpoint_dir, "parameter_server: the chief's checkpoints (restored from on start)");
  app.add_option("--checkpoint-every", ps.checkpoint_every, "parameter_server: global steps between checkpoints")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-staleness", ps.max_staleness, "parameter_server: steps a worker may run ahead of the slowest (-1 = unbounded)")
      ->capture_default_str();
  app.add_option("--ps-shards", ps_shards, "parameter_server: split each variable with >= 2 rows into this many shards (0 = whole)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    dtrain::set_global_seed(seed);
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, threads);
    if (ps_shards > 0) ps.partitioner = dtrain::fixed_shards_partitioner(ps_shards);
    opts.parameter_server = ps;

    // One binary for every task of a job: run_task() serves a ps task, calls evaluate on an
    // evaluator task and train on the chief and the workers.
    dtrain::TaskFunctions task;
    task.evaluate = [&](const dtrain::TaskInfo& info) {
      // TF's sidecar evaluation: evaluates each checkpoint the chief writes, until the final one,
      // on plain variables of its own.
      std::signal(SIGTERM, [](int) { g_stop = true; });
      const dtrain::FashionMnist data = dtrain::load_fashion_mnist(data_dir);
      dtrain::Sequential model = dtrain::examples::reference_cnn();
      std::vector<int64_t> dims = data.test_images.shape().dims();
      dims[0] = 1;
      model.build(dtrain::Shape(dims));
      dtrain::SidecarEvaluatorOptions so;
      so.checkpoint_dir = info.checkpoint_dir;
      so.stop = &g_stop;
      so.json = json;
      dtrain::SidecarEvaluator(model, dtrain::Dataset::from_tensors({data.test_images, data.test_labels}), so).run();
    };
    task.train = [&](dtrain::Strategy& strategy) {
      const dtrain::FashionMnist data = dtrain::load_fashion_mnist(data_dir);
      dtrain::Sequential model;
      std::unique_ptr<dtrain::Optimizer> optimizer;
      {
        auto scope = strategy.scope();
        model = dtrain::examples::reference_cnn();
        optimizer = std::make_unique<dtrain::Adam>(lr);
      }
      std::fprintf(stderr, "strategy %s, %d replica(s) in sync; local devices:", strategy.name().c_str(),
                   strategy.num_replicas_in_sync());
      for (const auto& d : strategy.worker_devices())
        std::fprintf(stderr, " %s", dtrain::get_device(d).description().c_str());
      std::fprintf(stderr, "\n");

      const auto train = dtrain::Dataset::from_tensors({data.train_images, data.train_labels});
      const auto test = dtrain::Dataset::from_tensors({data.test_images, data.test_labels});
      dtrain::ProgressBar progress(json ? stderr : stdout);
      dtrain::FitOptions fit;
      fit.epochs = epochs;
      fit.steps = steps;
      fit.global_batch_size = batch;
      fit.shuffle_seed = seed;
      const dtrain::StrategyExtended& ext = strategy.extended();
      if (ext.is_chief()) fit.callbacks = {&progress};  // multi-worker: the chief reports
      fit.warmup_steps = warmup;
      const dtrain::History h = dtrain::fit(strategy, model, *optimizer, train, no_eval ? nullptr : &test, fit);
      if (json && (ext.is_chief() || !ext.synchronous())) {  // async workers: each its own
        const std::optional<int64_t> job_step = ext.job_step();
        nlohmann::json j{{"strategy", strategy_name},
                         {"replicas", strategy.num_replicas_in_sync()},
                         {"devices", devices_flag},
                         {"steps", h.steps},
                         {"job_step", job_step ? nlohmann::json(*job_step) : nlohmann::json()},
                         {"global_batch", batch},
                         {"images_per_sec", h.images_per_sec},
                         {"final_loss", h.final_loss},
                         {"test_accuracy", no_eval ? nlohmann::json() : nlohmann::json(h.test_accuracy)},
                         {"test_loss", no_eval ? nlohmann::json() : nlohmann::json(h.test_loss)}};
        std::printf("%s\n", j.dump().c_str());
      }
    };
    dtrain::run_task(strategy_name, opts, task);
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
