// Callbacks' states across a restart: BackupAndRestore carries EarlyStopping's patience, best value
// and best weights, ModelCheckpoint's best value and LearningRateScheduler's last rate, so that a
// job killed anywhere and started again decides, saves and schedules as one never killed (Keras
// counts them afresh). How the states are stored: callback_states_test; the elastic commits carry
// them too (tests/elastic/elastic_test.py).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "dtrain/dtrain.h"
#include "train/training_api_util.h"

namespace dtrain {
namespace {

using namespace train_test;

// Throws Unavailable at one point of a fit (a process killed there).
struct Crash : Callback {
  int64_t at_step = -1;  // after this global step's batch end (before any backup of it)
  int at_epoch = -1;     // at this epoch's begin (after the previous epoch end's backup)
  bool at_end = false;   // in on_train_end, before BackupAndRestore deletes the backup
  void on_train_batch_end(const TrainLogs& l) override {
    if (l.global_step == at_step) throw Unavailable("simulated crash");
  }
  void on_epoch_begin(const TrainLogs& l) override {
    if (l.epoch == at_epoch) throw Unavailable("simulated crash");
  }
  void on_train_end(const TrainLogs&) override {
    if (at_end) throw Unavailable("simulated crash");
  }
};

// The rate every applied batch used, by global step.
struct Rates : Callback {
  std::map<int64_t, float> at;
  void on_train_batch_begin(const TrainLogs& l) override {
    at[l.global_step + 1] = optimizer().learning_rate();
  }
};

struct Outcome {
  std::vector<std::vector<float>> weights;
  int stopped_epoch = -1, best_epoch = -1;
  std::map<int64_t, float> rates;
  History history;
};

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") names.insert(e.path().filename().string());
  return names;
}

TEST_F(TrainingApi, BackupAndRestoreCarriesTheCallbacksStates) {
  // One process's life: a fresh model, optimizer and callbacks (nothing survives a restart but the
  // backup directory).
  auto run = [&](const fs::path& where, Crash* crash) {
    MirroredStrategy s(on(2));
    auto [m, opt] = build_seeded(s, 8, 0.2f, [] { return std::make_unique<SGD>(0.2f); });
    // "max" of a falling loss: epoch 0 stays the best, patience 2 stops after epoch 2 and puts
    // back epoch 0's weights; ModelCheckpoint(save_best_only) saves epoch 0 alone.
    EarlyStopping es("loss", 0, 2, MonitorMode::kMax, /*restore_best_weights=*/true);
    ModelCheckpoint mc((where / "best").string(), "loss", true, MonitorMode::kMax);
    LearningRateScheduler halve([](int, double lr) { return lr * 0.5; });
    BackupAndRestore bar((where / "backup").string(), /*save_freq=*/3);
    Rates rates;
    FitOptions o;
    o.epochs = 10;
    o.global_batch_size = 10;  // 7 batches per epoch, the last one partial
    o.shuffle_seed = 17;
    // The backup first in the list: fit() still takes it after the others' epoch ends.
    o.callbacks = {&bar, &halve, &rates, &es, &mc};
    if (crash) o.callbacks.insert(o.callbacks.begin(), crash);
    Outcome out;
    out.history = fit(s, m, *opt, classification(64), nullptr, o);
    out.weights = weights(m);
    out.stopped_epoch = es.stopped_epoch();
    out.best_epoch = es.best_epoch();
    out.rates = rates.at;
    return out;
  };
  const Outcome straight = run(dir_ / "straight", nullptr);
  ASSERT_EQ(straight.stopped_epoch, 2);
  ASSERT_EQ(straight.best_epoch, 0);
  ASSERT_EQ(straight.history.steps, 21);
  ASSERT_EQ(straight.rates.size(), 21u);
  EXPECT_FLOAT_EQ(straight.rates.at(21), 0.2f / 8);
  EXPECT_EQ(files_in(dir_ / "straight" / "best"), std::set<std::string>{"ckpt-7.safetensors"});

  struct Case {
    const char* what;
    Crash crash;
  };
  std::vector<Case> cases(6);
  cases[0] = {"mid epoch 0, before any epoch end", {}};
  cases[0].crash.at_step = 5;
  cases[1] = {"epoch 0's last batch (its epoch end not reached)", {}};
  cases[1].crash.at_step = 7;
  cases[2] = {"mid epoch 1", {}};
  cases[2].crash.at_step = 10;
  cases[3] = {"at epoch 2's begin (resumes at an epoch boundary)", {}};
  cases[3].crash.at_epoch = 2;
  cases[4] = {"mid epoch 2, the one that stops", {}};
  cases[4].crash.at_step = 17;
  cases[5] = {"after stopping, before the backup is deleted", {}};
  cases[5].crash.at_end = true;
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path where = dir_ / ("crash" + std::to_string(&c - cases.data()));
    EXPECT_THROW(run(where, &c.crash), Unavailable);
    const Outcome resumed = run(where, nullptr);
    EXPECT_EQ(resumed.weights, straight.weights);
    EXPECT_EQ(resumed.stopped_epoch, straight.stopped_epoch);
    EXPECT_EQ(resumed.best_epoch, straight.best_epoch);
    EXPECT_EQ(resumed.history.steps, 21);
    for (const auto& [step, lr] : resumed.rates) {
      const auto same = straight.rates.find(step);
      if (same == straight.rates.end()) {
        ADD_FAILURE() << "global step " << step << ": the uninterrupted run had stopped";
        break;
      }
      EXPECT_EQ(lr, same->second) << "global step " << step;
    }
    EXPECT_EQ(files_in(where / "best"), std::set<std::string>{"ckpt-7.safetensors"});
    EXPECT_FALSE(fs::exists(where / "backup" / "checkpoint"));  // deleted once training finished
  }
}

