// dtrain-bench: benchmarks as whole programs, each compared with a peer measured in the same run
// (runs interleaved, so machine noise hits both alike). Human table, and JSON lines with --json.
//
//   dtrain-bench train --peer=torch --runs=5 --steps=300 --threads=1
//   dtrain-bench train --strategy=mirrored --devices=cpu:2 --peer=torch-ddp --runs=3
//   dtrain-bench allreduce --backend=inproc --ranks=2 --sizes=4K,64K,1M,16M,64M --peer=mpi
//   dtrain-bench ps --ps=1,2 --workers=1,2,4 --sizes=4K,1M,16M --train
//   dtrain-bench scaling --max-replicas=2 --runs=3 --json
//   dtrain-bench input --images=2000 --runs=3
//   dtrain-bench peak --threads=1
//   DTRAIN_ALLOC_TRACE=t.txt examples/...; dtrain-bench alloc-replay t.txt
#include <CLI/CLI.hpp>
#include <cstdio>

#include "bench_util.h"

int main(int argc, char** argv) {
  using namespace dtrain::bench;
  CLI::App app{"dtrain benchmarks (each against a peer measured in the same run)"};
  app.require_subcommand(1);
  TrainArgs t;
  auto* train = app.add_subcommand("train", "reference CNN training throughput vs PyTorch");
  train->add_option("--strategy", t.strategy, "dtrain strategy")
      ->check(CLI::IsMember({"one_device", "mirrored", "central_storage", "multi_worker_mirrored"}))
      ->capture_default_str();
  train->add_option("--devices", t.devices, "dtrain devices (cpu or cpu:N)")->capture_default_str();
  train
      ->add_option("--peer", t.peer,
                   "torch (one process) or torch-ddp (one process per replica, gloo)")
      ->check(CLI::IsMember({"torch", "torch-ddp"}))
      ->capture_default_str();
  train
      ->add_option("--workers", t.workers,
                   "worker processes for multi_worker_mirrored (started with dtrain-run)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_option("--runs", t.runs, "interleaved runs of each")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_option("--steps", t.steps, "training steps per run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_option("--warmup", t.warmup, "steps excluded from timing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  train->add_option("--threads", t.threads, "CPU threads per replica, for both")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_option("--batch-size", t.batch_per_replica, "batch per replica")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  train->add_option("--python", t.python, "python with torch 1.13")->capture_default_str();
  train->add_flag("--json", t.json, "also print one JSON object");
  AllreduceArgs r;
  auto* ar = app.add_subcommand("allreduce", "allreduce bandwidth, nccl-tests style");
  ar->add_option("--backend", r.backend,
                 "inproc (threads of one process) or tcp (one process per rank)")
      ->check(CLI::IsMember({"inproc", "tcp"}))
      ->capture_default_str();
  ar->add_option("--ranks", r.ranks, "ranks")->check(CLI::PositiveNumber)->capture_default_str();
  ar->add_option("--sizes", r.sizes, "message sizes in bytes, K/M suffixes")->capture_default_str();
  ar->add_option("--iters", r.iters, "timed iterations per size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ar->add_option("--warmup", r.warmup, "untimed iterations per size")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  ar->add_option("--peer", r.peer,
                 "mpi, gloo (tcp only) or all: also run the peer on the same sizes")
      ->check(CLI::IsMember({"", "mpi", "gloo", "all"}));
  ar->add_option("--netns", r.netns,
                 "--backend=tcp across test hosts: rank r (and each peer's) on host r of "
                 "`tools/netns/dtrain-netns up "
                 "--prefix PREFIX` (own namespace, address and shaped link; needs root)");
  ar->add_flag(
      "--compute-probe", r.compute_probe,
      "--backend=tcp: pin rank r to core r mod cores (as dtrain-run --bind-to core) with a "
      "compute thread beside it, and report the core time the all-reduces took from it per "
      "byte a rank moves (lost(ns/B): the ranks' CPU, the kernel's work on the link, the "
      "caches), measured against the probe's rate just before");
  int wrank = 0;
  std::string waddrs, wtoken;
  auto* aw =
      app.add_subcommand("allreduce-worker", "one rank of allreduce --backend=tcp (internal)");
  aw->group("");  // hidden
  aw->add_option("--rank", wrank)->required();
  aw->add_option("--addresses", waddrs)->required();
  aw->add_option("--token", wtoken)->required();
  aw->add_option("--sizes", r.sizes);
  aw->add_option("--iters", r.iters);
  aw->add_option("--warmup", r.warmup);
  aw->add_flag("--compute-probe", r.compute_probe);
  ar->add_flag("--json", r.json, "also print one JSON object per result line");
  PsArgs p;
  auto* ps = app.add_subcommand(
      "ps", "parameter-server push+pull traffic, and PS vs MultiWorkerMirrored training");
  ps->add_option("--ps", p.ps, "numbers of ps tasks, e.g. 1,2")->capture_default_str();
  ps->add_option("--workers", p.workers, "numbers of workers, e.g. 1,2,4")->capture_default_str();
  ps->add_option("--sizes", p.sizes,
                 "variable sizes in bytes, K/M suffixes (none = skip the traffic table)")
      ->capture_default_str();
  ps->add_option("--seconds", p.seconds, "timed seconds per worker and configuration")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ps->add_option("--runs", p.runs, "runs of each configuration (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ps->add_option("--peer", p.peer,
                 "torch-rpc: also time a PyTorch torch.distributed.rpc parameter server")
      ->check(CLI::IsMember({"", "torch-rpc"}));
  ps->add_option("--python", p.python, "python with torch 1.13")->capture_default_str();
  ps->add_flag("--train", p.train,
               "also time the reference CNN: parameter_server vs multi_worker_mirrored, 2 workers");
  ps->add_option("--steps", p.steps, "--train: global steps per run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ps->add_flag("--json", p.json, "also print one JSON object per result");
  long pw_size = 4096;
  double pw_seconds = 2;
  auto* pw = app.add_subcommand("ps-worker", "one task of ps (internal)");
  pw->group("");  // hidden
  pw->add_option("--size", pw_size);
  pw->add_option("--seconds", pw_seconds);
  ScalingArgs sc;
  auto* scaling = app.add_subcommand(
      "scaling",
      "images/sec and scaling efficiency, 1..N replicas in one process and 1..N processes");
  scaling->add_option("--max-replicas", sc.max_replicas, "largest N")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  scaling->add_option("--runs", sc.runs, "interleaved rounds (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  scaling->add_option("--steps", sc.steps, "training steps per run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  scaling->add_option("--warmup", sc.warmup, "steps excluded from timing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  scaling->add_option("--batch-size", sc.batch_per_replica, "batch per replica")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  scaling->add_flag("--json", sc.json,
                    "also print one JSON object per result (tools/plot/plot_scaling.py)");
  scaling
      ->add_option(
          "--devices", sc.devices,
          "cpu: replicas are logical CPU devices / processes with one thread each; gpu: one GPU "
          "per "
          "replica (Mirrored on gpu:0..N-1, and N processes pinned by --devices=gpu:local)")
      ->check(CLI::IsMember({"cpu", "gpu"}))
      ->capture_default_str();
  CompareArgs cmp;
  auto* compare = app.add_subcommand("compare",
                                     "the reference CNN (or ResNet-50, Horovod's synthetic "
                                     "benchmark, or GPT-2 small) against TensorFlow 2.21, PyTorch "
                                     "2.x and PyTorch 1.13 (bench/peers/setup.sh)");
  compare
      ->add_option(
          "--model", cmp.model,
          "reference_cnn (Fashion-MNIST), or resnet50, resnet101, resnet152: Horovod's "
          "synthetic benchmark (examples/synthetic_benchmark against "
          "bench/resnet/peer_synthetic.py); --steps then counts timed batches; gpt2: GPT-2 "
          "small on random byte windows, tokens/sec (examples/gpt against "
          "bench/gpt/peer_gpt.py, PyTorch eager and torch.compile)")
      ->check(CLI::IsMember({"reference_cnn", "resnet50", "resnet101", "resnet152", "gpt2"}))
      ->capture_default_str();
  compare->add_option("--context", cmp.context, "gpt2: tokens per window")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  compare
      ->add_option("--batch-sizes", cmp.batch_sizes,
                   "images per replica, comma-separated (e.g. 32,64,256)")
      ->capture_default_str();
  compare->add_option("--rows", cmp.rows, "setups: one_thread, mirrored, workers")
      ->capture_default_str();
  compare
      ->add_option("--precision", cmp.precision,
                   "fp32, or bf16 (dtrain --precision=bf16 vs Keras mixed_bfloat16)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  compare->add_option("--runs", cmp.runs, "interleaved rounds (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  compare
      ->add_option("--steps", cmp.steps,
                   "timed steps per run at 64 images per replica (others: as many images)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  compare->add_option("--warmup", cmp.warmup, "steps before timing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  compare->add_option("--peers-python", cmp.peers_python,
                      "interpreter with tensorflow and torch (default: build/peers-venv)");
  compare->add_option("--debian-python", cmp.debian_python, "interpreter with Debian's torch 1.13")
      ->capture_default_str();
  compare->add_flag("--json", cmp.json, "also print one JSON object per result");
  InputArgs in;
  auto* input = app.add_subcommand(
      "input",
      "the image input pipeline (JPEG decode, random resized crop, flip, normalise, batch) vs "
      "tf.data and PyTorch's DataLoader, images/sec on 1 core and on all");
  input->add_option("--images", in.images, "JPEGs in the folder (made once)")
      ->check(CLI::Range(64, 60000))
      ->capture_default_str();
  input->add_option("--epochs", in.epochs, "passes over the folder per run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  input->add_option("--batch-size", in.batch, "images per batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  input->add_option("--warmup", in.warmup, "batches before timing")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  input->add_option("--runs", in.runs, "interleaved rounds (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  input->add_option("--peers-python", in.peers_python,
                    "interpreter with tensorflow and torchvision (default: build/peers-venv)");
  input->add_flag("--json", in.json, "also print one JSON object per result");
  std::string ir_dir;
  int ir_threads = 1;
  auto* input_run_cmd = app.add_subcommand("input-run", "one dtrain input run (internal)");
  input_run_cmd->group("");  // hidden
  input_run_cmd->add_option("--dir", ir_dir)->required();
  input_run_cmd->add_option("--threads", ir_threads);
  input_run_cmd->add_option("--batch-size", in.batch);
  input_run_cmd->add_option("--epochs", in.epochs);
  input_run_cmd->add_option("--warmup", in.warmup);
  std::string ir_samples;
  input_run_cmd->add_option("--samples", ir_samples,
                            "write the first batch's images as a PNG grid");
  PeakArgs pk;
  auto* peak = app.add_subcommand(
      "peak",
      "the machine's limit: float32 and mixed bfloat16 matmul GFLOP/s (oneDNN), and memory GB/s");
  peak->add_option("--threads", pk.threads, "threads (one CPU device)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  peak->add_option("--sizes", pk.sizes, "matrix sizes n (n x n x n products)")
      ->capture_default_str();
  peak->add_option("--reps", pk.reps, "timed products per size (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  peak->add_option("--images-per-sec", pk.images_per_sec,
                   "a training run's speed, to print its share of the peak");
  peak->add_option("--gflop-per-image", pk.gflop_per_image,
                   "that model's GFLOP per training image (ResNet-50 at 224: 24.6, 2 per "
                   "multiply-add)");
  peak->add_option("--stream-mb", pk.stream_mb,
                   "MB of each tensor of the memory-bandwidth line (c = a + b); 0 leaves it out")
      ->check(CLI::Range(0.0, 4096.0))
      ->capture_default_str();
  peak->add_option("--conv-batches", pk.conv_batches,
                   "also time ResNet-50's 3x3 layers (56x56x64 to 7x7x512; forward and both "
                   "backward passes) at these batch sizes, Winograd off and on")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  peak->add_flag("--json", pk.json, "also print one JSON object per result");
  AllocReplayArgs al;
  auto* alloc = app.add_subcommand(
      "alloc-replay",
      "an allocation trace (DTRAIN_ALLOC_TRACE=FILE) replayed against the CUDA allocator's "
      "policies: device memory each would reserve");
  alloc->add_option("trace", al.trace, "the trace file")->required();
  alloc->add_flag("--json", al.json, "also print one JSON object");
  ChaosArgs ch;
  auto* chaos =
      app.add_subcommand("chaos",
                         "R jobs across netns test hosts, one fault each (kill -9, SIGSTOP, link "
                         "cut, all packets dropped); hangs, named losses, resumes (needs root)");
  chaos
      ->add_option("--jobs", ch.jobs,
                   "R: jobs to run, taking the 8 (strategy, fault) pairs in turn "
                   "(MultiWorkerMirrored and ParameterServer x 4 faults)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  chaos->add_option("--workers", ch.workers, "workers per job (>= 2)")
      ->check(CLI::Range(2, 8))
      ->capture_default_str();
  chaos->add_option("--steps", ch.steps, "training steps per job")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  chaos->add_option("--seed", ch.seed, "picks the faults, victims and moments")
      ->capture_default_str();
  chaos
      ->add_option("--max-fault-seconds", ch.max_fault_s,
                   "the fault comes 1..this many seconds after the start")
      ->check(CLI::Range(1.5, 60.0))
      ->capture_default_str();
  chaos
      ->add_option("--heartbeat-timeout", ch.heartbeat_timeout_s,
                   "seconds a silent peer may go before it is hung (DTRAIN_HEARTBEAT_TIMEOUT for "
                   "every job); the lost task must be named within twice this")
      ->check(CLI::Range(0.5, 60.0))
      ->capture_default_str();
  chaos->add_option("--rate", ch.rate, "link rate of each test host (tc tbf)")
      ->capture_default_str();
  chaos->add_option("--prefix", ch.prefix, "dtrain-netns prefix for the hosts it makes and removes")
      ->capture_default_str();
  chaos
      ->add_option("--cases", ch.cases,
                   "only these (strategy, fault) pairs, taken in turn: STRATEGY:FAULT with "
                   "STRATEGY multi_worker_mirrored or parameter_server and FAULT kill, stop, "
                   "link_down or drop (e.g. --cases multi_worker_mirrored:link_down to repeat one)")
      ->delimiter(',')
      ->check([](const std::string& c) -> std::string {
        const auto colon = c.find(':');
        const std::string s = c.substr(0, colon),
                          f = colon == std::string::npos ? "" : c.substr(colon + 1);
        if ((s == "multi_worker_mirrored" || s == "parameter_server") &&
            (f == "kill" || f == "stop" || f == "link_down" || f == "drop"))
          return {};
        return "'" + c +
               "' is not STRATEGY:FAULT (multi_worker_mirrored or parameter_server; kill, stop, "
               "link_down or drop)";
      });
  chaos->add_flag("--json", ch.json, "also print one JSON object per case");
  chaos->add_flag("--elastic", ch.elastic,
                  "elastic jobs instead (examples/elastic_fashion_mnist under dtrain-run --min-np "
                  "2 --max-np W on W+1 "
                  "hosts, any worker hit, rank 0 included): each must re-form and finish with "
                  "every step applied once");
  SimulateArgs sim;
  auto* simulate = app.add_subcommand(
      "simulate",
      "a data-parallel step at other worker counts and link speeds, from one worker's timeline: "
      "gradient packs, ring/tree/hierarchical all-reduce, overlap with backward");
  simulate
      ->add_option("--profile", sim.profile,
                   "timeline of one worker (DTRAIN_TIMELINE=FILE examples/synthetic_benchmark or "
                   "examples/gpt --strategy=mirrored --devices=cpu)")
      ->required();
  simulate->add_option("--warmup", sim.warmup, "steps of the profile left out")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  simulate->add_option("--workers", sim.workers, "worker counts, comma-separated")
      ->capture_default_str();
  simulate->add_option("--gbps", sim.gbps,
                       "link rates in Gbit/s, comma-separated (default 10,25,100)");
  simulate
      ->add_option(
          "--link-efficiency", sim.link_efficiency,
          "bus bandwidth / link rate (0.93-0.94 measured over TCP on 1 Gbit/s netns links)")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  simulate
      ->add_option("--busbw", sim.busbw,
                   "measured bus bandwidth, bytes/s (dtrain-bench allreduce), instead of --gbps")
      ->check(CLI::PositiveNumber);
  simulate->add_option("--latency-us", sim.latency_us, "seconds x 1e6 of one empty ring step")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  simulate
      ->add_option("--small-allreduce-seconds", sim.small_allreduce_seconds,
                   "measured time of a tiny all-reduce at --workers (one count): sets the latency")
      ->check(CLI::PositiveNumber);
  simulate->add_option("--algorithm", sim.algorithm, "ring, tree or hierarchical")
      ->check(CLI::IsMember({"ring", "tree", "hierarchical"}))
      ->capture_default_str();
  simulate->add_option("--workers-per-host", sim.workers_per_host, "hierarchical: workers per host")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  simulate->add_option("--intra-gbps", sim.intra_gbps, "hierarchical: link rate inside a host")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  simulate
      ->add_option("--intra-latency-us", sim.intra_latency_us,
                   "hierarchical: step latency inside a host")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  simulate
      ->add_option("--comm-cpu-ns-per-byte", sim.comm_cpu_ns_per_byte,
                   "CPU links: ns of compute a worker loses per byte it moves (TCP, sums, the "
                   "kernel's work on the link: `allreduce --compute-probe` measures it; 0: none, "
                   "as on a GPU)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  simulate->add_option("--workers-per-core", sim.workers_per_core, "workers sharing one core")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  simulate
      ->add_option("--pack-mb", sim.pack_mb,
                   "gradient pack (fusion buffer) size, MB, or auto: dtrain's default for the "
                   "processes in the cross-worker ring (512 KiB each, 4-64 MiB)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            if (v == "auto") return "";
            try {
              size_t used = 0;
              if (std::stod(v, &used) > 0 && used == v.size()) return "";
            } catch (const std::exception&) {
            }
            return "'" + v + "' is neither a positive number of megabytes nor auto";
          },
          "MB|auto"))
      ->capture_default_str();
  simulate
      ->add_option("--step-seconds", sim.step_seconds,
                   "scale the profile's compute to this one-worker step time (a measured "
                   "step on another device, e.g. a GPU)")
      ->check(CLI::PositiveNumber);
  simulate->add_flag("--json", sim.json, "also print one JSON object per prediction");
  auto* links = app.add_subcommand(
      "links",
      "ResNet-50 and GPT-2 on 2-4 netns hosts at shaped link rates, MultiWorkerMirrored vs DDP "
      "(bench/links/links.py; its options follow, see --help there; needs root)");
  links->allow_extras();
  links->set_help_flag("");  // --help goes to links.py
  links->prefix_command();
  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) return train_bench(t);
    if (*ar) return allreduce_bench(r);
    if (*ps) return ps_bench(p);
    if (*scaling) return scaling_bench(sc);
    if (*compare) return compare_bench(cmp);
    if (*chaos) return chaos_bench(ch);
    if (*input) return input_bench(in);
    if (*peak) return peak_bench(pk);
    if (*alloc) return alloc_replay_bench(al);
    if (*simulate) return simulate_bench(sim);
    if (*links) return links_bench(links->remaining());
    if (*input_run_cmd)
      return input_run(ir_dir, ir_threads, in.batch, in.epochs, in.warmup, ir_samples);
    if (*pw) return ps_worker(pw_size, pw_seconds);
    if (*aw)
      return allreduce_worker(wrank, waddrs, wtoken, r.sizes, r.iters, r.warmup, r.compute_probe);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
