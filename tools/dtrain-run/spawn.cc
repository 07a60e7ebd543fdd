#include "spawn.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dtrain::run {
namespace {

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace

std::string check_program(const std::string& prog) {
  if (prog.empty()) return "the program name is empty";
  if (prog.find('/') != std::string::npos) {
    if (is_executable_file(prog)) return "";
    struct stat st {};
    if (::stat(prog.c_str(), &st) != 0) return "no such file";
    if (S_ISDIR(st.st_mode)) return "it is a directory";
    return "it is not executable (chmod +x " + prog + ")";
  }
  const char* path = std::getenv("PATH");
  const std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t colon = dirs.find(':', start);
    if (colon == std::string::npos) colon = dirs.size();
    const std::string dir = colon == start ? "." : dirs.substr(start, colon - start);
    if (is_executable_file(dir + "/" + prog)) return "";
    start = colon + 1;
  }
  return "not found in PATH; give its path, e.g. ./" + prog;
}

void ensure_std_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1) ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
  }
}

std::string spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                  int stdin_fd, const sigset_t& child_mask, const std::vector<int>& cpus,
                  Spawned& result) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return std::string("pipe: ") + std::strerror(errno);
  if (::pipe2(err, O_CLOEXEC) != 0) {
    const std::string msg = std::string("pipe: ") + std::strerror(errno);
    ::close(out[0]);
    ::close(out[1]);
    return msg;
  }
  std::vector<char*> argvp, envp;
  for (const auto& a : argv) argvp.push_back(const_cast<char*>(a.c_str()));
  argvp.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const std::string exec_error = "dtrain-run: cannot execute '" + argv.at(0) + "': ";
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid == 0) {
    // Own process group, so a terminal's Ctrl-C reaches only the launcher, which forwards it.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the launcher died before prctl
    ::dup2(stdin_fd, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::signal(SIGPIPE, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cpus) CPU_SET(c, &set);
      ::sched_setaffinity(0, sizeof(set), &set);  // best effort: an unpinned task still runs
    }
    ::execvpe(argvp[0], argvp.data(), envp.data());
    const char* why = std::strerror(errno);
    if (::write(2, exec_error.data(), exec_error.size()) > 0 &&
        ::write(2, why, std::strlen(why)) > 0) {
      [[maybe_unused]] auto n = ::write(2, "\n", 1);
    }
    ::_exit(kExitExecFailed);
  }
  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    const std::string msg = std::string("fork: ") + std::strerror(errno);
    ::close(out[0]);
    ::close(err[0]);
    return msg;
  }
  // Also here, so that signalling the group works before the child gets to its own setpgid.
  ::setpgid(pid, pid);
  result.pid = pid;
  result.out_fd = out[0];
  result.err_fd = err[0];
  for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return "";
}

namespace {
// Children this process had before it adopted any (a shell's `cmd & exec dtrain-run ...` hands its
// children to dtrain-run): not the tasks' orphans, never ended by end_adopted.
std::vector<pid_t>& inherited() {
  static std::vector<pid_t> pids;
  return pids;
}

// This process's living children (from /proc: each process's parent), but `known` and the
// inherited; the dead ones (zombies) are reaped.
std::vector<pid_t> adopted(const std::vector<pid_t>& known) {
  std::vector<pid_t> out;
  const pid_t self = ::getpid();
  DIR* proc = ::opendir("/proc");
  if (!proc) return out;
  while (const dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    char path[64], buf[512];
    std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
    ::close(fd);
    if (n <= 0) continue;
    buf[n] = '\0';
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ')' ends it.
    const char* close = std::strrchr(buf, ')');
    char state = 0;
    long ppid = 0;
    unsigned long flags = 0;
    if (!close || std::sscanf(close + 1, " %c %ld %*d %*d %*d %*d %lu", &state, &ppid, &flags) != 3)
      continue;
    const auto listed = [pid](const std::vector<pid_t>& v) {
      return std::find(v.begin(), v.end(), static_cast<pid_t>(pid)) != v.end();
    };
    if (ppid != self || listed(known) || listed(inherited())) continue;
    // Ended already, or ending (PF_EXITING: its files, the task's pipes among them, are closed
    // before it turns zombie): an orphan the job's stop reached. Reaped, not counted.
    constexpr unsigned long kExiting = 0x4;
    if (state == 'Z' || (flags & kExiting) != 0) {
      int status = 0;
      int tries = 0;
      while (::waitpid(static_cast<pid_t>(pid), &status, WNOHANG) == 0 && ++tries < 50)
        ::usleep(4000);
      if (tries < 50) continue;
    }
    out.push_back(static_cast<pid_t>(pid));
  }
  ::closedir(proc);
  return out;
}
}  // namespace

void adopt_orphans() {
  inherited() = adopted({});
  (void)::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
}

std::vector<pid_t> end_adopted(const std::vector<pid_t>& known, double grace_s) {
  using Clock = std::chrono::steady_clock;
  std::vector<pid_t> ended, left;
  auto reap_left = [&left] {
    left.erase(std::remove_if(left.begin(), left.end(),
                              [](pid_t p) {
                                int status = 0;
                                return ::waitpid(p, &status, WNOHANG) != 0;  // reaped, or gone
                              }),
               left.end());
  };
  auto take_new = [&](int sig) {
    for (pid_t p : adopted(known)) {
      if (std::find(ended.begin(), ended.end(), p) != ended.end()) continue;
      ended.push_back(p);
      left.push_back(p);
      ::kill(p, sig);
      if (sig != SIGKILL) ::kill(p, SIGCONT);  // a stopped one acts on its SIGTERM now
    }
  };
  // SIGTERM, scanning again while the grace lasts: an orphan's own children come to this process
  // when it exits.
  const auto term_until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(std::max(0.0, grace_s)));
  for (;;) {
    take_new(SIGTERM);
    reap_left();
    if (left.empty() || Clock::now() >= term_until) break;
    ::usleep(20000);
  }
  // SIGKILL to what is left and any found since; the wait is bounded (a process stuck in the
  // kernel, or one this process may not signal, is left behind rather than waited for forever).
  take_new(SIGKILL);
  for (pid_t p : left) ::kill(p, SIGKILL);
  const auto kill_until = Clock::now() + std::chrono::seconds(2);
  for (reap_left(); !left.empty() && Clock::now() < kill_until; reap_left()) ::usleep(20000);
  return ended;
}

std::vector<int> allowed_cpus() {
  std::vector<int> out;
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

std::vector<std::vector<int>> share_cpus(const std::vector<int>& cpus, int tasks) {
  std::vector<std::vector<int>> out(static_cast<size_t>(std::max(tasks, 0)));
  if (cpus.empty() || tasks <= 0) return out;
  const size_t n = cpus.size(), t = static_cast<size_t>(tasks);
  if (t >= n) {
    for (size_t i = 0; i < t; ++i) out[i] = {cpus[i % n]};
    return out;
  }
  const size_t per = n / t;
  for (size_t i = 0; i < t; ++i)
    out[i].assign(cpus.begin() + static_cast<long>(i * per),
                  cpus.begin() + static_cast<long>((i + 1) * per));
  return out;
}

}  // namespace dtrain::run
