// `dtrain-bench scaling`: images/sec of the reference CNN and the scaling efficiency for 1..N
// replicas in one process (Mirrored on N logical CPU devices, one thread each) and 1..N worker
// processes (MultiWorkerMirrored through dtrain-run, one thread each), at a fixed batch per replica.
// --devices=gpu: one GPU per replica instead (Mirrored on gpu:0..N-1; N processes, each pinned to the
// GPU of its local rank with --devices=gpu:local).
// Runs are interleaved round by round; medians. tools/plot/plot_scaling.py draws the JSON lines.
#include <cstdio>
#include <filesystem>
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
    throw Unavailable("dtrain-bench scaling --devices=gpu --max-replicas=" + std::to_string(a.max_replicas) +
                      " needs that many GPUs, but " + std::to_string(cuda_device_count()) +
                      " are visible (no CUDA device, no CUDA in this build, or CUDA_VISIBLE_DEVICES); use "
                      "--devices=cpu or a smaller --max-replicas");
  auto command = [&](const std::string& mode, int n) {
    std::string common = gpu ? "" : " --threads 1";
    common += " --no-eval --batch-size " + std::to_string(a.batch_per_replica * n);
    common += " --steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) + " --json";
    if (gpu) {
      std::string list = "gpu:0";
      for (int i = 1; i < n; ++i) {
        list += ',';
        list += std::to_string(i);
      }
      if (n == 1) return example.string() + " --strategy=one_device --devices=gpu:0" + common;
      if (mode == "in-process") return example.string() + " --strategy=mirrored --devices=" + list + common;
      return dtrain_run + " -np " + std::to_string(n) + " -- " + example.string() +
             " --strategy=multi_worker_mirrored --devices=gpu:local" + common;
    }
    if (n == 1) return "OMP_NUM_THREADS=1 " + example.string() + " --strategy=one_device --devices=cpu" + common;
    if (mode == "in-process")
      return "OMP_NUM_THREADS=1 " + example.string() + " --strategy=mirrored --devices=cpu:" + std::to_string(n) + common;
    return dtrain_run + " -np " + std::to_string(n) + " -- " + example.string() + " --strategy=multi_worker_mirrored" + common;
  };
  std::map<std::pair<std::string, int>, std::vector<double>> ips;
  for (int r = 0; r < a.runs; ++r) {
    for (int n = 1; n <= a.max_replicas; ++n)
      for (const std::string mode : {"in-process", "processes"}) {
        if (n == 1 && mode == "processes") continue;  // one replica is the same run either way
        ips[{mode, n}].push_back(run_json_lines(command(mode, n)).back()["images_per_sec"].get<double>());
      }
    std::fprintf(stderr, "round %d/%d done\n", r + 1, a.runs);
  }
  const double one = median(ips[{"in-process", 1}]);
  std::printf("reference CNN, %ld images per replica, %s per replica, median of %d interleaved runs\n",
              a.batch_per_replica, gpu ? "1 GPU" : "1 thread", a.runs);
  std::printf("%-9s %22s %12s %22s %12s\n", "replicas", "in one process (img/s)", "efficiency", "processes (img/s)",
              "efficiency");
  for (int n = 1; n <= a.max_replicas; ++n) {
    const double in = median(ips[{"in-process", n}]);
    const double pr = n == 1 ? one : median(ips[{"processes", n}]);
    std::printf("%-9d %22.0f %11.1f%% %22.0f %11.1f%%\n", n, in, 100 * in / (n * one), pr, 100 * pr / (n * one));
    if (a.json) {
      for (const std::string mode : {"in-process", "processes"}) {
        const double v = mode == "in-process" ? in : pr;
        nlohmann::json j{{"benchmark", "scaling"}, {"mode", mode}, {"replicas", n},
                         {"batch_per_replica", a.batch_per_replica}, {"images_per_sec", v}, {"devices", a.devices},
                         {"efficiency", v / (n * one)}, {"runs", a.runs}, {"steps", a.steps}};
        std::printf("%s\n", j.dump().c_str());
      }
    }
  }
  if (!gpu && a.max_replicas > static_cast<int>(std::thread::hardware_concurrency()))
    std::printf("note: more replicas than the %u cores of this machine: the extra ones share cores\n",
                std::thread::hardware_concurrency());
  return 0;
}

}  // namespace dtrain::bench
