// Helpers and entry points shared by dtrain-bench's subcommands.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtrain::bench {

// Runs a shell command; returns the JSON object lines of its stdout. Throws on a non-zero exit. Its
// stderr goes to stderr_log (commands run at once need one each).
std::vector<nlohmann::json> run_json_lines(
    const std::string& cmd, const std::string& stderr_log = "/tmp/dtrain-bench-stderr.log");
double median(std::vector<double> v);
std::string self_dir();  // directory of the running executable
// The dtrain checkout this dtrain-bench was built from (bench/, tools/netns/ live there). Defined
// in bench_util.cc alone, so that only that file's compile line carries the absolute path (ccache).
std::string source_dir();
// /proc/cpuinfo's "model name" of the first CPU ("unknown CPU" without one).
std::string cpu_model();
bool cpu_flag(const std::string& flag);  // the first CPU's flags line lists `flag`
// What a figure depends on, printed beside it: "CPU: <model name> (family F model M), N logical
// CPUs; AVX2 yes, AVX-512F yes, AVX-512 BF16 yes, AMX-BF16 no".
std::string cpu_description();
// The hypervisor's share of a VM's CPU time ("steal" in /proc/stat): time a vCPU was ready to run
// and the host ran something else. On these VMs it moves a run's speed by up to 2x, so a benchmark
// says it beside each figure. A snapshot of each online core's counters, by the N of its "cpuN":
struct CoreTicks {
  int cpu = 0;
  unsigned long long total = 0, steal = 0;  // elapsed ticks (guest time not counted twice), stolen
};
struct CpuTicks {
  std::vector<CoreTicks> cores;
};
// Parses /proc/stat's text (the "cpuN" lines; the all-CPU "cpu" line and malformed lines are left
// out). Kernels that report no steal column give 0 stolen.
CpuTicks parse_cpu_ticks(const std::string& proc_stat);
CpuTicks cpu_ticks();  // /proc/stat now; empty where it cannot be read
// The largest share of one core's elapsed ticks stolen between two snapshots, 0 to 1, over the
// cores in `cpus` (all when empty) that both snapshots have. The largest, not the mean: a run
// pinned to one core loses what that core loses, and an idle core is never stolen from. NaN where
// no such core elapsed a tick (cores gone offline, /proc/stat unreadable): unknown, not 0.
double steal_share(const CpuTicks& before, const CpuTicks& after,
                   const std::vector<int>& cpus = {});

// "4K,64K,1M,64M" -> bytes. Throws std::invalid_argument naming a bad entry.
std::vector<long> parse_sizes(const std::string& s);

struct TrainArgs {
  std::string strategy = "one_device", devices = "cpu", peer = "torch", python = "/usr/bin/python3";
  int runs = 5, threads = 1, warmup = 20, workers = 2;
  long steps = 300, batch_per_replica = 64;
  bool json = false;
};
int train_bench(const TrainArgs& a);

struct AllreduceArgs {
  std::string backend = "inproc", peer, sizes = "4K,64K,1M,16M,64M";
  std::string netns;  // --backend=tcp across the test hosts of tools/netns/dtrain-netns (PREFIX)
  int ranks = 2, iters = 20, warmup = 5;
  bool json = false;
  // --backend=tcp: each rank pinned as dtrain-run places workers, with a compute probe beside it
  // (allreduce_bench.cc, ComputeProbe); the rows gain compute_lost_ns_per_byte.
  bool compute_probe = false;
};
int allreduce_bench(const AllreduceArgs& a);
// One rank of `allreduce --backend=tcp` (a process started by allreduce_bench).
int allreduce_worker(int rank, const std::string& addresses, const std::string& token,
                     const std::string& sizes, int iters, int warmup, bool compute_probe);

