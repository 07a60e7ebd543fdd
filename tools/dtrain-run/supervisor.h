// Private to dtrain-run: the supervisor that runs a job's tasks (launcher.cc) and an elastic job's
// workers (launcher_elastic.cc).
#pragma once

#include <signal.h>

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "launcher.h"
#include "line_relay.h"

namespace dtrain::run::detail {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// After its leader exits, how long a task's output pipes may stay open (held by a process it
// started) before the launcher stops relaying them.
constexpr Seconds kDrainAfterExit{2.0};
// After SIGKILL, how long to wait for a process before giving up on it (it may be stuck in the
// kernel, e.g. on a dead NFS mount); the launcher never waits forever.
constexpr Seconds kGiveUpAfterKill{5.0};
constexpr int kMaxPollMs = 1000;
constexpr Clock::time_point kNever = Clock::time_point::max();

void log_line(const std::string& msg);

// "[worker:1] ". Built by appending: GCC 12 at -O3 warns falsely (-Wrestrict) on "[" + string.
inline std::string prefix_of(const Task& t) {
  std::string p = "[";
  p += t.name();
  p += "] ";
  return p;
}

struct Child {
  explicit Child(Task t)
      : task(std::move(t)), relays{LineRelay(1, prefix_of(task)), LineRelay(2, prefix_of(task))} {}

  bool has_open_fds() const { return fds[0] >= 0 || fds[1] >= 0; }
  // The group may still hold processes: the leader is not reaped, or someone holds its pipes.
  bool group_alive() const { return pid > 0 && (!reaped || has_open_fds()); }

  Task task;
  std::string netns;             // the network namespace it runs in ("" = ours)
  std::vector<std::string> env;  // kept for a restart, which gets the same TF_CONFIG
  std::vector<int> cpus;         // the cores it is bound to (empty: not bound)
  // A parameter-server job goes on without it when it fails (a non-chief worker, the evaluator).
  bool expendable = false;
  bool elastic = false;  // an elastic job's worker (task.index is its launcher id)
  int restarts = 0;
  Clock::time_point restart_at = kNever;  // a failed worker starts again then
  std::string lost;  // how it failed for good when the job went on without it, else empty
  pid_t pid = -1;    // also its process group id
  bool reaped = true;
  int fds[2] = {-1, -1};  // read ends of its stdout and stderr pipes
  LineRelay relays[2];
  bool stop_requested = false;  // we signalled it: a non-zero exit is not a failure
  bool given_up = false;        // still alive after SIGKILL (stuck in the kernel): not waited for
  bool sigkilled = false;
  Clock::time_point kill_at = kNever;     // SIGKILL when still alive then
  double kill_after_s = 0;                // the grace that set kill_at (for the log)
  Clock::time_point give_up_at = kNever;  // stop waiting for it then
  Clock::time_point reaped_at = kNever;
};

class Supervisor {
 public:
  explicit Supervisor(const LaunchOptions& o) : o_(o) {}
  int run();
  int run_elastic();
  // A task's failure (not an interrupt or the timeout) ended the job, and no stop signal came.
  bool task_failed() const;

 private:
  bool setup_signals();
  std::string start(Child& c);
  void loop();
  void on_signal(int sig);
  void reap();
  void on_exit(Child& c, int status);
  void carry_on_without(Child& c, const std::string& what);
  void restart(Child& c);
  void read_from(Child& c, int which, bool drain);
  void close_fds(Child& c);
  // SIGTERM: SIGKILL follows after grace_s seconds, or after grace_override_s when >= 0.
  void signal_child(Child& c, int sig, double grace_override_s = -1);
  void begin_stop(int sig);
  void stop_once(Child& c, int sig);
  void end_left_behind();
  void stop_servers_when_workers_done();
  void log_summary() const;
  void start_elastic(const ElasticSpawn& spawn);
  void elastic_exit(Child& c, int code, const std::string& what);
  void elastic_tick(Clock::time_point now);
  void check_deadlines(Clock::time_point now);
  int poll_timeout_ms(Clock::time_point now) const;

  const LaunchOptions& o_;
  std::vector<std::string> argv_;
  std::deque<Child> children_;  // elastic jobs add workers: references must stay valid
  std::vector<std::string> base_env_;
  std::vector<std::vector<int>> shares_;
  bool user_omp_ = false;
  std::unique_ptr<ElasticDriver> elastic_;
  bool elastic_success_ = false;  // an elastic worker finished
  int elastic_failure_ = 0;       // the first elastic worker's failure status
  bool elastic_failed_after_success_ = false;
  int sfd_ = -1;
  int devnull_ = -1;
  sigset_t old_mask_{};
  Seconds grace_{10.0};
  Seconds restart_delay_{1.0};
  Clock::time_point job_deadline_ = kNever;
  bool stopping_ = false;   // the job is being stopped; exit_code_ is final
  int interrupts_ = 0;      // SIGINTs received (the second kills every task)
  bool signalled_ = false;  // a stop signal came (SIGINT, SIGTERM or SIGHUP)
  bool ps_job_ = false;  // has parameter servers: workers may come and go (asynchronous training)
  bool servers_stopped_ = false;
  int exit_code_ = 0;
  bool task_failed_ = false;
};

}  // namespace dtrain::run::detail
