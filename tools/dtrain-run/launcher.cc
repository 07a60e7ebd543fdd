#include "launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>

#include "line_relay.h"
#include "spawn.h"
#include "supervisor.h"

extern char** environ;

namespace dtrain::run {
namespace detail {

void log_line(const std::string& msg) { write_all(2, "dtrain-run: " + msg + "\n"); }

namespace {

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    case SIGKILL:
      return "SIGKILL";
    default:
      if (const char* abbrev = ::sigabbrev_np(sig)) return std::string("SIG") + abbrev;
      return "signal " + std::to_string(sig);
  }
}

}  // namespace

bool Supervisor::setup_signals() {
  // Inherited "ignore SIGCHLD" would auto-reap the children and hide their statuses.
  ::signal(SIGCHLD, SIG_DFL);
  // A reader of our output that goes away must not kill the launcher (and orphan the job).
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    // A signal the launcher was told to ignore (nohup, `cmd &` in a script) stays ignored, and the
    // children inherit that.
    struct sigaction sa {};
    if (::sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler == SIG_IGN) continue;
    sigaddset(&mask, sig);
  }
  if (::sigprocmask(SIG_BLOCK, &mask, &old_mask_) != 0) return false;
  // The children's mask is the one this process started with: a relaunch (--max-restarts) makes a
  // new supervisor after the last one left these signals blocked, which its children would inherit
  // (a program without its own sigwait would then ignore SIGTERM and die only at SIGKILL).
  static sigset_t started_with;
  static bool saved = false;
  if (!saved) {
    started_with = old_mask_;
    saved = true;
  }
  old_mask_ = started_with;
  sfd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  return sfd_ >= 0;
}

std::string Supervisor::start(Child& c) {
  Spawned s;
  std::vector<std::string> argv = argv_;
  if (!c.netns.empty()) argv.insert(argv.begin(), {"ip", "netns", "exec", c.netns});
  const std::string err = spawn(argv, c.env, devnull_, old_mask_, c.cpus, s);
  if (!err.empty()) return err;
  c.pid = s.pid;
  c.reaped = false;
  c.fds[0] = s.out_fd;
  c.fds[1] = s.err_fd;
  return "";
}

void Supervisor::close_fds(Child& c) {
  for (int w = 0; w < 2; ++w) {
    if (c.fds[w] < 0) continue;
    c.relays[w].finish();
    ::close(c.fds[w]);
    c.fds[w] = -1;
  }
}

