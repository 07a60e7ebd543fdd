// The training API's callbacks: every hook in Keras' order, stop_training, EarlyStopping,
// CSVLogger with a schedule, TerminateOnNaN, ProgressBar's throughput unit, Horovod's warm-up, and
// what a fit() that ends in an exception leaves behind.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dtrain/dtrain.h"
#include "train/training_api_util.h"

namespace dtrain {
namespace {

using namespace train_test;

struct Recorder : Callback {
  std::vector<std::string> events;
  void on_train_begin(const TrainLogs&) override {
    events.push_back("train_begin");
    EXPECT_TRUE(model().built());
    EXPECT_GT(optimizer().learning_rate(), 0.f);
  }
  void on_epoch_begin(const TrainLogs& l) override {
    events.push_back("epoch_begin " + std::to_string(l.epoch));
  }
  void on_train_batch_begin(const TrainLogs&) override { events.push_back("b"); }
  void on_train_batch_end(const TrainLogs& l) override {
    events.push_back("e");
    EXPECT_TRUE(l.has("loss"));
    EXPECT_TRUE(l.has("accuracy"));
  }
  void on_test_begin(const TrainLogs&) override { events.push_back("test_begin"); }
  void on_test_batch_end(const TrainLogs&) override { events.push_back("t"); }
  void on_test_end(const TrainLogs& l) override {
    events.push_back("test_end");
    EXPECT_TRUE(l.has("accuracy"));
  }
  void on_epoch_end(const TrainLogs& l) override {
    events.push_back("epoch_end " + std::to_string(l.epoch));
    EXPECT_TRUE(l.has("val_loss"));
    EXPECT_TRUE(l.has("val_accuracy"));
    EXPECT_TRUE(l.has("learning_rate"));
  }
  void on_train_end(const TrainLogs&) override { events.push_back("train_end"); }
};

TEST_F(TrainingApi, CallbacksSeeEveryHookInKerasOrder) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  const Dataset train = classification(40), test = classification(20, 9);
  Recorder r;
  FitOptions o;
  o.epochs = 2;
  o.global_batch_size = 20;
  o.eval_batch_size = 10;
  o.callbacks = {&r};
  const History h = fit(s, m, *opt, train, &test, o);
  const std::vector<std::string> want{
      "train_begin", "epoch_begin 0", "b", "e", "b", "e", "test_begin", "t", "t", "test_end",
      "epoch_end 0", "epoch_begin 1", "b", "e", "b", "e", "test_begin", "t", "t", "test_end",
      "epoch_end 1", "train_end"};
  EXPECT_EQ(r.events, want);
  EXPECT_EQ(h.history.at("loss").size(), 2u);
  EXPECT_EQ(h.history.at("val_accuracy").size(), 2u);
  EXPECT_THROW(r.model(), FailedPrecondition);  // outside fit()
}

struct StopAfter : Callback {
  int64_t n;
  explicit StopAfter(int64_t k) : n(k) {}
  void on_train_batch_end(const TrainLogs& l) override {
    if (l.global_step == n) stop_training();
  }
};

TEST_F(TrainingApi, StopTrainingEndsAfterTheBatch) {
  MirroredStrategy s(on(2));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  StopAfter stop(3);
  FitOptions o;
  o.epochs = 5;
  o.global_batch_size = 8;
  o.callbacks = {&stop};
  const History h = fit(s, m, *opt, classification(64), nullptr, o);
  EXPECT_EQ(h.steps, 3);
  EXPECT_EQ(opt->iterations(), 3);
  EXPECT_EQ(h.epoch_loss.size(), 1u);
}

TEST_F(TrainingApi, EarlyStoppingStopsAndRestoresTheBestWeights) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  // In "max" mode a falling loss never improves after epoch 0: patience 2 stops after epoch 2,
  // and restore_best_weights puts back epoch 0's weights.
  EarlyStopping es("loss", 0, 2, MonitorMode::kMax, true);
  struct Snap : Callback {
    std::vector<std::vector<float>> first;
    void on_epoch_end(const TrainLogs& l) override {
      if (l.epoch == 0) first = weights(model());
    }
  } snap;
  FitOptions o;
  o.epochs = 10;
  o.global_batch_size = 16;
  o.callbacks = {&snap, &es};
  const History h = fit(s, m, *opt, classification(64), nullptr, o);
  EXPECT_EQ(h.epoch_loss.size(), 3u);
  EXPECT_EQ(es.stopped_epoch(), 2);
  EXPECT_EQ(es.best_epoch(), 0);
  EXPECT_EQ(weights(m), snap.first);
  EarlyStopping missing("val_auc");
  o.callbacks = {&missing};
  EXPECT_THROW(fit(s, m, *opt, classification(64), nullptr, o), NotFound);
}

