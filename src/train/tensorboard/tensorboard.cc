#include "dtrain/train/tensorboard.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "data/tfrecord_format.h"
#include "dtrain/core/error.h"
#include "summary.pb.h"

namespace dtrain {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::atomic<int> g_files{0};

}  // namespace

struct SummaryWriter::Impl {
  std::string path;
  FILE* f = nullptr;

  void write_record(const std::string& data) {
    const std::string header = detail::record_header(data.size());  // TFRecord framing
    const std::string footer = detail::record_footer(data);
    if (std::fwrite(header.data(), 1, 12, f) != 12 ||
        std::fwrite(data.data(), 1, data.size(), f) != data.size() ||
        std::fwrite(footer.data(), 1, 4, f) != 4)
      throw Unavailable("cannot write TensorBoard events to '" + path +
                        "': " + std::strerror(errno));
  }
  void write_event(const tensorboard::Event& e) {
    std::string bytes;
    if (!e.SerializeToString(&bytes)) throw Internal("cannot encode a TensorBoard event");
    write_record(bytes);
  }
};

SummaryWriter::SummaryWriter(const std::string& log_dir) : impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  if (ec)
    throw Unavailable("cannot create TensorBoard log directory '" + log_dir + "': " + ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  impl_->path = log_dir + "/events.out.tfevents." +
                std::to_string(static_cast<int64_t>(now_seconds())) + "." + host + "." +
                std::to_string(::getpid()) + "." + std::to_string(g_files++);
  impl_->f = std::fopen(impl_->path.c_str(), "wb");
  if (!impl_->f) throw Unavailable("cannot create '" + impl_->path + "': " + std::strerror(errno));
  tensorboard::Event first;
  first.set_wall_time(now_seconds());
  first.set_file_version("brain.Event:2");
  impl_->write_event(first);
  flush();
}

SummaryWriter::~SummaryWriter() {
  if (impl_ && impl_->f) std::fclose(impl_->f);
}

void SummaryWriter::scalar(const std::string& tag, double value, int64_t step) {
  tensorboard::Event e;
  e.set_wall_time(now_seconds());
  e.set_step(step);
  tensorboard::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  impl_->write_event(e);
}

void SummaryWriter::flush() {
  if (std::fflush(impl_->f) != 0)
    throw Unavailable("cannot write '" + impl_->path + "': " + std::strerror(errno));
}

const std::string& SummaryWriter::path() const { return impl_->path; }

// ---- TensorBoard callback ----

TensorBoard::TensorBoard(std::string log_dir, int64_t update_freq)
    : dir_(std::move(log_dir)), update_freq_(update_freq) {
  if (dir_.empty()) throw InvalidArgument("TensorBoard: the log directory is empty");
  if (update_freq < 0)
    throw InvalidArgument("TensorBoard: update_freq must be >= 0 (0: epochs only)");
}

TensorBoard::~TensorBoard() = default;

void TensorBoard::on_train_begin(const TrainLogs&) {
  // A fit() ended by an exception (an elastic reset) leaves the writers open; the next fit() opens
  // new ones, and none where this worker is no longer the chief (it rejoined after the others).
  train_.reset();
  validation_.reset();
  if (!is_chief()) return;
  train_ = std::make_unique<SummaryWriter>(dir_ + "/train");
  validation_ = std::make_unique<SummaryWriter>(dir_ + "/validation");
}

void TensorBoard::on_train_batch_end(const TrainLogs& logs) {
  if (!train_ || update_freq_ == 0 || logs.global_step % update_freq_ != 0) return;
  train_->scalar("batch_loss", logs.loss, logs.global_step);
  train_->scalar("batch_learning_rate", logs.learning_rate, logs.global_step);
  train_->scalar("batch_images_per_sec", logs.images_per_sec, logs.global_step);
}

void TensorBoard::on_epoch_end(const TrainLogs& logs) {
  if (!train_) return;
  for (const auto& [key, v] : logs.values) {
    if (key.rfind("val_", 0) == 0)
      validation_->scalar("epoch_" + key.substr(4), v, logs.epoch);
    else
      train_->scalar("epoch_" + key, v, logs.epoch);
  }
  train_->scalar("epoch_images_per_sec", logs.images_per_sec, logs.epoch);
  train_->flush();
  validation_->flush();
}

void TensorBoard::on_train_end(const TrainLogs&) {
  train_.reset();
  validation_.reset();
}

}  // namespace dtrain
