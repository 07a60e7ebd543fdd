// Exact-result tests of the in-process collectives over world sizes {1,2,3,4,7}, counts
// {0,1,odd,large} and every dtype, plus mismatch, abort and timeout behaviour.
#include "dtrain/collectives/inproc.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "collectives/sync_collectives.h"
#include "testing/collective_inputs.h"

namespace dtrain {
namespace {

// Runs body(rank, comm) on one thread per rank; returns the exceptions' messages ("" if none).
std::vector<std::string> run_ranks(int n, const std::function<void(int, Communicator&)>& body,
                                   CollectiveOptions opts = {}) {
  auto comms = make_inproc_group(n, opts);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, *comms[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

double value(int r, int64_t i) { return testing::collective_value(r, i); }
Tensor make(DType t, int64_t n, int r) { return testing::collective_input(t, n, r); }

double expected(ReduceOp op, int n, int64_t i) {
  double acc = value(0, i);
  for (int r = 1; r < n; ++r) {
    const double v = value(r, i);
    acc = op == ReduceOp::kMax   ? std::max(acc, v)
          : op == ReduceOp::kMin ? std::min(acc, v)
                                 : acc + v;
  }
  return op == ReduceOp::kMean ? acc / n : acc;
}

const DType kTypes[] = {DType::kFloat32, DType::kFloat64, DType::kInt32,
                        DType::kInt64,   DType::kFloat16, DType::kBFloat16};

TEST(Inproc, AllreduceExactForAllSizesCountsDtypesOps) {
  for (int n : {1, 2, 3, 4, 7})
    for (int64_t count : {0, 1, 13, 100003})
      for (DType t : kTypes)
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
          if ((t == DType::kInt32 || t == DType::kInt64) && op == ReduceOp::kMean)
            continue;  // truncates
          if (count == 100003 && t != DType::kFloat32 && op != ReduceOp::kSum)
            continue;  // keep it quick
          std::vector<Tensor> out(static_cast<size_t>(n));
          auto errs = run_ranks(n, [&](int r, Communicator& c) {
            out[static_cast<size_t>(r)] = make(t, count, r);
            c.allreduce(out[static_cast<size_t>(r)], op).wait();
          });
          for (const auto& e : errs) ASSERT_EQ(e, "");
          for (int r = 0; r < n; ++r) {
            const auto got = out[static_cast<size_t>(r)].to_vector<double>();
            for (int64_t i = 0; i < count; ++i) {
              const double want = expected(op, n, i);
              // The inputs are small integers (testing/collective_inputs.h): every sum, and every
              // mean (a multiple of 1/2), is exact in every dtype, float16 and bfloat16 included.
              const double tol =
                  (t == DType::kBFloat16 || t == DType::kFloat16) ? 0.0 : 1e-9 * std::fabs(want);
              ASSERT_NEAR(got[static_cast<size_t>(i)], want, tol)
                  << "n=" << n << " count=" << count << " " << dtype_name(t) << " "
                  << reduce_op_name(op) << " rank " << r << " i " << i;
            }
          }
        }
}

// Float sums depend on their order: every rank's slice of an all-reduce is summed in rank order,
// as reduce_scatter sums, so the two agree bitwise (Mirrored's shared variables rely on it).
// The inputs make order visible: (1e8 + 1) - 1e8 is 0 in float32, (1e8 - 1e8) + 1 is 1.
TEST(Inproc, AllreduceSumsInRankOrderLikeReduceScatter) {
  for (int n : {2, 3, 4, 7}) {
    const int64_t count = 16 * 1024 * n + 5;  // every rank owns a slice, several 64 KB blocks each
    auto input = [&](int r) {
      std::vector<float> v(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) {
        const int k = static_cast<int>((i + r) % 3);
        v[static_cast<size_t>(i)] = k == 0 ? 1e8f : k == 1 ? 1.f : -1e8f;
      }
      return Tensor::from_vector(v, Shape{count});
    };
    std::vector<float> want(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      float acc = input(0).to_vector<float>()[static_cast<size_t>(i)];
      for (int r = 1; r < n; ++r) acc += input(r).to_vector<float>()[static_cast<size_t>(i)];
      want[static_cast<size_t>(i)] = acc;
      if (i > 64) break;  // the pattern repeats every 3 elements; the rest below
    }
    for (int64_t i = 65; i < count; ++i)
      want[static_cast<size_t>(i)] = want[static_cast<size_t>(i % 3 + 3)];
    const int64_t padded = (count + n - 1) / n * n;
    std::vector<Tensor> ar(static_cast<size_t>(n)), rs(static_cast<size_t>(n));
    auto errs = run_ranks(n, [&](int r, Communicator& c) {
      ar[static_cast<size_t>(r)] = input(r);
      c.allreduce(ar[static_cast<size_t>(r)], ReduceOp::kSum).wait();
      Tensor in = Tensor::zeros(Shape{padded}, DType::kFloat32);
      in.slice_rows(0, count).copy_from(input(r));
      rs[static_cast<size_t>(r)] = Tensor::empty(Shape{padded / n}, DType::kFloat32);
      c.reduce_scatter(in, rs[static_cast<size_t>(r)], ReduceOp::kSum).wait();
    });
    for (const auto& e : errs) ASSERT_EQ(e, "");
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(ar[static_cast<size_t>(r)].to_vector<float>(), want) << "n=" << n << " rank " << r;
    for (int r = 0; r < n; ++r) {
      const auto got = rs[static_cast<size_t>(r)].to_vector<float>();
      for (int64_t i = 0; i < padded / n && r * (padded / n) + i < count; ++i)
        ASSERT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(r * (padded / n) + i)])
            << "n=" << n << " rank " << r;
    }
  }
}

TEST(Inproc, AllgatherBroadcastReduceScatterBarrier) {
  for (int n : {1, 2, 3, 4, 7}) {
    const int64_t count = 5;
    std::vector<Tensor> gathered(static_cast<size_t>(n)), bcast(static_cast<size_t>(n)),
        rs(static_cast<size_t>(n));
    auto errs = run_ranks(n, [&](int r, Communicator& c) {
      Tensor in = make(DType::kInt64, count, r);
      gathered[static_cast<size_t>(r)] = Tensor::empty(Shape{count * n}, DType::kInt64);
      c.allgather(in, gathered[static_cast<size_t>(r)]).wait();
      bcast[static_cast<size_t>(r)] = make(DType::kFloat32, count, r);
      c.broadcast(bcast[static_cast<size_t>(r)], n - 1).wait();
      Tensor red = make(DType::kFloat32, count, r);
      c.reduce(red, 0, ReduceOp::kSum).wait();
      if (r == 0) {
        const auto v = red.to_vector<double>();
        for (int64_t i = 0; i < count; ++i)
          EXPECT_EQ(v[static_cast<size_t>(i)], expected(ReduceOp::kSum, n, i));
      } else {
        EXPECT_EQ(red.to_vector<double>(),
                  make(DType::kFloat32, count, r).to_vector<double>());  // untouched
      }
      Tensor big = make(DType::kFloat64, count * n, r);
      rs[static_cast<size_t>(r)] = Tensor::empty(Shape{count}, DType::kFloat64);
      c.reduce_scatter(big, rs[static_cast<size_t>(r)], ReduceOp::kSum).wait();
      c.barrier().wait();
    });
    for (const auto& e : errs) ASSERT_EQ(e, "");
    for (int r = 0; r < n; ++r) {
      const auto g = gathered[static_cast<size_t>(r)].to_vector<double>();
      for (int s = 0; s < n; ++s)
        for (int64_t i = 0; i < count; ++i)
          EXPECT_EQ(g[static_cast<size_t>(s * count + i)], value(s, i));
      const auto b = bcast[static_cast<size_t>(r)].to_vector<double>();
      for (int64_t i = 0; i < count; ++i) EXPECT_EQ(b[static_cast<size_t>(i)], value(n - 1, i));
      const auto x = rs[static_cast<size_t>(r)].to_vector<double>();
      for (int64_t i = 0; i < count; ++i)
        EXPECT_EQ(x[static_cast<size_t>(i)], expected(ReduceOp::kSum, n, r * count + i));
    }
  }
}

// Float32 values that make a sum's rounding depend on the order of its terms.
Tensor random_floats(int64_t n, uint32_t seed) {
  Tensor t = Tensor::empty(Shape{n}, DType::kFloat32);
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    t.data<float>()[i] = (static_cast<float>(x >> 8) / 16777216.0f - 0.5f) *
                         std::ldexp(1.0f, static_cast<int>(x % 23) - 11);
  }
  return t;
}

