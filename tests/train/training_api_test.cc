// The training API around fit(): metrics, evaluate/predict, gradient accumulation, Checkpoint,
// ModelCheckpoint, BackupAndRestore and EnsembleStrategy (in one process; the callbacks are in
// training_callbacks_test.cc, the multi-process fault tests in backup_restore_test.py).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "dtrain/dtrain.h"
#include "train/training_api_util.h"

namespace dtrain {
namespace {

using namespace train_test;

TEST_F(TrainingApi, MetricsAreExactSumsAcrossReplicas) {
  // The same weights evaluated on 1 and 3 replicas with a batch that does not split evenly: the
  // metrics are sums over all examples, so they are equal.
  OneDeviceStrategy one(DeviceSpec::cpu(0));
  MirroredStrategy three(on(3));
  Sequential a, b;
  {
    auto scope = one.scope();
    set_global_seed(3);
    a = mlp();
    a.build(Shape{1, 4});
  }
  {
    auto scope = three.scope();
    set_global_seed(3);
    b = mlp();
    b.build(Shape{1, 4});
  }
  const Dataset test = classification(101, 4);
  const std::vector<std::string> metrics{"accuracy", "top_2", "sparse_categorical_accuracy"};
  const EvalResult r1 = evaluate(one, a, test, 25, {}, metrics);
  const EvalResult r3 = evaluate(three, b, test, 25, {}, metrics);
  EXPECT_EQ(r1.examples, 101);
  EXPECT_EQ(r3.examples, 101);
  for (const auto& name : metrics) EXPECT_EQ(r1.metrics.at(name), r3.metrics.at(name)) << name;
  EXPECT_NEAR(r1.loss, r3.loss, 1e-6);
  EXPECT_GE(r1.metrics.at("top_2"), r1.metrics.at("accuracy"));
  // By hand: accuracy = correct / 101 from predict().
  const Tensor logits = predict(one, a, test, 30);
  ASSERT_EQ(logits.shape(), (Shape{101, 3}));
  SparseCategoricalAccuracy acc;
  std::vector<Tensor> all;
  test.batch(101).make_iterator()->next(&all);
  acc.update_state(logits, all[1]);
  EXPECT_EQ(acc.result(), r1.accuracy);
  // The same logits from 3 replicas, each computing a third of every batch of 30: equal up to the
  // order in which oneDNN's matmul sums a row for another number of rows (bitwise on AVX-512; on an
  // AVX2 CPU 3 of these 303 logits are 1 ulp, 3e-8, apart).
  const auto l1 = logits.to_vector<float>(), l3 = predict(three, b, test, 30).to_vector<float>();
  ASSERT_EQ(l3.size(), l1.size());
  for (size_t i = 0; i < l1.size(); ++i)
    EXPECT_NEAR(l3[i], l1[i], 1e-6f * (1.f + std::abs(l1[i]))) << i;
}

TEST_F(TrainingApi, RegressionFitWithATestSetAndPredict) {
  MirroredStrategy s(on(3));
  auto [m, opt] = build(
      s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<Adam>(0.01f)); }, 1);
  // y = sum(x): a regression target [N, 1].
  auto make = [](int64_t n, uint64_t seed) {
    Philox rng(seed, 1);
    std::vector<float> x(static_cast<size_t>(n * 4)), y(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < 4; ++j) {
        x[static_cast<size_t>(i * 4 + j)] = rng.uniform(static_cast<uint64_t>(i * 4 + j));
        y[static_cast<size_t>(i)] += x[static_cast<size_t>(i * 4 + j)];
      }
    return Dataset::from_tensors(
        {Tensor::from_vector(x, Shape{n, 4}), Tensor::from_vector(y, Shape{n, 1})});
  };
  FitOptions o;
  o.epochs = 30;
  o.global_batch_size = 32;
  o.loss = [](const Tensor& p, const Tensor& y) { return ops::mean_squared_error(p, y); };
  o.metrics = {"mse", "mae"};
  const Dataset train = make(256, 1), test = make(64, 2);
  const History h = fit(s, m, *opt, train, &test, o);
  EXPECT_LT(h.history.at("val_mse").back(), 0.05);
  EXPECT_LT(h.history.at("val_mae").back(), h.history.at("val_mae").front());
  EXPECT_EQ(h.test_accuracy, -1);
  EXPECT_NEAR(h.history.at("val_mse").back(), h.test_loss, 1e-6);  // the loss is the MSE
  const Tensor p = predict(s, m, test, 20);
  EXPECT_EQ(p.shape(), (Shape{64, 1}));
  EXPECT_THROW(evaluate(s, m, test, 16, o.loss, {"accuracy"}),
               InvalidArgument);  // [N,1] labels are not classes
  EXPECT_THROW(make_metric("f1"), InvalidArgument);
}

