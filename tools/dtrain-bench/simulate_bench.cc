// dtrain-bench simulate: a data-parallel step at other worker counts and link speeds, from one
// worker's measured timeline (step_model.h). With --busbw and --small-allreduce-seconds measured on
// real links (bench/links/links.py does), it predicts those runs; with --gbps it goes past them.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "bench_util.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "step_model.h"

namespace dtrain::bench {
namespace {

std::vector<double> parse_list(const std::string& s, const char* what) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const double v = std::stod(item, &used);
      if (used != item.size() || !(v > 0)) throw std::invalid_argument("");
      out.push_back(v);
    } catch (const std::exception&) {
      throw std::invalid_argument(std::string(what) + ": '" + item +
                                  "' is not a positive number (give a comma-separated list)");
    }
  }
  if (out.empty()) throw std::invalid_argument(std::string(what) + " is empty");
  return out;
}

}  // namespace

int simulate_bench(const SimulateArgs& a) {
  std::ifstream in(a.profile);
  if (!in)
    throw std::runtime_error("cannot read --profile " + a.profile +
                             " (a timeline: DTRAIN_TIMELINE=FILE with one worker)");
  nlohmann::json trace;
  try {
    trace = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(a.profile + " is not JSON (" + e.what() +
                             "): a truncated timeline? The process writes it at exit");
  }
  StepProfile measured;
  try {
    measured = profile_from_timeline(trace, a.warmup);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(a.profile + ": " + e.what());
  }
  const StepProfile profile =
      a.step_seconds > 0 ? measured.scaled(a.step_seconds / measured.compute()) : measured;
  std::vector<double> workers = parse_list(a.workers, "--workers");
  for (double w : workers)
    if (w != std::floor(w) || w < 1)
      throw std::invalid_argument("--workers: whole numbers >= 1, got " + std::to_string(w));
  if (a.busbw > 0 && !a.gbps.empty())
    throw std::invalid_argument("give --busbw (measured) or --gbps (link rate), not both");
  if (a.small_allreduce_seconds > 0 && workers.size() != 1)
    throw std::invalid_argument(
        "--small-allreduce-seconds was measured at one worker count: give one --workers");
  // Link speeds: bytes/s per link and direction, with the label printed.
  std::vector<std::pair<double, std::string>> links;
  if (a.busbw > 0) {
    char label[64];
    std::snprintf(label, sizeof(label), "%.0f MB/s", a.busbw / 1e6);
    links.push_back({a.busbw, label});
  } else {
    for (double g : parse_list(a.gbps.empty() ? "10,25,100" : a.gbps, "--gbps")) {
      char label[64];
      std::snprintf(label, sizeof(label), "%g Gbit/s", g);
      links.push_back({g * 1e9 / 8 * a.link_efficiency, label});
    }
  }
  const Algorithm algo = parse_algorithm(a.algorithm);
  if (algo == Algorithm::kHierarchical && a.workers_per_host < 2)
    throw std::invalid_argument("--algorithm hierarchical needs --workers-per-host >= 2");

  const double grad_mb = profile.gradient_bytes() / 1e6;
  std::printf(
      "profile %s: %d step(s); forward %.3f s, backward %.3f s, update %.3f s, other %.3f s; %zu "
      "gradients, %.1f MB%s\n",
      a.profile.c_str(), measured.steps, profile.forward, profile.backward, profile.update,
      profile.other, profile.gradients.size(), grad_mb,
      a.step_seconds > 0 ? " (times scaled to --step-seconds)" : "");
  const bool auto_pack = a.pack_mb == "auto";
  const double fixed_pack = auto_pack ? 0 : std::stod(a.pack_mb) * 1e6;
  // dtrain's pack size at `w` workers: its cross-worker ring spans every worker, or one process
  // per host under hierarchical.
  auto pack_bytes = [&](double w) {
    if (!auto_pack) return fixed_pack;
    const int ring = algo == Algorithm::kHierarchical
                         ? std::max(1, static_cast<int>(w) / a.workers_per_host)
                         : static_cast<int>(w);
    return static_cast<double>(auto_bytes_per_pack(ring));
  };
  const std::string hosts = algo == Algorithm::kHierarchical
                                ? ", " + std::to_string(a.workers_per_host) + " workers per host"
                                : "";
  if (auto_pack)
    std::printf("%s all-reduce, packs chosen by worker count as dtrain does%s\n",
                a.algorithm.c_str(), hosts.c_str());
  else
    std::printf("%s all-reduce, packs of %.1f MB%s\n", a.algorithm.c_str(), fixed_pack / 1e6,
                hosts.c_str());
  std::printf("%-16s %8s %8s %11s %11s %13s %8s %11s\n", "link", "workers", "pack MB", "step s",
              "compute s", "all-reduce s", "hidden", "efficiency");
  for (const auto& [busbw, label] : links) {
    for (double w : workers) {
      Network net;
      net.workers = static_cast<int>(w);
      net.busbw = busbw;
      net.algorithm = algo;
      net.workers_per_host = a.workers_per_host;
      net.intra_busbw = a.intra_gbps * 1e9 / 8 * a.link_efficiency;
      net.intra_alpha = a.intra_latency_us * 1e-6;
      net.cpu_seconds_per_byte = a.comm_cpu_ns_per_byte * 1e-9;
      net.workers_per_core = a.workers_per_core;
      // alpha: measured (a small all-reduce is ~2 (N-1) empty ring steps) or given.
      net.alpha = a.small_allreduce_seconds > 0 && w > 1 ? a.small_allreduce_seconds / (2 * (w - 1))
                                                         : a.latency_us * 1e-6;
      const double pack = pack_bytes(w);
      const StepPrediction p = simulate_step(profile, net, pack);
      std::printf("%-16s %8d %8.1f %11.4f %11.4f %13.4f %7.0f%% %10.1f%%\n", label.c_str(),
                  net.workers, pack / 1e6, p.seconds_per_step, p.compute_seconds,
                  p.allreduce_seconds, 100 * p.hidden_share, 100 * p.efficiency);
      if (a.json)
        std::printf("%s\n", nlohmann::json({{"benchmark", "simulate"},
                                            {"profile", a.profile},
                                            {"link", label},
                                            {"busbw_bytes_per_sec", busbw},
                                            {"alpha_seconds", net.alpha},
                                            {"algorithm", a.algorithm},
                                            {"workers", net.workers},
                                            {"pack_bytes", pack},
                                            {"pack_rule", auto_pack ? "auto" : "fixed"},
                                            {"gradient_bytes", profile.gradient_bytes()},
                                            {"seconds_per_step", p.seconds_per_step},
                                            {"compute_seconds", p.compute_seconds},
                                            {"allreduce_seconds", p.allreduce_seconds},
                                            {"hidden_share", p.hidden_share},
                                            {"efficiency", p.efficiency},
                                            {"packs", p.packs.size()}})
                                .dump()
                                .c_str());
    }
  }
  std::printf(
      "efficiency: the one-worker step (compute, no all-reduce) over the predicted step; hidden: "
      "the share of all-reduce time inside backward. Not modelled: compute slowed by the "
      "communication itself, stragglers, other traffic on the links\n");
  return 0;
}

int links_bench(const std::vector<std::string>& args) {
  // The build this binary belongs to (build/tools/dtrain-bench -> build).
  const std::string build = self_dir() + "/..";
  std::vector<std::string> argv = {"python3", source_dir() + "/bench/links/links.py", "--build",
                                   build};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c;
  for (auto& s : argv) c.push_back(s.data());
  c.push_back(nullptr);
  std::fflush(stdout);
  ::execvp("python3", c.data());
  throw std::runtime_error("cannot run python3 (bench/links/links.py needs Python 3)");
}

}  // namespace dtrain::bench
