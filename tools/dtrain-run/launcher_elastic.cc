// The elastic side of dtrain-run's supervisor (--min-np / --max-np): workers that fail do not stop
// the job, new ones start where the discovery script lists free slots (elastic_driver.h).
#include <algorithm>

#include "spawn.h"
#include "supervisor.h"

namespace dtrain::run::detail {

// An elastic job goes on while workers remain: the survivors re-form at the rendezvous.
void Supervisor::elastic_exit(Child& c, int code, const std::string& what) {
  elastic_->exited(c.task.index, code != 0 && !c.stop_requested && !stopping_);
  if (code == 0) {
    if (!elastic_success_) {
      // Training is over: workers outside the finishing round (waiting to join) have nothing to
      // join.
      const std::vector<int> members = elastic_->members();
      for (auto& other : children_)
        if (other.elastic && !other.reaped && !other.stop_requested &&
            std::find(members.begin(), members.end(), other.task.index) == members.end()) {
          log_line("elastic: the job finished; stopping " + other.task.name() +
                   ", which was not in the last round");
          signal_child(other, SIGTERM);
        }
    }
    elastic_success_ = true;
    return;
  }
  if (stopping_) return;
  if (c.stop_requested) return;  // we stopped it (host no longer listed, or the job finished)
  if (elastic_failure_ == 0) elastic_failure_ = code;
  if (elastic_success_) elastic_failed_after_success_ = true;
  c.lost = what;
  log_line(c.task.name() + " " + what + "; the elastic job continues with " +
           std::to_string(elastic_->running()) + " worker(s) (--min-np " +
           std::to_string(o_.elastic.min_np) + ")");
}

void Supervisor::elastic_tick(Clock::time_point now) {
  if (!elastic_ || stopping_ || elastic_->running() == 0 || elastic_success_) return;
  std::vector<int> stop;
  std::vector<ElasticSpawn> spawns;
  try {
    spawns = elastic_->tick(now, &stop);
  } catch (const std::exception& e) {
    log_line(std::string("elastic: ") + e.what());
    return;
  }
  for (int id : stop)
    for (auto& c : children_)
      if (c.elastic && c.task.index == id && !c.reaped && !c.stop_requested) {
        log_line("elastic: the host of " + c.task.name() +
                 " is no longer listed; stopping it (SIGTERM)");
        signal_child(c, SIGTERM);
      }
  for (const auto& sp : spawns) start_elastic(sp);
}

void Supervisor::start_elastic(const ElasticSpawn& sp) {
  Task t;
  t.type = "worker";
  t.index = sp.id;
  t.host = sp.host.address;
  t.port = sp.port;
  Child& c = children_.emplace_back(t);
  c.elastic = true;
  c.expendable = true;
  c.netns = sp.host.netns;
  c.env = base_env_;
  for (const std::string& kv : sp.env) c.env.push_back(kv);
  c.env.push_back("DTRAIN_TASK=" + t.name());
  c.env.push_back("DTRAIN_JOB_TOKEN=" + o_.job_token);
  for (const std::string& kv : o_.extra_env) c.env.push_back(kv);
  if (!shares_.empty()) {
    c.cpus = shares_[static_cast<size_t>(sp.id) % shares_.size()];
    if (!user_omp_) c.env.push_back("OMP_NUM_THREADS=" + std::to_string(c.cpus.size()));
  }
  log_line("elastic: starting " + t.name() + " on " + sp.host.name + " (" + t.address() + ")");
  const std::string err = start(c);
  if (!err.empty()) {
    log_line("cannot start " + t.name() + ": " + err);
    elastic_->exited(sp.id, true);
    c.lost = "could not be started: " + err;
    c.reaped_at = Clock::now();
  }
}

int Supervisor::run_elastic() {
  if (o_.timeout_s > 0)
    job_deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(o_.timeout_s));
  if (o_.bind_cores)
    shares_ = share_cpus(
        allowed_cpus(),
        std::max(1, std::min(o_.elastic.max_np, static_cast<int>(allowed_cpus().size()))));
  try {
    elastic_ = std::make_unique<ElasticDriver>(o_.elastic, o_.job_token, old_mask_, devnull_);
    log_line("elastic job: " + std::to_string(o_.elastic.np) + " worker(s) now, between --min-np " +
             std::to_string(o_.elastic.min_np) + " and --max-np " +
             std::to_string(o_.elastic.max_np) + "; rendezvous at " +
             o_.elastic.rendezvous_address);
    for (const auto& sp : elastic_->initial()) start_elastic(sp);
  } catch (const std::exception& e) {
    log_line(std::string("cannot start the elastic job: ") + e.what());
    ::close(sfd_);
    ::close(devnull_);
    return kExitLaunchFailed;
  }
  loop();
  log_summary();
  ::close(sfd_);
  ::close(devnull_);
  elastic_.reset();  // its discovery script first
  end_left_behind();
  if (exit_code_ != 0) return exit_code_;  // interrupted or timed out
  if (elastic_success_ && !elastic_failed_after_success_) return 0;
  task_failed_ = true;
  if (elastic_failure_ == 0) elastic_failure_ = kExitLaunchFailed;
  log_line(elastic_success_ ? "a worker failed after another had finished; the job failed"
                            : "no elastic worker finished; the job failed");
  return elastic_failure_;
}

}  // namespace dtrain::run::detail