// The tensors rank r passes to reduce_scatter_concat: sizes 7, 0, 130, 33 and 1000 (uneven, one
// empty), so blocks start and end inside inputs.
std::vector<Tensor> concat_inputs(int r) {
  std::vector<Tensor> v;
  uint32_t k = 0;
  for (int64_t size : {7, 0, 130, 33, 1000})
    v.push_back(random_floats(size, static_cast<uint32_t>(r * 10) + k++));
  return v;
}
constexpr int64_t kConcatTotal = 7 + 130 + 33 + 1000;

// Each rank's block of op over the packed, zero-padded inputs, by reduce_scatter: the reference.
std::vector<std::vector<float>> packed_reference(int n, int64_t block, ReduceOp op) {
  std::vector<std::vector<float>> out(static_cast<size_t>(n));
  auto errs = run_ranks(n, [&](int r, Communicator& c) {
    Tensor buf = Tensor::zeros(Shape{block * n});
    int64_t off = 0;
    for (const Tensor& t : concat_inputs(r)) {
      if (t.numel()) buf.slice_rows(off, off + t.numel()).copy_from(t);
      off += t.numel();
    }
    Tensor o = Tensor::empty(Shape{block});
    c.reduce_scatter(buf, o, op).wait();
    out[static_cast<size_t>(r)] = o.to_vector<float>();
  });
  for (const auto& e : errs) EXPECT_EQ(e, "");
  return out;
}

