// `dtrain-bench ps`: parameter-server traffic and training throughput.
//
// Traffic: for each (ps tasks, workers, variable size) a real job is started with dtrain-run; every
// worker creates one float32 variable of that size (split evenly over the ps tasks) and times
// ParameterServerStrategy steps whose only work is apply_gradients: one pull of the whole
// variable and one push of its gradient (SGD applied on the servers). Reported: round trips/sec
// and bytes/sec (pulled + pushed) summed over the workers.
//
// Training (--train): the reference CNN with 2 workers under ParameterServer (2 ps tasks) vs
// MultiWorkerMirrored, batch 64 per worker, runs interleaved; images/sec of the whole job.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "bench_util.h"
#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/parameter_server_strategy.h"

namespace dtrain::bench {
namespace {

std::vector<int> parse_counts(const std::string& s, const char* flag) {
  std::vector<int> out;
  for (long v : parse_sizes(s)) {
    if (v < 1 || v > 64)
      throw std::invalid_argument(std::string("bad count in ") + flag + ": " + s);
    out.push_back(static_cast<int>(v));
  }
  return out;
}

std::string human(long bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + " MB";
  if (bytes >= 1024 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KB";
  return std::to_string(bytes) + " B";
}

}  // namespace

int ps_worker(long bytes, double seconds) {
  auto cluster = from_environment();
  if (!cluster) throw std::runtime_error("ps-worker runs under dtrain-run (no TF_CONFIG)");
  if (cluster->task_type() == TaskType::kPs) {
    serve_parameter_server(*cluster);
    return 0;
  }
  ParameterServerOptions o;
  const int num_ps = cluster->cluster().num_tasks(TaskType::kPs);
  const int64_t elems = std::max<long>(bytes / 4, 1);
  const int64_t rows =
      std::max<int64_t>(elems / 256, 1);  // rows of 256 floats (1 KB), sharded by row
  const int64_t cols = elems / rows;
  o.partitioner = fixed_shards_partitioner(num_ps);
  ParameterServerStrategy strategy(o, DeviceSpec::cpu(), *cluster);
  std::shared_ptr<Variable> var;
  {
    auto scope = strategy.scope();
    VariableSpec spec;
    spec.name = "payload";
    spec.shape = Shape{rows, cols};
    spec.initializer = initializers::zeros();
    var = create_variable(spec);
  }
  SGD sgd(1e-6f);
  const Tensor grad = Tensor::full(Shape{rows, cols}, 1.f);
  auto step = [&] {
    strategy.run([&](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
      sgd.apply_gradients({grad}, {var});
      return {};
    });
  };
  for (int i = 0; i < 3; ++i) step();
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  long n = 0;
  double elapsed = 0;
  while ((elapsed = std::chrono::duration<double>(Clock::now() - t0).count()) < seconds) {
    step();
    ++n;
  }
  const double payload = static_cast<double>(rows * cols * 4);
  nlohmann::json j{{"round_trips_per_sec", n / elapsed},
                   {"bytes_per_sec", 2 * payload * n / elapsed},
                   {"variable_bytes", payload}};
  std::printf("%s\n", j.dump().c_str());
  strategy
      .finish_training();  // the chief waits for the others, so no worker loses its server early
  return 0;
}

int ps_bench(const PsArgs& a) {
  namespace fs = std::filesystem;
  const std::string self = (fs::path(self_dir()) / "dtrain-bench").string();
  const std::string launcher = (fs::path(self_dir()) / "dtrain-run").string();
  std::vector<nlohmann::json> results;
  if (!a.sizes.empty() && a.sizes != "none") {
    const bool peer = a.peer == "torch-rpc";
    const std::string peer_script =
        (fs::path(source_dir()) / "bench" / "peers" / "torch_rpc_ps.py").string();
    std::printf("%-6s %-8s %-8s %18s %14s %16s%s\n", "ps", "workers", "size", "round trips/sec",
                "MB/sec", "per worker rt/s", peer ? "   torch-rpc rt/s   ratio" : "");
    for (int ps : parse_counts(a.ps, "--ps"))
      for (int w : parse_counts(a.workers, "--workers"))
        for (long size : parse_sizes(a.sizes)) {
          std::vector<double> rt, bw, prt;
          for (int r = 0; r < a.runs; ++r) {
            if (peer)
              prt.push_back(run_json_lines("OMP_NUM_THREADS=1 " + a.python + " " + peer_script +
                                           " --ps " + std::to_string(ps) + " --workers " +
                                           std::to_string(w) + " --size " + std::to_string(size) +
                                           " --seconds " + std::to_string(a.seconds))
                                .back()["round_trips_per_sec"]
                                .get<double>());
            const auto lines = run_json_lines(launcher + " -np " + std::to_string(w) + " --ps " +
                                              std::to_string(ps) + " --timeout 300 -- " + self +
                                              " ps-worker --size " + std::to_string(size) +
                                              " --seconds " + std::to_string(a.seconds));
            double sum_rt = 0, sum_bw = 0;
            for (const auto& l : lines) {
              sum_rt += l["round_trips_per_sec"].get<double>();
              sum_bw += l["bytes_per_sec"].get<double>();
            }
            rt.push_back(sum_rt);
            bw.push_back(sum_bw);
          }
          const double mrt = median(rt), mbw = median(bw);
          std::printf("%-6d %-8d %-8s %18.0f %14.1f %16.0f", ps, w, human(size).c_str(), mrt,
                      mbw / 1e6, mrt / w);
          nlohmann::json j{{"benchmark", "ps_push_pull"},
                           {"ps", ps},
                           {"workers", w},
                           {"variable_bytes", size},
                           {"round_trips_per_sec", mrt},
                           {"bytes_per_sec", mbw},
                           {"runs", a.runs},
                           {"seconds", a.seconds}};
          if (peer) {
            const double mp = median(prt);
            std::printf(" %18.0f %6.2fx", mp, mrt / mp);
            j["peer"] = "torch-rpc";
            j["peer_round_trips_per_sec"] = mp;
            j["ratio"] = mrt / mp;
          }
          std::printf("\n");
          std::fflush(stdout);
          results.push_back(j);
        }
  }
  if (a.train) {
    const fs::path example = fs::path(self_dir()).parent_path() / "examples" / "fashion_mnist";
    const std::string common =
        " -- " + example.string() + " --devices=cpu --threads 1 --no-eval --batch-size ";
    const std::string steps = " --steps " + std::to_string(a.steps) + " --json";
    const std::string ps_cmd = "OMP_NUM_THREADS=1 " + launcher + " -np 2 --ps 2" + common +
                               "64 --strategy=parameter_server" + steps;
    const std::string mw_cmd = "OMP_NUM_THREADS=1 " + launcher + " -np 2" + common +
                               "128 --strategy=multi_worker_mirrored" + steps;
    std::vector<double> p, m;
    for (int r = 0; r < a.runs; ++r) {
      double sum = 0;
      for (const auto& l : run_json_lines(ps_cmd))
        sum += l["images_per_sec"].get<double>();  // every worker's own
      p.push_back(sum);
      m.push_back(run_json_lines(mw_cmd)
                      .back()["images_per_sec"]
                      .get<double>());  // the chief's, of the job
      std::fprintf(stderr,
                   "run %d/%d: parameter_server %.0f, multi_worker_mirrored %.0f images/sec\n",
                   r + 1, a.runs, p.back(), m.back());
    }
    const double mp = median(p), mm = median(m);
    std::printf("%-58s %12s\n", "reference CNN, 2 workers x 1 CPU thread (median)", "images/sec");
    std::printf("%-58s %12.0f\n", "parameter_server (2 ps, async, batch 64 per worker)", mp);
    std::printf("%-58s %12.0f\n", "multi_worker_mirrored (sync, global batch 128)", mm);
    std::printf("ratio parameter_server / multi_worker_mirrored: %.2fx\n", mp / mm);
    results.push_back({{"benchmark", "ps_train_fashion_mnist"},
                       {"workers", 2},
                       {"ps", 2},
                       {"steps", a.steps},
                       {"runs", a.runs},
                       {"parameter_server_images_per_sec", mp},
                       {"multi_worker_mirrored_images_per_sec", mm},
                       {"ratio", mp / mm}});
  }
  if (a.json)
    for (const auto& j : results) std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace dtrain::bench
