// Training callbacks (Keras style). fit() calls them on the training loop's thread, on every
// worker of a multi-worker job with the same logs (loss and epoch metrics are global), so a
// callback that stops training usually decides the same everywhere. When only some workers ask
// (e.g. a wall-clock budget), fit() still stops them together: a stop asked in a batch callback
// travels with the next step's loss and every worker leaves after that step; one asked at an
// epoch's end is agreed on before the next epoch. Callbacks that write files or print do so on the
// chief only (is_chief()).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

class Strategy;
class Model;
class Optimizer;
class LearningRateSchedule;

struct DTRAIN_API TrainLogs {
  int epoch = 0;  // 0-based
  int epochs = 0;
  int64_t step = 0;             // batches done in this epoch (test: in this evaluation)
  int64_t steps_per_epoch = 0;  // -1 when unknown
  int64_t global_step = 0;      // batches done in this fit() (and before a restored backup)
  double loss = 0;              // running mean over the epoch
  double images_per_sec = 0;    // rows of the global batch a second, over the epoch so far
  double seconds_per_step = 0;  // mean over the epoch so far
  double learning_rate = 0;     // the rate the next step uses
  double test_accuracy = -1;    // set at epoch end when evaluated
  double test_loss = -1;
  // Keras' logs: "loss", every metric by name, "val_loss" and "val_<metric>" after an epoch with
  // validation data, "learning_rate". Epoch-end values are over all examples of all workers.
  std::map<std::string, double> values;
  // The value of `key`; throws NotFound naming the keys there are.
  double get(const std::string& key) const;
  bool has(const std::string& key) const { return values.count(key) != 0; }
};

// What a callback must carry across a restart to decide as an uninterrupted run would
// (EarlyStopping's patience and best value, ...): PyTorch Lightning's Callback.state_dict. Keras
// keeps none, so a Keras job restarted by BackupAndRestore counts EarlyStopping's patience afresh;
// dtrain's BackupAndRestore and elastic::run carry it. Values are doubles (exact up to 2^53, and
// +-inf and NaN survive); tensors are on the host.
struct DTRAIN_API CallbackState {
  std::map<std::string, double> values;
  std::map<std::string, Tensor> tensors;
  bool empty() const { return values.empty() && tensors.empty(); }
};

// What callbacks see of the training run: set by fit() before on_train_begin.
struct DTRAIN_API TrainingContext {
  Strategy* strategy = nullptr;
  Model* model = nullptr;
  Optimizer* optimizer = nullptr;
  bool is_chief = true;
  // Set by a callback to end training after the current batch (keras model.stop_training).
  bool stop_training = false;
  // Where training starts: a callback's on_train_begin (BackupAndRestore) may move it forward.
  int initial_epoch = 0;
  int64_t initial_step = 0;  // batches into initial_epoch
  int64_t initial_global_step = 0;
  // The epoch's loss and metric sums at initial_step, so that a resumed epoch reports what an
  // uninterrupted one would (see Metric::state()).
  std::map<std::string, std::vector<double>> initial_epoch_state;
  // Filled by fit() for callbacks that save the data position: the loss and metric sums so far.
  std::function<std::map<std::string, std::vector<double>>()> epoch_state;
  // Filled by fit() for callbacks that back up: the state_dict() of every callback with a
  // state_key() (empty ones too), by its key ("#2", "#3", ... appended to repeats in the list's
  // order).
  std::function<std::map<std::string, CallbackState>()> callback_states;
  // Set by a callback's on_train_begin that restored a backup: fit() gives each callback its state
  // (load_state_dict) after every on_train_begin has run (which resets them).
  std::map<std::string, CallbackState> initial_callback_states;
  uint64_t shuffle_seed = 0;
  int64_t global_batch_size = 0;
  // True while gradient accumulation holds batches not yet applied (no consistent backup then).
  bool accumulating = false;
  // During on_epoch_end: the epoch's log values, which a callback may change for the callbacks
  // after it and for the History (hvd::MetricAverageCallback averages them over the ranks).
  std::map<std::string, double>* epoch_logs = nullptr;
};

class DTRAIN_API Callback {
 public:
  virtual ~Callback() = default;
  void set_context(TrainingContext* context) { ctx_ = context; }
  // Valid from on_train_begin to on_train_end; FailedPrecondition outside fit().
  TrainingContext& context() const;
  Model& model() const;
  Optimizer& optimizer() const;
  Strategy& strategy() const;
  bool is_chief() const { return ctx_ == nullptr || ctx_->is_chief; }
  void stop_training() { context().stop_training = true; }

