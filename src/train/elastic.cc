// elastic::run and its commit callback (dtrain/train/elastic.h).
#include "dtrain/train/elastic.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>

#include "dtrain/core/logging.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/train/checkpoint.h"
#include "train/callback_states.h"
#include "train/elastic_state.h"

namespace dtrain::elastic {
namespace {

const char* kEpochState = "dtrain.epoch_state";

// Horovod's KerasState with its commit callbacks: keeps the last committed state in memory (in
// pieces across the workers: elastic_state.h), asks at each commit whether the membership changes,
// and puts a restored state's position into fit().
class CommitState final : public Callback {
 public:
  CommitState(Job& job, MultiWorkerMirroredStrategy& strategy, Model& model, Optimizer& optimizer,
              int64_t every)
      : job_(job), strategy_(strategy), every_(every), state_(strategy, model, optimizer) {}

  void on_train_begin(const TrainLogs&) override {
    // The same stateful callbacks on every worker (any with a state_key(): the commits hold their
    // states), checked before this fit()'s first commit; fit() has checked the ones that must run
    // on every worker just before (EarlyStopping's gather under ZeRO-3 would meet another
    // worker's commit).
    if (context().callback_states)
      sum_checking_layout(0,
                          dtrain::detail::callback_states_layout(context().callback_states(),
                                                                 /*keys_only=*/true),
                          context().callback_states());
    if (!resume_) return;
    TrainingContext& ctx = context();
    ctx.initial_epoch = static_cast<int>(resume_->epoch);
    ctx.initial_step = resume_->step;
    ctx.initial_global_step = resume_->global_step;
    ctx.initial_epoch_state = resume_state_;
    ctx.initial_callback_states = std::move(resume_callbacks_);
    resume_callbacks_.clear();
    resume_.reset();
  }
  bool saves_backup() const override { return true; }
  bool must_run_on_every_worker() const override { return true; }
  void on_train_batch_end(const TrainLogs& logs) override {
    last_global_step_ = logs.global_step;
    if (every_ > 0 && logs.global_step % every_ == 0 && !context().accumulating &&
        logs.step != logs.steps_per_epoch)
      commit(TrainingPosition{logs.epoch, logs.step, logs.global_step});
  }
  void on_epoch_end(const TrainLogs& logs) override {
    last_global_step_ = logs.global_step;
    // After the last epoch nothing is left to train: commit, but keep the round (a newcomer is
    // turned away when the job ends).
    commit(TrainingPosition{logs.epoch + 1, 0, logs.global_step},
           /*ask=*/logs.epoch + 1 < logs.epochs);
  }

  // Restores the newest state the workers of this round committed between them (before the first
  // commit: the state they start with). Collective over the current workers. Returns the batches
  // this worker had computed beyond the restored position.
  int64_t sync() {
    std::map<std::string, std::string> meta;
    const TrainingPosition p =
        state_.restore(job_.membership().generation, &meta, &resume_callbacks_);
    resume_ = p;
    resume_state_.clear();
    if (auto it = meta.find(kEpochState); it != meta.end()) {
      const nlohmann::json s = nlohmann::json::parse(it->second);
      for (const auto& [k, v] : s.items()) resume_state_[k] = v.get<std::vector<double>>();
    }
    const int64_t lost = std::max<int64_t>(0, last_global_step_ - p.global_step);
    last_global_step_ = p.global_step;
    return lost;
  }

 private:
  void commit(const TrainingPosition& p, bool ask = true) {
    std::map<std::string, std::string> extra;
    if (p.step > 0 && context().epoch_state) {
      nlohmann::json j = nlohmann::json::object();
      for (const auto& [k, v] : context().epoch_state()) j[k] = v;
      extra[kEpochState] = j.dump();
    }
    const std::map<std::string, CallbackState> callbacks =
        context().callback_states ? context().callback_states()
                                  : std::map<std::string, CallbackState>{};
    state_.commit(job_.membership().generation, p, extra, /*first=*/false, callbacks);
    // Every worker asks; any yes stops all of them after this same commit. The same sum checks
    // that every worker committed the same callbacks' states: a restore rebuilds each entry from
    // the pieces of several workers.
    const bool mine = ask && job_.membership_changing();
    if (sum_checking_layout(mine ? 1.0 : 0.0, dtrain::detail::callback_states_layout(callbacks),
                            callbacks) > 0)
      throw HostsUpdated("the membership changes after global step " +
                         std::to_string(p.global_step));
  }