// An ensemble's members keep their own best weights through two restarts (the second backup is
// taken by an EarlyStopping that was itself restored from the first).
TEST_F(TrainingApi, EnsembleMembersKeepTheirBestWeightsThroughTwoRestarts) {
  auto run = [&](int crash_at_epoch) {
    EnsembleStrategy ens({DeviceSpec::cpu(0), DeviceSpec::cpu(1)});
    auto [m, opt] = build_seeded(ens, 5, 0, [] { return std::make_unique<SGD>(0.2f); });
    // "max" of a falling loss: epoch 0 stays the best; patience 3 stops after epoch 3.
    EarlyStopping es("loss", 0, 3, MonitorMode::kMax, /*restore_best_weights=*/true);
    BackupAndRestore bar((dir_ / "backup").string());
    Crash crash;
    crash.at_epoch = crash_at_epoch;
    FitOptions o;
    o.epochs = 10;
    o.global_batch_size = 16;
    o.callbacks = {&crash, &es, &bar};
    fit(ens, m, *opt, classification(64), nullptr, o);
    std::vector<std::vector<float>> members;
    for (const auto& v : m.variables())
      for (const Tensor& t : v->device_values()) members.push_back(t.to_vector<float>());
    return members;
  };
  const auto straight = run(-1);
  fs::remove_all(dir_ / "backup");
  EXPECT_THROW(run(2), Unavailable);  // backup of epoch 1's end
  EXPECT_THROW(run(3), Unavailable);  // restored, then the backup of epoch 2's end
  const auto resumed = run(-1);
  EXPECT_EQ(resumed, straight);
  ASSERT_GE(straight.size(), 2u);
  EXPECT_NE(straight[0], straight[1]);  // the members differ
}

// A LearningRateScheduler's rate at the epoch that ends a warm-up is the one that epoch trains
// with: the warm-up hands back the user's schedule only where its own warming rate is in place.
TEST_F(TrainingApi, AWarmUpEndingKeepsTheSchedulersRate) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  LearningRateScheduler schedule([](int epoch, double) { return 0.3 * std::pow(0.5, epoch); });
  LearningRateWarmup warmup(/*warmup_epochs=*/1, 0, /*num_replicas=*/2);
  Rates rates;
  FitOptions o;
  o.epochs = 3;
  o.global_batch_size = 16;  // 4 batches an epoch
  o.callbacks = {&schedule, &warmup, &rates};
  fit(s, m, *opt, classification(64), nullptr, o);
  ASSERT_EQ(rates.at.size(), 12u);
  EXPECT_LT(rates.at.at(1), 0.1f);  // warming towards the rate at train begin
  for (int64_t step = 5; step <= 8; ++step) EXPECT_FLOAT_EQ(rates.at.at(step), 0.15f) << step;
  for (int64_t step = 9; step <= 12; ++step) EXPECT_FLOAT_EQ(rates.at.at(step), 0.075f) << step;
}

