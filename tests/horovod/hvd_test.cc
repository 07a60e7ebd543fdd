// dtrain::hvd, run as `dtrain-run -np 3 -- hvd_test`: every rank runs the same tests in the same
// order; results are checked exactly (integer-valued floats) on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "dtrain/dtrain.h"

namespace dtrain::hvd {
namespace {

Tensor vec(std::vector<float> v) {
  return Tensor::from_vector(v, Shape{static_cast<int64_t>(v.size())});
}
std::vector<float> host(const Tensor& t) { return t.to(DeviceSpec::cpu()).to_vector<float>(); }

template <typename F>
std::string failure(F f) {
  try {
    f();
  } catch (const FailedPrecondition& e) {
    return e.what();
  }
  return "";
}

TEST(Hvd, RanksAndSizes) {
  ASSERT_TRUE(is_initialized());
  EXPECT_EQ(size(), 3);
  EXPECT_GE(rank(), 0);
  EXPECT_LT(rank(), 3);
  EXPECT_EQ(local_size(), 3);  // dtrain-run: one machine
  EXPECT_EQ(local_rank(), rank());
  EXPECT_EQ(cross_size(), 1);
  EXPECT_EQ(cross_rank(), 0);
}

TEST(Hvd, AllreduceOpsAreExact) {
  const float r = static_cast<float>(rank());
  EXPECT_EQ(host(allreduce(vec({r, 2 * r, 1}), "sum", Op::kSum)), (std::vector<float>{3, 6, 3}));
  EXPECT_EQ(host(allreduce(vec({r, 3 * r}), "avg")), (std::vector<float>{1, 3}));
  EXPECT_EQ(host(allreduce(vec({r, -r}), "max", Op::kMax)), (std::vector<float>{2, 0}));
  EXPECT_EQ(host(allreduce(vec({r, -r}), "min", Op::kMin)), (std::vector<float>{0, -2}));
  // A rank-2 tensor keeps its shape; float64 averages too.
  const Tensor m = allreduce(Tensor::full(Shape{2, 2}, r), "matrix", Op::kSum);
  EXPECT_EQ(m.shape(), (Shape{2, 2}));
  EXPECT_EQ(host(m), (std::vector<float>{3, 3, 3, 3}));
  const Tensor d = allreduce(Tensor::from_vector<double>({r * 1.5}, Shape{1}), "double");
  EXPECT_EQ(d.to_vector<double>()[0], 1.5);
}

TEST(Hvd, AsyncHandlesCompleteInOrder) {
  const float r = static_cast<float>(rank());
  std::vector<Handle> hs;
  for (int i = 0; i < 5; ++i)
    hs.push_back(allreduce_async(vec({r + i}), "async." + std::to_string(i), Op::kSum));
  for (int i = 4; i >= 0; --i)
    EXPECT_EQ(host(hs[static_cast<size_t>(i)].synchronize())[0], 3.f + 3 * i);
  for (const auto& h : hs) EXPECT_TRUE(h.poll());
}

TEST(Hvd, AllreducesQueuedTogetherAreFusedAndExact) {
  // 24 all-reduces of three dtypes queued at once: negotiated together, reduced in one buffer per
  // dtype (Tensor Fusion), each result exact and in its own shape.
  const CollectiveStats before = collective_stats();
  const int r = rank();
  std::vector<Handle> hs;
  for (int i = 0; i < 24; ++i) {
    const std::string name = "fuse." + std::to_string(i);
    if (i % 3 == 0)
      hs.push_back(
          allreduce_async(Tensor::full(Shape{i + 1}, static_cast<float>(r + i)), name, Op::kSum));
    if (i % 3 == 1)
      hs.push_back(allreduce_async(
          Tensor::from_vector<double>({r + i + 0.5, -r - 1.0, 0, 1}, Shape{2, 2}), name));
    if (i % 3 == 2)
      hs.push_back(
          allreduce_async(Tensor::from_vector<int32_t>({r, i, r * i}, Shape{3}), name, Op::kSum));
  }
  for (int i = 23; i >= 0; --i) {
    const Tensor t = hs[static_cast<size_t>(i)].synchronize();
    if (i % 3 == 0) {
      EXPECT_EQ(t.shape(), (Shape{i + 1}));
      EXPECT_EQ(host(t),
                std::vector<float>(static_cast<size_t>(i + 1), 3.f + 3.f * static_cast<float>(i)))
          << i;
    } else if (i % 3 == 1) {
      EXPECT_EQ(t.shape(), (Shape{2, 2}));  // the average over 3 ranks
      EXPECT_EQ(t.to_vector<double>(), (std::vector<double>{i + 1.5, -2, 0, 1})) << i;
    } else {
      EXPECT_EQ(t.to_vector<int32_t>(), (std::vector<int32_t>{3, 3 * i, 3 * i})) << i;
    }
  }
  const CollectiveStats after = collective_stats();
  EXPECT_EQ(after.tensors - before.tensors, 24);
  // Fused: one transfer per dtype per negotiation round (3 when all 24 land in one cycle on every
  // rank, as measured: 3 transfers after 2 rounds), at most 6 however the cycles fall.
  const int64_t transfers = after.transfers - before.transfers;
  EXPECT_LE(transfers, 3 * (after.negotiations - before.negotiations));
  EXPECT_LE(transfers, 6);
  std::printf("rank %d: 24 all-reduces in %lld transfers after %lld negotiation rounds\n", r,
              static_cast<long long>(after.transfers - before.transfers),
              static_cast<long long>(after.negotiations - before.negotiations));
  EXPECT_EQ(cycle_time(), std::chrono::microseconds(1000));  // Horovod's default
  EXPECT_EQ(fusion_threshold_bytes(), size_t{128} << 20);
}

TEST(Hvd, AsyncAllreducesInAnotherOrderFailOnEveryRank) {
  // Rank 0 queues p then q, the others q then p: both fail everywhere (fused or not), and the
  // group still works after.
  const bool first = rank() == 0;
  Handle a = allreduce_async(vec({1}), first ? "p" : "q");
  Handle b = allreduce_async(vec({1}), first ? "q" : "p");
  std::string e = failure([&] { a.synchronize(); });
  EXPECT_NE(e.find("different collectives"), std::string::npos) << e;
  e = failure([&] { b.synchronize(); });
  EXPECT_NE(e.find("different collectives"), std::string::npos) << e;
  EXPECT_EQ(host(allreduce(vec({1}), "after.order", Op::kSum))[0], 3.f);
}

TEST(Hvd, AllgatherTakesDifferentFirstDimensions) {
  // Rank r contributes r + 1 rows of [r, r].
  const int64_t rows = rank() + 1;
  const Tensor t = Tensor::full(Shape{rows, 2}, static_cast<float>(rank()));
  const Tensor all = allgather(t, "ragged");
  EXPECT_EQ(all.shape(), (Shape{6, 2}));
  EXPECT_EQ(host(all), (std::vector<float>{0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2}));
}

TEST(Hvd, BroadcastAlltoallReducescatter) {
  const float r = static_cast<float>(rank());
  EXPECT_EQ(host(broadcast(vec({r, r + 10}), 1, "bcast")), (std::vector<float>{1, 11}));
  // alltoall: rank r sends block j (2 rows: 100 r + 10 j + {0, 1}) to rank j.
  std::vector<float> v;
  for (int j = 0; j < 3; ++j)
    for (int k = 0; k < 2; ++k) v.push_back(100 * r + 10 * j + k);
  const std::vector<float> got = host(alltoall(Tensor::from_vector(v, Shape{6}), "a2a"));
  std::vector<float> want;
  for (int q = 0; q < 3; ++q)
    for (int k = 0; k < 2; ++k) want.push_back(100.f * q + 10 * r + k);
  EXPECT_EQ(got, want);
  // reducescatter: sum of [r, r, r, r+1, r+1, r+1] over ranks = [3, 3, 3, 6, 6, 6]; rank r keeps 2
  // of them.
  const Tensor rs = reducescatter(vec({r, r, r, r + 1, r + 1, r + 1}), "rs", Op::kSum);
  const std::vector<float> all{3, 3, 3, 6, 6, 6};
  EXPECT_EQ(host(rs), std::vector<float>(all.begin() + 2 * rank(), all.begin() + 2 * rank() + 2));
  EXPECT_THROW(alltoall(vec({1, 2, 3, 4}), "a2a.bad"), InvalidArgument);  // 4 rows into 3 blocks
}

TEST(Hvd, CompressionHalvesThePrecisionNotTheResult) {
  const float r = static_cast<float>(rank());
  for (Compression c : {Compression::kFP16, Compression::kBF16}) {
    const Tensor t = allreduce(vec({0.1f * (r + 1), 1000.f + r}),
                               std::string("comp.") + compression_name(c), Op::kSum, c);
    EXPECT_EQ(t.dtype(), DType::kFloat32);
    const std::vector<float> v = host(t);
    const double tol = c == Compression::kFP16 ? 2e-3 : 2e-2;
    EXPECT_NEAR(v[0], 0.6, 0.6 * tol) << compression_name(c);
    EXPECT_NEAR(v[1], 3003, 3003 * tol) << compression_name(c);
  }
  EXPECT_EQ(parse_compression("bf16"), Compression::kBF16);
  EXPECT_THROW(parse_compression("int8"), InvalidArgument);
}

TEST(Hvd, MismatchedNamesShapesAndOrderFailOnEveryRank) {
  // Another name on rank 1.
  std::string e = failure([] { allreduce(vec({1}), rank() == 1 ? "b" : "a"); });
  EXPECT_NE(e.find("rank 0: allreduce 'a' float32 [1] average"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 1: allreduce 'b' float32 [1] average"), std::string::npos) << e;
  // Another shape on rank 2.
  e = failure([] { allreduce(Tensor::zeros(Shape{rank() == 2 ? 3 : 2}), "shape"); });
  EXPECT_NE(e.find("rank 2: allreduce 'shape' float32 [3]"), std::string::npos) << e;
  // Another order on rank 0: both collectives fail everywhere, and the group still works after.
  const bool first = rank() == 0;
  e = failure([&] { allreduce(vec({1}), first ? "x" : "y"); });
  EXPECT_NE(e.find("different collectives"), std::string::npos) << e;
  e = failure([&] { allreduce(vec({1}), first ? "y" : "x"); });
  EXPECT_NE(e.find("different collectives"), std::string::npos) << e;
  // Another op, another kind.
  e = failure([] { allreduce(vec({1}), "op", rank() == 0 ? Op::kSum : Op::kMax); });
  EXPECT_NE(e.find("sum"), std::string::npos) << e;
  e = failure([] {
    if (rank() == 1)
      allgather(vec({1}), "kind");
    else
      allreduce(vec({1}), "kind");
  });
  EXPECT_NE(e.find("rank 1: allgather 'kind'"), std::string::npos) << e;
  EXPECT_EQ(host(allreduce(vec({1}), "after", Op::kSum))[0], 3.f);
}

TEST(Hvd, JoinLetsARankStopEarly) {
  // The last rank runs out of data at once; the others run two more all-reduces, then join.
  if (rank() == 2) {
    EXPECT_EQ(join(), 1);  // ranks 0 and 1 join in the same round; the higher is reported
    return;
  }
  const float r = static_cast<float>(rank());
  EXPECT_EQ(host(allreduce(vec({r + 1}), "j.sum", Op::kSum))[0], 3.f);  // 1 + 2 + rank 2's zero
  EXPECT_EQ(host(allreduce(vec({r + 1}), "j.avg"))[0], 1.5f);  // over the 2 that contributed
  const Tensor g = allgather(Tensor::full(Shape{1, 1}, r), "j.gather");
  EXPECT_EQ(g.shape(), (Shape{2, 1}));  // nothing from the joined rank
  // A fused run: the joined rank takes part with zeros of every tensor's shape.
  std::vector<Handle> hs;
  for (int i = 0; i < 6; ++i)
    hs.push_back(
        allreduce_async(Tensor::full(Shape{i + 1}, r + i), "j.fused." + std::to_string(i)));
  for (int i = 0; i < 6; ++i)  // the average of (0 + i) and (1 + i) over the 2 that contributed
    EXPECT_EQ(host(hs[static_cast<size_t>(i)].synchronize()),
              std::vector<float>(static_cast<size_t>(i + 1), 0.5f + i));
  EXPECT_EQ(join(), 1);
}

TEST(Hvd, BroadcastVariablesAndObjects) {
  auto v = create_variable(
      {"w", Shape{3}, DType::kFloat32, initializers::constant(static_cast<float>(rank()))});
  broadcast_variables({v}, 2);
  EXPECT_EQ(host(v->value()), (std::vector<float>{2, 2, 2}));
  const std::string msg =
      rank() == 0 ? std::string("epoch=7;best=0.91 and some bytes\0\1", 34) : "";
  const std::string got = broadcast_object(msg, 0);
  EXPECT_EQ(got.size(), 34u);
  EXPECT_EQ(got.substr(0, 16), "epoch=7;best=0.9");
}

TEST(Hvd, DistributedOptimizerAveragesAndAccumulates) {
  auto w = create_variable({"w", Shape{2}, DType::kFloat32, initializers::constant(1.f)});
  auto opt = DistributedOptimizer(std::make_unique<SGD>(1.f));
  const float r = static_cast<float>(rank());
  opt->apply_gradients({vec({r, 2 * r})}, {w});  // mean gradient [1, 2]
  EXPECT_EQ(host(w->value()), (std::vector<float>{0, -1}));
  EXPECT_EQ(opt->iterations(), 1);
  auto acc = DistributedOptimizer(std::make_unique<SGD>(1.f), Compression::kNone, 2);
  auto u = create_variable({"u", Shape{1}, DType::kFloat32, initializers::constant(0.f)});
  acc->apply_gradients({vec({r})}, {u});  // held
  EXPECT_EQ(host(u->value())[0], 0.f);
  EXPECT_EQ(acc->iterations(), 0);
  acc->apply_gradients({vec({r + 2})}, {u});  // mean over passes (r + 1), then over ranks: 2
  EXPECT_EQ(host(u->value())[0], -2.f);
  EXPECT_EQ(acc->iterations(), 1);
}

TEST(Hvd, DistributedOptimizerCompressesTheGradients) {
  // Each rank's gradient is 1 + (r + 1) 2^-13: fp16 (11 significant bits) rounds every one to 1
  // before the all-reduce, float32 keeps them, so the step differs by 2^-12 at 3 ranks.
  const float tiny = std::ldexp(1.f, -13);
  const float g = 1.f + tiny * static_cast<float>(rank() + 1);
  for (Compression c : {Compression::kNone, Compression::kFP16}) {
    auto w = create_variable({std::string("wc.") + compression_name(c), Shape{1}, DType::kFloat32,
                              initializers::constant(0.f)});
    auto opt = DistributedOptimizer(std::make_unique<SGD>(1.f), c);
    opt->apply_gradients({vec({g})}, {w});
    const float mean = c == Compression::kFP16
                           ? 1.f
                           : 1.f + tiny * 0.5f * static_cast<float>(size() + 1);  // mean of r + 1
    EXPECT_NEAR(host(w->value())[0], -mean, 1e-7) << compression_name(c);
  }
}

TEST(Hvd, DistributedGradientTapeAverages) {
  auto w = create_variable({"w", Shape{1}, DType::kFloat32, initializers::constant(3.f)});
  DistributedGradientTape tape;
  const Tensor loss =
      ops::scale(ops::sum(ops::mul(w->value(), w->value())), static_cast<float>(rank() + 1));
  // d/dw (r + 1) w^2 = 2 (r + 1) w = 6 (r + 1): average over ranks 12.
  EXPECT_EQ(host(tape.gradient(loss, {w})[0])[0], 12.f);
}

// fit() with one device per rank, Horovod-style: each rank its own shard, DistributedOptimizer,
// weights broadcast from rank 0 at the start, metrics averaged: every rank ends with the same
// weights.
// Horovod's variables, read by hvd::init(): ctest hvd_environment runs this test alone with
// HOROVOD_CYCLE_TIME=2.5 and HOROVOD_FUSION_THRESHOLD=0 (fusion off: one transfer per tensor).
TEST(Hvd, EnvironmentSetsCycleTimeAndFusionThreshold) {
  const char* cycle = std::getenv("HOROVOD_CYCLE_TIME");
  const char* fusion = std::getenv("HOROVOD_FUSION_THRESHOLD");
  if (!cycle || !fusion) GTEST_SKIP() << "ctest hvd_environment sets the variables";
  EXPECT_EQ(cycle_time(), std::chrono::microseconds(std::lround(std::atof(cycle) * 1000)));
  EXPECT_EQ(fusion_threshold_bytes(), std::stoull(fusion));
  if (fusion_threshold_bytes() != 0) return;
  const CollectiveStats before = collective_stats();
  std::vector<Handle> hs;
  for (int i = 0; i < 12; ++i)
    hs.push_back(allreduce_async(vec({static_cast<float>(i)}), "unfused." + std::to_string(i)));
  for (int i = 0; i < 12; ++i)
    EXPECT_EQ(host(hs[static_cast<size_t>(i)].synchronize())[0], static_cast<float>(i));
  EXPECT_EQ(collective_stats().transfers - before.transfers, 12);
}

TEST(Hvd, FitKeepsEveryRankInStep) {
  OneDeviceStrategy s(DeviceSpec::cpu());
  Sequential m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s.scope();
    set_global_seed(100 + static_cast<uint64_t>(rank()));  // different initial weights per rank
    m.add(std::make_shared<Dense>(8, Activation::kRelu));
    m.add(std::make_shared<Dense>(3));
    opt = DistributedOptimizer(std::make_unique<Adam>(0.01f * static_cast<float>(size())));
  }
  std::vector<float> x(96 * 4);
  std::vector<int32_t> y(96);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 11) / 11.f - 0.5f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(i % 3);
  const Dataset all = Dataset::from_tensors(
      {Tensor::from_vector(x, Shape{96, 4}), Tensor::from_vector(y, Shape{96})});
  BroadcastGlobalVariablesCallback bcast(0);
  MetricAverageCallback avg;
  LearningRateWarmupCallback warm(1.0);
  // Before avg: each rank's own epoch logs. After warm: the rate every step of epoch 0 uses.
  struct Recorder : Callback {
    std::map<std::string, double> own;
    std::vector<double> rates;
    int64_t steps_per_epoch = 0;
    void on_epoch_end(const TrainLogs&) override { own = *context().epoch_logs; }
    void on_train_batch_begin(const TrainLogs& logs) override {
      if (logs.epoch == 0 || logs.step == 0) rates.push_back(context().optimizer->learning_rate());
      steps_per_epoch = logs.steps_per_epoch;
    }
  } own_logs, own_rates;
  FitOptions o;
  o.epochs = 2;
  o.global_batch_size = 8;
  o.callbacks = {&own_logs, &avg, &bcast, &warm, &own_rates};
  const Dataset test = all.take(30);
  const History h = fit(s, m, *opt, all.shard(size(), rank()), &test, o);
  std::vector<float> mine;
  for (const auto& v : m.variables())
    for (float f : host(v->value())) mine.push_back(f);
  const std::vector<float> root = host(broadcast(vec(mine), 0, "final-weights"));
  EXPECT_EQ(mine, root);
  // MetricAverageCallback: every logged value is the mean of the ranks' own values (which differ:
  // each rank trains on its own shard), not one rank's.
  ASSERT_TRUE(own_logs.own.count("loss") && own_logs.own.count("accuracy"));
  for (const auto& [key, value] : own_logs.own) {
    const Tensor mine = Tensor::from_vector<double>({value}, Shape{1});
    const double mean = allreduce(mine, "own." + key, Op::kAverage).to_vector<double>()[0];
    EXPECT_NEAR(h.history.at(key).back(), mean, 1e-12 * std::abs(mean)) << key;
    if (key == "loss") {
      EXPECT_GT(allreduce(mine, "own.max", Op::kMax).to_vector<double>()[0],
                allreduce(mine, "own.min", Op::kMin).to_vector<double>()[0])
          << "the ranks' own losses are equal, so averaging them proves nothing";
    }
  }
  // LearningRateWarmupCallback (Horovod's): epoch 0 rises from target / size to target over its
  // batches, lr = target / n * (e * (n - 1) + 1) with e the fractional epoch; epoch 1 uses target.
  const double target = 0.01 * size(), n = size();
  ASSERT_EQ(own_rates.rates.size(), static_cast<size_t>(own_rates.steps_per_epoch + 1));
  for (size_t i = 0; i < own_rates.rates.size(); ++i) {
    const double e = std::min(1.0, static_cast<double>(i) / own_rates.steps_per_epoch);
    EXPECT_NEAR(own_rates.rates[i], target / n * (e * (n - 1) + 1), 1e-6 * target) << "batch " << i;
  }
}

}  // namespace
}  // namespace dtrain::hvd

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dtrain::hvd::InitOptions o;
  o.timeout = std::chrono::seconds(30);  // a bug shows as an error, not a hang
  if (argc > 1 && std::string(argv[1]) == "--stall-demo") {
    // The stall inspector: the last rank starts its all-reduce 3.5 s late; the others warn each
    // second.
    o.stall_warning = std::chrono::seconds(1);
    dtrain::hvd::init(o);
    dtrain::hvd::allreduce(dtrain::Tensor::full(dtrain::Shape{4}, 1.f), "warm-up",
                           dtrain::hvd::Op::kSum);
    if (dtrain::hvd::rank() == dtrain::hvd::size() - 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(3500));
    const dtrain::Tensor t = dtrain::hvd::allreduce(dtrain::Tensor::full(dtrain::Shape{4}, 1.f),
                                                    "late_tensor", dtrain::hvd::Op::kSum);
    std::printf("stall demo: rank %d got %g\n", dtrain::hvd::rank(), t.to_vector<float>()[0]);
    dtrain::hvd::shutdown();
    return 0;
  }
  dtrain::hvd::init(o);
  const int rc = RUN_ALL_TESTS();
  dtrain::hvd::shutdown();
  return rc;
}
