// Training callbacks (Keras style). Called from the training loop's thread only; in multi-worker
// jobs only the chief prints.
#pragma once

#include "dtrain/core/export.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dtrain {

struct DTRAIN_API TrainLogs {
  int epoch = 0;                // 0-based
  int epochs = 0;
  int64_t step = 0;             // steps done in this epoch
  int64_t steps_per_epoch = 0;  // -1 when unknown
  int64_t global_step = 0;
  double loss = 0;              // running mean over the epoch
  double images_per_sec = 0;    // over the epoch so far
  double test_accuracy = -1;    // set at epoch end when evaluated
  double test_loss = -1;
};

class DTRAIN_API Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_begin(const TrainLogs&) {}
  virtual void on_epoch_begin(const TrainLogs&) {}
  virtual void on_batch_end(const TrainLogs&) {}
  virtual void on_epoch_end(const TrainLogs&) {}
  virtual void on_train_end(const TrainLogs&) {}
};

// A progress bar with loss and images/sec on a terminal; plain periodic lines otherwise (logs,
// CI). Writes to `out` (stdout by default).
class DTRAIN_API ProgressBar : public Callback {
 public:
  explicit ProgressBar(FILE* out = stdout);
  void on_epoch_begin(const TrainLogs& logs) override;
  void on_batch_end(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;
  void on_train_end(const TrainLogs& logs) override;

 private:
  FILE* out_;
  bool tty_;
  std::chrono::steady_clock::time_point last_print_;
};

}  // namespace dtrain