void Supervisor::read_from(Child& c, int which, bool drain) {
  char buf[64 * 1024];
  // Bounded even when draining: a process of the group may still be writing.
  for (int reads = 0; reads < (drain ? 64 : 1) && c.fds[which] >= 0; ++reads) {
    const ssize_t n = ::read(c.fds[which], buf, sizeof(buf));
    if (n > 0) {
      c.relays[which].feed(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) {
      --reads;
      continue;
    }
    if (n < 0 && errno == EAGAIN) return;
    c.relays[which].finish();  // EOF, or an error that ends the stream
    ::close(c.fds[which]);
    c.fds[which] = -1;
  }
}

void Supervisor::signal_child(Child& c, int sig, double grace_override_s) {
  if (!c.group_alive()) return;
  if (::kill(-c.pid, sig) != 0 && !c.reaped) ::kill(c.pid, sig);
  // A stopped task (SIGSTOP, a debugger's, a hung peer's test) acts on a signal only once it runs
  // again: continue it, so that it gets its SIGTERM now rather than the SIGKILL after --grace (as
  // Slurm does when it ends a job step).
  if (sig != SIGKILL && ::kill(-c.pid, SIGCONT) != 0 && !c.reaped) ::kill(c.pid, SIGCONT);
  const auto now = Clock::now();
  if (sig == SIGKILL) {
    c.sigkilled = true;
    c.give_up_at = now + std::chrono::duration_cast<Clock::duration>(kGiveUpAfterKill);
  } else {
    c.stop_requested = true;
    // The earliest deadline holds: a --timeout or a signal after the evaluator's longer grace
    // began still stops it within --grace.
    const Seconds grace = grace_override_s >= 0 ? Seconds(grace_override_s) : grace_;
    const auto deadline = now + std::chrono::duration_cast<Clock::duration>(grace);
    if (deadline < c.kill_at) {
      c.kill_at = deadline;
      c.kill_after_s = grace.count();
    }
  }
}

void Supervisor::begin_stop(int sig) {
  stopping_ = true;
  for (auto& c : children_) {
    c.restart_at = kNever;  // a worker waiting for its restart stays down
    stop_once(c, sig);
  }
}

// A task already asked to stop (the evaluator and the ps tasks at the end of a ps job, an elastic
// worker whose host left the list, any task when the job is already stopping) gets no second
// signal, which dtrain's programs take as "die now" (a backup being written would be lost); its
// SIGKILL comes within --grace from now, sooner than the evaluator's longer grace.
void Supervisor::stop_once(Child& c, int sig) {
  if (!c.stop_requested) {
    signal_child(c, sig);
    return;
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(grace_);
  if (!c.sigkilled && deadline < c.kill_at) {
    c.kill_at = deadline;
    c.kill_after_s = grace_.count();
  }
}

void Supervisor::on_signal(int sig) {
  signalled_ = true;
  if (sig == SIGINT && ++interrupts_ >= 2) {
    log_line("second interrupt; killing all tasks (SIGKILL)");
    for (auto& c : children_) signal_child(c, SIGKILL);
    return;
  }
  if (stopping_) {  // a failure or --timeout is stopping the job: its status stays
    log_line("got " + signal_name(sig) + " while stopping the job; SIGKILL after " +
             seconds_text(o_.grace_s) + " s" + (sig == SIGINT ? ", or at a second Ctrl-C" : ""));
    for (auto& c : children_) stop_once(c, sig);
    return;
  }
  log_line("got " + signal_name(sig) + "; forwarding it to every task (SIGKILL after " +
           seconds_text(o_.grace_s) + " s" + (sig == SIGINT ? ", or at a second Ctrl-C)" : ")"));
  exit_code_ = 128 + sig;
  begin_stop(sig);
}

void Supervisor::on_exit(Child& c, int status) {
  c.reaped = true;
  c.reaped_at = Clock::now();
  // The child's last words (often why it failed) come before our line about it.
  for (int w = 0; w < 2; ++w) read_from(c, w, /*drain=*/true);
  const bool by_signal = WIFSIGNALED(status);
  const int code = by_signal ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  const std::string what = by_signal ? "killed by signal " + std::to_string(WTERMSIG(status)) +
                                           " (" + signal_name(WTERMSIG(status)) + ")"
                                     : "exited with status " + std::to_string(code);
  if (c.elastic) {
    elastic_exit(c, code, what);
    return;
  }
  if (code != 0 && c.stop_requested && !stopping_ && !c.sigkilled) {
    // Stopped after the workers (a ps or the evaluator): its SIGTERM asks for a clean exit, so
    // anything else is said, though the chief's status stays the job's.
    log_line(c.task.name() + " " + what + " after its SIGTERM" +
             (c.task.type == "evaluator"
                  ? "; the newest checkpoint may not have been evaluated (evaluate it again with "
                    "the evaluator's TF_CONFIG and --checkpoint-dir)"
                  : ""));
    return;
  }
  if (code == 0 || stopping_ || c.stop_requested) return;
  if (c.expendable) {
    carry_on_without(c, what);
    return;
  }
  log_line(c.task.name() + " " + what);
  exit_code_ = code;
  task_failed_ = true;
  begin_stop(SIGTERM);
}

// As under TensorFlow's ParameterServerStrategy, asynchronous training goes on when a non-chief
// worker or the evaluator fails: the variables live on the parameter servers, and the chief decides
// when training is done. A worker with --restart-workers left starts again with the same TF_CONFIG.
void Supervisor::carry_on_without(Child& c, const std::string& what) {
  const bool worker = c.task.type == "worker";
  if (worker && c.restarts < o_.restart_workers) {
    log_line(c.task.name() + " " + what +
             "; the parameter-server job continues, restarting it in " +
             seconds_text(restart_delay_.count()) + " s");
    c.restart_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(restart_delay_);
    return;
  }
  std::string hint;
  if (worker && o_.restart_workers == 0) hint = " (--restart-workers=N restarts it)";
  if (worker && o_.restart_workers > 0) {
    hint = " (no restarts left of --restart-workers=" + std::to_string(o_.restart_workers) + ")";
  }
  log_line(c.task.name() + " " + what + "; the parameter-server job continues without it" + hint);
  c.lost = what;
}

void Supervisor::restart(Child& c) {
  c.restart_at = kNever;
  if (c.has_open_fds()) {
    // A process the failed instance started still holds its output (and maybe its port).
    ::kill(-c.pid, SIGKILL);
    close_fds(c);
  }
  ++c.restarts;
  log_line("restarting " + c.task.name() + " (restart " + std::to_string(c.restarts) + " of " +
           std::to_string(o_.restart_workers) + ")");
  c.stop_requested = c.given_up = false;
  c.sigkilled = false;
  c.kill_at = c.give_up_at = c.reaped_at = kNever;
  const std::string err = start(c);
  if (!err.empty()) {
    log_line("cannot restart " + c.task.name() + ": " + err +
             "; the parameter-server job continues without it");
    c.reaped_at = Clock::now();
    c.lost = "could not be restarted: " + err;
  }
}

void Supervisor::reap() {
  // Every child that exited, as waitid() gives them: a task's status goes to on_exit; an orphan a
  // task left (adopt_orphans) is reaped, so that none piles up while the job runs. The discovery
  // script's is its driver's to reap.
  const pid_t script = elastic_ ? elastic_->discovery_pid() : -1;
  for (;;) {
    siginfo_t info{};
    if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) break;
    const pid_t pid = info.si_pid;
    if (pid == script) break;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) != pid) break;
    for (auto& c : children_)
      if (!c.reaped && c.pid == pid) {
        on_exit(c, status);
        break;
      }
  }
  for (auto& c : children_) {
    if (c.reaped) continue;
    int status = 0;
    const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) {
      on_exit(c, status);
    } else if (r < 0 && errno == ECHILD) {  // cannot happen with SIGCHLD at SIG_DFL; never spin
      log_line("lost track of " + c.task.name() + " (pid " + std::to_string(c.pid) + ")");
      c.reaped = true;
      c.reaped_at = Clock::now();
    }
  }
  stop_servers_when_workers_done();
}