// A SyncCollectives over another group's communicators that does not override
// reduce_scatter_concat: its default (pack, then reduce_scatter) is what transports between
// processes use.
class PackingBackend final : public SyncCollectives {
 public:
  explicit PackingBackend(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  void allreduce(Tensor& t, ReduceOp op) override { c_.allreduce(t, op).wait(); }
  void allgather(const Tensor& in, Tensor& out) override { c_.allgather(in, out).wait(); }
  void broadcast(Tensor& t, int root) override { c_.broadcast(t, root).wait(); }
  void reduce(Tensor& t, int root, ReduceOp op) override { c_.reduce(t, root, op).wait(); }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    c_.reduce_scatter(in, out, op).wait();
  }
  void barrier() override { c_.barrier().wait(); }
  void abort(const std::string& reason) override { c_.abort(reason); }

 private:
  Communicator& c_;
};

// A user's Communicator that implements only the required collectives: it gets
// Communicator::reduce_scatter_concat's default.
class MinimalCommunicator final : public Communicator {
 public:
  explicit MinimalCommunicator(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  Work allreduce(Tensor& t, ReduceOp op) override { return c_.allreduce(t, op); }
  Work allgather(const Tensor& in, Tensor& out) override { return c_.allgather(in, out); }
  Work broadcast(Tensor& t, int root) override { return c_.broadcast(t, root); }
  Work reduce(Tensor& t, int root, ReduceOp op) override { return c_.reduce(t, root, op); }
  Work reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    return c_.reduce_scatter(in, out, op);
  }
  Work barrier() override { return c_.barrier(); }
  void abort(const std::string& reason) override { c_.abort(reason); }

 private:
  Communicator& c_;
};

