// A physics-informed network for -u''(x) = pi^2 sin(pi x) on [0, 1], u(0) = u(1) = 0 (exact
// solution sin(pi x)). u(x) = x (1 - x) N(x) meets the boundary conditions by construction; N is an
// MLP trained so that the residual u'' + pi^2 sin(pi x) vanishes at the collocation points. u''
// comes from two nested GradientTapes, and a third, outer tape differentiates the residual loss
// with respect to the weights: a custom training loop with strategy.run, data-parallel over the
// collocation points (each replica or worker takes its share; gradients are all-reduced as for any
// model), or as an ensemble (--strategy=ensemble --devices=cpu:N: every member on all the points,
// no all-reduce; the solution is the members' mean, their spread an error estimate).
//
//   ./pinn --strategy=mirrored --devices=cpu:2 --json --solution pinn.csv
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/dtrain.h"

namespace {

constexpr float kPi = 3.14159265358979f;

// u(x) = x (1 - x) N(x): zero at both ends whatever N is.
dtrain::Tensor solution(dtrain::Sequential& net, const dtrain::Tensor& x, bool training) {
  using namespace dtrain::ops;
  return mul(mul(x, add_scalar(neg(x), 1.f)), net(x, training));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Solve -u'' = pi^2 sin(pi x), u(0) = u(1) = 0 with a physics-informed network under any "
      "strategy"};
  std::string strategy_name = "one_device", devices_flag = "cpu", solution_path;
  int64_t points = 256, steps = 3000, width = 32;
  float lr = 3e-3f;
  uint64_t seed = 3;
  bool json = false;
  app.add_option("--strategy", strategy_name)->capture_default_str();
  app.add_option("--devices", devices_flag)->capture_default_str();
  app.add_option("--points", points, "collocation points in (0, 1) (the global batch)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps", steps, "Adam steps (cosine decay to zero)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--width", width, "units of each of the two tanh layers")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", lr, "Adam learning rate")->capture_default_str();
  app.add_option("--seed", seed, "weights seed")->capture_default_str();
  app.add_option("--solution", solution_path,
                 "write x,u,exact,error on 1001 points to this CSV (chief)");
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  CLI11_PARSE(app, argc, argv);