TEST_F(TrainingApi, CsvLoggerSchedulerAndTerminateOnNan) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] =
      build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<Adam>(0.01f)); });
  const std::string csv = (dir_ / "log.csv").string();
  CSVLogger logger(csv);
  LearningRateScheduler sched([](int epoch, double lr) { return epoch == 0 ? lr : lr * 0.5; });
  FitOptions o;
  o.epochs = 3;
  o.global_batch_size = 16;
  o.callbacks = {&sched, &logger};
  const History h = fit(s, m, *opt, classification(48), nullptr, o);
  EXPECT_NEAR(h.history.at("learning_rate")[0], 0.01, 1e-9);
  EXPECT_NEAR(h.history.at("learning_rate")[2], 0.0025, 1e-9);
  std::ifstream f(csv);
  std::string header, row;
  std::getline(f, header);
  EXPECT_EQ(header, "epoch,accuracy,learning_rate,loss");
  int rows = 0;
  while (std::getline(f, row)) ++rows;
  EXPECT_EQ(rows, 3);

  TerminateOnNaN nan;
  o.callbacks = {&nan};
  o.loss = [](const Tensor& p, const Tensor&) {
    return ops::log(ops::scale(ops::sum(p, {1}), 0.f));
  };  // log 0 = -inf
  o.metrics = {"accuracy"};
  const History bad = fit(s, m, *opt, classification(48), nullptr, o);
  EXPECT_TRUE(nan.terminated());
  EXPECT_EQ(bad.steps, 1);
}

// A fit that resumes at epoch k (BackupAndRestore, elastic::run after a reset) keeps the CSV rows
// of the epochs before k; one that starts at epoch 0 starts the file afresh (Keras' append=false).
TEST_F(TrainingApi, CsvLoggerKeepsTheEpochsBeforeAResumedFit) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  const std::string csv = (dir_ / "resumed.csv").string();
  auto epochs_in_file = [&] {
    std::ifstream f(csv);
    std::string line;
    std::vector<std::string> out;
    while (std::getline(f, line)) out.push_back(line.substr(0, line.find(',')));
    return out;
  };
  CSVLogger logger(csv);
  struct Resume : Callback {
    int at = 0;
    void on_train_begin(const TrainLogs&) override { context().initial_epoch = at; }
  } resume;
  FitOptions o;
  o.epochs = 3;
  o.global_batch_size = 16;
  o.callbacks = {&resume, &logger};
  fit(s, m, *opt, classification(32), nullptr, o);
  EXPECT_EQ(epochs_in_file(), (std::vector<std::string>{"epoch", "0", "1", "2"}));
  resume.at = 2;  // epoch 2 runs again (it had not been committed), then 3
  o.epochs = 4;
  fit(s, m, *opt, classification(32), nullptr, o);
  EXPECT_EQ(epochs_in_file(), (std::vector<std::string>{"epoch", "0", "1", "2", "3"}));
  resume.at = 0;
  o.epochs = 2;
  fit(s, m, *opt, classification(32), nullptr, o);
  EXPECT_EQ(epochs_in_file(), (std::vector<std::string>{"epoch", "0", "1"}));
  CSVLogger appending(csv, /*append=*/true);
  o.callbacks = {&appending};
  fit(s, m, *opt, classification(32), nullptr, o);
  EXPECT_EQ(epochs_in_file(), (std::vector<std::string>{"epoch", "0", "1", "0", "1"}));
  // Resumed with other columns (validation data now): the old rows would not fit under them.
  o.callbacks = {&resume, &logger};
  resume.at = 1;
  const Dataset val = classification(16, 9);
  fit(s, m, *opt, classification(32), &val, o);
  EXPECT_EQ(epochs_in_file(), (std::vector<std::string>{"epoch", "1"}));
  std::ifstream f(csv);
  std::string header;
  std::getline(f, header);
  EXPECT_NE(header.find("val_loss"), std::string::npos) << header;
}

// The throughput a ProgressBar prints is rows/sec times the rows' unit: two bars on one fit, one
// counting images (the default), one tokens at 256 a row, print the same rate 256 times apart.
TEST_F(TrainingApi, ProgressBarCountsTheUnitItIsGiven) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  const fs::path images_log = dir_ / "images.txt", tokens_log = dir_ / "tokens.txt";
  {
    FILE* images_out = std::fopen(images_log.c_str(), "w");
    FILE* tokens_out = std::fopen(tokens_log.c_str(), "w");
    ASSERT_TRUE(images_out && tokens_out);
    ProgressBar images(images_out), tokens(tokens_out, "tokens", 256);
    FitOptions o;
    o.epochs = 1;
    o.global_batch_size = 16;
    o.callbacks = {&images, &tokens};
    fit(s, m, *opt, classification(64), nullptr, o);
    std::fclose(images_out);
    std::fclose(tokens_out);
  }
  // "epoch 1: loss 1.0986, 1234 images/sec, 3ms/step"
  auto rate = [](const fs::path& log, const std::string& unit) {
    std::ifstream f(log);
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("epoch 1:", 0) != 0) continue;
      const size_t at = line.find(" " + unit + "/sec");
      EXPECT_NE(at, std::string::npos) << "no " << unit << "/sec in: " << line;
      if (at == std::string::npos) return -1.0;
      const size_t from = line.rfind(' ', at - 1) + 1;
      return std::stod(line.substr(from, at - from));
    }
    ADD_FAILURE() << "no epoch line in " << log;
    return -1.0;
  };
  const double per_sec = rate(images_log, "images"), tokens_per_sec = rate(tokens_log, "tokens");
  ASSERT_GT(per_sec, 0);
  EXPECT_NEAR(tokens_per_sec, 256 * per_sec, 256 * 0.5 + 0.5);  // each printed to a whole number
  EXPECT_THROW(ProgressBar(stdout, "tokens", 0), InvalidArgument);
  EXPECT_THROW(ProgressBar(stdout, "", 1), InvalidArgument);
}

