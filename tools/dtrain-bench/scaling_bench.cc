// `dtrain-bench scaling`: images/sec of the reference CNN and the scaling efficiency for 1..N
// replicas in one process (Mirrored on N logical CPU devices, one thread each) and 1..N worker
// processes (MultiWorkerMirrored through dtrain-run, one thread each), at a fixed batch per
// replica.
// --devices=gpu: one GPU per replica instead (Mirrored on gpu:0..N-1; N processes, each pinned to
// the GPU of its local rank with --devices=gpu:local). On CPUs a third figure is the machine's own
// ceiling: N independent one-replica jobs started at once, job i pinned to the i-th allowed core
// (taskset), their images/sec summed, over N times one such pinned job alone. Nothing is shared
// between them but the machine (memory bandwidth, caches, the hypervisor), so this is what sharing
// the machine alone costs; it says what the efficiencies above are up against on this machine, in
// the same run. Runs are interleaved round by round; medians. tools/plot/plot_scaling.py draws the
// JSON lines.
#include <sched.h>

#include <cstdio>
#include <filesystem>
#include <future>
#include <map>
#include <thread>

#include "bench_util.h"
#include "dtrain/core/error.h"
#include "dtrain/devices/device.h"

namespace dtrain::bench {

int scaling_bench(const ScalingArgs& a) {
  namespace fs = std::filesystem;
  const fs::path example = fs::path(self_dir()).parent_path() / "examples" / "fashion_mnist";
  const std::string dtrain_run = (fs::path(self_dir()) / "dtrain-run").string();
  const bool gpu = a.devices == "gpu";
  if (gpu && cuda_device_count() < a.max_replicas)
    throw Unavailable(
        "dtrain-bench scaling --devices=gpu --max-replicas=" + std::to_string(a.max_replicas) +
        " needs that many GPUs, but " + std::to_string(cuda_device_count()) +
        " are visible (no CUDA device, no CUDA in this build, or CUDA_VISIBLE_DEVICES); use "
        "--devices=cpu or a smaller --max-replicas");
  auto command = [&](const std::string& mode, int n) {
    std::string common = gpu ? "" : " --threads 1";
    common += " --no-eval --batch-size " + std::to_string(a.batch_per_replica * n);
    common +=
        " --steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) + " --json";
    if (gpu) {
      std::string list = "gpu:0";
      for (int i = 1; i < n; ++i) {
        list += ',';
        list += std::to_string(i);
      }
      if (n == 1) return example.string() + " --strategy=one_device --devices=gpu:0" + common;
      if (mode == "in-process")
        return example.string() + " --strategy=mirrored --devices=" + list + common;
      return dtrain_run + " -np " + std::to_string(n) + " -- " + example.string() +
             " --strategy=multi_worker_mirrored --devices=gpu:local" + common;
    }
    if (n == 1)
      return "OMP_NUM_THREADS=1 " + example.string() + " --strategy=one_device --devices=cpu" +
             common;
    if (mode == "in-process")
      return "OMP_NUM_THREADS=1 " + example.string() +
             " --strategy=mirrored --devices=cpu:" + std::to_string(n) + common;
    return dtrain_run + " -np " + std::to_string(n) + " -- " + example.string() +
           " --strategy=multi_worker_mirrored" + common;
  };
  // The cores this process may use (a launcher or cgroup may have narrowed them): job i of the
  // independent runs is pinned to the i-th, wrapping round when there are more jobs than cores.
  std::vector<int> cores;
  {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &allowed)) cores.push_back(c);
    if (cores.empty()) cores.push_back(0);
  }
  // N one-replica jobs at once; the sum of their images/sec.
  auto independent = [&](int n) {
    std::vector<std::future<double>> jobs;
    for (int i = 0; i < n; ++i) {
      const std::string cmd = "taskset -c " +
                              std::to_string(cores[static_cast<size_t>(i) % cores.size()]) +
                              " env " + command("in-process", 1);
      const std::string log = "/tmp/dtrain-bench-stderr-" + std::to_string(i) + ".log";
      jobs.push_back(std::async(std::launch::async, [cmd, log] {
        return run_json_lines(cmd, log).back()["images_per_sec"].get<double>();
      }));
    }
    double sum = 0;
    for (auto& j : jobs) sum += j.get();
    return sum;
  };
  const std::vector<std::string> modes =
      gpu ? std::vector<std::string>{"in-process", "processes"}
          : std::vector<std::string>{"in-process", "processes", "independent"};
  std::map<std::pair<std::string, int>, std::vector<double>> ips;
  for (int r = 0; r < a.runs; ++r) {
    for (int n = 1; n <= a.max_replicas; ++n)
      for (const std::string& mode : modes) {
        if (n == 1 && mode == "processes") continue;  // one replica is the same run either way
        ips[{mode, n}].push_back(
            mode == "independent"
                ? independent(n)
                : run_json_lines(command(mode, n)).back()["images_per_sec"].get<double>());
      }
    std::fprintf(stderr, "round %d/%d done\n", r + 1, a.runs);
  }
  const double one = median(ips[{"in-process", 1}]);
  // The efficiency of each round on its own (that round's N-replica run over N times that round's
  // one-replica run): its lowest and highest show how far one round's figure moves on this machine.
  auto round_range = [&](const std::string& mode, int n) {
    const std::string base = mode == "independent" ? "independent" : "in-process";
    const auto& v = n == 1 && mode == "processes" ? ips[{"in-process", 1}] : ips[{mode, n}];
    const auto& b = ips[{base, 1}];
    std::pair<double, double> r{1e300, 0};
    for (size_t i = 0; i < v.size() && i < b.size(); ++i) {
      const double e = v[i] / (n * b[i]);
      r = {std::min(r.first, e), std::max(r.second, e)};
    }
    return r;
  };
  std::printf(
      "reference CNN, %ld images per replica, %s per replica, median of %d interleaved runs\n",
      a.batch_per_replica, gpu ? "1 GPU" : "1 thread", a.runs);
  std::printf("%-9s %22s %12s %22s %12s", "replicas", "in one process (img/s)", "efficiency",
              "processes (img/s)", "efficiency");
  if (!gpu) std::printf(" %24s %12s", "independent jobs (img/s)", "ceiling");
  std::printf("\n");
  for (int n = 1; n <= a.max_replicas; ++n) {
    const double in = median(ips[{"in-process", n}]);
    const double pr = n == 1 ? one : median(ips[{"processes", n}]);
    const double ind = gpu ? 0 : median(ips[{"independent", n}]);
    const double ind_one = gpu ? 1 : median(ips[{"independent", 1}]);
    std::printf("%-9d %22.0f %11.1f%% %22.0f %11.1f%%", n, in, 100 * in / (n * one), pr,
                100 * pr / (n * one));
    if (!gpu) std::printf(" %24.0f %11.1f%%", ind, 100 * ind / (n * ind_one));
    std::printf("\n");
    if (n > 1 && a.runs > 1) {
      const auto ri = round_range("in-process", n), rp = round_range("processes", n);
      std::printf("%-9s %22s %5.1f-%4.1f%% %22s %5.1f-%4.1f%%", "  rounds", "", 100 * ri.first,
                  100 * ri.second, "", 100 * rp.first, 100 * rp.second);
      if (!gpu) {
        const auto rn = round_range("independent", n);
        std::printf(" %24s %5.1f-%4.1f%%", "", 100 * rn.first, 100 * rn.second);
      }
      std::printf("\n");
    }
    if (a.json) {
      for (const std::string& mode : modes) {
        const double v = mode == "in-process" ? in : mode == "processes" ? pr : ind;
        const double base = mode == "independent" ? ind_one : one;
        nlohmann::json j{{"benchmark", "scaling"},
                         {"mode", mode},
                         {"replicas", n},
                         {"batch_per_replica", a.batch_per_replica},
                         {"images_per_sec", v},
                         {"devices", a.devices},
                         {"efficiency", v / (n * base)},
                         {"runs", a.runs},
                         {"steps", a.steps}};
        const auto [lo, hi] = round_range(mode, n);
        j["efficiency_round_min"] = lo;
        j["efficiency_round_max"] = hi;
        std::printf("%s\n", j.dump().c_str());
      }
    }
  }
  if (a.runs > 1)
    std::printf(
        "rounds: the lowest and highest efficiency of a single round (its N-replica run over N "
        "times "
        "its own one-replica run)\n");
  if (!gpu)
    std::printf(
        "independent jobs: N one-replica runs at once, each pinned to its own core (taskset), "
        "images/sec "
        "summed, against one such run alone: what sharing the machine alone costs N replicas that "
        "share "
        "nothing else\n");
  if (!gpu && a.max_replicas > static_cast<int>(std::thread::hardware_concurrency()))
    std::printf(
        "note: more replicas than the %u cores of this machine: the extra ones share cores\n",
        std::thread::hardware_concurrency());
  return 0;
}

}  // namespace dtrain::bench
