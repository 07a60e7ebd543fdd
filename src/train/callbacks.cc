#include "dtrain/train/callbacks.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/strategy.h"
#include "dtrain/train/checkpoint.h"

namespace dtrain {

double TrainLogs::get(const std::string& key) const {
  auto it = values.find(key);
  if (it != values.end()) return it->second;
  std::string have;
  for (const auto& [k, v] : values) have += (have.empty() ? "" : ", ") + k;
  throw NotFound("no log value '" + key + "' (the logs hold: " +
                 (have.empty() ? "nothing yet" : have) + "); a val_ key needs a test set");
}

TrainingContext& Callback::context() const {
  if (!ctx_)
    throw FailedPrecondition(
        "a callback's model, optimizer and strategy exist only while fit() runs it");
  return *ctx_;
}
Model& Callback::model() const { return *context().model; }
Optimizer& Callback::optimizer() const { return *context().optimizer; }
Strategy& Callback::strategy() const { return *context().strategy; }

namespace {

bool maximizes(const std::string& monitor, MonitorMode mode) {
  if (mode != MonitorMode::kAuto) return mode == MonitorMode::kMax;
  return monitor.find("acc") != std::string::npos || monitor.find("auc") != std::string::npos;
}

std::string format_duration(double s) {
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof(buf), "%d:%02d:%02d", static_cast<int>(s / 3600),
                  static_cast<int>(s / 60) % 60, static_cast<int>(s) % 60);
  else if (s >= 60)
    std::snprintf(buf, sizeof(buf), "%d:%02d", static_cast<int>(s / 60), static_cast<int>(s) % 60);
  else
    std::snprintf(buf, sizeof(buf), "%ds", static_cast<int>(std::lround(s)));
  return buf;
}

std::string format_step_time(double s) {
  char buf[32];
  if (s >= 1)
    std::snprintf(buf, sizeof(buf), "%.2fs/step", s);
  else
    std::snprintf(buf, sizeof(buf), "%.0fms/step", s * 1e3);
  return buf;
}

// " - accuracy: 0.8123 - val_loss: 0.3012" for every value but the loss.
std::string other_values(const TrainLogs& logs) {
  std::string out;
  char buf[96];
  for (const auto& [k, v] : logs.values) {
    if (k == "loss" || k == "learning_rate") continue;
    std::snprintf(buf, sizeof(buf), " - %s: %.4f", k.c_str(), v);
    out += buf;
  }
  return out;
}

}  // namespace

// ---- ProgressBar ----

ProgressBar::ProgressBar(FILE* out, std::string unit, double per_row)
    : out_(out),
      tty_(isatty(fileno(out)) != 0),
      unit_(std::move(unit) + "/sec"),
      per_row_(per_row) {
  if (unit_ == "/sec")
    throw InvalidArgument(
        "ProgressBar: the throughput's unit is empty; name what a row counts, e.g. \"images\"");
  if (!(per_row > 0) || !std::isfinite(per_row))
    throw InvalidArgument("ProgressBar: per_row must be a positive count of " +
                          unit_.substr(0, unit_.size() - 4) + " a row, got " +
                          std::to_string(per_row));
}

void ProgressBar::on_train_begin(const TrainLogs&) {
  if (!is_chief()) return;
  const TrainingContext& c = context();
  if (c.initial_global_step > 0 || c.initial_epoch > 0) {
    std::fprintf(
        out_,
        "resuming from a backup or an elastic commit: epoch %d, step %lld (global step %lld)\n",
        c.initial_epoch + 1, static_cast<long long>(c.initial_step),
        static_cast<long long>(c.initial_global_step));
    std::fflush(out_);
  }
}

void ProgressBar::on_epoch_begin(const TrainLogs& logs) {
  if (!is_chief()) return;
  last_print_ = std::chrono::steady_clock::now();
  if (logs.step > 0)
    std::fprintf(out_, "Epoch %d/%d (from step %lld)\n", logs.epoch + 1, logs.epochs,
                 static_cast<long long>(logs.step));
  else
    std::fprintf(out_, "Epoch %d/%d\n", logs.epoch + 1, logs.epochs);
  std::fflush(out_);
}

