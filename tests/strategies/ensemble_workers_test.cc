// Run as `dtrain-run -np 2 -- ensemble_workers_test` (DTRAIN_TEST_DIR: a directory both workers
// see). An ensemble whose members span two worker processes (2 devices each: members 0..3) trains
// exactly the members one process with 4 devices trains: the same weights, predictions, mean and
// spread, bit for bit; its checkpoint holds all four and restores into either layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "dtrain/dtrain.h"

namespace dtrain {
namespace {

Dataset regression(int64_t n, uint64_t salt = 0) {
  std::vector<float> x(static_cast<size_t>(n * 2)), y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float a = static_cast<float>((i * 37 + static_cast<int64_t>(salt)) % 101) / 101.f;
    const float b = static_cast<float>((i * 53 + 7) % 89) / 89.f;
    x[static_cast<size_t>(2 * i)] = a;
    x[static_cast<size_t>(2 * i + 1)] = b;
    y[static_cast<size_t>(i)] = std::sin(3.f * a) + 0.5f * b * b;
  }
  return Dataset::from_tensors(
      {Tensor::from_vector(x, Shape{n, 2}), Tensor::from_vector(y, Shape{n, 1})});
}

Tensor mse(const Tensor& p, const Tensor& t) { return ops::mean_squared_error(p, t); }

struct Trained {
  Sequential model;
  std::unique_ptr<Optimizer> opt;
  History history;
};

void build(Strategy& s, Trained& t) {
  auto scope = s.scope();
  set_global_seed(11);
  t.model.add(std::make_shared<Dense>(16, Activation::kTanh));
  t.model.add(std::make_shared<Dense>(1));
  t.model.build(Shape{1, 2});
  t.opt = std::make_unique<Adam>(0.01f);
}

Trained train(Strategy& s) {
  Trained t;
  build(s, t);
  FitOptions o;
  o.epochs = 3;
  o.global_batch_size = 16;
  o.shuffle_seed = 3;
  o.loss = mse;
  t.history = fit(s, t.model, *t.opt, regression(96), nullptr, o);
  return t;
}

std::vector<float> values(const Tensor& t) { return t.to_vector<float>(); }

std::unique_ptr<Strategy> across_workers() {
  StrategyOptions o;
  o.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  return make_strategy("ensemble", o);
}

TEST(EnsembleWorkers, MembersAcrossTwoWorkersEqualOneProcessWithFourDevices) {
  auto dist = across_workers();
  ASSERT_EQ(dist->extended().num_workers(), 2);
  auto* ens = dynamic_cast<EnsembleStrategy*>(dist.get());
  ASSERT_NE(ens, nullptr);
  EXPECT_EQ(ens->num_members(), 4);
  const int rank = dist->extended().worker_rank();
  EXPECT_EQ(ens->first_member(), 2 * rank);
  EnsembleStrategy one_process(
      {DeviceSpec::cpu(0), DeviceSpec::cpu(1), DeviceSpec::cpu(2), DeviceSpec::cpu(3)});

  Trained a = train(*dist), b = train(one_process);
  // This worker's members are members 2*rank and 2*rank + 1 of the one-process ensemble.
  for (size_t v = 0; v < a.model.variables().size(); ++v)
    for (size_t m = 0; m < 2; ++m)
      EXPECT_EQ(values(a.model.variables()[v]->device_values()[m]),
                values(b.model.variables()[v]->device_values()[2 * static_cast<size_t>(rank) + m]))
          << "variable " << a.model.variables()[v]->name() << ", local member " << m;
  // The logged loss is the mean over all four members (summed in another order: within rounding).
  ASSERT_EQ(a.history.epoch_loss.size(), b.history.epoch_loss.size());
  for (size_t e = 0; e < a.history.epoch_loss.size(); ++e)
    EXPECT_NEAR(a.history.epoch_loss[e], b.history.epoch_loss[e],
                1e-6 * std::abs(b.history.epoch_loss[e]));
  EXPECT_EQ(a.opt->iterations(), 3 * 6);

  // Every worker gets every member's predictions, in member order; mean and spread over all four.
  const Dataset test = regression(40, 5);
  const EnsemblePrediction pa = predict_ensemble(*dist, a.model, test, 16);
  const EnsemblePrediction pb = predict_ensemble(one_process, b.model, test, 16);
  ASSERT_EQ(pa.members.size(), 4u);
  for (size_t m = 0; m < 4; ++m)
    EXPECT_EQ(values(pa.members[m]), values(pb.members[m])) << "member " << m;
  EXPECT_EQ(values(pa.mean), values(pb.mean));
  EXPECT_EQ(values(pa.stddev), values(pb.stddev));
  EXPECT_NE(values(pa.members[0]), values(pa.members[3]));  // members differ
  EXPECT_EQ(values(predict(*dist, a.model, test, 16)), values(pa.mean));
  // evaluate(): every member on every example; the examples are counted once.
  EXPECT_EQ(evaluate(*dist, a.model, test, 16, mse).examples, 40);

  // Checkpoint: the chief writes all four members; it restores into a fresh two-worker ensemble
  // and into the one-process layout.
  const char* dir = std::getenv("DTRAIN_TEST_DIR");
  ASSERT_NE(dir, nullptr) << "set DTRAIN_TEST_DIR to a directory both workers see";
  const std::string path = std::string(dir) + "/ensemble_workers.safetensors";
  if (rank == 0) std::filesystem::remove(path);
  dist->extended().sum_across_workers({1.0});  // nobody reads before it is removed
  EXPECT_EQ(Checkpoint(a.model, a.opt.get(), dist.get()).save(path), rank == 0);
  dist->extended().sum_across_workers({1.0});  // written before anyone reads it
  const CheckpointData saved = load_safetensors(path);
  EXPECT_EQ(saved.metadata.at("dtrain.ensemble_members"), "4");
  for (int g = 1; g < 4; ++g)
    EXPECT_EQ(values(*saved.find("ensemble/member_" + std::to_string(g) + "/dense/kernel")),
              values(b.model.variables()[0]->device_values()[static_cast<size_t>(g)]));

  Trained fresh;
  build(*dist, fresh);
  EXPECT_NE(values(fresh.model.variables()[0]->device_values()[0]),
            values(a.model.variables()[0]->device_values()[0]));
  Checkpoint(fresh.model, fresh.opt.get(), dist.get()).restore(path);
  for (size_t v = 0; v < a.model.variables().size(); ++v)
    for (size_t m = 0; m < 2; ++m)
      EXPECT_EQ(values(fresh.model.variables()[v]->device_values()[m]),
                values(a.model.variables()[v]->device_values()[m]));
  EXPECT_EQ(fresh.opt->iterations(), a.opt->iterations());

  Trained local;
  build(one_process, local);
  Checkpoint(local.model, local.opt.get(), &one_process).restore(path);
  for (size_t m = 0; m < 4; ++m)
    EXPECT_EQ(values(local.model.variables()[0]->device_values()[m]),
              values(b.model.variables()[0]->device_values()[m]));
}

TEST(EnsembleWorkers, WorkersWithDifferentDeviceCountsFailOnEveryWorkerNamingThem) {
  StrategyOptions o;
  const std::optional<ClusterResolution> c = resolve_cluster(false);
  ASSERT_TRUE(c.has_value());
  const int dist_rank = c->worker_rank();
  o.devices = dist_rank == 0 ? std::vector<DeviceSpec>{DeviceSpec::cpu(0)}
                             : std::vector<DeviceSpec>{DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  try {
    make_strategy("ensemble", o);
    FAIL() << "expected FailedPrecondition";
  } catch (const FailedPrecondition& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("worker 0: 1, worker 1: 2"), std::string::npos) << what;
    EXPECT_NE(what.find("same --devices"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace dtrain

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dtrain::DeviceConfig c;
  c.num_cpu_devices = 4;
  c.threads_per_cpu_device = 1;
  dtrain::configure_devices(c);
  return RUN_ALL_TESTS();
}