// k batches of b accumulated = one batch of k*b (SGD, exact up to float reassociation).
TEST_F(TrainingApi, GradientAccumulationEqualsTheLargerBatch) {
  for (int replicas : {1, 2}) {
    auto train = [&](int64_t batch, int accumulate) {
      MirroredStrategy s(on(replicas));
      Sequential m;
      std::unique_ptr<Optimizer> opt;
      {
        auto scope = s.scope();
        set_global_seed(21);
        m = mlp();
        opt = std::make_unique<SGD>(0.5f, 0.9f);
      }
      FitOptions o;
      o.epochs = 2;
      o.global_batch_size = batch;
      o.accumulate = accumulate;
      o.shuffle_seed = 3;
      fit(s, m, *opt, classification(96), nullptr, o);
      return std::make_pair(weights(m), opt->iterations());
    };
    const auto [big, big_steps] = train(48, 1);
    const auto [acc, acc_steps] = train(12, 4);
    EXPECT_EQ(big_steps, 4);
    EXPECT_EQ(acc_steps, 4);
    ASSERT_EQ(big.size(), acc.size());
    for (size_t i = 0; i < big.size(); ++i)
      for (size_t j = 0; j < big[i].size(); ++j)
        ASSERT_NEAR(acc[i][j], big[i][j], 2e-5) << replicas << " replicas";
  }
}

