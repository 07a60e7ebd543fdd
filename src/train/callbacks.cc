#include "dtrain/train/callbacks.h"

#include <unistd.h>

#include <string>

namespace dtrain {

ProgressBar::ProgressBar(FILE* out) : out_(out), tty_(isatty(fileno(out)) != 0) {}

void ProgressBar::on_epoch_begin(const TrainLogs& logs) {
  last_print_ = std::chrono::steady_clock::now();
  std::fprintf(out_, "Epoch %d/%d\n", logs.epoch + 1, logs.epochs);
  std::fflush(out_);
}

void ProgressBar::on_batch_end(const TrainLogs& logs) {
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_print_).count();
  if (tty_) {
    if (since < 0.1 && logs.step != logs.steps_per_epoch) return;
    last_print_ = now;
    std::string bar;
    if (logs.steps_per_epoch > 0) {
      const int width = 30;
      const int done = static_cast<int>(width * logs.step / logs.steps_per_epoch);
      bar.reserve(width + 2);
      bar.push_back('[');
      bar.append(static_cast<size_t>(done), '=');
      if (done < width) bar.push_back('>');
      bar.append(static_cast<size_t>(std::max(0, width - done - 1)), '.');
      bar.push_back(']');
    }
    std::fprintf(out_, "\r%6lld/%lld %s loss: %.4f - %.0f images/sec", static_cast<long long>(logs.step),
                 static_cast<long long>(logs.steps_per_epoch), bar.c_str(), logs.loss, logs.images_per_sec);
  } else {
    if (since < 10.0) return;  // plain lines for logs and CI: one every 10 s
    last_print_ = now;
    std::fprintf(out_, "step %lld/%lld loss %.4f images/sec %.0f\n", static_cast<long long>(logs.step),
                 static_cast<long long>(logs.steps_per_epoch), logs.loss, logs.images_per_sec);
  }
  std::fflush(out_);
}

void ProgressBar::on_epoch_end(const TrainLogs& logs) {
  if (tty_) std::fprintf(out_, "\n");
  std::fprintf(out_, "epoch %d: loss %.4f, %.0f images/sec", logs.epoch + 1, logs.loss, logs.images_per_sec);
  if (logs.test_accuracy >= 0)
    std::fprintf(out_, ", test loss %.4f, test accuracy %.2f%%", logs.test_loss, 100.0 * logs.test_accuracy);
  std::fprintf(out_, "\n");
  std::fflush(out_);
}

void ProgressBar::on_train_end(const TrainLogs& logs) {
  std::fprintf(out_, "done: %lld steps, final loss %.4f", static_cast<long long>(logs.global_step), logs.loss);
  if (logs.test_accuracy >= 0) std::fprintf(out_, ", test accuracy %.2f%%", 100.0 * logs.test_accuracy);
  std::fprintf(out_, "\n");
  std::fflush(out_);
}

}  // namespace dtrain