struct PsArgs {
  std::string ps = "1,2", workers = "1,2,4", sizes = "4K,1M,16M", peer, python = "/usr/bin/python3";
  int runs = 3;
  double seconds = 2;
  bool train = false, json = false;
  long steps = 300;
};
int ps_bench(const PsArgs& a);
// One task of `ps` (started by dtrain-run): a ps task serves, a worker times pull+push steps.
int ps_worker(long bytes, double seconds);

struct ScalingArgs {
  int max_replicas = 2;
  int runs = 3;
  int steps = 200;
  int warmup = 20;
  long batch_per_replica = 64;
  bool json = false;
  std::string devices = "cpu";  // or "gpu"
};
int scaling_bench(const ScalingArgs& a);

struct CompareArgs {
  std::string batch_sizes = "64", rows = "one_thread,mirrored,workers", precision = "fp32";
  std::string model = "reference_cnn";  // or resnet50/101/152 (Horovod's synthetic benchmark), gpt2
  long context = 256;                   // gpt2: tokens per window
  std::string peers_python;             // default: <build>/peers-venv/bin/python
  std::string debian_python = "/usr/bin/python3";
  int runs = 3, warmup = 20;
  long steps = 300;
  bool json = false;
};
int compare_bench(const CompareArgs& a);

struct InputArgs {
  int images = 2000, batch = 64, epochs = 2, warmup = 3, runs = 3;
  std::string peers_python;  // default: <build>/peers-venv/bin/python
  bool json = false;
};
int input_bench(const InputArgs& a);
// One dtrain run of the input pipeline (a JSON line); `dtrain-bench input` starts it.
int input_run(const std::string& dir, int threads, int batch, int epochs, int warmup,
              const std::string& samples = "");

struct PeakArgs {
  int threads = 1, reps = 5;
  std::vector<int64_t> sizes = {512, 1024, 2048};
  double images_per_sec = 0, gflop_per_image = 0;
  double stream_mb = 128;             // the memory-bandwidth line's tensor size; 0: none
  std::vector<int64_t> conv_batches;  // ResNet-50's 3x3 layers at these batches; empty: none
  bool json = false;
};
int peak_bench(const PeakArgs& a);

struct AllocReplayArgs {
  std::string trace;  // DTRAIN_ALLOC_TRACE's file
  bool json = false;
};
// An allocation trace replayed against the CUDA allocator's policies (alloc_bench.cc).
int alloc_replay_bench(const AllocReplayArgs& a);

struct ChaosArgs {
  int jobs = 10, workers = 3, steps = 400;
  uint64_t seed = 1;
  double max_fault_s = 4, heartbeat_timeout_s = 5;
  std::string prefix = "dtc", rate = "1gbit";
  // Which (strategy, fault) pairs the jobs take in turn, e.g. {"multi_worker_mirrored:link_down"};
  // empty: all 8.
  std::vector<std::string> cases;
  bool json = false;
  bool elastic =
      false;  // elastic MultiWorkerMirrored jobs (dtrain-run --min-np/--max-np) that must finish
};
int chaos_bench(const ChaosArgs& a);
struct SimulateArgs {
  std::string profile;  // a one-worker timeline (DTRAIN_TIMELINE)
  std::string workers = "2,8,32,128,512,1024", gbps, algorithm = "ring";
  int warmup = 1, workers_per_host = 8;
  double busbw = 0, small_allreduce_seconds = 0, link_efficiency = 0.94, latency_us = 25;
  double intra_gbps = 2400, intra_latency_us = 5, step_seconds = 0;
  // Megabytes, or "auto": dtrain's default for the processes the cross-worker ring spans
  // (auto_bytes_per_pack: every worker under ring and tree, one per host under hierarchical).
  std::string pack_mb = "auto";
  double comm_cpu_ns_per_byte = 0;
  int workers_per_core = 1;
  bool json = false;
};
int simulate_bench(const SimulateArgs& a);
// `dtrain-bench links ARGS`: runs bench/links/links.py ARGS with the build this tool is in.
int links_bench(const std::vector<std::string>& args);

}  // namespace dtrain::bench
