// `dtrain-bench allreduce`: nccl-tests style table for dtrain's collectives, optionally next to a
// peer (OpenMPI's MPI_Allreduce over shared memory) measured in the same run.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <thread>

#include "bench_util.h"
#include "dtrain/collectives/inproc.h"
#include "dtrain/collectives/tcp.h"
#include "dtrain/core/strings.h"

namespace dtrain::bench {
namespace {

// CPU time of this process so far (every thread, user + system), seconds.
double process_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The compute a rank's communication costs the work beside it on its core (`allreduce
// --compute-probe`): a thread of the rank's process runs a float32 matrix product that stays in L2
// (96 x 96) and counts the products it finishes. Its rate while the all-reduces run, against its
// rate just before them, gives the core time they took from it: the rank's own threads, the
// kernel's work on the link (softirq, a shaped link's qdisc timers, which the rank's CPU time does
// not show) and what they evict from the caches. This is what a training step's backward pass loses
// per byte it all-reduces (bench/links/links.py feeds it to the step model as
// Network::cpu_seconds_per_byte).
class ComputeProbe {
 public:
  ComputeProbe() : thread_([this] { loop(); }) {}
  ~ComputeProbe() {
    stop_.store(true);
    thread_.join();
  }
  ComputeProbe(const ComputeProbe&) = delete;
  ComputeProbe& operator=(const ComputeProbe&) = delete;
  long done() const { return done_.load(std::memory_order_relaxed); }
  // The probe thread's own CPU time so far, seconds (left out of the ranks' cpu(us)).
  double cpu_seconds() {
    clockid_t id;
    timespec ts{};
    if (::pthread_getcpuclockid(thread_.native_handle(), &id) != 0 || ::clock_gettime(id, &ts) != 0)
      return 0;
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  }

 private:
  void loop() {
    constexpr int n = 96;
    std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n, 0.f);
    while (!stop_.load(std::memory_order_relaxed)) {
      for (int i = 0; i < n; ++i)
        for (int k = 0; k < n; ++k) {
          const float av = a[static_cast<size_t>(i * n + k)];
          for (int j = 0; j < n; ++j)
            c[static_cast<size_t>(i * n + j)] += av * b[static_cast<size_t>(k * n + j)];
        }
      a[0] = c[0] * 1e-30f;  // (keeps the products live)
      done_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::atomic<bool> stop_{false};
  std::atomic<long> done_{0};
  std::thread thread_;
};

// Pins this process to core rank % cores of the cores it may run on, as `dtrain-run --bind-to core`
// places worker `rank` when there are at least as many workers as cores (with fewer, dtrain-run
// gives each a block of cores; the probe still takes one, so that it shares it with the rank);
// returns how many of the `ranks` share that core. Throws where the pinning fails: the probe's
// share of the core would be unknown.
int pin_like_dtrain_run(int rank, int ranks) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
    throw std::runtime_error(std::string("--compute-probe: sched_getaffinity failed: ") +
                             std::strerror(errno));
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  const int k = static_cast<int>(cores.size());
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cores[static_cast<size_t>(rank % k)], &one);
  if (::sched_setaffinity(0, sizeof(one), &one) != 0)
    throw std::runtime_error("--compute-probe: could not pin rank " + std::to_string(rank) +
                             " to core " + std::to_string(cores[static_cast<size_t>(rank % k)]) +
                             ": " + std::strerror(errno));
  int sharing = 0;
  for (int r = 0; r < ranks; ++r) sharing += r % k == rank % k ? 1 : 0;
  return sharing;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Mean time per allreduce (max over ranks), in-process group of `ranks` threads.
double time_inproc(int ranks, long bytes, int iters, int warmup) {
  auto comms = make_inproc_group(ranks);
  std::vector<double> secs(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      Tensor t = Tensor::full(Shape{std::max(1L, bytes / 4)}, 1.f + r);
      Communicator& c = *comms[static_cast<size_t>(r)];
      for (int i = 0; i < warmup; ++i) c.allreduce(t, ReduceOp::kSum).wait();
      c.barrier().wait();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) c.allreduce(t, ReduceOp::kSum).wait();
      secs[static_cast<size_t>(r)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    });
  for (auto& t : threads) t.join();
  return *std::max_element(secs.begin(), secs.end());
}

nlohmann::json row(const std::string& backend, int ranks, long bytes, double secs) {
  const double alg = static_cast<double>(bytes) / secs / 1e9;
  return {{"backend", backend}, {"ranks", ranks},
          {"bytes", bytes},     {"time_us", secs * 1e6},
          {"algbw_GBps", alg},  {"busbw_GBps", alg * 2.0 * (ranks - 1) / ranks}};
}

// cpu(us): CPU time of all ranks' processes together per all-reduce (user + system, every thread
// but the probe's), where the row has it (dtrain's tcp backend): what the ranks spend, busy or
// waiting, per operation. lost(ns/B), with --compute-probe: the core time the probes lost per byte
// a rank moved.
void print_table(const std::vector<nlohmann::json>& rows, bool json) {
  std::printf("%-8s %6s %12s %12s %12s %12s %12s %12s\n", "backend", "ranks", "bytes", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "cpu(us)", "lost(ns/B)");
  for (const auto& r : rows) {
    char cpu[32] = "-", lost[32] = "-";
    if (r.contains("cpu_us")) std::snprintf(cpu, sizeof cpu, "%.1f", r["cpu_us"].get<double>());
    if (r.contains("compute_lost_ns_per_byte"))
      std::snprintf(lost, sizeof lost, "%.2f", r["compute_lost_ns_per_byte"].get<double>());
    std::printf("%-8s %6d %12ld %12.1f %12.3f %12.3f %12s %12s\n",
                r["backend"].get<std::string>().c_str(), r["ranks"].get<int>(),
                r["bytes"].get<long>(), r["time_us"].get<double>(), r["algbw_GBps"].get<double>(),
                r["busbw_GBps"].get<double>(), cpu, lost);
  }
  if (json)
    for (const auto& r : rows) std::printf("%s\n", r.dump().c_str());
}

std::vector<std::string> free_addresses(int n) {
  std::vector<int> fds;
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
    socklen_t len = sizeof(sa);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
    out.push_back("127.0.0.1:" + std::to_string(ntohs(sa.sin_port)));
    fds.push_back(fd);
  }
  for (int fd : fds) ::close(fd);
  return out;
}

