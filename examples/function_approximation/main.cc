// An MLP fitting f(x) = sin(2 pi x) exp(-x) on [0, 1] from noisy samples, under any strategy:
// data-parallel (mirrored, multi_worker_mirrored: one model, the batch split over replicas) or
// --strategy=ensemble (one model per device, each from its own initial weights and data order; the
// prediction is the members' mean with their spread as an uncertainty band). The model code is the
// same either way. --predictions writes x, target, mean, stddev on a grid for
// tools/plot/plot_function_approximation.py.
//
//   ./function_approximation --strategy=ensemble --devices=cpu:5 --json --predictions ens.csv
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/dtrain.h"

namespace {
double target(double x) { return std::sin(2 * M_PI * x) * std::exp(-x); }
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fit sin(2 pi x) exp(-x) with an MLP: data-parallel or as an ensemble"};
  std::string strategy_name = "one_device", devices_flag = "cpu", predictions_path, data_path;
  int epochs = 300;
  int64_t n = 256, batch = 32, width = 64;
  float lr = 1e-2f, noise = 0.05f;
  uint64_t seed = 7;
  bool json = false;
  app.add_option("--strategy", strategy_name)->capture_default_str();
  app.add_option("--devices", devices_flag,
                 "cpu, cpu:N (ensemble: one member per device), gpu, ...")
      ->capture_default_str();
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--examples", n, "noisy samples of f on [0, 1]")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--batch-size", batch, "global batch (ensemble: each member's)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--width", width, "units of each of the two tanh layers")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", lr, "Adam learning rate (cosine decay to zero)")->capture_default_str();
  app.add_option("--noise", noise, "standard deviation of the noise on the samples")
      ->capture_default_str();
  app.add_option("--seed", seed)->capture_default_str();
  app.add_option("--predictions", predictions_path,
                 "write x,target,mean,stddev on 201 points (chief)");
  app.add_option("--data", data_path, "write the noisy samples x,y (chief)");
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  CLI11_PARSE(app, argc, argv);

  try {
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, 0);
    dtrain::TaskFunctions task;
    task.train = [&](dtrain::Strategy& strategy) {
      dtrain::Philox rng(seed, 99);
      std::vector<float> x(static_cast<size_t>(n)), y(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = rng.uniform(2 * i);
        y[i] = static_cast<float>(target(x[i])) + noise * rng.normal(2 * i + 1);
      }
      const auto data =
          dtrain::Dataset::from_tensors({dtrain::Tensor::from_vector(x, dtrain::Shape{n, 1}),
                                         dtrain::Tensor::from_vector(y, dtrain::Shape{n, 1})});
      dtrain::set_global_seed(seed);
      dtrain::Sequential model;
      std::unique_ptr<dtrain::Optimizer> opt;
      const int64_t steps = epochs * ((n + batch - 1) / batch);
      {
        auto scope = strategy.scope();
        model.add(std::make_shared<dtrain::Dense>(width, dtrain::Activation::kTanh));
        model.add(std::make_shared<dtrain::Dense>(width, dtrain::Activation::kTanh));
        model.add(std::make_shared<dtrain::Dense>(1));
        opt = std::make_unique<dtrain::Adam>(std::make_shared<dtrain::CosineDecay>(lr, steps));
      }
      dtrain::FitOptions fit;
      fit.epochs = epochs;
      fit.global_batch_size = batch;
      fit.shuffle_seed = seed;
      fit.warmup_steps = 0;
      fit.loss = [](const dtrain::Tensor& p, const dtrain::Tensor& t) {
        return dtrain::ops::mean_squared_error(p, t);
      };
      fit.metrics = {"mse"};
      const dtrain::History h = dtrain::fit(strategy, model, *opt, data, nullptr, fit);

      const int64_t m = 201;
      std::vector<float> grid(static_cast<size_t>(m));
      for (size_t i = 0; i < grid.size(); ++i)
        grid[i] = static_cast<float>(i) / static_cast<float>(m - 1);
      const auto gx =
          dtrain::Dataset::from_tensors({dtrain::Tensor::from_vector(grid, dtrain::Shape{m, 1})});
      const dtrain::EnsemblePrediction p = dtrain::predict_ensemble(strategy, model, gx, 256);
      const std::vector<float> mean = p.mean.to_vector<float>(), sd = p.stddev.to_vector<float>();
      double se = 0, inside = 0, member_se = 0;
      for (size_t i = 0; i < grid.size(); ++i) {
        const double t = target(grid[i]);
        se += (mean[i] - t) * (mean[i] - t);
        inside += std::fabs(mean[i] - t) <= 2 * sd[i] + 1e-12;
      }
      for (const auto& member : p.members) {
        const std::vector<float> v = member.to_vector<float>();
        for (size_t i = 0; i < grid.size(); ++i)
          member_se += (v[i] - target(grid[i])) * (v[i] - target(grid[i]));
      }
      const double rmse = std::sqrt(se / static_cast<double>(m));
      const double member_rmse =
          std::sqrt(member_se / static_cast<double>(m * static_cast<int64_t>(p.members.size())));
      if (!strategy.extended().is_chief()) return;
      if (!predictions_path.empty()) {
        std::ofstream f(predictions_path);
        f << "x,target,mean,stddev\n";
        char buf[128];
        for (size_t i = 0; i < grid.size(); ++i) {
          std::snprintf(buf, sizeof(buf), "%.6g,%.9g,%.9g,%.9g\n", grid[i], target(grid[i]),
                        mean[i], sd[i]);
          f << buf;
        }
      }
      if (!data_path.empty()) {
        std::ofstream f(data_path);
        f << "x,y\n";
        for (size_t i = 0; i < x.size(); ++i) f << x[i] << ',' << y[i] << '\n';
      }
      std::fprintf(
          json ? stderr : stdout,
          "%s, %zu model(s): RMSE of the %s against f: %.4f (members: %.4f)%s\n",
          strategy.name().c_str(), p.members.size(), p.members.size() > 1 ? "ensemble mean" : "fit",
          rmse, member_rmse,
          p.members.size() > 1
              ? (", " + std::to_string(static_cast<int>(100 * inside / m)) + "% of f inside +-2 sd")
                    .c_str()
              : "");
      if (json) {
        nlohmann::json j{{"strategy", strategy_name},
                         {"members", p.members.size()},
                         {"replicas", strategy.num_replicas_in_sync()},
                         {"steps", h.steps},
                         {"final_loss", h.final_loss},
                         {"rmse", rmse},
                         {"member_rmse", member_rmse},
                         {"inside_two_sd", inside / static_cast<double>(m)}};
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