// Parameter servers serve until told to stop (as in TensorFlow), so once every worker has finished
// (exited 0, or failed for good in this parameter-server job) the launcher stops them and the
// evaluator, and the job succeeds.
void Supervisor::stop_servers_when_workers_done() {
  if (servers_stopped_ || stopping_ || !ps_job_) return;
  int running_ps = 0;
  bool running_evaluator = false;
  for (const auto& c : children_) {
    const bool trains = c.task.type == "worker" || c.task.type == "chief";
    if (trains && (!c.reaped || c.restart_at != kNever)) return;
    if (c.task.type == "ps" && !c.reaped) ++running_ps;
    if (c.task.type == "evaluator" && !c.reaped) running_evaluator = true;
  }
  servers_stopped_ = true;
  if (running_ps == 0 && !running_evaluator) return;
  std::string what;
  if (running_ps > 0) what = std::to_string(running_ps) + " parameter server(s)";
  if (running_evaluator) what += running_ps > 0 ? " and the evaluator" : "the evaluator";
  log_line("all workers finished; stopping " + what + " (SIGTERM" +
           (running_evaluator ? "; the evaluator finishes the newest checkpoint, SIGKILL after " +
                                    seconds_text(o_.evaluator_grace_s) + " s (--evaluator-grace)"
                              : std::string()) +
           ")");
  for (auto& c : children_) {
    if (c.task.type == "ps") signal_child(c, SIGTERM);
    if (c.task.type == "evaluator") signal_child(c, SIGTERM, std::max(0.0, o_.evaluator_grace_s));
  }
}