// The test hosts of `dtrain-netns up --prefix P`: (namespace, address) per host.
std::vector<std::pair<std::string, std::string>> netns_hosts(const std::string& prefix, int ranks) {
  const std::string file = "/run/dtrain-netns/" + prefix + ".hosts";
  std::ifstream in(file);
  std::vector<std::pair<std::string, std::string>> hosts;
  for (std::string ns, addr; in >> ns >> addr;) hosts.emplace_back(ns, addr);
  if (static_cast<int>(hosts.size()) < ranks)
    throw std::runtime_error("--netns " + prefix + ": " + std::to_string(hosts.size()) +
                             " test host(s) in " + file + ", fewer than --ranks " +
                             std::to_string(ranks) +
                             "; run tools/netns/dtrain-netns up "
                             "--prefix " +
                             prefix + " --hosts " + std::to_string(ranks));
  hosts.resize(static_cast<size_t>(ranks));
  return hosts;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

// Starts `ranks` copies of cmd(r) in the background and rank 0 in the foreground; JSON from rank 0.
std::vector<nlohmann::json> run_ranks(int ranks, const std::function<std::string(int)>& cmd) {
  std::string sh = "(";
  for (int r = 1; r < ranks; ++r) sh += cmd(r) + " >/dev/null & ";
  sh += cmd(0) + "; wait)";
  return run_json_lines(sh);
}

void print_ratios(const std::vector<nlohmann::json>& ours,
                  const std::vector<std::vector<nlohmann::json>>& peers) {
  std::printf("\n%12s %22s\n", "bytes", "busbw / best peer");
  for (size_t i = 0; i < ours.size(); ++i) {
    double best = 0;
    for (const auto& p : peers)
      for (const auto& r : p)
        if (r["bytes"].get<long>() == ours[i]["bytes"].get<long>())
          best = std::max(best, r["busbw_GBps"].get<double>());
    if (best > 0)
      std::printf("%12ld %21.2fx\n", ours[i]["bytes"].get<long>(),
                  ours[i]["busbw_GBps"].get<double>() / best);
  }
}

}  // namespace