TEST(Inproc, ReduceScatterConcatIsBitwiseThePackedReduceScatter) {
  for (int n : {1, 2, 3, 4, 7})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
      const int64_t block = (kConcatTotal + n - 1) / n + 3;  // some zero padding on every size
      const std::vector<std::vector<float>> want = packed_reference(n, block, op);
      // 0: in place (the in-process transport), 1: the transports' packing default, 2:
      // Communicator's default.
      for (int way = 0; way < 3; ++way) {
        std::vector<std::vector<float>> got(static_cast<size_t>(n));
        auto errs = run_ranks(n, [&](int r, Communicator& c) {
          std::unique_ptr<Communicator> packing =
              way == 1   ? make_async_communicator(std::make_unique<PackingBackend>(c),
                                                   std::chrono::seconds(30))
              : way == 2 ? std::make_unique<MinimalCommunicator>(c)
                         : nullptr;
          Communicator& use = packing ? *packing : c;
          const std::vector<Tensor> in = concat_inputs(r);
          Tensor o = Tensor::full(Shape{block}, 99.0f);  // the padding must be written, not left
          use.reduce_scatter_concat(in, o, op).wait();
          got[static_cast<size_t>(r)] = o.to_vector<float>();
        });
        for (const auto& e : errs) ASSERT_EQ(e, "") << "n=" << n << " way " << way;
        for (int r = 0; r < n; ++r) {
          const auto& g = got[static_cast<size_t>(r)];
          const auto& w = want[static_cast<size_t>(r)];
          ASSERT_EQ(g.size(), w.size());
          EXPECT_EQ(std::memcmp(g.data(), w.data(), g.size() * sizeof(float)), 0)
              << "n=" << n << " rank " << r << " op " << reduce_op_name(op) << " way " << way;
          for (int64_t i = std::max<int64_t>(0, kConcatTotal - r * block); i < block; ++i)
            EXPECT_EQ(g[static_cast<size_t>(i)], 0.0f) << "padding at " << i << ", rank " << r;
        }
      }
    }
}

TEST(Inproc, ReduceScatterConcatRefusesMismatchedInputsOnEveryRank) {
  // Rank 1's second input is one element longer: the same total would fit, but the layouts differ.
  auto errs = run_ranks(3, [&](int r, Communicator& c) {
    std::vector<Tensor> in = {Tensor::zeros(Shape{10}), Tensor::zeros(Shape{r == 1 ? 6 : 5})};
    Tensor o = Tensor::empty(Shape{8});
    c.reduce_scatter_concat(in, o, ReduceOp::kSum).wait();
  });
  for (const auto& e : errs)
    EXPECT_NE(e.find("inputs of other sizes than rank 0's"), std::string::npos) << e;
  // Too many elements for the output, and another dtype: refused before any rank waits for another.
  auto errs2 = run_ranks(2, [&](int r, Communicator& c) {
    Tensor o = Tensor::empty(Shape{4});
    if (r == 0) {
      EXPECT_THROW(c.reduce_scatter_concat({Tensor::zeros(Shape{9})}, o, ReduceOp::kSum).wait(),
                   InvalidArgument);
    } else {
      EXPECT_THROW(
          c.reduce_scatter_concat({Tensor::zeros(Shape{2}, DType::kFloat64)}, o, ReduceOp::kSum)
              .wait(),
          InvalidArgument);
    }
  });
  for (const auto& e : errs2) EXPECT_EQ(e, "");
}