TEST_F(TrainingApi, WarmupRisesToTheScaledRateThenHandsBack) {
  MirroredStrategy s(on(4));
  auto [m, opt] = build(s, [&] {
    return std::unique_ptr<Optimizer>(
        std::make_unique<SGD>(scale_learning_rate(0.01f, s.num_replicas_in_sync())));
  });
  LearningRateWarmup warm(1.0);
  struct Lr : Callback {
    std::vector<double> seen;
    void on_train_batch_begin(const TrainLogs&) override {
      seen.push_back(optimizer().learning_rate());
    }
  } lr;
  FitOptions o;
  o.epochs = 2;
  o.global_batch_size = 16;  // 4 batches per epoch
  o.callbacks = {&warm, &lr};
  fit(s, m, *opt, classification(64), nullptr, o);
  ASSERT_EQ(lr.seen.size(), 8u);
  // lr = 0.04 / 4 * (e * 3 / 1 + 1) for e = 0, 0.25, 0.5, 0.75; then 0.04.
  const double want[] = {0.01, 0.0175, 0.025, 0.0325, 0.04, 0.04, 0.04, 0.04};
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(lr.seen[i], want[i], 1e-7) << i;
}

// A fit() that ends in an exception (a step, a collective, a callback; elastic::run then calls
// fit() again) skips on_train_end. The callbacks must not keep a pointer to that fit's context,
// and a warm-up cut short must not leave its half-warmed rate as the next fit's target.
TEST_F(TrainingApi, AFitEndedByAnExceptionLeavesNoContextAndTheNextWarmsUpToTheUsersRate) {
  MirroredStrategy s(on(4));
  auto [m, opt] = build(s, [&] {
    return std::unique_ptr<Optimizer>(
        std::make_unique<SGD>(scale_learning_rate(0.01f, s.num_replicas_in_sync())));
  });
  LearningRateWarmup warm(1.0);
  struct Failing : Callback {
    bool armed = true;
    std::vector<double> seen;
    void on_train_batch_begin(const TrainLogs&) override {
      seen.push_back(optimizer().learning_rate());
    }
    void on_train_batch_end(const TrainLogs& l) override {
      if (armed && l.step == 2) throw Unavailable("worker:1 is gone (test)");  // rate 0.0175
    }
  } failing;
  FitOptions o;
  o.epochs = 2;
  o.global_batch_size = 16;  // 4 batches per epoch
  o.callbacks = {&warm, &failing};
  EXPECT_THROW(fit(s, m, *opt, classification(64), nullptr, o), Unavailable);
  EXPECT_THROW(failing.context(), FailedPrecondition);
  EXPECT_THROW(warm.context(), FailedPrecondition);
  failing.armed = false;
  failing.seen.clear();
  fit(s, m, *opt, classification(64), nullptr, o);
  ASSERT_EQ(failing.seen.size(), 8u);
  // The warm-up starts again from the user's 0.04 (towards 0.0175 before the fix: 0.004375...).
  const double want[] = {0.01, 0.0175, 0.025, 0.0325, 0.04, 0.04, 0.04, 0.04};
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(failing.seen[i], want[i], 1e-7) << i;
  EXPECT_NEAR(opt->learning_rate(), 0.04, 1e-7);
  // Cut short again, then the rate set anew before the next fit (as elastic's on_reset rescales
  // it for the new number of workers): that rate is the target, not the schedule from before.
  failing.armed = true;
  EXPECT_THROW(fit(s, m, *opt, classification(64), nullptr, o), Unavailable);
  opt->set_learning_rate(0.02f);
  failing.armed = false;
  failing.seen.clear();
  fit(s, m, *opt, classification(64), nullptr, o);
  ASSERT_EQ(failing.seen.size(), 8u);
  EXPECT_NEAR(failing.seen[0], 0.005, 1e-7);
  EXPECT_NEAR(failing.seen[4], 0.02, 1e-7);
}

}  // namespace
}  // namespace dtrain
