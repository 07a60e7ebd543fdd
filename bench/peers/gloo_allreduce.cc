// Peer for `dtrain-bench allreduce --backend=tcp --peer=gloo`: Gloo's ring and ring_chunked
// allreduce (float SUM) over its TCP transport on 127.0.0.1 (or --host, this rank's address on a
// dtrain-netns test host), rendezvous through a FileStore.
// Timed like dtrain's (max over ranks of the mean time per call after warm-up); rank 0 prints one
// JSON object per size and algorithm.
//   gloo_allreduce --rank R --size N --store DIR --sizes 65536,1048576 --iters 20
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int rank = 0, size = 1, iters = 20, warmup = 5;
  std::string store_dir = "/tmp/gloo-store", host = "127.0.0.1";
  std::vector<long> sizes;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank")
      rank = std::stoi(v);
    else if (k == "--size")
      size = std::stoi(v);
    else if (k == "--store")
      store_dir = v;
    else if (k == "--host")
      host = v;
    else if (k == "--iters")
      iters = std::stoi(v);
    else if (k == "--warmup")
      warmup = std::stoi(v);
    else if (k == "--sizes") {
      size_t p = 0;
      while (p < v.size()) {
        const size_t c = v.find(',', p);
        sizes.push_back(std::stol(v.substr(p, c - p)));
        if (c == std::string::npos) break;
        p = c + 1;
      }
    }
  }
  gloo::transport::tcp::attr attr;
  attr.hostname = host;
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(store_dir);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->connectFullMesh(store, dev);
  auto barrier = [&] {  // a 1-element allreduce as a barrier
    float x = 0;
    gloo::AllreduceRing<float>(ctx, {&x}, 1).run();
  };
  for (long bytes : sizes) {
    const int n = static_cast<int>(std::max(1L, bytes / 4));
    std::vector<float> buf(static_cast<size_t>(n), 1.f + rank);
    for (int algo = 0; algo < 2; ++algo) {
      std::unique_ptr<gloo::Algorithm> a;
      if (algo == 0)
        a = std::make_unique<gloo::AllreduceRing<float>>(ctx, std::vector<float*>{buf.data()}, n);
      else
        a = std::make_unique<gloo::AllreduceRingChunked<float>>(ctx,
                                                                std::vector<float*>{buf.data()}, n);
      for (int i = 0; i < warmup; ++i) a->run();
      barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) a->run();
      double t =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
      // max over ranks
      gloo::AllreduceRing<double> mx(ctx, {&t}, 1, gloo::ReductionFunction<double>::max);
      mx.run();
      if (rank == 0) {
        const double alg = static_cast<double>(n) * 4 / t / 1e9;
        std::printf(
            "{\"backend\":\"%s\",\"ranks\":%d,\"bytes\":%d,\"time_us\":%.3f,\"algbw_GBps\":%.4f,"
            "\"busbw_GBps\":%.4f}\n",
            algo == 0 ? "gloo_ring" : "gloo_ring_chunked", size, n * 4, t * 1e6, alg,
            alg * 2.0 * (size - 1) / size);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