  // Backups (BackupAndRestore, elastic commits) hold each callback's state under its key: its kind
  // and what tells two of a kind apart (EarlyStopping: "EarlyStopping(val_loss)"). Empty (the
  // default): a callback with no state to carry.
  virtual std::string state_key() const { return {}; }
  virtual CallbackState state_dict() const { return {}; }
  // Called by fit() after on_train_begin when the restored backup holds this callback's state.
  // Throws FailedPrecondition when the state does not fit this callback (the model changed).
  virtual void load_state_dict(const CallbackState&) {}
  // Whether this callback saves a backup of the training state (BackupAndRestore, elastic::run's
  // commits): fit() calls its on_train_batch_end and on_epoch_end after every other callback's,
  // so that a backup taken there holds what they did at that batch or epoch.
  virtual bool saves_backup() const { return false; }
  // Whether, under strategy(), this callback must run on every worker of a synchronous
  // multi-worker job: true where its hooks take part in collectives (a checkpoint of sharded
  // state, BackupAndRestore) or change what the replicas train with (the learning rate,
  // EarlyStopping's restored weights). fit() asks it with the context set, before
  // on_train_begin, and throws FailedPrecondition naming them unless every worker runs the same
  // such callbacks in the same order; the others may run on some workers only (Horovod's
  // `if (rank == 0) callbacks.push_back(...)`: ProgressBar, CSVLogger, TensorBoard, and
  // ModelCheckpoint where nothing is sharded). Keras and Horovod do not check: a collective
  // mismatch later, or replicas that drift apart silently.
  virtual bool must_run_on_every_worker() const { return false; }

  virtual void on_train_begin(const TrainLogs&) {}
  virtual void on_train_end(const TrainLogs&) {}
  virtual void on_epoch_begin(const TrainLogs&) {}
  virtual void on_epoch_end(const TrainLogs&) {}
  virtual void on_train_batch_begin(const TrainLogs&) {}
  virtual void on_train_batch_end(const TrainLogs&) {}
  virtual void on_test_begin(const TrainLogs&) {}
  virtual void on_test_end(const TrainLogs&) {}
  virtual void on_test_batch_begin(const TrainLogs&) {}
  virtual void on_test_batch_end(const TrainLogs&) {}

 private:
  TrainingContext* ctx_ = nullptr;
};

