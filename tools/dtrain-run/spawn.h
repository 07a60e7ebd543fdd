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
std::string spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                  int stdin_fd, const sigset_t& child_mask, Spawned& out);

}  // namespace dtrain::run
