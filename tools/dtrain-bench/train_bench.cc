// `dtrain-bench train`: reference-CNN training throughput, dtrain vs PyTorch 1.13, interleaved.
#include <cstdio>
#include <filesystem>

#include "bench_util.h"

namespace dtrain::bench {

int train_bench(const TrainArgs& a) {
  namespace fs = std::filesystem;
  const fs::path example = fs::path(self_dir()).parent_path() / "examples" / "fashion_mnist";
  const fs::path bench_dir = fs::path(source_dir()) / "bench";
  int replicas = 1;
  if (a.devices.rfind("cpu:", 0) == 0) replicas = std::stoi(a.devices.substr(4));
  const bool multi_worker = a.strategy == "multi_worker_mirrored";
  if (multi_worker) replicas *= a.workers;
  const long global = a.batch_per_replica * replicas;
  const std::string omp = "OMP_NUM_THREADS=" + std::to_string(a.threads) + " ";
  const std::string steps =
      " --steps " + std::to_string(a.steps) + " --warmup " + std::to_string(a.warmup) + " --json";
  const std::string launcher = multi_worker ? (fs::path(self_dir()) / "dtrain-run").string() +
                                                  " -np " + std::to_string(a.workers) + " -- "
                                            : std::string();
  const std::string ours = omp + launcher + example.string() + " --strategy=" + a.strategy +
                           " --devices=" + a.devices + " --threads " + std::to_string(a.threads) +
                           " --no-eval --batch-size " + std::to_string(global) + steps;
  // One replica on one thread, for the scaling efficiency of multi-replica runs.
  const std::string single = omp + example.string() +
                             " --strategy=one_device --devices=cpu --threads " +
                             std::to_string(a.threads) + " --no-eval --batch-size " +
                             std::to_string(a.batch_per_replica) + steps;
  std::string theirs;
  if (a.peer == "torch")
    theirs = omp + a.python + " " + (bench_dir / "torch_fashion_mnist.py").string() +
             " --threads " + std::to_string(a.threads) + " --batch-size " + std::to_string(global) +
             steps;
  else
    theirs = omp + a.python + " " + (bench_dir / "torch_ddp_fashion_mnist.py").string() +
             " --nproc " + std::to_string(replicas) + " --threads-per-proc " +
             std::to_string(a.threads) + " --batch-size " + std::to_string(a.batch_per_replica) +
             steps;
  const bool scaling = replicas > 1;
  std::vector<double> o, t, s;
  for (int r = 0; r < a.runs; ++r) {
    o.push_back(run_json_lines(ours).back()["images_per_sec"].get<double>());
    t.push_back(run_json_lines(theirs).back()["images_per_sec"].get<double>());
    if (scaling) s.push_back(run_json_lines(single).back()["images_per_sec"].get<double>());
    std::fprintf(stderr, "run %d/%d: dtrain %.0f, %s %.0f%s images/sec\n", r + 1, a.runs, o.back(),
                 a.peer.c_str(), t.back(),
                 scaling
                     ? (", dtrain 1 replica " + std::to_string(static_cast<int>(s.back()))).c_str()
                     : "");
  }
  const double mo = median(o), mt = median(t);
  std::printf("%-44s %14s\n", "benchmark (median of runs)", "images/sec");
  std::printf("%-44s %14.0f\n",
              ("dtrain " + a.strategy + " --devices=" + a.devices +
               (multi_worker ? " x " + std::to_string(a.workers) + " workers" : ""))
                  .c_str(),
              mo);
  std::printf("%-44s %14.0f\n",
              (a.peer == "torch" ? std::string("pytorch 1.13")
                                 : "pytorch 1.13 DDP gloo x" + std::to_string(replicas))
                  .c_str(),
              mt);
  std::printf("ratio dtrain / %s: %.2fx\n", a.peer.c_str(), mo / mt);
  double eff = 0;
  if (scaling) {
    eff = mo / (replicas * median(s));
    std::printf("%-44s %14.0f\n", "dtrain one_device (1 replica)", median(s));
    std::printf("scaling efficiency %d replicas vs 1: %.1f%%\n", replicas, 100 * eff);
  }
  if (a.json) {
    nlohmann::json j{{"benchmark", "train_fashion_mnist"},
                     {"strategy", a.strategy},
                     {"devices", a.devices},
                     {"threads_per_replica", a.threads},
                     {"batch_per_replica", a.batch_per_replica},
                     {"steps", a.steps},
                     {"runs", a.runs},
                     {"dtrain_images_per_sec", mo},
                     {"peer", a.peer},
                     {"peer_images_per_sec", mt},
                     {"ratio", mo / mt}};
    if (scaling) j["scaling_efficiency"] = eff;
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace dtrain::bench