TEST_F(TrainingApi, CheckpointMovesBetweenStrategiesAndRefusesAnotherModel) {
  MirroredStrategy two(on(2));
  Sequential a;
  std::unique_ptr<Optimizer> opt_a;
  {
    auto scope = two.scope();
    a = mlp();
    opt_a = std::make_unique<Adam>(0.01f);
  }
  FitOptions o;
  o.epochs = 1;
  o.global_batch_size = 16;
  fit(two, a, *opt_a, classification(64), nullptr, o);
  const std::string path = (dir_ / "model.safetensors").string();
  ASSERT_TRUE(Checkpoint(a, opt_a.get(), &two).save(path, {1, 0, 4}));

  OneDeviceStrategy one(DeviceSpec::cpu(1));
  Sequential b;
  std::unique_ptr<Optimizer> opt_b;
  {
    auto scope = one.scope();
    set_global_seed(999);  // other initial weights
    b = mlp();
    b.build(Shape{1, 4});
    opt_b = std::make_unique<Adam>(0.01f);
  }
  const TrainingPosition p = Checkpoint(b, opt_b.get(), &one).restore(path);
  EXPECT_EQ(p.epoch, 1);
  EXPECT_EQ(p.global_step, 4);
  EXPECT_EQ(weights(b), weights(a));
  EXPECT_EQ(opt_b->iterations(), 4);
  ASSERT_EQ(opt_b->slot_variables().size(), opt_a->slot_variables().size());
  for (size_t i = 0; i < opt_a->slot_variables().size(); ++i)
    EXPECT_EQ(opt_b->slot_variables()[i]->value().to_vector<float>(),
              opt_a->slot_variables()[i]->value().to_vector<float>());
  // And back, into three replicas.
  MirroredStrategy three(on(3));
  Sequential c;
  {
    auto scope = three.scope();
    c = mlp();
    c.build(Shape{1, 4});
  }
  Checkpoint(c, nullptr, &three).restore(path);
  for (const auto& v : c.variables())
    for (const Tensor& copy : v->device_values())
      EXPECT_EQ(copy.to_vector<float>(), v->value().to_vector<float>());
  EXPECT_EQ(weights(c), weights(a));

  // Another model: the first variable that differs is named, and nothing changes.
  Sequential d;
  {
    auto scope = one.scope();
    d.add(std::make_shared<Dense>(16, Activation::kRelu));
    d.add(std::make_shared<Dense>(4));
    d.build(Shape{1, 4});
  }
  const auto before = weights(d);
  try {
    Checkpoint(d, nullptr, &one).restore(path);
    ADD_FAILURE() << "a checkpoint of another model was restored";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("variable 'dense_1/kernel': the model has float32 [16, "
                                         "4], the checkpoint float32 [16, 3]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(weights(d), before);
}

// One fit() killed mid-epoch (an exception from a callback after a backup) and run again with a
// fresh model and optimizer ends bitwise equal to an uninterrupted fit().
TEST_F(TrainingApi, BackupAndRestoreResumesBitwise) {
  struct Crash : Callback {
    int64_t at;
    explicit Crash(int64_t s) : at(s) {}
    void on_train_batch_end(const TrainLogs& l) override {
      if (l.global_step == at) throw Unavailable("simulated crash");
    }
  };
  auto run = [&](const std::string& backup, Callback* extra, History* out) {
    MirroredStrategy s(on(2));
    Sequential m;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s.scope();
      set_global_seed(8);
      m = mlp();
      m.add(std::make_shared<Dropout>(0.2f));  // its random state is in the backup too
      // and a dropout nested in a block (a GPT's are): its state was left out, by name
      m.add(std::make_shared<Sequential>(
          std::vector<std::shared_ptr<Layer>>{std::make_shared<Dropout>(0.3f)}));
      opt = std::make_unique<Adam>(0.01f);
    }
    BackupAndRestore bar(backup, /*save_freq=*/3);
    FitOptions o;
    o.epochs = 3;
    o.global_batch_size = 10;  // 7 batches per epoch, the last one partial
    o.shuffle_seed = 17;
    o.callbacks = {&bar};
    if (extra) o.callbacks.push_back(extra);
    *out = fit(s, m, *opt, classification(64), nullptr, o);
    return weights(m);
  };
  History h;
  const auto straight = run((dir_ / "a").string(), nullptr, &h);
  EXPECT_EQ(h.steps, 21);
  for (int64_t crash_at :
       {5, 7, 13, 19}) {  // mid-epoch after a step backup, at an epoch end, in the last epoch
    const std::string b = (dir_ / ("b" + std::to_string(crash_at))).string();
    Crash crash(crash_at);
    History first;
    EXPECT_THROW(run(b, &crash, &first), Unavailable);
    History second;
    const auto resumed = run(b, nullptr, &second);
    EXPECT_EQ(resumed, straight) << "crash at " << crash_at;
    EXPECT_EQ(second.steps, 21);
    EXPECT_EQ(second.final_loss, h.final_loss)
        << "crash at " << crash_at;                        // the epoch's sums were restored
    EXPECT_FALSE(fs::exists(fs::path(b) / "checkpoint"));  // deleted once training finished
  }
}

TEST_F(TrainingApi, ModelCheckpointKeepsTheBest) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  // "max" of a falling loss: only epoch 0 is ever the best, so one file.
  ModelCheckpoint mc((dir_ / "ckpt").string(), "loss", true, MonitorMode::kMax);
  FitOptions o;
  o.epochs = 3;
  o.global_batch_size = 16;
  o.callbacks = {&mc};
  fit(s, m, *opt, classification(64), nullptr, o);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_ / "ckpt"))
    files += e.path().extension() == ".safetensors";
  EXPECT_EQ(files, 1);
  EXPECT_NE(mc.last_saved().find("ckpt-4.safetensors"), std::string::npos) << mc.last_saved();
  ModelCheckpoint every((dir_ / "every").string());
  o.callbacks = {&every};
  fit(s, m, *opt, classification(64), nullptr, o);
  EXPECT_NE(every.last_saved().find("ckpt-12.safetensors"), std::string::npos)
      << every.last_saved();
  ModelCheckpoint none((dir_ / "none").string(), "val_loss", true);  // no test set: no val_loss
  o.callbacks = {&none};
  EXPECT_THROW(fit(s, m, *opt, classification(64), nullptr, o), NotFound);
}

}  // namespace
}  // namespace dtrain