TEST(Inproc, MismatchedCollectivesFailOnEveryRankNamingBoth) {
  auto errs = run_ranks(3, [&](int r, Communicator& c) {
    Tensor t = Tensor::zeros(Shape{r == 2 ? 5 : 4});
    c.allreduce(t, ReduceOp::kSum).wait();
  });
  for (const auto& e : errs) {
    EXPECT_NE(e.find("collective mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("x5"), std::string::npos) << e;
  }
}

// A barrier is matched like any collective: against an all-reduce it fails on both ranks, at once
// (it returned on the barrier's rank, which then posted its next collective into the slot the other
// was comparing; that rank's next collective could then wait out the timeout).
TEST(Inproc, ABarrierAgainstAnotherCollectiveFailsOnBothRanks) {
  CollectiveOptions o;
  o.timeout = std::chrono::seconds(60);
  const auto start = std::chrono::steady_clock::now();
  auto errs = run_ranks(
      2,
      [&](int r, Communicator& c) {
        Tensor t = Tensor::zeros(Shape{4});
        if (r == 0)
          c.barrier().wait();
        else
          c.allreduce(t, ReduceOp::kSum).wait();
        c.allreduce(t, ReduceOp::kSum).wait();  // never reached
      },
      o);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  for (const auto& e : errs) EXPECT_NE(e.find("collective mismatch"), std::string::npos) << e;
}

TEST(Inproc, AbortWakesWaitersFast) {
  const auto t0 = std::chrono::steady_clock::now();
  auto errs = run_ranks(3, [&](int r, Communicator& c) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      c.abort("replica 1 crashed");
      return;
    }
    Tensor t = Tensor::zeros(Shape{4});
    c.allreduce(t, ReduceOp::kSum).wait();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_NE(errs[0].find("replica 1 crashed"), std::string::npos) << errs[0];
  EXPECT_NE(errs[2].find("replica 1 crashed"), std::string::npos) << errs[2];
}

// An abort while the ranks are inside a collective's body (a replica failing while another's
// gradient pack is being summed): no rank may leave the collective while another still reads its
// input or writes its output. Rank 0 overwrites its buffer the moment its collective returns, and
// nothing may change it afterwards. Abort times are random within the body's few milliseconds;
// before the closing barrier ignored aborts, a rank that had done its part left on the abort and
// the other wrote into its buffer after it had returned.
TEST(Inproc, AnAbortInsideACollectiveLeavesNoRankWhileAnotherUsesItsBuffers) {
  constexpr int64_t kCount = int64_t{8} << 20;  // 32 MB a rank
  std::mt19937 rng(7);
  int clobbered_rounds = 0;
  for (int round = 0; round < 30; ++round) {
    auto comms = make_inproc_group(2, {});
    Tensor t0 = Tensor::full(Shape{kCount}, 1.f), t1 = Tensor::full(Shape{kCount}, 2.f);
    const auto delay = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 8000)(rng));
    std::thread aborter([&] {
      std::this_thread::sleep_for(delay);
      comms[1]->abort("a replica failed");
    });
    std::thread rank1([&] {
      try {
        comms[1]->allreduce(t1, ReduceOp::kSum).wait();
      } catch (const Unavailable&) {
      }
    });
    try {
      comms[0]->allreduce(t0, ReduceOp::kSum).wait();
    } catch (const Unavailable&) {
    }
    float* p = static_cast<float*>(t0.raw_data());
    std::fill(p, p + kCount, -1.f);  // rank 0 reuses its buffer
    rank1.join();
    aborter.join();
    clobbered_rounds += std::count(p, p + kCount, -1.f) != kCount;
  }
  EXPECT_EQ(clobbered_rounds, 0)
      << "rank 1 wrote into rank 0's buffer after its collective returned";
}

TEST(Inproc, MissingRankTimesOutNamingIt) {
  CollectiveOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto errs = run_ranks(
      3,
      [&](int r, Communicator& c) {
        if (r == 2) return;  // never shows up
        c.barrier().wait();
      },
      o);
  EXPECT_NE(errs[0].find("rank(s) 2 did not arrive"), std::string::npos) << errs[0];
}