// A progress bar with loss, metrics, ETA and time per step on a terminal (as Keras prints);
// plain periodic lines otherwise (logs, CI). Writes to `out` (stdout by default), chief only.
// Beside Keras' time per step it prints the whole job's throughput: rows of the global batch a
// second as "images/sec" by default; a model whose rows are sequences names its own unit and how
// many of it a row holds, e.g. ProgressBar(stdout, "tokens", context): tokens/sec (rows/sec x
// `per_row`).
class DTRAIN_API ProgressBar : public Callback {
 public:
  explicit ProgressBar(FILE* out = stdout) : ProgressBar(out, "images", 1) {}
  ProgressBar(FILE* out, std::string unit, double per_row);
  void on_train_begin(const TrainLogs& logs) override;  // says so when a backup was restored
  void on_epoch_begin(const TrainLogs& logs) override;
  void on_train_batch_end(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;
  void on_train_end(const TrainLogs& logs) override;

 private:
  FILE* out_;
  bool tty_;
  std::string unit_;  // "images/sec", "tokens/sec"
  double per_row_;
  std::chrono::steady_clock::time_point last_print_;
};

// "min" or "max" from the monitored key as Keras decides it ("auto": max for accuracy-like keys).
enum class MonitorMode { kAuto, kMin, kMax };

// Stops training when `monitor` has not improved by more than min_delta for `patience` epochs;
// with restore_best_weights, puts back the best epoch's weights when it stops or training ends.
// Its state (epochs waited, best value and epoch, and with restore_best_weights the best weights,
// whole) goes into backups, so a restarted or re-formed job stops where an uninterrupted one would
// (the best weights of an ensemble over several workers excepted: each worker holds other members).
// A backup kept after it stopped (BackupAndRestore(delete_checkpoint = false)) stops the same
// command again before its first epoch; remove the backup to train on.
class DTRAIN_API EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(std::string monitor = "val_loss", double min_delta = 0, int patience = 0,
                         MonitorMode mode = MonitorMode::kAuto, bool restore_best_weights = false,
                         int start_from_epoch = 0);
  void on_train_begin(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;
  void on_train_end(const TrainLogs& logs) override;
  std::string state_key() const override { return "EarlyStopping(" + monitor_ + ")"; }
  // With restore_best_weights (the restored weights); stopping alone is agreed among the workers.
  bool must_run_on_every_worker() const override { return restore_best_; }
  CallbackState state_dict() const override;
  void load_state_dict(const CallbackState& state) override;
  int stopped_epoch() const { return stopped_epoch_; }  // 0-based; -1 when it did not stop
  int best_epoch() const { return best_epoch_; }
  double best() const { return best_; }
  int wait() const { return wait_; }  // epochs without improvement so far

 private:
  std::string monitor_;
  double min_delta_;
  int patience_, start_from_epoch_;
  bool maximize_ = false, restore_best_;
  MonitorMode mode_;
  double best_ = 0;
  int wait_ = 0, best_epoch_ = -1, stopped_epoch_ = -1;
  void load_best(const CallbackState& state);
  std::vector<std::vector<Tensor>> best_weights_;  // per variable, every copy (host)
  std::vector<std::string> best_names_;            // those variables' names
  bool members_ = false;                 // the copies are an ensemble's members (they differ)
  bool members_across_workers_ = false;  // ... and other workers hold other members
};

// Appends one CSV row per epoch (epoch and every log value, sorted by key) to `path`; chief only.
// append = false starts the file afresh when training starts at epoch 0 (Keras); a fit() that
// resumes at epoch k (BackupAndRestore after a restart, elastic::run after a reset) keeps the rows
// of the epochs before k and replaces the others, where Keras would drop every earlier row (unless
// the columns changed: then it starts afresh). The file is rewritten at a fit's first row, so a fit
// that ends before its first epoch leaves it as it was. append = true always appends (Keras).
class DTRAIN_API CSVLogger : public Callback {
 public:
  explicit CSVLogger(std::string path, bool append = false);
  void on_train_begin(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;

 private:
  // append = false, at a fit's first row: the file holds the rows of the epochs before `epoch`.
  void keep_rows_before(int epoch) const;
  std::string path_;
  bool append_;
  std::vector<std::string> keys_;
};

// Sets the learning rate at each epoch's start to schedule(epoch, current rate). After a restored
// backup (BackupAndRestore, an elastic reset) the resumed epoch's rate is computed from the rate
// its last epoch started with, the schedule replayed from there, not from the optimizer's rate
// then: a backup taken mid-epoch holds the rate already changed (Keras' scheduler keeps no state
// and would change it again), and a worker that joins an elastic job holds the initial one. The
// replay follows this scheduler's own chain: a rate set by someone else since its last epoch
// start (elastic::RunOptions::on_reset, a LearningRateWarmup's last warming rate) is overwritten
// at the resumed epoch's start, as it would be at any epoch's start. Give it a function of the
// epoch alone where other code also sets the rate.
class DTRAIN_API LearningRateScheduler : public Callback {
 public:
  using Fn = std::function<double(int epoch, double lr)>;
  explicit LearningRateScheduler(Fn schedule);
  void on_train_begin(const TrainLogs& logs) override;
  void on_epoch_begin(const TrainLogs& logs) override;
  std::string state_key() const override { return "LearningRateScheduler"; }
  bool must_run_on_every_worker() const override { return true; }
  CallbackState state_dict() const override;
  void load_state_dict(const CallbackState& state) override;

 private:
  double apply(int epoch, double lr) const;  // fn_, checked
  Fn fn_;
  int epoch_ = -1;        // the epoch it set the rate for last
  double lr_before_ = 0;  // the rate it gave fn_ then
  bool replay_ = false;   // loaded: the next epoch's input is replayed from (epoch_, lr_before_)
};

// Horovod's gradual warm-up (Goyal et al.): over the first warmup_epochs the rate rises from
// target / num_replicas to target = the optimizer's rate at train begin (already scaled by the
// number of replicas), per batch: lr = target / n * (e * (n - 1) / warmup_epochs + 1), e the
// fractional epoch. After warm-up the optimizer's schedule takes over again.
class DTRAIN_API LearningRateWarmup : public Callback {
 public:
  // num_replicas: n above; 0 = the strategy's num_replicas_in_sync() (hvd: the number of ranks).
  explicit LearningRateWarmup(double warmup_epochs = 5, int verbose = 0, int num_replicas = 0);
  void on_train_begin(const TrainLogs& logs) override;
  void on_train_batch_begin(const TrainLogs& logs) override;
  void on_train_end(
      const TrainLogs& logs) override;  // hands the schedule back if warm-up was cut short
  bool must_run_on_every_worker() const override { return true; }

 private:
  double warmup_epochs_;
  int verbose_, num_replicas_;
  double target_ = 0;
  bool done_ = false;
  std::shared_ptr<LearningRateSchedule> saved_schedule_;
  std::shared_ptr<LearningRateSchedule> installed_;  // the warming rate it set last
};

// Stops training when the loss becomes NaN or infinite (after that batch).
class DTRAIN_API TerminateOnNaN : public Callback {
 public:
  void on_train_batch_end(const TrainLogs& logs) override;
  bool terminated() const { return terminated_; }

 private:
  bool terminated_ = false;
};

}  // namespace dtrain
