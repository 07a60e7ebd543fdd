// TensorBoard event files, written as TensorFlow writes them: TFRecord framing (length, masked
// CRC-32C of the length, the record, masked CRC-32C of the record; CRC from Boost.CRC) around Event
// and Summary protocol buffers (encoded with protobuf), in files named
// `events.out.tfevents.<seconds>.<host>.<pid>.<n>`. TensorBoard's own reader (EventAccumulator)
// loads them; `tensorboard --logdir DIR` shows them.
//
// Thread-safety: a SummaryWriter may be used from one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/core/export.h"
#include "dtrain/train/callbacks.h"

namespace dtrain {

// tf.summary.create_file_writer: one event file in `log_dir` (created with its parents).
// Throws Unavailable naming the path when it cannot be created or written.
class DTRAIN_API SummaryWriter {
 public:
  explicit SummaryWriter(const std::string& log_dir);
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  void scalar(const std::string& tag, double value, int64_t step);
  // Pushes what was written to the file (fflush); the destructor does too.
  void flush();
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// keras.callbacks.TensorBoard: on the chief, `<log_dir>/train` gets `epoch_loss`, `epoch_<metric>`,
// epoch_learning_rate and epoch_images_per_sec per epoch (step = epoch) and, every update_freq
// batches (0: never), batch_loss, batch_learning_rate and batch_images_per_sec (step = global
// step); `<log_dir>/validation` gets `epoch_loss` and `epoch_<metric>` of the test set.
class DTRAIN_API TensorBoard : public Callback {
 public:
  explicit TensorBoard(std::string log_dir, int64_t update_freq = 100);
  ~TensorBoard() override;
  void on_train_begin(const TrainLogs& logs) override;
  void on_train_batch_end(const TrainLogs& logs) override;
  void on_epoch_end(const TrainLogs& logs) override;
  void on_train_end(const TrainLogs& logs) override;

 private:
  std::string dir_;
  int64_t update_freq_;
  std::unique_ptr<SummaryWriter> train_, validation_;
};

}  // namespace dtrain