void Supervisor::log_summary() const {
  std::string lost;
  for (const auto& c : children_) {
    if (!c.lost.empty()) lost += (lost.empty() ? "" : ", ") + c.task.name() + " (" + c.lost + ")";
  }
  if (lost.empty()) return;
  if (elastic_) {
    log_line("the elastic job ran on without " + lost);
    return;
  }
  log_line("the job ran on without " + lost +
           "; in a parameter-server job such failures do not change the exit status, which the "
           "chief and the parameter servers decide");
}

void Supervisor::check_deadlines(Clock::time_point now) {
  if (!stopping_ && now >= job_deadline_) {
    log_line("timed out after " +
             seconds_text(o_.job_timeout_s > 0 ? o_.job_timeout_s : o_.timeout_s) +
             " s (--timeout" + (o_.job_timeout_s > 0 ? ", over every launch of the job" : "") +
             "); stopping all tasks (SIGTERM, SIGKILL after " + seconds_text(o_.grace_s) + " s)");
    exit_code_ = kExitTimeout;
    begin_stop(SIGTERM);
  }
  elastic_tick(now);
  for (auto& c : children_) {
    if (!stopping_ && now >= c.restart_at) restart(c);
    if (!c.sigkilled && c.group_alive() && now >= c.kill_at) {
      log_line(c.task.name() + " still running " + seconds_text(c.kill_after_s) +
               " s after SIGTERM; sending SIGKILL");
      signal_child(c, SIGKILL);
    }
    if (!c.reaped && now >= c.give_up_at) {
      log_line(c.task.name() + " (pid " + std::to_string(c.pid) +
               ") is still alive after SIGKILL; not waiting for it");
      c.reaped = c.given_up = true;
      c.reaped_at = now;
      close_fds(c);
    }
    if (c.reaped && c.has_open_fds() &&
        now >= c.reaped_at + std::chrono::duration_cast<Clock::duration>(kDrainAfterExit)) {
      if (c.stop_requested || stopping_) {
        ::kill(-c.pid, SIGKILL);
      } else {
        log_line(c.task.name() +
                 " exited but a process it started still holds its output; "
                 "no longer relaying it");
      }
      close_fds(c);
    }
  }
}

int Supervisor::poll_timeout_ms(Clock::time_point now) const {
  Clock::time_point next = stopping_ ? kNever : job_deadline_;
  // Only while elastic_tick() runs the driver (else a past next_tick() made poll() spin).
  if (elastic_ && !stopping_ && !o_.elastic.discovery_script.empty() && elastic_->running() > 0 &&
      !elastic_success_)
    next = std::min(next, elastic_->next_tick());
  for (const auto& c : children_) {
    if (!c.sigkilled && c.group_alive()) next = std::min(next, c.kill_at);
    if (!c.reaped) next = std::min(next, c.give_up_at);
    next = std::min(next, c.restart_at);
    if (c.reaped && c.has_open_fds()) {
      next = std::min(next,
                      c.reaped_at + std::chrono::duration_cast<Clock::duration>(kDrainAfterExit));
    }
  }
  if (next == kNever) return kMaxPollMs;
  const double ms = std::ceil(Seconds(next - now).count() * 1000.0);
  return static_cast<int>(std::clamp(ms, 0.0, static_cast<double>(kMaxPollMs)));
}