namespace dtrain {
namespace {

using namespace train_test;

TEST_F(TrainingApi, EnsembleOfOneIsOneDeviceBitwise) {
  auto train = [&](Strategy& s) {
    Sequential m;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s.scope();
      set_global_seed(31);
      m = mlp();
      m.add(std::make_shared<Dropout>(0.1f));
      opt = std::make_unique<Adam>(0.01f);
    }
    FitOptions o;
    o.epochs = 2;
    o.global_batch_size = 16;
    o.shuffle_seed = 4;
    const History h = fit(s, m, *opt, classification(80), nullptr, o);
    return std::make_pair(weights(m), h.final_loss);
  };
  OneDeviceStrategy one(DeviceSpec::cpu(0));
  EnsembleStrategy ens({DeviceSpec::cpu(0)});
  EXPECT_EQ(ens.num_members(), 1);
  EXPECT_EQ(train(one), train(ens));
}

// Keras' layer.trainable = False (fine-tuning a base model): the frozen block's weights, its batch
// norm's moving statistics included, stay bitwise what they were through fit() on one device and
// under Mirrored; the head trains; trainable_variables() and summary() say so.
TEST_F(TrainingApi, FrozenLayersStayAsTheyWere) {
  for (int devices : {1, 2}) {
    MirroredStrategy s(on(devices));
    Sequential m;
    std::shared_ptr<Sequential> base;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s.scope();
      set_global_seed(12);
      base = std::make_shared<Sequential>(std::vector<std::shared_ptr<Layer>>{
          std::make_shared<Dense>(16, Activation::kRelu, true, "features"),
          std::make_shared<BatchNormalization>()});
      m.add(base);
      m.add(std::make_shared<Dense>(3, Activation::kNone, true, "head"));
      m.build(Shape{1, 4});
      opt = std::make_unique<Adam>(0.05f);
    }
    base->set_trainable(false);
    EXPECT_FALSE(base->layers()[1]->trainable());  // sublayers too
    std::vector<std::string> names;
    for (const auto& v : m.trainable_variables()) names.push_back(v->name());
    EXPECT_EQ(names, (std::vector<std::string>{"head/kernel", "head/bias"}));
    EXPECT_EQ(m.non_trainable_variables().size(), 6u);  // kernel, bias, gamma, beta, mean, var
    std::map<std::string, std::vector<float>> before;
    for (const auto& v : m.variables()) before[v->name()] = v->value().to_vector<float>();
    FitOptions o;
    o.epochs = 2;
    o.global_batch_size = 16;
    fit(s, m, *opt, classification(64), nullptr, o);
    for (const auto& v : m.variables()) {
      const bool head = v->name().rfind("head/", 0) == 0;
      EXPECT_EQ(v->value().to_vector<float>() != before.at(v->name()), head)
          << devices << " device(s): " << v->name();
    }
    std::ostringstream out;
    m.summary(out);
    EXPECT_NE(out.str().find("Trainable params: 51 "), std::string::npos) << out.str();
  }
}

