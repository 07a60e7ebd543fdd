// Peer for `dtrain-bench allreduce --peer=mpi`: OpenMPI's MPI_Allreduce (in place, float SUM) over
// the same sizes, timed the same way (max over ranks of the mean time per call after warm-up).
// Prints one JSON object per size on rank 0.
//   mpirun -np 2 ./mpi_allreduce --sizes 4096,65536 --iters 20
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<long> sizes;
  int iters = 20, warmup = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--sizes") && i + 1 < argc) {
      std::string s = argv[++i];
      size_t p = 0;
      while (p < s.size()) {
        const size_t c = s.find(',', p);
        sizes.push_back(std::stol(s.substr(p, c - p)));
        if (c == std::string::npos) break;
        p = c + 1;
      }
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) {
      warmup = std::atoi(argv[++i]);
    }
  }
  for (long bytes : sizes) {
    const long n = std::max(1L, bytes / 4);
    std::vector<float> buf(static_cast<size_t>(n), 1.f + rank);
    for (int i = 0; i < warmup; ++i)
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i)
      MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    double t = (MPI_Wtime() - t0) / iters, tmax = 0;
    MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      const double alg = static_cast<double>(n * 4) / tmax / 1e9;
      std::printf(
          "{\"backend\":\"mpi\",\"ranks\":%d,\"bytes\":%ld,\"time_us\":%.3f,\"algbw_GBps\":%.4f,"
          "\"busbw_GBps\":%.4f}\n",
          size, n * 4, tmax * 1e6, alg, alg * 2.0 * (size - 1) / size);
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}
