// `dtrain-bench compare`: the reference CNN on Fashion-MNIST, dtrain against TensorFlow 2.21, a
// current PyTorch 2.x and Debian's PyTorch 1.13, all in one run on this machine, round-robin
// interleaved, medians; images/sec, each run's peak RSS and the hypervisor's steal. Three setups,
// as issue #11 defines them:
//   one_thread  one process on one core (taskset -c 0), one thread
//   mirrored    two replicas in one process: dtrain Mirrored cpu:2; TF MirroredStrategy on 2
//   logical CPUs workers     two worker processes: plain `dtrain-run -np 2` MultiWorkerMirrored; TF
//   MWMS (RING);
//               PyTorch DDP over gloo (one core each)
// --steps timed steps at 64 images per replica; other batch sizes time the same number of images.
// --precision=bf16: dtrain --precision=bf16 against Keras' mixed_bfloat16 (PyTorch left out).
// --model resnet50 (101, 152): Horovod's synthetic benchmark instead, 224x224 random images:
// examples/synthetic_benchmark against bench/resnet/peer_synthetic.py (Keras ResNet50(weights=None)
// in a tf.function step; torchvision resnet50() eager; bf16: mixed_bfloat16 and
// autocast(bfloat16)); --steps timed batches after --warmup; rows one_thread, workers (TF MWMS
// RING, DDP over gloo; the peers' launcher pins a core each) and dtrain's mirrored. The two peers
// train different ResNets (Keras' v1 with convolution biases, torchvision's v1.5 without), so
// dtrain runs both forms: the Keras one against TensorFlow, "dtrain (tv form)" (--resnet-style
// torchvision) against PyTorch.
// --model gpt2: GPT-2 small (the gpt2 preset: 12 layers, width 768, vocabulary 50,257) on random
// byte windows of --context tokens, --batch-sizes windows per replica, AdamW and clipping:
// examples/gpt against bench/gpt/peer_gpt.py (the same model in PyTorch, eager and torch.compile);
// tokens/sec; rows one_thread, workers (DDP over gloo) and dtrain's mirrored.
// The peers come from bench/peers/setup.sh (a venv with tensorflow-cpu and torch; python3-torch).
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "bench_util.h"

namespace dtrain::bench {
namespace {

struct System {
  std::string key, label;
};

const std::vector<System> kSystems = {
    {"dtrain", "dtrain"},     {"dtrain_tv", "dtrain (tv form)"},  {"tf", "TensorFlow"},
    {"torch", "PyTorch 2.x"}, {"torch_compile", "torch.compile"}, {"torch113", "PyTorch 1.13"}};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

bool runs_python(const std::string& python, const std::string& module) {
  return std::system((python + " -c 'import " + module + "' >/dev/null 2>&1").c_str()) == 0;
}

const char* const kStderrLog = "/tmp/dtrain-bench-stderr.log";
const double kStealWarn = 0.05;  // a run losing more of a core than this is pointed out

// A share as "2.5%", or "n/a" where it is unknown (NaN).
std::string percent(double share) {
  if (std::isnan(share)) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * share);
  return buf;
}

// The largest known value (JSON null where none is known).
nlohmann::json most_known(const std::vector<double>& v) {
  nlohmann::json most = nullptr;
  for (const double x : v)
    if (!std::isnan(x) && (most.is_null() || x > most.get<double>())) most = x;
  return most;
}

// The last n lines of a file, each indented and ended, for a failure's message.
std::string last_lines(const std::string& path, size_t n) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string l; std::getline(in, l);) {
    if (l.empty()) continue;
    lines.push_back(l);
    if (lines.size() > n) lines.pop_front();
  }
  std::string out;
  for (const std::string& l : lines) out += "  " + l + "\n";
  return out;
}

}  // namespace

