// Starting one task of a dtrain-run job: fork/exec of the program in its own process group, with
// stdin from a given fd (/dev/null), its stdout and stderr on pipes the launcher reads, exactly the
// environment it is given, and PR_SET_PDEATHSIG so it dies with the launcher. Plus the checks the
// launcher makes before it starts anything. Linux only.
//
// Plain functions; spawn() must be called from the launcher's only thread (it forks).
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <vector>

namespace dtrain::run {

// A started task: the leader's pid (also its process group id) and the non-blocking, close-on-exec
// read ends of its stdout and stderr pipes, which the caller owns.
struct Spawned {
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
};

// Status of a child whose exec failed (it also writes why on its stderr).
constexpr int kExitExecFailed = 127;

// Empty when `prog` can be executed (the way execvpe looks it up), else why not, with the fix.
// Never throws.
std::string check_program(const std::string& prog);

// Reopens a closed fd 0, 1 or 2 on /dev/null: a pipe reusing one of them would break the
// children's redirections. Never throws.
void ensure_std_fds_open();

// Starts argv[0] (looked up in PATH) with `argv` and exactly `env`, stdin dup'ed from `stdin_fd`,
// and the signal mask `child_mask` (the launcher blocks signals it reads through a signalfd; the
// child must not inherit that). Returns "" and fills `out`, or why it could not start (pipe or
// fork failed; then nothing is left open). An exec failure shows later as exit status 127.
// Never throws.
// `cpus`, when not empty: the cores the child is bound to (sched_setaffinity before exec; the cores
// dtrain's devices and OpenMP then use).
std::string spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                  int stdin_fd, const sigset_t& child_mask, const std::vector<int>& cpus,
                  Spawned& out);

// Makes this process the reaper of its descendants' orphans (PR_SET_CHILD_SUBREAPER): a process a
// task started and left behind (its own stdout elsewhere, so the task's pipes close) becomes this
// process's child instead of init's, and ends with the job. Children this process already has
// (inherited through an exec) are left alone. Never throws.
void adopt_orphans();
// Ends this process's children other than `known` (the orphans adopted, and theirs as they come):
// SIGTERM (and SIGCONT), SIGKILL to those still alive after grace_s seconds, each reaped within 2 s
// more or left (stuck in the kernel; not ours to signal). Returns their pids. Never throws.
std::vector<pid_t> end_adopted(const std::vector<pid_t>& known, double grace_s);

// The cores this process may run on (its affinity mask), in order. Never throws.
std::vector<int> allowed_cpus();

// The cores each of `tasks` local tasks is bound to: an equal share of `cpus` each, contiguous
// (task i of 2 on 4 cores: {2i, 2i+1}); with more tasks than cores, one core each, round-robin.
std::vector<std::vector<int>> share_cpus(const std::vector<int>& cpus, int tasks);

}  // namespace dtrain::run
