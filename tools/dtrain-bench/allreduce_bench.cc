// `dtrain-bench allreduce`: nccl-tests style table for dtrain's collectives, optionally next to a
// peer (OpenMPI's MPI_Allreduce over shared memory) measured in the same run.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "bench_util.h"
#include "dtrain/collectives/inproc.h"

namespace dtrain::bench {
namespace {

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
      secs[static_cast<size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    });
  for (auto& t : threads) t.join();
  return *std::max_element(secs.begin(), secs.end());
}

nlohmann::json row(const std::string& backend, int ranks, long bytes, double secs) {
  const double alg = static_cast<double>(bytes) / secs / 1e9;
  return {{"backend", backend}, {"ranks", ranks}, {"bytes", bytes}, {"time_us", secs * 1e6},
          {"algbw_GBps", alg}, {"busbw_GBps", alg * 2.0 * (ranks - 1) / ranks}};
}

void print_table(const std::vector<nlohmann::json>& rows, bool json) {
  std::printf("%-8s %6s %12s %12s %12s %12s\n", "backend", "ranks", "bytes", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
  for (const auto& r : rows)
    std::printf("%-8s %6d %12ld %12.1f %12.3f %12.3f\n", r["backend"].get<std::string>().c_str(), r["ranks"].get<int>(),
                r["bytes"].get<long>(), r["time_us"].get<double>(), r["algbw_GBps"].get<double>(),
                r["busbw_GBps"].get<double>());
  if (json)
    for (const auto& r : rows) std::printf("%s\n", r.dump().c_str());
}

}  // namespace

int allreduce_bench(const AllreduceArgs& a) {
  if (a.backend != "inproc")
    throw std::invalid_argument("--backend=" + a.backend + " is not available in this build; valid: inproc");
  const std::vector<long> sizes = parse_sizes(a.sizes);
  std::vector<nlohmann::json> ours, theirs;
  std::string size_list;
  for (long b : sizes) {
    if (!size_list.empty()) size_list += ',';
    size_list += std::to_string(b);
  }
  for (long b : sizes) ours.push_back(row("inproc", a.ranks, std::max(4L, b / 4 * 4), time_inproc(a.ranks, b, a.iters, a.warmup)));
  print_table(ours, a.json);
  if (a.peer == "mpi") {
    const std::string peer = self_dir() + "/mpi_allreduce";
    if (!std::filesystem::exists(peer))
      throw std::runtime_error(peer + " was not built: install libopenmpi-dev openmpi-bin and re-run cmake");
    theirs = run_json_lines("mpirun --allow-run-as-root --oversubscribe --bind-to none -np " + std::to_string(a.ranks) +
                            " --mca btl self,vader " + peer + " --sizes " + size_list + " --iters " +
                            std::to_string(a.iters) + " --warmup " + std::to_string(a.warmup));
    std::printf("\npeer: OpenMPI MPI_Allreduce (shared memory, vader)\n");
    print_table(theirs, a.json);
    std::printf("\n%12s %16s\n", "bytes", "busbw ratio");
    for (size_t i = 0; i < ours.size() && i < theirs.size(); ++i)
      std::printf("%12ld %15.2fx\n", ours[i]["bytes"].get<long>(),
                  ours[i]["busbw_GBps"].get<double>() / theirs[i]["busbw_GBps"].get<double>());
  }
  return 0;
}

}  // namespace dtrain::bench