int allreduce_worker(int rank, const std::string& addresses, const std::string& token,
                     const std::string& sizes_arg, int iters, int warmup, bool compute_probe) {
  TcpGroupOptions o;
  o.rank = rank;
  for (const std::string_view a : split_list(addresses))
    if (!a.empty()) o.addresses.emplace_back(a);
  o.token = token;
  const int n = static_cast<int>(o.addresses.size());
  // With the probe, placed as dtrain-run places workers (before any thread starts: they inherit
  // it).
  const int sharing = compute_probe ? pin_like_dtrain_run(rank, n) : 1;
  auto comm = connect_tcp_group(o);
  std::unique_ptr<ComputeProbe> probe;
  if (compute_probe) probe = std::make_unique<ComputeProbe>();
  for (long bytes : parse_sizes(sizes_arg)) {
    Tensor t = Tensor::full(Shape{std::max(1L, bytes / 4)}, 1.f + rank);
    for (int i = 0; i < warmup; ++i) comm->allreduce(t, ReduceOp::kSum).wait();
    double probe_rate = 0;  // products a second with nothing else on the core but the probes
    if (probe) {
      comm->barrier().wait();
      const auto b0 = std::chrono::steady_clock::now();
      const long d0 = probe->done();
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      probe_rate = static_cast<double>(probe->done() - d0) / seconds_since(b0);
    }
    comm->barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = process_cpu_seconds(), probe_cpu0 = probe ? probe->cpu_seconds() : 0;
    const long d0 = probe ? probe->done() : 0;
    for (int i = 0; i < iters; ++i) comm->allreduce(t, ReduceOp::kSum).wait();
    const double window = seconds_since(t0);
    const double cpu =
        (process_cpu_seconds() - cpu0 - (probe ? probe->cpu_seconds() - probe_cpu0 : 0.0)) / iters;
    // Core seconds the probe lost: its share of the core (1 / sharing) times the fraction of its
    // rate that went. Summed over the ranks, with the bytes they moved.
    double lost = 0;
    if (probe && probe_rate > 0)
      lost =
          (1.0 - static_cast<double>(probe->done() - d0) / window / probe_rate) * window / sharing;
    const double moved = 2.0 * (n - 1) / n * static_cast<double>(t.numel() * 4) * iters;
    Tensor secs = Tensor::from_vector<double>({window / iters}, Shape{1});
    comm->allreduce(secs, ReduceOp::kMax).wait();
    Tensor sums = Tensor::from_vector<double>({cpu, lost, moved}, Shape{3});
    comm->allreduce(sums, ReduceOp::kSum).wait();
    if (rank == 0) {
      const auto s = sums.to_vector<double>();
      auto r = row("tcp", n, t.numel() * 4, secs.to_vector<double>()[0]);
      r["cpu_us"] = s[0] * 1e6;
      if (probe) r["compute_lost_ns_per_byte"] = s[1] / s[2] * 1e9;
      std::printf("%s\n", r.dump().c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

int allreduce_bench(const AllreduceArgs& a) {
  if (a.backend != "inproc" && a.backend != "tcp")
    throw std::invalid_argument("--backend=" + a.backend + " is not available; valid: inproc, tcp");
  const std::vector<long> sizes = parse_sizes(a.sizes);
  std::vector<nlohmann::json> ours;
  std::string size_list;
  for (long b : sizes) {
    if (!size_list.empty()) size_list += ',';
    size_list += std::to_string(b);
  }
  const std::string common = " --sizes " + size_list + " --iters " + std::to_string(a.iters) +
                             " --warmup " + std::to_string(a.warmup);
  if (a.compute_probe && a.backend != "tcp")
    throw std::invalid_argument(
        "--compute-probe measures what the tcp backend's ranks cost the compute beside them; add "
        "--backend=tcp");
  if (a.backend == "inproc") {
    for (long b : sizes)
      ours.push_back(row("inproc", a.ranks, std::max(4L, b / 4 * 4),
                         time_inproc(a.ranks, b, a.iters, a.warmup)));
  } else {
    // On test hosts (--netns): rank r runs in host r's namespace and listens on its address.
    const auto hosts = a.netns.empty() ? std::vector<std::pair<std::string, std::string>>{}
                                       : netns_hosts(a.netns, a.ranks);
    std::vector<std::string> addrs;
    if (hosts.empty()) addrs = free_addresses(a.ranks);
    for (const auto& h : hosts) addrs.push_back(h.second + ":29500");
    const std::string self = self_dir() + "/dtrain-bench";
    ours = run_ranks(a.ranks, [&](int r) {
      const std::string in_ns =
          hosts.empty() ? "" : "ip netns exec " + hosts[static_cast<size_t>(r)].first + " ";
      return in_ns + self + " allreduce-worker --rank " + std::to_string(r) + " --addresses " +
             join(addrs) + " --token bench-token-0123456789abcdef" + common +
             (a.compute_probe ? " --compute-probe" : "");
    });
  }
  print_table(ours, a.json);
  std::vector<std::vector<nlohmann::json>> peers;
  const bool want_mpi = a.peer == "mpi" || a.peer == "all",
             want_gloo = a.peer == "gloo" || a.peer == "all";
  if (want_mpi) {
    const std::string peer = self_dir() + "/mpi_allreduce";
    if (!std::filesystem::exists(peer))
      throw std::runtime_error(
          peer + " was not built: install libopenmpi-dev openmpi-bin and re-run cmake");
    const std::string btl =
        a.backend == "tcp" ? "tcp,self --mca btl_tcp_if_include lo" : "self,vader";
    if (a.netns.empty()) {
      peers.push_back(
          run_json_lines("mpirun --allow-run-as-root --oversubscribe --bind-to none -np " +
                         std::to_string(a.ranks) + " --mca btl " + btl + " " + peer + common));
    } else {
      // mpirun on host 0 starts its daemons on the other hosts through dtrain-netns-rsh (its ssh).
      const auto hosts = netns_hosts(a.netns, a.ranks);
      std::string list;
      for (const auto& h : hosts) list += (list.empty() ? "" : ",") + h.second;
      const std::string rsh = source_dir() + "/tools/netns/dtrain-netns-rsh";
      peers.push_back(run_json_lines(
          "ip netns exec " + hosts[0].first + " mpirun --allow-run-as-root --bind-to none -np " +
          std::to_string(a.ranks) + " --host " + list + " --mca plm_rsh_agent " + rsh +
          " --mca btl tcp,self --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 " +
          peer + common));
    }
    std::printf("\npeer: OpenMPI MPI_Allreduce (btl %s)\n",
                a.backend == "tcp" ? "tcp" : "vader shared memory");
    print_table(peers.back(), a.json);
  }
  if (want_gloo) {
    const std::string peer = self_dir() + "/gloo_allreduce";
    if (!std::filesystem::exists(peer))
      throw std::runtime_error(peer + " was not built: install libgloo-dev and re-run cmake");
    const std::string store = "/tmp/dtrain-bench-gloo-" + std::to_string(::getpid());
    std::filesystem::remove_all(store);
    std::filesystem::create_directories(store);
    const auto hosts = a.netns.empty() ? std::vector<std::pair<std::string, std::string>>{}
                                       : netns_hosts(a.netns, a.ranks);
    peers.push_back(run_ranks(a.ranks, [&](int r) {
      if (hosts.empty())
        return peer + " --rank " + std::to_string(r) + " --size " + std::to_string(a.ranks) +
               " --store " + store + common;
      const auto& h = hosts[static_cast<size_t>(r)];
      return "ip netns exec " + h.first + " " + peer + " --rank " + std::to_string(r) + " --size " +
             std::to_string(a.ranks) + " --store " + store + " --host " + h.second + common;
    }));
    std::filesystem::remove_all(store);
    std::printf("\npeer: Gloo allreduce_ring / allreduce_ring_chunked (TCP)\n");
    print_table(peers.back(), a.json);
  }
  if (!peers.empty()) print_ratios(ours, peers);
  return 0;
}

}  // namespace dtrain::bench
