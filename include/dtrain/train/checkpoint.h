// tf.train.Checkpoint for dtrain: one object over a model, its optimizer (slots and iteration
// count), the data position (epoch, step) and the random state (each Dropout's call count), saved
// as one safetensors file (core/checkpoint.h: atomic, validated on load).
//
// Names are the variables' own: layer paths with Keras-style unique layer names ("conv1/kernel",
// "dense_1/bias"), slots "optimizer/<variable>/<slot>", "optimizer/iterations",
// "rng/<layer>/calls". Values are read from the replicas' copy 0 and written to every copy, so a
// checkpoint saved under one strategy and replica count restores under any other: mirrored cpu:2 ->
// one_device -> three MultiWorkerMirrored workers -> parameter_server (variables assigned on the
// servers) and back. Under parameter_server the optimizer's slots live on the servers (their own
// checkpoints keep them); a checkpoint saved there holds none, and restoring one without slots into
// a synchronous strategy starts the slots afresh, with one WARNING.
//
// Who writes: save() writes on the chief only (every worker holds the same values; others return
// without writing), atomically. restore() runs on every worker.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/core/checkpoint.h"
#include "dtrain/core/export.h"

namespace dtrain {

class Strategy;
class Model;
class Optimizer;

struct DTRAIN_API TrainingPosition {
  int64_t epoch = 0;        // the epoch to run next (0-based)
  int64_t step = 0;         // batches of that epoch already done
  int64_t global_step = 0;  // batches done in all
};

class DTRAIN_API Checkpoint {
 public:
  // `optimizer` may be null (weights only). `strategy`: the strategy the model was built under
  // (nullptr: the current one).
  explicit Checkpoint(Model& model, Optimizer* optimizer = nullptr, Strategy* strategy = nullptr);

  // Everything as tensors and metadata (position, optimizer config, seed, extra).
  CheckpointData capture(const TrainingPosition& position = {},
                         const std::map<std::string, std::string>& extra = {}) const;
  // Writes capture() to `path` when this task is the chief; returns whether it wrote.
  bool save(const std::string& path, const TrainingPosition& position = {},
            const std::map<std::string, std::string>& extra = {}) const;
  // Through a CheckpointManager (`ckpt-<global_step>.safetensors`, index, max_to_keep), chief only.
  bool save(CheckpointManager& manager, const TrainingPosition& position,
            const std::map<std::string, std::string>& extra = {}) const;

  // Loads and applies data: every model variable must be there with its shape, and the file may
  // hold nothing else but optimizer, rng and callback entries; otherwise FailedPrecondition naming
  // the first variable that differs ("variable 'dense/kernel': the model has [784, 128], the
  // checkpoint [784, 64]") and nothing is changed. Builds the optimizer's slots if needed (inside
  // the strategy's scope). Returns the position and metadata stored; the entries under
  // "callbacks/" (callbacks' states, which BackupAndRestore saves) go to `callback_entries`.
  TrainingPosition restore(
      const CheckpointData& data, std::map<std::string, std::string>* metadata = nullptr,
      std::vector<std::pair<std::string, Tensor>>* callback_entries = nullptr) const;
  TrainingPosition restore(const std::string& path,
                           std::map<std::string, std::string>* metadata = nullptr) const;
  // The latest checkpoint of a manager's directory, or nullopt when it has none.
  std::optional<TrainingPosition> restore_latest(
      const CheckpointManager& manager, std::map<std::string, std::string>* metadata = nullptr,
      std::vector<std::pair<std::string, Tensor>>* callback_entries = nullptr) const;

 private:
  Model& model_;
  Optimizer* optimizer_;
  Strategy* strategy_;
};

}  // namespace dtrain

#include "dtrain/train/callbacks.h"

namespace dtrain {

// keras ModelCheckpoint: at each epoch end (or every save_freq batches) saves a Checkpoint of the
// model and optimizer into `directory` (`ckpt-<global step>.safetensors`, newest max_to_keep kept);
// with save_best_only, only when `monitor` improved. Chief only.
class DTRAIN_API ModelCheckpoint : public Callback {
 public:
  explicit ModelCheckpoint(std::string directory, std::string monitor = "val_loss",
                           bool save_best_only = false, MonitorMode mode = MonitorMode::kAuto,
                           int64_t save_freq = 0, int max_to_keep = 5);
  void on_train_begin(const TrainLogs& logs) override;
  void on_train_batch_end(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;
  // With save_best_only, the best value so far goes into backups (a restarted job saves only what
  // beats it, as an uninterrupted one would).
  std::string state_key() const override {
    return "ModelCheckpoint(" + directory_ + ", " + monitor_ + ")";
  }
  CallbackState state_dict() const override;
  void load_state_dict(const CallbackState& state) override;
  // Where its checkpoints gather from every worker: sharded optimizer state or parameters, or an
  // ensemble's members over several workers. Elsewhere the chief alone may run it.
  bool must_run_on_every_worker() const override;
  const std::string& last_saved() const { return last_saved_; }

 private:
  void save(const TrainLogs& logs, int64_t epoch, int64_t step);
  std::string directory_, monitor_;
  bool save_best_only_, maximize_ = false;
  MonitorMode mode_;
  int64_t save_freq_;
  int max_to_keep_;
  std::optional<double> best_;
  std::optional<CheckpointManager> manager_;
  std::string last_saved_;
};

// keras BackupAndRestore, TF's fault tolerance for MultiWorkerMirrored: backs up the model, the
// optimizer, the data position and the epoch's running sums into `backup_dir` at every epoch end
// (and every save_freq batches when > 0); on train begin, restores the latest backup and makes
// fit() continue from its position. A job killed at any moment and started again with the same
// command ends with the same weights, bit for bit, as one never killed (the data order depends only
// on the seed, the epoch and the step). A finished fit() deletes the backup (delete_checkpoint).
// Beside Keras' backup it keeps the other callbacks' states (Callback::state_dict: EarlyStopping's
// patience and best weights, ModelCheckpoint's best value, LearningRateScheduler's last rate),
// which fit() gives back to them after on_train_begin.
class DTRAIN_API BackupAndRestore : public Callback {
 public:
  explicit BackupAndRestore(std::string backup_dir, int64_t save_freq = 0,
                            bool delete_checkpoint = true);
  void on_train_begin(const TrainLogs& logs) override;
  void on_train_batch_end(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;
  void on_train_end(const TrainLogs& logs) override;
  bool saves_backup() const override { return true; }
  bool must_run_on_every_worker() const override { return true; }
  // Where the last on_train_begin resumed from (nullopt: started afresh).
  const std::optional<TrainingPosition>& restored() const { return restored_; }

 private:
  void backup(const TrainLogs& logs, const TrainingPosition& p);
  std::string dir_;
  int64_t save_freq_;
  bool delete_;
  std::optional<CheckpointManager> manager_;
  std::optional<TrainingPosition> restored_;
};

}  // namespace dtrain
