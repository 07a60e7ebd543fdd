// dtrain-bench: benchmarks as whole programs, each compared against a peer measured in the same
// run (runs interleaved, so machine noise hits both alike).
//
//   dtrain-bench train --peer=torch --runs=5 --steps=300 --threads=1 --batch-size=64 [--json]
//
// `train` runs examples/fashion_mnist (OneDevice) and bench/torch_fashion_mnist.py (PyTorch with
// the same model, optimizer, batch and thread count) alternately and reports the median
// images/sec of each and their ratio.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// Runs a shell command and returns the JSON object on its last stdout line.
nlohmann::json run_json(const std::string& cmd) {
  std::FILE* p = ::popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) throw std::runtime_error("cannot start: " + cmd);
  std::string out, last;
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), buf.size(), p)) out += buf.data();
  const int rc = ::pclose(p);
  if (rc != 0) throw std::runtime_error("command failed (status " + std::to_string(rc) + "): " + cmd);
  std::string line;
  for (char c : out) {
    if (c == '\n') {
      if (!line.empty()) last = line;
      line.clear();
    } else {
      line += c;
    }
  }
  if (!line.empty()) last = line;
  try {
    return nlohmann::json::parse(last);
  } catch (const nlohmann::json::exception&) {
    throw std::runtime_error("no JSON result line from: " + cmd);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

fs::path self_dir() { return fs::canonical("/proc/self/exe").parent_path(); }

int train_bench(int runs, int64_t steps, int warmup, int threads, int64_t batch, const std::string& python,
                bool json) {
  const fs::path example = self_dir().parent_path() / "examples" / "fashion_mnist";
  const fs::path script = fs::path(DTRAIN_SOURCE_DIR) / "bench" / "torch_fashion_mnist.py";
  const std::string common = " --steps " + std::to_string(steps) + " --warmup " + std::to_string(warmup) +
                             " --batch-size " + std::to_string(batch) + " --json";
  const std::string dtrain_cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " " + example.string() +
                                 " --strategy=one_device --devices=cpu --threads " + std::to_string(threads) +
                                 " --no-eval" + common;
  const std::string torch_cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " " + python + " " +
                                script.string() + " --threads " + std::to_string(threads) + common;
  std::vector<double> ours, theirs;
  for (int r = 0; r < runs; ++r) {
    ours.push_back(run_json(dtrain_cmd)["images_per_sec"].get<double>());
    theirs.push_back(run_json(torch_cmd)["images_per_sec"].get<double>());
    std::fprintf(stderr, "run %d/%d: dtrain %.0f images/sec, pytorch %.0f images/sec\n", r + 1, runs,
                 ours.back(), theirs.back());
  }
  const double mo = median(ours), mt = median(theirs);
  std::printf("%-28s %8s %14s %14s %14s\n", "benchmark", "threads", "images/sec", "min", "max");
  std::printf("%-28s %8d %14.0f %14.0f %14.0f\n", "dtrain one_device", threads, mo,
              *std::min_element(ours.begin(), ours.end()), *std::max_element(ours.begin(), ours.end()));
  std::printf("%-28s %8d %14.0f %14.0f %14.0f\n", "pytorch 1.13 (same model)", threads, mt,
              *std::min_element(theirs.begin(), theirs.end()), *std::max_element(theirs.begin(), theirs.end()));
  std::printf("ratio dtrain / pytorch (medians): %.2fx\n", mo / mt);
  if (json) {
    nlohmann::json j{{"benchmark", "train_fashion_mnist"}, {"strategy", "one_device"}, {"threads", threads},
                     {"batch", batch}, {"steps", steps}, {"runs", runs}, {"dtrain_images_per_sec", mo},
                     {"pytorch_images_per_sec", mt}, {"ratio", mo / mt}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain benchmarks (each against a peer measured in the same run)"};
  app.require_subcommand(1);
  bool json = false;
  app.add_flag("--json", json, "also print one JSON object per result");
  auto* train = app.add_subcommand("train", "reference CNN training throughput vs PyTorch");
  int runs = 5, threads = 1, warmup = 20;
  int64_t steps = 300, batch = 64;
  std::string peer = "torch", python = "/usr/bin/python3";
  train->add_option("--peer", peer, "peer to compare against")->check(CLI::IsMember({"torch"}))->capture_default_str();
  train->add_option("--runs", runs, "interleaved runs of each")->check(CLI::PositiveNumber)->capture_default_str();
  train->add_option("--steps", steps, "training steps per run")->check(CLI::PositiveNumber)->capture_default_str();
  train->add_option("--warmup", warmup, "steps excluded from timing")->check(CLI::NonNegativeNumber)->capture_default_str();
  train->add_option("--threads", threads, "CPU threads for both")->check(CLI::PositiveNumber)->capture_default_str();
  train->add_option("--batch-size", batch, "batch size")->check(CLI::PositiveNumber)->capture_default_str();
  train->add_option("--python", python, "python with torch 1.13")->capture_default_str();
  train->add_flag("--json", json, "also print one JSON object per result");
  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) return train_bench(runs, steps, warmup, threads, batch, python, json);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