  // Sums `value` over the workers, and with it `layout`; throws FailedPrecondition on every worker
  // when the workers' layouts differ.
  double sum_checking_layout(double value, uint64_t layout,
                             const std::map<std::string, CallbackState>& callbacks) {
    constexpr int kChunks = 3;  // 20 bits each: sums of them stay exact
    std::vector<double> v{value};
    for (int c = 0; c < kChunks; ++c)
      v.push_back(static_cast<double>((layout >> (20 * c)) & 0xfffff));
    const std::vector<double> sums = strategy_.extended().sum_across_workers(v);
    const double workers = static_cast<double>(strategy_.extended().num_workers());
    for (int c = 1; c <= kChunks; ++c)
      if (sums[static_cast<size_t>(c)] != v[static_cast<size_t>(c)] * workers)
        throw FailedPrecondition(
            "elastic::run: the workers' callbacks keep different states (this worker's: " +
            dtrain::detail::callback_states_keys(callbacks) +
            "); give every worker the same EarlyStopping, ModelCheckpoint, LearningRateScheduler "
            "(and any callback with a state_key()), in the same order: what they write is written "
            "by the chief alone");
    return sums[0];
  }

  Job& job_;
  MultiWorkerMirroredStrategy& strategy_;
  int64_t every_;
  detail::CommittedState state_;
  std::optional<TrainingPosition> resume_;
  std::map<std::string, std::vector<double>> resume_state_;
  std::map<std::string, CallbackState> resume_callbacks_;
  int64_t last_global_step_ = 0;
};

}  // namespace

RunReport run(Job& job, MultiWorkerMirroredStrategy& strategy, Model& model, Optimizer& optimizer,
              const std::function<void(Callback& elastic)>& train, const RunOptions& options) {
  if (job.membership().generation == 0)
    throw FailedPrecondition(
        "elastic::run: the job has not joined a round; build the strategy with job.join()");
  if (strategy.broadcast_initial_values())
    throw FailedPrecondition(
        "elastic::run: build the strategy with CommunicationOptions::broadcast_initial_values = "
        "false: a worker that joins later creates its variables alone, and elastic::run gives it "
        "the state by broadcast (a broadcast at creation would meet no partner)");
  if (!model.built())
    throw FailedPrecondition(
        "elastic::run: build the model first (model.build(input_shape) inside strategy.scope()): "
        "its state is what the workers commit and broadcast");
  {
    // Slots now, so that the state every worker receives holds them (a newcomer builds its own
    // here).
    auto scope = strategy.scope();
    optimizer.build(model.trainable_variables());
  }
  CommitState state(job, strategy, model, optimizer, options.commit_every);
  RunReport report;
  bool reset = false;
  while (true) {
    std::string why;
    try {
      report.rolled_back += state.sync();
      // After the restore (a rate set here is not overwritten by the commit's), on every worker of
      // a new round: survivors, and newcomers (a first round after the job's first).
      if ((reset || job.membership().generation > 1) && options.on_reset)
        options.on_reset(job.membership());
      train(state);
      report.generation = job.membership().generation;
      report.workers = static_cast<int>(job.membership().addresses.size());
      return report;
    } catch (const HostsUpdated& e) {
      why = e.what();
    } catch (const Unavailable& e) {
      why = e.what();
    } catch (const DeadlineExceeded& e) {
      why = e.what();
    }
    if (++report.resets > options.max_resets)
      throw FailedPrecondition("elastic::run: the membership changed more than " +
                               std::to_string(options.max_resets) +
                               " times (RunOptions::max_resets); last: " + why);
    DTRAIN_LOG(WARNING) << "elastic worker " << job.id() << " (rank " << job.membership().rank
                        << " of round " << job.membership().generation << "): " << why
                        << "; rejoining";
    // A worker of the new round may die while the round connects: rejoin then too. What join()
    // throws (no round within the timeout, the job's state lost) ends the run.
    while (true) {
      ClusterResolution cluster = job.join();
      try {
        strategy.reconnect(std::move(cluster), job.token());
        break;
      } catch (const Unavailable& e) {
        why = e.what();
      } catch (const DeadlineExceeded& e) {
        why = e.what();
      } catch (const PermissionDenied& e) {
        why = e.what();
      }
      if (++report.resets > options.max_resets)
        throw FailedPrecondition("elastic::run: the membership changed more than " +
                                 std::to_string(options.max_resets) +
                                 " times (RunOptions::max_resets); last: " + why);
      DTRAIN_LOG(WARNING) << "elastic worker " << job.id() << ": round "
                          << job.membership().generation << " did not connect (" << why
                          << "); rejoining";
    }
    DTRAIN_LOG(INFO) << "elastic worker " << job.id() << " is rank " << job.membership().rank
                     << " of " << job.membership().addresses.size() << " in round "
                     << job.membership().generation;
    reset = true;
  }
}

}  // namespace dtrain::elastic