// Work is really asynchronous: collectives return before they complete and run on the
// communicator's thread in issue order; a wait() that runs out of time aborts the group and returns
// only when the collective no longer touches the caller's tensors.
TEST(Async, CollectivesReturnAtOnceAndCompleteInOrder) {
  CollectiveOptions o;
  o.timeout = std::chrono::seconds(20);
  auto comms = make_inproc_group(2, o);
  Tensor a0 = Tensor::full(Shape{1000}, 1.f), b0 = Tensor::full(Shape{10}, 5.f);
  Tensor a1 = Tensor::full(Shape{1000}, 2.f), b1 = Tensor::full(Shape{10}, 7.f);
  // Rank 0 issues two collectives; rank 1 has issued nothing, so neither can have completed.
  Work w0a = comms[0]->allreduce(a0, ReduceOp::kSum);
  Work w0b = comms[0]->allreduce(b0, ReduceOp::kMax);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(w0a.ready());
  EXPECT_FALSE(w0b.ready());
  // Rank 1 joins from another thread; both of rank 0's collectives complete, in order.
  std::thread t1([&] {
    comms[1]->allreduce(a1, ReduceOp::kSum).wait();
    comms[1]->allreduce(b1, ReduceOp::kMax).wait();
  });
  w0b.wait();  // waiting on the later one first is fine: it runs after the first
  EXPECT_TRUE(w0a.ready());
  w0a.wait();
  t1.join();
  EXPECT_EQ(a0.to_vector<float>()[999], 3.f);
  EXPECT_EQ(a1.to_vector<float>()[0], 3.f);
  EXPECT_EQ(b0.to_vector<float>()[3], 7.f);
}

TEST(Async, AWaitThatRunsOutAbortsTheGroupAndWaitsTheCollectiveOut) {
  CollectiveOptions o;
  o.timeout = std::chrono::seconds(60);
  auto comms = make_inproc_group(2, o);
  Tensor t0 = Tensor::zeros(Shape{8}), later = Tensor::zeros(Shape{8});
  Work w = comms[0]->allreduce(t0, ReduceOp::kSum);  // rank 1 never joins
  Work next = comms[0]->allreduce(later, ReduceOp::kSum);
  const auto start = std::chrono::steady_clock::now();
  try {
    w.wait(std::chrono::milliseconds(200));
    ADD_FAILURE() << "a collective completed without its peer";
  } catch (const DeadlineExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("allreduce #0 on rank 0 of 2"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            std::chrono::seconds(5));      // not the 60 s timeout
  EXPECT_TRUE(w.ready());                  // waited out: it no longer touches t0
  EXPECT_THROW(next.wait(), Unavailable);  // the group is aborted for everyone
  EXPECT_THROW(comms[1]->allreduce(later, ReduceOp::kSum).wait(), Unavailable);
}

TEST(Async, AnErrorOnTheCommunicationThreadIsRethrownByWait) {
  auto comms = make_inproc_group(2, {});
  Tensor in = Tensor::zeros(Shape{5}), out = Tensor::zeros(Shape{7});  // not size * 5 elements
  Work w = comms[0]->allgather(in, out);
  EXPECT_THROW(w.wait(), InvalidArgument);
  EXPECT_THROW(w.wait(), InvalidArgument);  // every wait sees it
}

TEST(Async, DestroyingACommunicatorGivesPendingWorkItsTimeoutThenFailsIt) {
  CollectiveOptions o;
  o.timeout = std::chrono::milliseconds(500);
  auto comms = make_inproc_group(2, o);
  Tensor t = Tensor::zeros(Shape{4});
  Work w = comms[0]->allreduce(t, ReduceOp::kSum);  // rank 1 never joins
  const auto t0 = std::chrono::steady_clock::now();
  comms[0].reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_THROW(w.wait(), Error);  // the group's own timeout: rank 1 did not arrive
  EXPECT_TRUE(w.ready());
}

// A backend that records which thread ran each collective; the first one it runs can be made to
// take a while.
class RecordingBackend final : public SyncCollectives {
 public:
  explicit RecordingBackend(std::chrono::milliseconds first_takes = {})
      : first_takes_(first_takes) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce(Tensor&, ReduceOp) override { record(); }
  void allgather(const Tensor&, Tensor&) override { record(); }
  void broadcast(Tensor&, int) override { record(); }
  void reduce(Tensor&, int, ReduceOp) override { record(); }
  void reduce_scatter(const Tensor&, Tensor&, ReduceOp) override { record(); }
  void barrier() override { record(); }
  void abort(const std::string&) override {}
  std::vector<std::thread::id> threads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }

 private:
  void record() {
    bool first;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = threads_.empty();
      threads_.push_back(std::this_thread::get_id());
    }
    if (first) std::this_thread::sleep_for(first_takes_);
  }
  const std::chrono::milliseconds first_takes_;
  mutable std::mutex mu_;
  std::vector<std::thread::id> threads_;
};