void ProgressBar::on_train_batch_end(const TrainLogs& logs) {
  if (!is_chief()) return;
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_print_).count();
  const bool known = logs.steps_per_epoch > 0;
  const double eta =
      known ? logs.seconds_per_step * static_cast<double>(logs.steps_per_epoch - logs.step) : 0;
  if (tty_) {
    if (since < 0.1 && logs.step != logs.steps_per_epoch) return;
    last_print_ = now;
    std::string bar;
    if (known) {
      const int width = 30;
      const int done = static_cast<int>(width * logs.step / logs.steps_per_epoch);
      bar.reserve(width + 2);
      bar.push_back('[');
      bar.append(static_cast<size_t>(done), '=');
      if (done < width) bar.push_back('>');
      bar.append(static_cast<size_t>(std::max(0, width - done - 1)), '.');
      bar.push_back(']');
    }
    std::fprintf(out_, "\r%6lld/%lld %s - ETA: %s - %s - loss: %.4f%s - %.0f %s\033[K",
                 static_cast<long long>(logs.step), static_cast<long long>(logs.steps_per_epoch),
                 bar.c_str(), format_duration(eta).c_str(),
                 format_step_time(logs.seconds_per_step).c_str(), logs.loss,
                 other_values(logs).c_str(), logs.images_per_sec * per_row_, unit_.c_str());
  } else {
    if (since < 10.0) return;  // plain lines for logs and CI: one every 10 s
    last_print_ = now;
    std::fprintf(out_, "step %lld/%lld - ETA: %s - %s - loss: %.4f%s - %.0f %s\n",
                 static_cast<long long>(logs.step), static_cast<long long>(logs.steps_per_epoch),
                 format_duration(eta).c_str(), format_step_time(logs.seconds_per_step).c_str(),
                 logs.loss, other_values(logs).c_str(), logs.images_per_sec * per_row_,
                 unit_.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::on_epoch_end(const TrainLogs& logs) {
  if (!is_chief()) return;
  if (tty_) std::fprintf(out_, "\n");
  std::fprintf(out_, "epoch %d: loss %.4f%s, %.0f %s, %s", logs.epoch + 1,
               logs.has("loss") ? logs.get("loss") : logs.loss, other_values(logs).c_str(),
               logs.images_per_sec * per_row_, unit_.c_str(),
               format_step_time(logs.seconds_per_step).c_str());
  if (logs.test_accuracy >= 0)
    std::fprintf(out_, ", test loss %.4f, test accuracy %.2f%%", logs.test_loss,
                 100.0 * logs.test_accuracy);
  std::fprintf(out_, "\n");
  std::fflush(out_);
}

void ProgressBar::on_train_end(const TrainLogs& logs) {
  if (!is_chief()) return;
  std::fprintf(out_, "done: %lld steps, final loss %.4f", static_cast<long long>(logs.global_step),
               logs.loss);
  if (logs.test_accuracy >= 0)
    std::fprintf(out_, ", test accuracy %.2f%%", 100.0 * logs.test_accuracy);
  std::fprintf(out_, "\n");
  std::fflush(out_);
}

// ---- EarlyStopping ----

EarlyStopping::EarlyStopping(std::string monitor, double min_delta, int patience, MonitorMode mode,
                             bool restore_best_weights, int start_from_epoch)
    : monitor_(std::move(monitor)),
      min_delta_(std::fabs(min_delta)),
      patience_(patience),
      start_from_epoch_(start_from_epoch),
      restore_best_(restore_best_weights),
      mode_(mode) {
  if (patience < 0)
    throw InvalidArgument("EarlyStopping patience must be >= 0, got " + std::to_string(patience));
  maximize_ = maximizes(monitor_, mode_);
}

void EarlyStopping::on_train_begin(const TrainLogs&) {
  wait_ = 0;
  best_epoch_ = stopped_epoch_ = -1;
  best_ = maximize_ ? -INFINITY : INFINITY;
  best_weights_.clear();
  best_names_.clear();
  members_ = members_across_workers_ = false;
}

void EarlyStopping::on_epoch_end(const TrainLogs& logs) {
  if (logs.epoch < start_from_epoch_) return;
  const double v = logs.get(monitor_);
  const bool better = maximize_ ? v - min_delta_ > best_ : v + min_delta_ < best_;
  if (best_epoch_ < 0 || better) {
    best_ = v;
    best_epoch_ = logs.epoch;
    wait_ = 0;
    if (restore_best_) {  // every copy (an ensemble's members differ)
      const auto vars = model().variables();
      // Parameters sharded across the replicas (ZeRO-3) hold parts only: gathered whole, as a
      // checkpoint gathers them (collective: every worker is at this epoch's end).
      std::map<std::string, Tensor> whole;
      if (std::any_of(vars.begin(), vars.end(),
                      [](const auto& v) { return !v->value_parts().empty(); })) {
        CheckpointData d = Checkpoint(model(), nullptr, &strategy()).capture();
        for (const auto& st : d.streamed) whole[st.name] = st.produce();
      }
      const StrategyExtended& ext = strategy().extended();
      members_ = ext.independent_replicas();
      members_across_workers_ = members_ && ext.num_workers() > 1;
      best_weights_.clear();
      best_names_.clear();
      for (const auto& var : vars) {
        const auto w = whole.find(var->name());
        best_weights_.push_back(w != whole.end() ? std::vector<Tensor>{w->second}
                                                 : var->device_values());
        best_names_.push_back(var->name());
      }
      for (auto& copies : best_weights_)
        for (Tensor& t : copies) t = t.to(DeviceSpec::cpu()).clone();
    }
    return;
  }
  if (++wait_ >= patience_) {
    stopped_epoch_ = logs.epoch;
    stop_training();
    if (is_chief()) {
      DTRAIN_LOG(INFO) << "EarlyStopping: '" << monitor_ << "' did not improve for " << wait_
                       << " epoch(s); stopping after epoch " << logs.epoch + 1 << " (best " << best_
                       << " at epoch " << best_epoch_ + 1 << ")";
    }
  }
}

CallbackState EarlyStopping::state_dict() const {
  CallbackState s;
  s.values = {{"wait", wait_},
              {"best", best_},
              {"best_epoch", best_epoch_},
              {"stopped_epoch", stopped_epoch_}};
  // An ensemble over several workers: each holds its own members' best weights, and a backup
  // holds the chief's state only; they are not carried (the restarted job takes its best epoch
  // from the epochs after the restart, with a WARNING) rather than give every worker the chief's.
  if (best_weights_.empty() || members_across_workers_) return s;
  // "weights/<variable>" holds copy 0; "weights.<c>/<variable>" copy c of an ensemble's members.
  for (size_t i = 0; i < best_weights_.size(); ++i) {
    const std::vector<Tensor>& copies = best_weights_[i];
    const std::string& name = best_names_[i];
    s.tensors["weights/" + name] = copies[0];
    if (members_)
      for (size_t c = 1; c < copies.size(); ++c)
        s.tensors["weights." + std::to_string(c) + "/" + name] = copies[c];
  }
  return s;
}

void EarlyStopping::load_state_dict(const CallbackState& state) {
  load_best(state);
  // The backup was taken after this callback had stopped training (the job ended before fit()
  // returned): it stops again, before the next epoch, as the uninterrupted run did.
  if (stopped_epoch_ >= 0) stop_training();
}

void EarlyStopping::load_best(const CallbackState& state) {
  auto value = [&](const char* name) {
    const auto it = state.values.find(name);
    if (it == state.values.end())
      throw FailedPrecondition("EarlyStopping(" + monitor_ + "): the backup's state has no '" +
                               name + "'");
    return it->second;
  };
  wait_ = static_cast<int>(value("wait"));
  best_ = value("best");
  best_epoch_ = static_cast<int>(value("best_epoch"));
  stopped_epoch_ = static_cast<int>(value("stopped_epoch"));
  best_weights_.clear();
  best_names_.clear();
  if (!restore_best_ || best_epoch_ < 0) return;
  if (state.tensors.empty()) {
    DTRAIN_LOG(WARNING) << "EarlyStopping(" << monitor_
                        << "): the backup holds no best weights (made without "
                           "restore_best_weights, or by an ensemble over several workers); the "
                           "best epoch is taken from the epochs after this restart";
    best_epoch_ = -1;
    best_ = maximize_ ? -INFINITY : INFINITY;
    return;
  }
  std::vector<std::vector<Tensor>> loaded;
  for (const auto& var : model().variables()) {
    const auto it = state.tensors.find("weights/" + var->name());
    if (it == state.tensors.end())
      throw FailedPrecondition("EarlyStopping(" + monitor_ +
                               "): the backup's best weights have no variable '" + var->name() +
                               "' (the model changed since the backup)");
    std::vector<Tensor> copies{it->second};
    for (size_t c = 1;; ++c) {
      const auto more = state.tensors.find("weights." + std::to_string(c) + "/" + var->name());
      if (more == state.tensors.end()) break;
      copies.push_back(more->second);
    }
    for (const Tensor& t : copies)
      if (t.shape() != var->shape() || t.dtype() != var->dtype())
        throw FailedPrecondition("EarlyStopping(" + monitor_ + "): the backup's best '" +
                                 var->name() + "' is " + dtype_name(t.dtype()) + " " +
                                 t.shape().to_string() + ", the model's " +
                                 dtype_name(var->dtype()) + " " + var->shape().to_string());
    if (copies.size() > 1 && var->value_parts().empty() &&
        copies.size() != var->device_values().size())
      throw FailedPrecondition("EarlyStopping(" + monitor_ + "): the backup's best weights hold " +
                               std::to_string(copies.size()) + " different copies of '" +
                               var->name() + "', this strategy " +
                               std::to_string(var->device_values().size()));
    members_ = members_ || copies.size() > 1;  // an ensemble's members, saved one by one
    loaded.push_back(std::move(copies));
    best_names_.push_back(var->name());
  }
  best_weights_ = std::move(loaded);
}

void EarlyStopping::on_train_end(const TrainLogs&) {
  if (!restore_best_ || best_weights_.empty() || best_epoch_ < 0) return;
  const auto vars = model().variables();
  for (size_t i = 0; i < vars.size() && i < best_weights_.size(); ++i) {
    const std::vector<Tensor>& best = best_weights_[i];
    if (best.size() == 1) {
      vars[i]->assign(best[0]);  // sharded (ZeRO-3): each replica's part takes its range
      continue;
    }
    vars[i]->update(
        [&](Tensor& value, size_t copy) { value.copy_from(best.at(copy).to(value.device())); });
  }
}

// ---- CSVLogger ----

CSVLogger::CSVLogger(std::string path, bool append) : path_(std::move(path)), append_(append) {}

void CSVLogger::on_train_begin(const TrainLogs&) {
  keys_.clear();
  if (!is_chief()) return;
  std::ofstream f(path_, std::ios::app);  // writable? (the rows kept are decided at the first row)
  if (!f) throw Unavailable("CSVLogger cannot write '" + path_ + "'");
}

void CSVLogger::keep_rows_before(int epoch) const {
  std::vector<std::string> kept;
  if (epoch > 0) {
    std::string header = "epoch";  // the one this fit writes
    for (const auto& k : keys_) header += "," + k;
    std::ifstream in(path_);
    std::string line;
    bool rows = false;
    for (bool first = true; std::getline(in, line); first = false) {
      if (first && line.rfind("epoch", 0) == 0) {
        if (line != header) {  // other columns (a fit with validation data now): start afresh
          kept.clear();
          break;
        }
        kept.push_back(line);
        continue;
      }
      char* end = nullptr;
      const long e = std::strtol(line.c_str(), &end, 10);
      if (end != line.c_str() && e < epoch) {
        kept.push_back(line);
        rows = true;
      }
    }
    if (!rows) kept.clear();  // nothing before this epoch: the new header follows
  }
  auto write = [&kept](const std::string& path) {
    std::ofstream out(path, std::ios::trunc);
    for (const std::string& l : kept) out << l << '\n';
    return static_cast<bool>(out.flush());
  };
  // Rows kept in a regular file: written aside and renamed, so a crash leaves the old file or the
  // new one, never half of one. Otherwise (nothing kept, as Keras; a pipe or a device; a directory
  // that takes no other file) in place.
  std::error_code ec;
  if (!kept.empty() && std::filesystem::is_regular_file(path_, ec)) {
    const std::string tmp = path_ + ".tmp";
    if (write(tmp) && std::rename(tmp.c_str(), path_.c_str()) == 0) return;
    std::remove(tmp.c_str());
  }
  if (!write(path_)) throw Unavailable("CSVLogger cannot write '" + path_ + "'");
}

void CSVLogger::on_epoch_end(const TrainLogs& logs) {
  if (!is_chief()) return;
  const bool header = keys_.empty();
  if (header) {
    for (const auto& [k, v] : logs.values) keys_.push_back(k);
    if (!append_) keep_rows_before(logs.epoch);
  }
  std::ofstream f(path_, std::ios::app);
  if (!f) throw Unavailable("CSVLogger cannot write '" + path_ + "'");
  f.seekp(0, std::ios::end);  // (where glibc's append mode already is; not every libc's)
  if (header && f.tellp() == 0) {
    f << "epoch";
    for (const auto& k : keys_) f << ',' << k;
    f << '\n';
  }
  f << logs.epoch;
  char buf[32];
  for (const auto& k : keys_) {
    auto it = logs.values.find(k);
    if (it == logs.values.end()) {
      f << ',';
      continue;
    }
    std::snprintf(buf, sizeof(buf), ",%.9g", it->second);
    f << buf;
  }
  f << '\n';
}

// ---- LearningRateScheduler ----

LearningRateScheduler::LearningRateScheduler(Fn fn) : fn_(std::move(fn)) {
  if (!fn_) throw InvalidArgument("LearningRateScheduler: the schedule function is empty");
}

double LearningRateScheduler::apply(int epoch, double lr) const {
  const double next = fn_(epoch, lr);
  if (!(next > 0) || !std::isfinite(next))
    throw InvalidArgument("LearningRateScheduler returned " + std::to_string(next) + " for epoch " +
                          std::to_string(epoch) + "; a learning rate must be a finite number > 0");
  return next;
}

void LearningRateScheduler::on_train_begin(const TrainLogs&) {
  epoch_ = -1;
  replay_ = false;
}

void LearningRateScheduler::on_epoch_begin(const TrainLogs& logs) {
  double lr = optimizer().learning_rate();
  if (replay_ && epoch_ <= logs.epoch) {
    // The rate this epoch would have started with: the schedule from the last epoch the backup
    // saw begin, each step stored as the optimizer stores it (float).
    lr = lr_before_;
    for (int e = epoch_; e < logs.epoch; ++e)
      lr = static_cast<double>(static_cast<float>(apply(e, lr)));
  }
  replay_ = false;
  const double next = apply(logs.epoch, lr);
  epoch_ = logs.epoch;
  lr_before_ = lr;
  optimizer().set_learning_rate(static_cast<float>(next));
}

CallbackState LearningRateScheduler::state_dict() const {
  if (epoch_ < 0) return {};
  return CallbackState{{{"epoch", epoch_}, {"learning_rate", lr_before_}}, {}};
}

void LearningRateScheduler::load_state_dict(const CallbackState& state) {
  const auto e = state.values.find("epoch"), lr = state.values.find("learning_rate");
  if (e == state.values.end() || lr == state.values.end() || !(e->second >= 0) || !(lr->second > 0))
    throw FailedPrecondition(
        "LearningRateScheduler: the backup's state needs 'epoch' >= 0 and 'learning_rate' > 0");
  epoch_ = static_cast<int>(e->second);
  lr_before_ = lr->second;
  replay_ = true;
}

// ---- LearningRateWarmup ----

namespace {
// The rate a LearningRateWarmup sets while warming: a constant of its own kind, which an elastic
// commit leaves out (it keeps the user's or a LearningRateScheduler's constant rate); after a reset
// the warm-up puts the user's schedule back itself and warms towards the user's rate again.
class WarmingRate final : public ConstantSchedule {
 public:
  using ConstantSchedule::ConstantSchedule;
};
}  // namespace

LearningRateWarmup::LearningRateWarmup(double warmup_epochs, int verbose, int num_replicas)
    : warmup_epochs_(warmup_epochs), verbose_(verbose), num_replicas_(num_replicas) {
  if (!(warmup_epochs > 0)) throw InvalidArgument("LearningRateWarmup needs warmup_epochs > 0");
  if (num_replicas < 0)
    throw InvalidArgument("LearningRateWarmup: num_replicas must be >= 0 (0: the strategy's)");
}

void LearningRateWarmup::on_train_begin(const TrainLogs&) {
  // A fit() that ended in an exception during the warm-up (elastic::run then calls fit() again)
  // left the warming rate in place: the user's schedule first, or the target would be that rate.
  // Unless the rate was set since (elastic's on_reset rescaling it, another optimizer): then
  // that is the target.
  if (!done_ && saved_schedule_ && installed_ && optimizer().schedule() == installed_)
    optimizer().set_schedule(saved_schedule_);
  installed_ = nullptr;
  target_ = optimizer().learning_rate();
  saved_schedule_ = optimizer().schedule();
  done_ = false;
}

void LearningRateWarmup::on_train_batch_begin(const TrainLogs& logs) {
  if (done_) return;
  const double e =
      logs.epoch + (logs.steps_per_epoch > 0
                        ? static_cast<double>(logs.step) / static_cast<double>(logs.steps_per_epoch)
                        : 0.0);
  if (e >= warmup_epochs_) {
    // The user's schedule back, unless the rate was set since the last warming one (a
    // LearningRateScheduler at this epoch's start) or this fit() resumed past the warm-up: then
    // the rate in place is the one to go on with.
    if (installed_ && optimizer().schedule() == installed_)
      optimizer().set_schedule(saved_schedule_);
    done_ = true;
    if (verbose_ && is_chief()) {
      DTRAIN_LOG(INFO) << "LearningRateWarmup: warm-up done at epoch " << logs.epoch + 1
                       << ", learning rate " << optimizer().learning_rate();
    }
    return;
  }
  const double n = num_replicas_ > 0 ? num_replicas_ : strategy().num_replicas_in_sync();
  installed_ = std::make_shared<WarmingRate>(
      static_cast<float>(target_ / n * (e * (n - 1) / warmup_epochs_ + 1)));
  optimizer().set_schedule(installed_);
}

void LearningRateWarmup::on_train_end(const TrainLogs&) {
  if (!done_ && saved_schedule_) optimizer().set_schedule(saved_schedule_);
  done_ = true;
}

// ---- TerminateOnNaN ----

void TerminateOnNaN::on_train_batch_end(const TrainLogs& logs) {
  if (std::isfinite(logs.loss)) return;
  terminated_ = true;
  stop_training();
  if (is_chief()) {
    DTRAIN_LOG(WARNING) << "TerminateOnNaN: batch " << logs.step << " gave loss " << logs.loss
                        << "; stopping training";
  }
}

}  // namespace dtrain