  try {
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, 0);
    dtrain::TaskFunctions task;
    task.train = [&](dtrain::Strategy& strategy) {
      const auto t0 = std::chrono::steady_clock::now();
      // Collocation points: a midpoint grid over (0, 1), with the right-hand side f = pi^2 sin(pi
      // x).
      std::vector<float> xs(static_cast<size_t>(points)), fs(xs.size());
      for (size_t i = 0; i < xs.size(); ++i) {
        xs[i] = (static_cast<float>(i) + 0.5f) / static_cast<float>(points);
        fs[i] = kPi * kPi * std::sin(kPi * xs[i]);
      }
      const auto data = dtrain::Dataset::from_tensors(
          {dtrain::Tensor::from_vector(xs, dtrain::Shape{points, 1}),
           dtrain::Tensor::from_vector(fs, dtrain::Shape{points, 1})});
      dtrain::set_global_seed(seed);
      dtrain::Sequential net;
      std::unique_ptr<dtrain::Optimizer> opt;
      {
        auto scope = strategy.scope();
        net.add(std::make_shared<dtrain::Dense>(width, dtrain::Activation::kTanh));
        net.add(std::make_shared<dtrain::Dense>(width, dtrain::Activation::kTanh));
        net.add(std::make_shared<dtrain::Dense>(1));
        net.build(dtrain::Shape{1, 1});
        opt = std::make_unique<dtrain::Adam>(std::make_shared<dtrain::CosineDecay>(lr, steps));
        opt->build(net.trainable_variables());
      }
      const dtrain::VariableList vars = net.trainable_variables();
      int64_t global_rows = 0;
      // One step on this replica's points: residual r = u'' + f; loss = sum(r^2) / all points.
      const dtrain::ReplicaFn step = [&](dtrain::ReplicaContext&,
                                         const std::vector<dtrain::Tensor>& in) {
        const dtrain::Tensor& x = in[0];
        dtrain::Tensor loss;
        std::vector<dtrain::Tensor> grads;
        {
          dtrain::GradientTape weights;  // outermost: d loss / d weights through u''
          dtrain::Tensor uxx;
          {
            dtrain::GradientTape outer;
            outer.watch(x);
            dtrain::Tensor ux;
            {
              dtrain::GradientTape inner;
              inner.watch(x);
              ux = inner.gradient(dtrain::ops::sum(solution(net, x, true)), {x})[0];
            }
            uxx = outer.gradient(dtrain::ops::sum(ux), {x})[0];
          }
          const dtrain::Tensor r = dtrain::ops::add(uxx, in[1]);
          loss = dtrain::compute_average_loss(dtrain::ops::flatten(dtrain::ops::square(r)),
                                              global_rows);
          grads = weights.gradient(loss, vars);
        }
        opt->apply_gradients(grads, vars);
        return std::vector<dtrain::Tensor>{loss};
      };
      double last_loss = 0;
      int64_t done = 0;
      auto next = strategy.distribute_dataset(data.batch(points).repeat(), points);
      dtrain::PerReplica batch;
      for (; done < steps && next(&batch); ++done) {
        global_rows = batch.global_rows;
        last_loss = strategy.reduce(dtrain::ReduceOp::kSum, strategy.run(step, batch))[0].item();
        if (strategy.extended().is_chief() && (done + 1) % 500 == 0)
          std::fprintf(json ? stderr : stdout, "step %lld: residual loss %.3e\n",
                       static_cast<long long>(done + 1), last_loss);
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

      // Relative L2 error against sin(pi x) on 1001 points of [0, 1], of the model (the ensemble's
      // mean under --strategy=ensemble, whose members' spread is reported too).
      const int64_t m = 1001;
      std::vector<float> grid(static_cast<size_t>(m));
      for (size_t i = 0; i < grid.size(); ++i)
        grid[i] = static_cast<float>(i) / static_cast<float>(m - 1);
      const dtrain::EnsemblePrediction net_out = dtrain::predict_ensemble(
          strategy, net,
          dtrain::Dataset::from_tensors({dtrain::Tensor::from_vector(grid, dtrain::Shape{m, 1})}),
          1001);
      const size_t members = net_out.members.size();
      std::vector<float> u(grid.size(), 0.f), sd(grid.size(), 0.f);
      std::vector<std::vector<float>> each;
      for (const auto& t : net_out.members) {
        std::vector<float> v = t.to_vector<float>();
        for (size_t i = 0; i < v.size(); ++i)
          v[i] *= grid[i] * (1.f - grid[i]);  // u = x (1 - x) N(x)
        for (size_t i = 0; i < v.size(); ++i) u[i] += v[i] / static_cast<float>(members);
        each.push_back(std::move(v));
      }
      for (const auto& v : each)
        for (size_t i = 0; i < v.size(); ++i)
          sd[i] += (v[i] - u[i]) * (v[i] - u[i]) / static_cast<float>(members);
      for (float& s : sd) s = std::sqrt(s);
      double num = 0, den = 0;
      for (size_t i = 0; i < grid.size(); ++i) {
        const double exact = std::sin(static_cast<double>(kPi) * grid[i]);
        num += (u[i] - exact) * (u[i] - exact);
        den += exact * exact;
      }
      const double rel = std::sqrt(num / den);
      if (!strategy.extended().is_chief()) return;
      if (!solution_path.empty()) {
        std::ofstream f(solution_path);
        f << "x,u,exact,error,stddev\n";
        char buf[160];
        for (size_t i = 0; i < grid.size(); ++i) {
          const double exact = std::sin(static_cast<double>(kPi) * grid[i]);
          std::snprintf(buf, sizeof(buf), "%.6g,%.9g,%.9g,%.9g,%.9g\n", grid[i], u[i], exact,
                        u[i] - exact, sd[i]);
          f << buf;
        }
      }
      std::fprintf(json ? stderr : stdout,
                   "%s x%d: relative L2 error %.2e after %lld steps, %.1f s\n",
                   strategy_name.c_str(), strategy.num_replicas_in_sync(), rel,
                   static_cast<long long>(done), seconds);
      if (json) {
        nlohmann::json j{{"strategy", strategy_name},
                         {"replicas", strategy.num_replicas_in_sync()},
                         {"members", members},
                         {"points", points},
                         {"steps", done},
                         {"final_loss", last_loss},
                         {"relative_l2_error", rel},
                         {"seconds", seconds}};
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