int compare_bench(const CompareArgs& a) {
  namespace fs = std::filesystem;
  const fs::path bin = fs::path(self_dir()).parent_path();
  const std::string example = (bin / "examples" / "fashion_mnist").string();
  const std::string dtrain_run = (fs::path(self_dir()) / "dtrain-run").string();
  const fs::path bench_dir = fs::path(source_dir()) / "bench";
  const std::string peers =
      a.peers_python.empty() ? (bin / "peers-venv" / "bin" / "python").string() : a.peers_python;
  const bool bf16 = a.precision == "bf16";
  const bool gpt = a.model == "gpt2";
  const bool resnet = a.model != "reference_cnn" && !gpt;
  const std::string gpt_example = (bin / "examples" / "gpt").string();
  const std::string peer_gpt = (bench_dir / "gpt" / "peer_gpt.py").string();
  const std::string synthetic = (bin / "examples" / "synthetic_benchmark").string();
  const std::string peer_synthetic = (bench_dir / "resnet" / "peer_synthetic.py").string();

  // Which peers are here: a missing one is left out of the table, said once.
  std::map<std::string, bool> have{{"dtrain", true}};
  // No TensorFlow GPT peer is written, and Debian's PyTorch 1.13 has no torch.compile.
  have["tf"] = !gpt && runs_python(peers, "tensorflow");
  have["torch"] = (resnet || gpt || !bf16) && runs_python(peers, resnet ? "torchvision" : "torch");
  have["torch_compile"] = gpt && have["torch"];
  have["torch113"] =
      !gpt && !bf16 && runs_python(a.debian_python, resnet ? "torchvision" : "torch");
  // ResNets: torchvision's form of the model, for the PyTorch columns.
  have["dtrain_tv"] = resnet && (have["torch"] || have["torch113"]);
  std::string torch113_version;
  for (const auto& [k, ok] : have)
    if (!ok && k != "dtrain_tv" && !(bf16 && (k == "torch" || k == "torch113")) &&
        !(gpt && k != "torch") && !(!gpt && k == "torch_compile")) {
      if (k == "torch113" && resnet && runs_python(a.debian_python, "torch"))
        std::fprintf(stderr,
                     "compare: Debian's PyTorch 1.13 (%s) has no torchvision, which the ResNets "
                     "need; left out\n",
                     a.debian_python.c_str());
      else
        std::fprintf(stderr,
                     "compare: %s is not installed (bench/peers/setup.sh installs it); left out\n",
                     k.c_str());
    }

  const std::vector<std::string> rows = split(a.rows);
  for (const std::string& r : rows)
    if (r != "one_thread" && r != "mirrored" && r != "workers")
      throw std::invalid_argument("--rows: unknown row '" + r +
                                  "' (one_thread, mirrored, workers)");
  std::vector<long> batches;
  for (const std::string& b : split(a.batch_sizes)) batches.push_back(std::stol(b));

  const std::string prec = bf16 ? " --precision=bf16" : "";
  // --steps is for 64 images per replica; other batch sizes run the same number of images.
  auto steps_for = [&](long b) {
    return resnet || gpt ? a.steps : std::max<long>(20, a.steps * 64 / b);
  };
  // The command of one system in one row, or "" when it has no such setup.
  // Horovod's synthetic benchmark: dtrain's example and the peers' script, same flags.
  auto resnet_command = [&](const std::string& row, const std::string& sys, long b) -> std::string {
    const std::string flags = " --model " + a.model + " --batch-size " + std::to_string(b) +
                              " --num-warmup-batches " + std::to_string(a.warmup) +
                              " --num-batches-per-iter 1 --num-iters " + std::to_string(a.steps) +
                              " --json";
    const std::string pin = "taskset -c 0 env OMP_NUM_THREADS=1 ";
    const std::string py = sys == "torch" ? peers : a.debian_python;
    if (sys == "dtrain" || sys == "dtrain_tv") {
      if (sys == "dtrain_tv" && row == "mirrored") return "";  // no peer to set it beside
      const std::string d =
          synthetic + flags + prec + (sys == "dtrain_tv" ? " --resnet-style torchvision" : "");
      if (row == "one_thread") return pin + d + " --strategy=one_device --threads 1";
      if (row == "mirrored") return d + " --strategy=mirrored --devices=cpu:2 --threads 1";
      return dtrain_run + " -np 2 -- " + d + " --strategy=multi_worker_mirrored";
    }
    const std::string peer = (sys == "tf" ? peers : py) + " " + peer_synthetic +
                             (sys == "tf" ? " tf" : " torch") + " --threads 1" + flags +
                             (bf16 ? " --precision bf16" : "");
    if (row == "one_thread") return pin + peer;
    if (row == "workers") return peer + " --workers 2";  // TF MWMS RING; DDP gloo; a core each
    return "";
  };
  // GPT-2 small: --steps timed steps after --warmup, --batch-sizes windows per replica.
  auto gpt_command = [&](const std::string& row, const std::string& sys, long b) -> std::string {
    const std::string pin = "taskset -c 0 env OMP_NUM_THREADS=1 ";
    if (sys == "dtrain") {
      const long replicas = row == "one_thread" ? 1 : 2, n = a.warmup + a.steps;
      const std::string d = gpt_example + " --preset gpt2 --context " + std::to_string(a.context) +
                            " --batch-size " + std::to_string(replicas * b) + " --steps " +
                            std::to_string(n) + " --steps-per-epoch " + std::to_string(n) +
                            " --epochs 1 --val-windows 1 --timing-warmup-steps " +
                            std::to_string(a.warmup) + " --json" + prec;
      if (row == "one_thread") return pin + d + " --strategy=one_device --threads 1";
      if (row == "mirrored") return d + " --strategy=mirrored --devices=cpu:2 --threads 1";
      return dtrain_run + " -np 2 -- " + d + " --strategy=multi_worker_mirrored";
    }
    if (row == "mirrored") return "";
    const std::string peer =
        peers + " " + peer_gpt + " --context " + std::to_string(a.context) + " --batch-size " +
        std::to_string(b) + " --threads 1 --warmup " + std::to_string(std::max(1, a.warmup)) +
        " --steps " + std::to_string(a.steps) + " --json" + (bf16 ? " --precision bf16" : "") +
        (sys == "torch_compile" ? " --compile" : "");
    return row == "one_thread" ? pin + peer : peer + " --workers 2";
  };
  auto command = [&](const std::string& row, const std::string& sys, long b) -> std::string {
    if (sys == "dtrain_tv" && !resnet) return "";
    if (gpt) return gpt_command(row, sys, b);
    if (resnet) return resnet_command(row, sys, b);
    const std::string timing = " --steps " + std::to_string(steps_for(b)) + " --warmup " +
                               std::to_string(a.warmup) + " --json";
    const std::string B = std::to_string(b), B2 = std::to_string(2 * b);
    const std::string tf = peers + " " + (bench_dir / "tf_fashion_mnist.py").string();
    const std::string pt = (bench_dir / "torch_fashion_mnist.py").string();
    const std::string ddp = (bench_dir / "torch_ddp_fashion_mnist.py").string();
    const std::string py = sys == "torch" ? peers : a.debian_python;
    if (row == "one_thread") {
      const std::string pin = "taskset -c 0 env OMP_NUM_THREADS=1 ";
      if (sys == "dtrain")
        return pin + example +
               " --strategy=one_device --devices=cpu --threads 1 --no-eval --batch-size " + B +
               prec + timing;
      if (sys == "tf")
        return pin + tf + " --strategy one_device --threads 1 --batch-size " + B +
               (bf16 ? " --precision bf16" : "") + timing;
      return pin + py + " " + pt + " --threads 1 --batch-size " + B + timing;
    }
    if (row == "mirrored") {
      if (sys == "dtrain")
        return example +
               " --strategy=mirrored --devices=cpu:2 --threads 1 --no-eval --batch-size " + B2 +
               prec + timing;
      if (sys == "tf")
        return tf + " --strategy mirrored --replicas 2 --threads 1 --batch-size " + B +
               (bf16 ? " --precision bf16" : "") + timing;
      return "";
    }
    // workers: plain dtrain-run (it gives each task its share of the cores and OMP_NUM_THREADS)
    if (sys == "dtrain")
      return dtrain_run + " -np 2 -- " + example +
             " --strategy=multi_worker_mirrored --no-eval --batch-size " + B2 + prec + timing;
    if (sys == "tf")
      return tf + " --strategy multi_worker_mirrored --replicas 2 --threads 1 --batch-size " + B +
             (bf16 ? " --precision bf16" : "") + timing;
    return "OMP_NUM_THREADS=1 " + py + " " + ddp + " --nproc 2 --threads-per-proc 1 --batch-size " +
           B + timing;
  };

  struct Result {
    std::vector<double> ips, rss, steal;  // steal: the hypervisor's share of a core (steal_share)
  };
  const int digits = resnet ? 2 : gpt ? 1 : 0;  // a few images a second for ResNet-50 on a core
  const char* unit = gpt ? "tokens/sec" : "images/sec";
  std::map<std::tuple<long, std::string, std::string>, Result> res;
  // A peer that fails (TensorFlow's mixed_bfloat16 has no oneDNN convolution below AVX-512, say)
  // is said, left out of that row and batch, and not run again there; the others go on. dtrain
  // failing ends the comparison.
  std::set<std::tuple<long, std::string, std::string>> failed;
  for (int round = 0; round < a.runs; ++round) {
    for (long b : batches)
      for (const std::string& row : rows)
        for (const System& s : kSystems) {
          if (!have[s.key] || failed.count({b, row, s.key})) continue;
          const std::string cmd = command(row, s.key, b);
          if (cmd.empty()) continue;
          nlohmann::json j;
          const CpuTicks before = cpu_ticks();
          try {
            j = run_json_lines(cmd, kStderrLog).back();
          } catch (const std::runtime_error& e) {
            if (s.key.rfind("dtrain", 0) == 0) throw;
            failed.insert({b, row, s.key});
            res.erase({b, row, s.key});  // earlier rounds' results too: no median of fewer
            std::fprintf(stderr, "compare: %s failed (batch %ld, %s row); left out of it: %s\n%s",
                         s.label.c_str(), b, row.c_str(), e.what(),
                         last_lines(kStderrLog, 3).c_str());
            continue;
          }
          Result& r = res[{b, row, s.key}];
          r.ips.push_back(j.contains("tokens_per_sec")   ? j.at("tokens_per_sec").get<double>()
                          : j.contains("images_per_sec") ? j.at("images_per_sec").get<double>()
                                                         : j.at("total_img_sec").get<double>());
          r.rss.push_back(j.value("peak_rss_mb", 0.0));
          // The cores the run used: one_thread's is pinned to core 0, the others use every core.
          r.steal.push_back(steal_share(
              before, cpu_ticks(), row == "one_thread" ? std::vector<int>{0} : std::vector<int>{}));
          std::fprintf(stderr, "round %d/%d  batch %ld  %-10s %-14s %8.*f %s  %6.0f MB  steal %s\n",
                       round + 1, a.runs, b, row.c_str(), s.label.c_str(), digits, r.ips.back(),
                       unit, r.rss.back(), percent(r.steal.back()).c_str());
        }
  }

  const std::map<std::string, std::string> row_label{
      {"one_thread", "one process, one thread (taskset -c 0)"},
      {"mirrored", "two replicas in one process (Mirrored)"},
      {"workers", "two worker processes (MWMS; DDP gloo)"}};
  std::printf("\n%s\n", cpu_description().c_str());
  for (long b : batches) {
    const std::string what = gpt      ? "GPT-2 small, context " + std::to_string(a.context)
                             : resnet ? a.model + " synthetic 224x224"
                                      : std::string("reference CNN");
    std::printf("\n%s, %ld %s per replica, %s, median of %d interleaved rounds: %s (peak RSS MB)\n",
                what.c_str(), b, gpt ? "windows" : "images", bf16 ? "mixed bfloat16" : "float32",
                a.runs, unit);
    std::printf("%-42s", "run");
    for (const System& s : kSystems)
      if (have[s.key]) std::printf(" %18s", s.label.c_str());
    for (const System& s : kSystems)
      if (have[s.key] && s.key.rfind("dtrain", 0) != 0)
        std::printf(" %10s", ("vs " + s.key).c_str());
    std::printf("\n");
    auto med = [&](const std::string& row, const std::string& sys, bool rss = false) {
      auto it = res.find({b, row, sys});
      if (it == res.end()) return 0.0;
      return median(rss ? it->second.rss : it->second.ips);
    };
    // dtrain's run of the same model as a peer's: the torchvision form for PyTorch's ResNets.
    auto ours = [&](const std::string& row, const std::string& peer) {
      const bool tv = (peer == "torch" || peer == "torch113") && med(row, "dtrain_tv") > 0;
      return med(row, tv ? "dtrain_tv" : "dtrain");
    };
    for (const std::string& row : rows) {
      std::printf("%-42s", row_label.at(row).c_str());
      for (const System& s : kSystems) {
        if (!have[s.key]) continue;
        const double v = med(row, s.key);
        if (v > 0)
          std::printf(" %11.*f (%4.0f)", digits, v, med(row, s.key, true));
        else
          std::printf(" %18s", failed.count({b, row, s.key}) ? "failed" : "-");
      }
      for (const System& s : kSystems) {
        if (!have[s.key] || s.key.rfind("dtrain", 0) == 0) continue;
        const double v = med(row, s.key);
        if (v > 0)
          std::printf(" %9.2fx", ours(row, s.key) / v);
        else
          std::printf(" %10s", "-");
      }
      std::printf("\n");
      if (a.json)
        for (const System& s : kSystems) {
          const double v = med(row, s.key);
          if (v <= 0) continue;
          nlohmann::json j{{"benchmark", "compare"},
                           {"model", a.model},
                           {"row", row},
                           {"system", s.key},
                           {"batch_per_replica", b},
                           {"precision", a.precision},
                           {gpt ? "tokens_per_sec" : "images_per_sec", v},
                           {"peak_rss_mb", med(row, s.key, true)},
                           {"steal_max", most_known(res.at({b, row, s.key}).steal)},
                           {"ratio_dtrain", ours(row, s.key) / v},
                           {"runs", a.runs},
                           {"steps", steps_for(b)}};
          if (gpt) j["context"] = a.context;
          std::printf("%s\n", j.dump().c_str());
        }
    }
    const double one = med("one_thread", "dtrain");
    if (one > 0) {
      if (med("mirrored", "dtrain") > 0)
        std::printf("dtrain scaling 1 -> 2 replicas in one process: %.1f%%\n",
                    100 * med("mirrored", "dtrain") / (2 * one));
      if (med("workers", "dtrain") > 0)
        std::printf("dtrain scaling 1 -> 2 worker processes: %.1f%%\n",
                    100 * med("workers", "dtrain") / (2 * one));
      if (med("mirrored", "dtrain") > 0 && med("workers", "dtrain") > 0)
        std::printf("dtrain Mirrored cpu:2 / two MWMS processes: %.2fx\n",
                    med("mirrored", "dtrain") / med("workers", "dtrain"));
    }
    // The hypervisor's share: on a quiet VM 0; where it took a few percent of a core in some runs,
    // those runs (and the ratios they enter) moved by that much.
    std::vector<double> all;
    double most = 0;
    std::string where;
    for (const auto& [key, r] : res) {
      if (std::get<0>(key) != b) continue;
      for (size_t i = 0; i < r.steal.size(); ++i) {
        if (std::isnan(r.steal[i])) continue;  // unknown (steal_share)
        all.push_back(r.steal[i]);
        if (r.steal[i] > most) {
          most = r.steal[i];
          const auto sys = std::find_if(kSystems.begin(), kSystems.end(),
                                        [&](const System& s) { return s.key == std::get<2>(key); });
          where = sys->label + ", " + std::get<1>(key) + " row, round " + std::to_string(i + 1);
        }
      }
    }
    if (!all.empty()) {
      std::printf(
          "hypervisor steal (/proc/stat; per run, the share of time stolen from the most-stolen "
          "core, core 0 alone for one-thread runs, over its process's life): median %.1f%%, most "
          "%.1f%%%s\n",
          100 * median(all), 100 * most, most > 0 ? (" (" + where + ")").c_str() : "");
      if (most > kStealWarn)
        std::printf(
            "  runs that lost more than %.0f%% to the hypervisor ran that much slower; the "
            "medians weigh them less with more --runs\n",
            100 * kStealWarn);
    }
  }
  return 0;
}

}  // namespace dtrain::bench