void Supervisor::loop() {
  std::vector<pollfd> pfds;
  std::vector<std::pair<Child*, int>> owners;  // pfds[i + 1] reads owners[i]
  while (true) {
    reap();
    check_deadlines(Clock::now());
    const bool done = std::all_of(children_.begin(), children_.end(), [](const Child& c) {
      return c.reaped && !c.has_open_fds() && c.restart_at == kNever;
    });
    if (done) return;
    pfds.assign(1, pollfd{sfd_, POLLIN, 0});
    owners.clear();
    for (auto& c : children_) {
      for (int w = 0; w < 2; ++w) {
        if (c.fds[w] < 0) continue;
        pfds.push_back(pollfd{c.fds[w], POLLIN, 0});
        owners.emplace_back(&c, w);
      }
    }
    const int r = ::poll(pfds.data(), pfds.size(), poll_timeout_ms(Clock::now()));
    if (r < 0 && errno != EINTR) {
      log_line(std::string("poll failed: ") + std::strerror(errno) + "; killing all tasks");
      for (auto& c : children_) signal_child(c, SIGKILL);
      if (!stopping_) exit_code_ = kExitLaunchFailed;
      return;
    }
    if (r <= 0) continue;
    if (pfds[0].revents != 0) {
      signalfd_siginfo info;
      while (::read(sfd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
        if (info.ssi_signo != SIGCHLD) on_signal(static_cast<int>(info.ssi_signo));
      }
    }
    for (size_t i = 0; i < owners.size(); ++i) {
      if (pfds[i + 1].revents != 0) read_from(*owners[i].first, owners[i].second, false);
    }
  }
}

// A stop signal that came while a failure was stopping the job also means: no relaunch.
bool Supervisor::task_failed() const { return task_failed_ && interrupts_ == 0 && !signalled_; }

namespace {
bool is_training(const Task& t) { return t.type == "worker" || t.type == "chief"; }
}  // namespace

// Processes the tasks started and left behind (adopt_orphans): ended with the job.
void Supervisor::end_left_behind() {
  std::vector<pid_t> known;  // children given up on after their SIGKILL (stuck in the kernel)
  for (const auto& c : children_)
    if (c.given_up) known.push_back(c.pid);
  const std::vector<pid_t> ended = end_adopted(known, std::min(grace_.count(), 2.0));
  if (ended.empty()) return;
  std::string pids;
  for (pid_t p : ended) pids += (pids.empty() ? "" : ", ") + std::to_string(p);
  log_line("ended " + std::to_string(ended.size()) + " process(es) the tasks left running (pid " +
           pids + ")");
}

int Supervisor::run() {
  adopt_orphans();
  argv_ = task_argv(o_.command, o_.devices);
  const std::string why = check_program(argv_.at(0));
  if (!why.empty()) {
    log_line("cannot run '" + argv_[0] + "': " + why + " (nothing was started)");
    return kExitNotFound;
  }
  if (std::any_of(o_.netns.begin(), o_.netns.end(),
                  [](const std::string& n) { return !n.empty(); })) {
    const std::string no_ip = check_program("ip");
    if (!no_ip.empty()) {
      log_line("--netns runs tasks through `ip netns exec`, but 'ip' cannot run: " + no_ip +
               " (apt-get install iproute2; nothing was started)");
      return kExitNotFound;
    }
  }
  grace_ = Seconds(std::max(0.0, o_.grace_s));
  restart_delay_ = Seconds(std::max(0.0, o_.restart_delay_s));
  ensure_std_fds_open();
  devnull_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull_ < 0 || !setup_signals()) {
    log_line(std::string("cannot set up: ") + std::strerror(errno));
    return kExitLaunchFailed;
  }
  std::vector<std::string>& base_env = base_env_;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("TF_CONFIG=", 0) == 0 || kv.rfind("DTRAIN_TASK=", 0) == 0 ||
        kv.rfind("DTRAIN_JOB_TOKEN=", 0) == 0 || kv.rfind("LOCAL_RANK=", 0) == 0 ||
        kv.rfind("LOCAL_WORLD_SIZE=", 0) == 0) {
      continue;
    }
    base_env.push_back(kv);
  }
  ps_job_ =
      std::any_of(o_.tasks.begin(), o_.tasks.end(), [](const Task& t) { return t.type == "ps"; });
  user_omp_ = std::any_of(base_env.begin(), base_env.end(), [](const std::string& kv) {
    return kv.rfind("OMP_NUM_THREADS=", 0) == 0;
  });
  const bool user_omp = user_omp_;
  if (o_.elastic.min_np > 0) return run_elastic();
  const std::vector<std::vector<int>> shares =
      o_.bind_cores ? share_cpus(allowed_cpus(), static_cast<int>(o_.tasks.size()))
                    : std::vector<std::vector<int>>{};
  for (size_t i = 0; i < o_.tasks.size(); ++i) {
    Child& c = children_.emplace_back(o_.tasks[i]);
    if (!o_.netns.empty()) c.netns = o_.netns.at(i);
    c.env = base_env;
    c.env.push_back("TF_CONFIG=" + tf_config(o_.tasks, i));
    c.env.push_back("DTRAIN_TASK=" + o_.tasks[i].name());
    c.env.push_back("DTRAIN_JOB_TOKEN=" + o_.job_token);
    if (is_training(o_.tasks[i])) {
      // torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE: this training task's place among those on its
      // host (--devices=gpu:local pins GPU LOCAL_RANK; hvd::local_rank() is the same number).
      int local = 0, local_size = 0;
      for (size_t j = 0; j < o_.tasks.size(); ++j)
        if (is_training(o_.tasks[j]) && o_.tasks[j].host == o_.tasks[i].host) {
          if (j < i) ++local;
          ++local_size;
        }
      c.env.push_back("LOCAL_RANK=" + std::to_string(local));
      c.env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(local_size));
    }
    for (const std::string& kv : o_.extra_env) c.env.push_back(kv);
    if (!shares.empty() && !shares[i].empty()) {
      c.cpus = shares[i];
      if (!user_omp) c.env.push_back("OMP_NUM_THREADS=" + std::to_string(c.cpus.size()));
    }
    const std::string& type = o_.tasks[i].type;
    c.expendable = ps_job_ && ((type == "worker" && !is_chief(o_.tasks, i)) || type == "evaluator");
  }
  if (o_.timeout_s > 0) {
    job_deadline_ =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(o_.timeout_s));
  }
  for (size_t i = 0; i < children_.size(); ++i) {
    const std::string err = start(children_[i]);
    if (!err.empty()) {
      log_line("cannot start " + o_.tasks[i].name() + ": " + err + "; stopping the job");
      exit_code_ = kExitLaunchFailed;
      begin_stop(SIGTERM);
      break;
    }
  }
  loop();
  log_summary();
  end_left_behind();
  // Signals stay blocked: one arriving now must not kill the launcher before it returns the status.
  ::close(sfd_);
  ::close(devnull_);
  return exit_code_;
}

}  // namespace detail

std::vector<std::string> task_argv(const std::vector<std::string>& command,
                                   const std::string& devices) {
  std::vector<std::string> argv = command;
  if (devices.empty()) return argv;
  const bool has_devices = std::any_of(
      argv.begin() + (argv.empty() ? 0 : 1), argv.end(),
      [](const std::string& a) { return a == "--devices" || a.rfind("--devices=", 0) == 0; });
  if (!has_devices) argv.push_back("--devices=" + devices);
  return argv;
}

int launch(const LaunchOptions& options, bool* task_failed) {
  if (task_failed) *task_failed = false;
  if (options.command.empty()) {
    detail::log_line("no program to run; e.g. dtrain-run -np 2 -- ./prog --flag");
    return 2;
  }
  detail::Supervisor s(options);
  const int status = s.run();
  if (task_failed) *task_failed = s.task_failed();
  return status;
}

}  // namespace dtrain::run
