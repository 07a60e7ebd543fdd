// y = a·x + b + noise fitted by SGD under any strategy: data parallelism is one big batch, so 1, 2
// and 4 replicas at the same global batch follow the same trajectory (to float rounding), while the
// batch size changes the path. --trajectory writes (step, a, b, loss) per step for
// tools/plot/plot_linear_regression.py.
//
//   ./linear_regression --strategy=mirrored --devices=cpu:4 --batch-size=32 --json
#include <CLI/CLI.hpp>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/dtrain.h"

namespace {

// Records a, b and the loss over the whole data set after every step.
class Trajectory : public dtrain::Callback {
 public:
  Trajectory(std::shared_ptr<dtrain::Dense> layer, const std::vector<float>& x,
             const std::vector<float>& y)
      : layer_(std::move(layer)), x_(x), y_(y) {}
  void on_train_begin(const dtrain::TrainLogs&) override { record(0); }
  void on_train_batch_end(const dtrain::TrainLogs& logs) override { record(logs.global_step); }
  std::vector<std::array<double, 4>> rows;  // step, a, b, full-data MSE

 private:
  void record(int64_t step) {
    const double a = value(layer_->kernel), b = value(layer_->bias);
    double sse = 0;
    for (size_t i = 0; i < x_.size(); ++i) sse += (a * x_[i] + b - y_[i]) * (a * x_[i] + b - y_[i]);
    rows.push_back({static_cast<double>(step), a, b, sse / static_cast<double>(x_.size())});
  }
  static double value(const std::shared_ptr<dtrain::Variable>& v) {
    return v->value().to(dtrain::DeviceSpec::cpu()).to_vector<float>()[0];
  }
  std::shared_ptr<dtrain::Dense> layer_;
  const std::vector<float>& x_;
  const std::vector<float>& y_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fit y = a*x + b + noise with SGD under any dtrain strategy"};
  std::string strategy_name = "one_device", devices_flag = "cpu", trajectory_path;
  int epochs = 3;
  int64_t batch = 32, n = 1024;
  float lr = 0.1f, a = 2.f, b = -1.f, noise = 0.1f;
  uint64_t seed = 1;
  bool json = false;
  app.add_option("--strategy", strategy_name,
                 "one_device, mirrored, central_storage, multi_worker_mirrored, ...")
      ->capture_default_str();
  app.add_option("--devices", devices_flag, "cpu, cpu:N, gpu, ...")->capture_default_str();
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", batch, "global batch size (0: the whole data set)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--examples", n, "number of (x, y) points")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", lr, "SGD learning rate")->capture_default_str();
  app.add_option("--a", a, "true slope")->capture_default_str();
  app.add_option("--b", b, "true intercept")->capture_default_str();
  app.add_option("--noise", noise, "standard deviation of the noise")->capture_default_str();
  app.add_option("--seed", seed, "data and shuffling seed")->capture_default_str();
  app.add_option("--trajectory", trajectory_path,
                 "write step,a,b,loss per step to this CSV (chief)");
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  CLI11_PARSE(app, argc, argv);
  if (batch == 0) batch = n;

  try {
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, 0);
    dtrain::TaskFunctions task;
    task.train = [&](dtrain::Strategy& strategy) {
      // The data: x ~ U[-1, 1], y = a x + b + N(0, noise^2), from a Philox stream (same on every
      // task).
      dtrain::Philox rng(seed, 0);
      std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const size_t k = static_cast<size_t>(i);
        x[k] = 2.f * rng.uniform(3 * static_cast<uint64_t>(i)) - 1.f;
        const double u1 = std::max(1e-12f, rng.uniform(3 * static_cast<uint64_t>(i) + 1));
        const double u2 = rng.uniform(3 * static_cast<uint64_t>(i) + 2);
        y[k] = a * x[k] + b +
               noise * static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2));
      }
      const auto data =
          dtrain::Dataset::from_tensors({dtrain::Tensor::from_vector(x, dtrain::Shape{n, 1}),
                                         dtrain::Tensor::from_vector(y, dtrain::Shape{n, 1})});

      dtrain::Sequential model;
      std::shared_ptr<dtrain::Dense> line;
      std::unique_ptr<dtrain::Optimizer> opt;
      {
        auto scope = strategy.scope();
        line = std::make_shared<dtrain::Dense>(1, dtrain::Activation::kNone, true, "line");
        model.add(line);
        model.build(dtrain::Shape{1, 1});
        line->kernel->assign(dtrain::Tensor::zeros(dtrain::Shape{1, 1}));  // start at a = b = 0
        opt = std::make_unique<dtrain::SGD>(lr);
      }
      Trajectory traj(line, x, y);
      dtrain::FitOptions fit;
      fit.epochs = epochs;
      fit.global_batch_size = batch;
      fit.shuffle_seed = seed;
      fit.warmup_steps = 0;
      fit.loss = [](const dtrain::Tensor& p, const dtrain::Tensor& t) {
        return dtrain::ops::mean_squared_error(p, t);
      };
      fit.metrics = {"mae"};
      fit.callbacks = {&traj};
      const dtrain::History h = dtrain::fit(strategy, model, *opt, data, nullptr, fit);
      const bool chief = strategy.extended().is_chief();
      if (chief && !trajectory_path.empty()) {
        std::ofstream f(trajectory_path);
        f << "step,epoch,a,b,loss\n";
        char buf[160];
        for (const auto& r : traj.rows) {
          const double epoch =
              std::min(r[0] * static_cast<double>(batch), r[0] * static_cast<double>(n)) /
              static_cast<double>(n);
          std::snprintf(buf, sizeof(buf), "%.0f,%.6g,%.9g,%.9g,%.9g\n", r[0], epoch, r[1], r[2],
                        r[3]);
          f << buf;
        }
      }
      const double fa = traj.rows.back()[1], fb = traj.rows.back()[2];
      if (chief) {
        std::fprintf(json ? stderr : stdout,
                     "%s x%d, batch %lld: a = %.4f (true %.2f), b = %.4f (true %.2f), loss %.5f\n",
                     strategy_name.c_str(), strategy.num_replicas_in_sync(),
                     static_cast<long long>(batch), fa, a, fb, b, h.final_loss);
        if (json) {
          nlohmann::json j{{"strategy", strategy_name},
                           {"replicas", strategy.num_replicas_in_sync()},
                           {"global_batch", batch},
                           {"steps", h.steps},
                           {"a", fa},
                           {"b", fb},
                           {"final_loss", h.final_loss},
                           {"a_error", std::fabs(fa - a)},
                           {"b_error", std::fabs(fb - b)}};
          std::printf("%s\n", j.dump().c_str());
        }
      }
    };
    dtrain::run_task(strategy_name, opts, task);
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