// An elastic job's chief that loses its connection rejoins last and is a worker like the others in
// the next round: its ModelCheckpoint and TensorBoard must stop writing (the new chief writes).
TEST_F(TrainingApi, AFormerChiefWritesNoMore) {
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  ModelCheckpoint mc((dir_ / "ckpt").string(), "loss", false, MonitorMode::kAuto, /*save_freq=*/2);
  TensorBoard tb((dir_ / "tb").string(), /*update_freq=*/1);
  auto bytes_under = [](const fs::path& d) {
    uintmax_t n = 0;
    for (const auto& e : fs::recursive_directory_iterator(d))
      if (e.is_regular_file()) n += e.file_size();
    return n;
  };
  Crash crash;
  crash.at_step = 3;  // the round ends in an exception: no on_train_end
  FitOptions o;
  o.epochs = 2;
  o.global_batch_size = 16;
  o.callbacks = {&crash, &mc, &tb};
  EXPECT_THROW(fit(s, m, *opt, classification(64), nullptr, o), Unavailable);
  ASSERT_EQ(files_in(dir_ / "ckpt"), std::set<std::string>{"ckpt-2.safetensors"});
  // What the first round writes, its writers closed: the same round again beside it.
  uintmax_t written = 0;
  {
    auto [m2, opt2] =
        build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
    TensorBoard alone((dir_ / "tb_alone").string(), /*update_freq=*/1);
    o.callbacks = {&crash, &alone};
    EXPECT_THROW(fit(s, m2, *opt2, classification(64), nullptr, o), Unavailable);
  }
  written = bytes_under(dir_ / "tb_alone");
  ASSERT_GT(written, 0u);
  struct Demote : Callback {  // the next round: another worker is the chief
    void on_train_begin(const TrainLogs&) override { context().is_chief = false; }
  } demote;
  o.callbacks = {&demote, &mc, &tb};
  fit(s, m, *opt, classification(64), nullptr, o);
  EXPECT_EQ(files_in(dir_ / "ckpt"), std::set<std::string>{"ckpt-2.safetensors"});
  EXPECT_EQ(bytes_under(dir_ / "tb"), written);
}

TEST_F(TrainingApi, ACallbackStateThatDoesNotFitTheModelIsRefused) {
  // A state that does not fit the model: FailedPrecondition from fit(), naming the variable.
  OneDeviceStrategy s(DeviceSpec::cpu(0));
  auto [m, opt] = build(s, [&] { return std::unique_ptr<Optimizer>(std::make_unique<SGD>(0.1f)); });
  struct Give : Callback {
    CallbackState state;
    void on_train_begin(const TrainLogs&) override {
      context().initial_callback_states["EarlyStopping(loss)"] = state;
    }
  } give;
  give.state.values = {{"wait", 0}, {"best", 1}, {"best_epoch", 0}, {"stopped_epoch", -1}};
  give.state.tensors["weights/dense/kernel"] = Tensor::zeros(Shape{3, 3});
  EarlyStopping keeper("loss", 0, 1, MonitorMode::kAuto, true);
  FitOptions o;
  o.epochs = 1;
  o.global_batch_size = 16;
  o.callbacks = {&give, &keeper};
  try {
    fit(s, m, *opt, classification(64), nullptr, o);
    ADD_FAILURE() << "fit() took a state that does not fit";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("'dense/kernel' is float32 [3, 3]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(LearningRateScheduler([](int, double l) { return l; }).load_state_dict({}),
               FailedPrecondition);
}

}  // namespace
}  // namespace dtrain
