// A model of one data-parallel training step, for `dtrain-bench simulate`: what a step of N workers
// would take, from what one worker measured (its timeline) and what the links can carry.
//
// The step, as MultiWorkerMirrored runs it (and Horovod, and DDP with its buckets):
//   forward; backward, during which gradients become ready one by one (measured: when, how large);
//   ready gradients are fused into packs of `bytes_per_pack` in the order they become ready, and
//   each full pack is all-reduced on one communication channel, after the packs before it (FIFO);
//   the last, partly filled pack is all-reduced when backward ends; the update runs once every pack
//   is back. step = forward + max(backward, when the last pack is back) + update + other, where
//   "other" is what the profile measured between one step's update and the next step's forward.
// An all-reduce of S bytes over N workers:
//   ring:          2 (N-1) alpha + 2 (N-1)/N S / busbw
//   tree:          2 ceil(log2 N) alpha + 2 (N-1)/N S / busbw     (NCCL's double binary tree: the
//                  ring's bandwidth, logarithmic latency)
//   hierarchical:  G workers per host: reduce-scatter and all-gather inside each host (ring steps
//   at
//                  intra_busbw), a ring across the H = N/G hosts of S/G per worker, the G rings
//                  sharing one host link: 2 (G-1)(alpha_intra + S/(G intra_busbw))
//                  + 2 (H-1) alpha + 2 (H-1)/H S / busbw
// where busbw is the bus bandwidth nccl-tests and `dtrain-bench allreduce` report (what each link
// carries per direction) and alpha the time of one ring step with nothing in it.
//
// Where communication runs on the cores that compute (TCP and the sums on a CPU), backward is
// stretched by the compute the bytes each worker moves while backward runs take from it
// (Network::cpu_seconds_per_byte: bench/links/links.py measures it on the same links with
// `dtrain-bench allreduce --compute-probe`, a compute thread beside each rank: the ranks' CPU, the
// kernel's work on the link and the caches; on a 1 Gbit/s shaped link 2-4x the ranks' own CPU);
// bytes all-reduced after it cost only the channel's time. What it leaves out: on a GPU, kernels
// sharing SMs with NCCL; stragglers; contention between the channel's packs and other traffic; the
// channel slowed inside backward by the compute beside it (the packs run at the idle machine's bus
// bandwidth); the memory bandwidth the all-reduce's copies and sums take from backward's
// memory-bound passes (the probe's product stays in L2). Scaling efficiency = compute-only step /
// predicted step.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtrain::bench {

struct GradientReady {
  double at = 0;     // seconds after backward started
  double bytes = 0;  // its size
};

struct StepProfile {
  double forward = 0, backward = 0, update = 0, other = 0;  // seconds, medians over steps
  std::vector<GradientReady> gradients;                     // in the order they became ready
  int steps = 0;                                            // steps the medians are over
  double compute() const { return forward + backward + update + other; }
  double gradient_bytes() const;
  // The same profile with every time multiplied by `factor` (another device's speed).
  StepProfile scaled(double factor) const;
};

// From a Chrome trace written by DTRAIN_TIMELINE: the first process with "backward" spans; each
// step's "forward", "backward" and "optimizer update" spans on that thread and the zero-length
// "gradient I: B B" events inside its backward span; the first `warmup` steps left out. Medians per
// phase and per gradient. Throws std::runtime_error naming what is missing.
StepProfile profile_from_timeline(const nlohmann::json& trace, int warmup);

enum class Algorithm { kRing, kTree, kHierarchical };
Algorithm parse_algorithm(const std::string& name);  // ring, tree, hierarchical; throws otherwise

struct Network {
  int workers = 2;
  double busbw = 0;  // bytes/s per link and direction, as an all-reduce's bus bandwidth
  double alpha = 0;  // seconds per ring step with no payload
  Algorithm algorithm = Algorithm::kRing;
  int workers_per_host = 1;  // hierarchical: G
  double intra_busbw = 0;    // hierarchical: bytes/s inside a host
  double intra_alpha = 0;    // hierarchical: seconds per step inside a host
  // CPU links (TCP through the kernel, sums on the host): the core seconds of compute lost per byte
  // a worker moves (2 (N-1)/N of the gradients a step), on the cores its compute runs on, shared by
  // `workers_per_core` workers; charged to backward for the bytes moved while it runs. 0 =
  // communication costs no compute (a GPU with its own copy engines).
  double cpu_seconds_per_byte = 0;
  int workers_per_core = 1;
};

double allreduce_seconds(double bytes, const Network& net);

struct PackTiming {
  double bytes = 0, launch = 0, start = 0, end = 0;  // seconds after backward started
};

struct StepPrediction {
  double seconds_per_step = 0;
  double compute_seconds = 0;    // the same step with no all-reduce (one worker)
  double allreduce_seconds = 0;  // summed over packs
  double hidden_share = 0;       // of allreduce_seconds, the part inside backward
  double efficiency = 0;         // compute_seconds / seconds_per_step
  std::vector<PackTiming> packs;
};

StepPrediction simulate_step(const StepProfile& profile, const Network& net, double bytes_per_pack);

}  // namespace dtrain::bench