TEST_F(TrainingApi, EnsembleMembersTrainApartPredictTogetherAndCheckpoint) {
  EnsembleStrategy ens({DeviceSpec::cpu(0), DeviceSpec::cpu(1), DeviceSpec::cpu(2)});
  Sequential m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = ens.scope();
    set_global_seed(5);
    m = mlp();
    m.build(Shape{1, 4});
    opt = std::make_unique<Adam>(0.02f);
  }
  // Members start apart (their own seeds).
  const auto k0 = m.variables()[0]->device_values();
  ASSERT_EQ(k0.size(), 3u);
  EXPECT_NE(k0[0].to_vector<float>(), k0[1].to_vector<float>());
  FitOptions o;
  o.epochs = 6;
  o.global_batch_size = 16;
  const Dataset test = classification(60, 8);
  const History h = fit(ens, m, *opt, classification(120), &test, o);
  EXPECT_LT(h.epoch_loss.back(), h.epoch_loss.front());  // the members' mean loss falls
  EXPECT_EQ(opt->iterations(), 6 * 8);  // 120 / 16 -> 8 steps per epoch, per member
  const auto k1 = m.variables()[0]->device_values();
  EXPECT_NE(k1[1].to_vector<float>(), k1[2].to_vector<float>());
  // Prediction: every member, the mean and the spread; predict() is the mean.
  const EnsemblePrediction p = predict_ensemble(ens, m, test, 25);
  ASSERT_EQ(p.members.size(), 3u);
  const std::vector<float> a = p.members[0].to_vector<float>(), b = p.members[1].to_vector<float>(),
                           c = p.members[2].to_vector<float>(), mean = p.mean.to_vector<float>(),
                           sd = p.stddev.to_vector<float>();
  double spread = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(mean[i], (a[i] + b[i] + c[i]) / 3, 1e-5);
    const double mu = (a[i] + b[i] + c[i]) / 3.0;
    EXPECT_NEAR(sd[i],
                std::sqrt(((a[i] - mu) * (a[i] - mu) + (b[i] - mu) * (b[i] - mu) +
                           (c[i] - mu) * (c[i] - mu)) /
                          3),
                1e-4);
    spread += sd[i];
  }
  EXPECT_GT(spread, 0);
  EXPECT_EQ(predict(ens, m, test, 25).to_vector<float>(), mean);
  // A checkpoint holds every member: restored into another ensemble, every member comes back; into
  // one device, member 0.
  const std::string path = (dir_ / "ensemble.safetensors").string();
  Checkpoint(m, opt.get(), &ens).save(path);
  const CheckpointData saved = load_safetensors(path);
  EXPECT_NE(saved.find("ensemble/member_2/dense/kernel"), nullptr);
  EXPECT_NE(saved.find("ensemble/member_1/optimizer/dense/kernel/m"), nullptr);
  EnsembleStrategy ens2({DeviceSpec::cpu(1), DeviceSpec::cpu(2), DeviceSpec::cpu(3)});
  Sequential m2;
  std::unique_ptr<Optimizer> opt2;
  {
    auto scope = ens2.scope();
    m2 = mlp();
    m2.build(Shape{1, 4});
    opt2 = std::make_unique<Adam>(0.02f);
  }
  Checkpoint(m2, opt2.get(), &ens2).restore(path);
  for (size_t v = 0; v < m.variables().size(); ++v)
    for (size_t k = 0; k < 3; ++k)
      EXPECT_EQ(m2.variables()[v]->device_values()[k].to_vector<float>(),
                m.variables()[v]->device_values()[k].to_vector<float>());
  OneDeviceStrategy one(DeviceSpec::cpu(0));
  Sequential single;
  {
    auto scope = one.scope();
    single = mlp();
    single.build(Shape{1, 4});
  }
  ::testing::internal::CaptureStderr();
  Checkpoint(single, nullptr, &one).restore(path);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find(
                "ensemble of 3 members, this job trains one model: members 1..2 of the checkpoint "
                "not restored (member 0 is)"),
            std::string::npos);
  EXPECT_EQ(single.variables()[0]->value().to_vector<float>(), k1[0].to_vector<float>());
  // Into an ensemble of another size: said, not silently member 0's copies or dropped.
  for (int n : {2, 4}) {
    std::vector<DeviceSpec> devices;
    for (int i = 0; i < n; ++i) devices.push_back(DeviceSpec::cpu(i));
    EnsembleStrategy other(devices);
    Sequential m3;
    {
      auto scope = other.scope();
      m3 = mlp();
      m3.build(Shape{1, 4});
    }
    ::testing::internal::CaptureStderr();
    Checkpoint(m3, nullptr, &other).restore(path);
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(
        log.find(n == 2 ? "ensemble of 3 members, this ensemble has 2: member 2 of the checkpoint "
                          "not restored"
                        : "ensemble of 3 members, this ensemble has 4: member 3 starts from "
                          "member 0"),
        std::string::npos)
        << log;
  }
  EXPECT_THROW(EnsembleStrategy({DeviceSpec::cpu(0), DeviceSpec::cpu(0)}), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
