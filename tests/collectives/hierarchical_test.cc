// The hierarchical communicator (MultiWorkerMirrored: local replicas over shared memory, one
// replica per worker across workers over TCP) on reduce_scatter, reduce_scatter_in_place and
// allgather, the collectives of sharded optimizer state: exact results for workers x local
// replicas in {2 x 1, 3 x 1, 2 x 2, 2 x 3}, element counts with and without a remainder, and
// bfloat16 compression on the wire between the workers. Workers are threads here; the
// multi-process runs are in tests/multiworker/sharding_test.py.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "collectives/hierarchical/hierarchical_communicator.h"
#include "dtrain/collectives/inproc.h"
#include "dtrain/collectives/tcp.h"
#include "testing/collective_inputs.h"
#include "testing/ports.h"

namespace dtrain {
namespace {

double value(int r, int64_t i) { return testing::collective_value(r, i); }

// Runs body(global rank, communicator) on every replica of `workers` x `local`; returns each
// replica's error ("" if none).
std::vector<std::string> job_errors(int workers, int local, Compression compression,
                                    const std::function<void(int, Communicator&)>& body) {
  const auto addrs = testing::free_loopback_addresses(workers);
  std::vector<std::string> errs(static_cast<size_t>(workers * local));
  std::vector<std::thread> ts;
  for (int w = 0; w < workers; ++w)
    ts.emplace_back([&, w] {
      try {
        auto cross = std::make_shared<CrossWorkerCommunicators>();
        TcpGroupOptions o;
        o.rank = w;
        o.addresses = addrs;
        for (int i = 0; i < workers; ++i) o.task_names.push_back("worker:" + std::to_string(i));
        o.token = "0123456789abcdef0123";
        o.connect_timeout = std::chrono::seconds(20);
        o.collective.timeout = std::chrono::seconds(20);
        cross->host = connect_tcp_group(o);
        cross->workers = workers;
        cross->compression = compression;
        cross->timeout = std::chrono::seconds(20);
        CollectiveOptions co;
        co.timeout = std::chrono::seconds(20);
        auto group = make_inproc_group(local, co);
        std::vector<std::unique_ptr<Communicator>> comms;
        for (auto& c : group)
          comms.push_back(make_hierarchical_communicator(std::move(c), cross, local));
        std::vector<std::thread> replicas;
        for (int l = 0; l < local; ++l)
          replicas.emplace_back([&, l] {
            const int g = w * local + l;
            try {
              body(g, *comms[static_cast<size_t>(l)]);
            } catch (const std::exception& e) {
              errs[static_cast<size_t>(g)] = e.what();
            }
          });
        for (auto& t : replicas) t.join();
      } catch (const std::exception& e) {
        errs[static_cast<size_t>(w * local)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errs;
}

void run_job(int workers, int local, Compression compression,
             const std::function<void(int, Communicator&)>& body) {
  const std::vector<std::string> errs = job_errors(workers, local, compression, body);
  for (size_t i = 0; i < errs.size(); ++i) EXPECT_EQ(errs[i], "") << "replica " << i;
}

Tensor inputs(int rank, int64_t count) {
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>(value(rank, i));
  return Tensor::from_vector(v, Shape{count});
}

TEST(Hierarchical, ReduceScatterAndAllgatherAreExact) {
  for (auto [workers, local] : {std::pair{2, 1}, {3, 1}, {2, 2}, {2, 3}}) {
    const int n = workers * local;
    for (int64_t block : {1, 16, 4099}) {
      run_job(workers, local, Compression::kNone, [&](int r, Communicator& c) {
        EXPECT_EQ(c.rank(), r);
        EXPECT_EQ(c.size(), n);
        const Tensor in = inputs(r, block * n);
        Tensor out = Tensor::empty(Shape{block});
        c.reduce_scatter(in, out, ReduceOp::kSum).wait();
        EXPECT_EQ(in.to_vector<float>(), inputs(r, block * n).to_vector<float>())
            << "reduce_scatter must not change its input";
        Tensor scratch = inputs(r, block * n), out2 = Tensor::empty(Shape{block});
        c.reduce_scatter_in_place(scratch, out2, ReduceOp::kSum).wait();
        // Mismatches are counted, not asserted: a replica that left early would leave its
        // peers waiting in the next collective.
        const auto got = out.to_vector<float>(), got2 = out2.to_vector<float>();
        int64_t wrong_sums = 0, wrong_gathered = 0;
        for (int64_t i = 0; i < block; ++i) {
          double want = 0;
          for (int q = 0; q < n; ++q) want += value(q, r * block + i);
          wrong_sums += got[static_cast<size_t>(i)] != want;
          wrong_sums += got2[static_cast<size_t>(i)] != want;
        }
        Tensor all = Tensor::empty(Shape{block * n});
        c.allgather(inputs(r, block), all).wait();
        const auto g = all.to_vector<float>();
        for (int q = 0; q < n; ++q)
          for (int64_t i = 0; i < block; ++i)
            wrong_gathered +=
                g[static_cast<size_t>(q * block + i)] != static_cast<float>(value(q, i));
        EXPECT_EQ(wrong_sums, 0) << workers << "x" << local << ", block " << block << ", rank "
                                 << r;
        EXPECT_EQ(wrong_gathered, 0) << workers << "x" << local << ", block " << block;
        Tensor wrong = Tensor::empty(Shape{block + 1});
        EXPECT_THROW(c.reduce_scatter(in, wrong, ReduceOp::kSum).wait(), InvalidArgument);
      });
    }
  }
}

TEST(Hierarchical, CompressedReduceScatterIsTheBfloat16Sum) {
  // Small integers are exact in bfloat16: the compressed sum equals the exact one.
  run_job(2, 2, Compression::kBF16, [&](int r, Communicator& c) {
    Tensor in = inputs(r, 4 * 64), out = Tensor::empty(Shape{64});
    c.reduce_scatter_in_place(in, out, ReduceOp::kSum).wait();
    const auto got = out.to_vector<float>();
    int64_t wrong = 0;
    for (int64_t i = 0; i < 64; ++i) {
      double want = 0;
      for (int q = 0; q < 4; ++q) want += value(q, r * 64 + i);
      wrong += got[static_cast<size_t>(i)] != want;
    }
    EXPECT_EQ(wrong, 0) << "rank " << r;
  });
}

// A worker that is gone (here: it leaves at once, closing its connections) while the other's
// replicas all-reduce, 2 workers x 2 replicas: local replica 0's stage across workers fails, and
// both local replicas fail with the dead worker's error, in that collective and the next; local
// replica 1 failed with a "collective mismatch" against replica 0's next collective, which hid the
// dead worker (found with two workers of two replicas of the ResNet-50 benchmark, one SIGKILLed).
TEST(Hierarchical, AWorkerGoneFailsEveryLocalReplicaWithItsErrorNotAMismatch) {
  std::vector<std::vector<std::string>> seen(2);
  const std::vector<std::string> errs =
      job_errors(2, 2, Compression::kNone, [&](int g, Communicator& c) {
        if (g >= 2) return;  // worker 1 leaves
        for (int k = 0; k < 2; ++k) {
          Tensor t = inputs(g, 1000);
          try {
            c.allreduce(t, ReduceOp::kSum).wait();
            seen[static_cast<size_t>(g)].push_back("");
          } catch (const std::exception& e) {
            seen[static_cast<size_t>(g)].push_back(e.what());
          }
        }
      });
  for (const auto& e : errs) EXPECT_EQ(e, "");
  for (int g = 0; g < 2; ++g) {
    ASSERT_EQ(seen[static_cast<size_t>(g)].size(), 2u);
    for (const std::string& e : seen[static_cast<size_t>(g)]) {
      EXPECT_NE(e.find("worker:1"), std::string::npos) << "replica " << g << ": " << e;
      EXPECT_EQ(e.find("mismatch"), std::string::npos) << "replica " << g << ": " << e;
    }
  }
}

// A collective refused on one replica of a worker before it posts anything (an all-gather output
// of the wrong size): the worker's other replica, waiting for it within the worker, fails at once
// with its error, not after the 20 s collective timeout.
TEST(Hierarchical, AReplicaRefusingACollectiveFailsItsLocalPeersAtOnceWithItsError) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> errs =
      job_errors(2, 2, Compression::kNone, [&](int g, Communicator& c) {
        const int64_t n = 10;
        Tensor in = inputs(g, n), out = Tensor::zeros(Shape{g == 1 ? n : n * 4});
        c.allgather(in, out).wait();
      });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (int g = 0; g < 2; ++g)
    EXPECT_NE(errs[static_cast<size_t>(g)].find("allgather: output must hold"), std::string::npos)
        << "replica " << g << ": " << errs[static_cast<size_t>(g)];
}

}  // namespace
}  // namespace dtrain
