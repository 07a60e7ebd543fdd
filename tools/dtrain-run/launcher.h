// The local half of dtrain-run: starts every task of a job as a child process on this machine and
// supervises it until the job ends.
//
// Each child runs in its own process group, with stdin from /dev/null, TF_CONFIG, DTRAIN_TASK and
// DTRAIN_JOB_TOKEN in its environment, and its stdout/stderr relayed line by line with a
// "[worker:1] " prefix. The launcher never hangs: a failed child stops the job (SIGTERM to every
// group, SIGKILL after the grace period), SIGINT/SIGTERM/SIGHUP are forwarded (a second SIGINT
// kills), --timeout bounds the whole job, and children die with the launcher (PR_SET_PDEATHSIG).
//
// A job with parameter servers trains asynchronously, as under TensorFlow's
// ParameterServerStrategy, and survives workers coming and going: when a non-chief worker or the
// evaluator fails (non-zero exit or a signal), the job goes on without it, and a worker is started
// again (same argv, environment and TF_CONFIG, after restart_delay_s) up to restart_workers times.
// The chief (worker:0) or a parameter server failing still stops the job. Once every worker has
// finished, the parameter servers and the evaluator are stopped with SIGTERM. Jobs without
// parameter servers are synchronous: any failure stops them. Linux only.
//
// Not thread-safe; call launch() once, from the main thread, before any other thread exists (it
// blocks signals and reads them through a signalfd).
#pragma once

#include <string>
#include <vector>

#include "cluster_config.h"
#include "elastic_driver.h"

namespace dtrain::run {

struct LaunchOptions {
  std::vector<Task> tasks;           // with addresses assigned
  std::vector<std::string> command;  // program and its arguments
  std::string devices;               // appended as --devices=<value> unless the command has one
  double timeout_s = 0;              // whole-job limit; 0 = none
  // With --max-restarts, timeout_s is what is left of the job's --timeout, this many seconds (for
  // the log); 0: timeout_s is the --timeout.
  double job_timeout_s = 0;
  double grace_s = 10;  // SIGTERM to SIGKILL when stopping the job
  // A parameter-server job whose workers all finished: the evaluator's SIGTERM means "evaluate the
  // newest checkpoint, then exit" (the chief's final one), which can take longer than --grace on a
  // loaded machine; SIGKILL follows only after this many seconds.
  double evaluator_grace_s = 300;
  std::string job_token;       // DTRAIN_JOB_TOKEN for every task
  int restart_workers = 0;     // jobs with ps: restarts of each failed non-chief worker
  double restart_delay_s = 1;  // between a worker's failure and its restart
  // Each local task is bound to its share of this process's cores (share_cpus) and, unless the
  // environment sets OMP_NUM_THREADS, told that many threads; false (--bind-to none): no binding.
  bool bind_cores = true;
  std::vector<std::string> extra_env;  // "NAME=value" for every task (e.g. DTRAIN_TIMELINE)
  // Per task (empty, or one per task): the network namespace it runs in, through `ip netns exec`
  // (--netns: the test hosts of tools/netns/dtrain-netns); "" = this process's namespace.
  std::vector<std::string> netns;
  // --min-np / --max-np: an elastic job (elastic_driver.h); `tasks` is then ignored. A worker that
  // fails does not stop it; it ends when every worker has exited: 0 when one finished (exit 0) and
  // none failed after that, else the first failure's status.
  ElasticOptions elastic;
};

// Exit statuses besides a child's own.
constexpr int kExitTimeout = 124;
constexpr int kExitNotFound = 127;
constexpr int kExitLaunchFailed = 1;

// The argv each task runs: `command`, plus --devices=<devices> when devices is non-empty and no
// argument is --devices or starts with --devices=.
std::vector<std::string> task_argv(const std::vector<std::string>& command,
                                   const std::string& devices);

// Runs the job to its end and returns the launcher's exit status: 0 when every task exited 0 (in a
// job with parameter servers: when the chief did and no parameter server failed; a non-chief
// worker or the evaluator that failed for good is named in a last line on stderr but does not
// count); the first failed task's status that stops the job (128 + signal when killed by a
// signal); 124 on --timeout; 128 + signal when the launcher was interrupted; 127 when the program
// cannot be found (nothing started); 1 when a task cannot be started. Reports each of these with
// one line on stderr. Does not throw. *task_failed (when given) says whether a task's failure, not
// an interrupt, the timeout or a start-up problem, ended the job (what --max-restarts relaunches
// on).
int launch(const LaunchOptions& options, bool* task_failed = nullptr);

}  // namespace dtrain::run
