#include "dtrain/core/stop_signals.h"

#include <dirent.h>
#include <pthread.h>

#include <string>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

sigset_t set_of(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  return set;
}

// Threads of this process (entries of /proc/self/task); 0 where it cannot be read.
int threads_running() {
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return 0;
  int n = 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

}  // namespace

StopSignals::StopSignals(std::vector<int> signals) : signals_(std::move(signals)) {
  if (signals_.empty()) throw InvalidArgument("StopSignals: no signals given");
  for (int s : signals_)
    if (s <= 0 || s > 64 || s == SIGKILL || s == SIGSTOP)
      throw InvalidArgument("StopSignals: signal " + std::to_string(s) +
                            " cannot be taken (1-64, not SIGKILL or SIGSTOP)");
  const int others = threads_running() - 1;
  if (others > 0) {
    DTRAIN_LOG(WARNING) << "StopSignals: " << others
                        << " other thread(s) already run and keep their signal masks; a stop "
                           "signal delivered to one of them ends the process at once. Create "
                           "StopSignals first in main(), before any thread starts.";
  }
  sigset_t before;
  const sigset_t set = set_of(signals_);
  pthread_sigmask(SIG_BLOCK, &set, &before);
  for (int s : signals_) was_blocked_[s] = sigismember(&before, s) == 1;
  waiter_ = std::thread([this] { wait_loop(); });
}

void StopSignals::wait_loop() {
  pthread_setname_np(pthread_self(), "stop signals");
  const sigset_t set = set_of(signals_);
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (closing_.load()) return;
    if (!flag_.load()) {
      signal_.store(sig);
      flag_.store(true);
      continue;
    }
    // A second one: what the signal does without a handler (its default action, ending the
    // process for SIGTERM and SIGINT), from this thread, where it is unblocked for the purpose.
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);
  }
}

StopSignals::~StopSignals() {
  closing_.store(true);
  pthread_kill(waiter_.native_handle(), signals_.front());
  waiter_.join();
  sigset_t unblock;
  sigemptyset(&unblock);
  for (int s : signals_)
    if (!was_blocked_[s]) sigaddset(&unblock, s);
  pthread_sigmask(SIG_UNBLOCK, &unblock, nullptr);
}

}  // namespace dtrain