bool ready_within(const Work& w, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!w.ready() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return w.ready();
}

// Issue-then-wait, the pattern of every strategy, runs on the caller's thread: no hand-off to the
// communication thread (which would have to be woken on a core a replica computes on).
TEST(Async, IssueThenWaitRunsOnTheCallersThread) {
  auto backend = std::make_unique<RecordingBackend>();
  RecordingBackend* rec = backend.get();
  auto comm = make_async_communicator(std::move(backend), std::chrono::seconds(30));
  Tensor t = Tensor::zeros(Shape{4});
  for (int i = 0; i < 300; ++i) comm->allreduce(t, ReduceOp::kSum).wait();
  comm->barrier().wait();
  const auto threads = rec->threads();
  ASSERT_EQ(threads.size(), 301u);
  // A caller preempted for over 50 us between issuing and waiting (a loaded machine) leaves that
  // one to the thread; the rest run here.
  const auto here = std::count(threads.begin(), threads.end(), std::this_thread::get_id());
  EXPECT_GE(here, 200) << "of 301 issue-then-wait collectives ran on the caller's thread";
}

// A collective nobody waits on is still started by the communication thread, which does not poll:
// it is issued after the thread has slept a while, and again behind one that a waiter runs.
TEST(Async, ACollectiveNobodyWaitsOnIsRunByTheThread) {
  auto backend = std::make_unique<RecordingBackend>(std::chrono::milliseconds(150));
  RecordingBackend* rec = backend.get();
  auto comm = make_async_communicator(std::move(backend), std::chrono::seconds(30));
  Tensor t = Tensor::zeros(Shape{4});
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the thread has gone to sleep
  std::thread::id waiter_id;
  std::thread waiter([&] {
    waiter_id = std::this_thread::get_id();
    comm->allreduce(t, ReduceOp::kSum).wait();  // runs #0 (150 ms) unless preempted for kGrace
  });
  while (rec->threads().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Work behind =
      comm->allreduce(t, ReduceOp::kSum);  // #1: queued behind the waiter's, never waited on
  EXPECT_FALSE(behind.ready());
  EXPECT_TRUE(ready_within(behind, std::chrono::seconds(5)));
  waiter.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Work alone = comm->allgather(t, t);  // #2, on an idle communicator, never waited on
  EXPECT_TRUE(ready_within(alone, std::chrono::seconds(5)));
  const auto threads = rec->threads();
  ASSERT_EQ(threads.size(), 3u);
  EXPECT_NE(threads[1], std::this_thread::get_id());
  // Not the waiter's: the communication thread's. (#0 itself may have been taken by the thread
  // too, when the waiter was preempted between issuing and waiting on a loaded machine.)
  EXPECT_NE(threads[1], waiter_id);
  EXPECT_EQ(threads[2], threads[1]);
}

// The communicator is destroyed while a waiter on another thread runs a collective that outlasts
// the destructor's grace: the destructor returns once that collective is done (its thread is not
// left asleep, which would hang the join).
TEST(Async, DestroyingACommunicatorWhileAWaiterRunsACollectiveReturns) {
  auto backend = std::make_unique<RecordingBackend>(std::chrono::milliseconds(400));
  RecordingBackend* rec = backend.get();
  std::unique_ptr<Communicator> comm =
      make_async_communicator(std::move(backend), std::chrono::milliseconds(100));
  Tensor t = Tensor::zeros(Shape{4});
  Communicator* c = comm.get();
  std::thread waiter([&] { c->allreduce(t, ReduceOp::kSum).wait(); });  // runs it itself: 400 ms
  while (rec->threads().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto start = std::chrono::steady_clock::now();
  comm.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  waiter.join();
}

}  // namespace
}  // namespace dtrain
