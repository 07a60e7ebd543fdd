// StopSignals: the stop signals as a flag, taken by sigwait on a thread of its own, never by a
// handler on a thread that computes.
#include "dtrain/core/stop_signals.h"

#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "dtrain/core/random.h"
#include "dtrain/model/ops.h"
#include "gtest/gtest.h"

namespace dtrain {
namespace {

bool blocked_here(int sig) {
  sigset_t now;
  pthread_sigmask(SIG_BLOCK, nullptr, &now);
  return sigismember(&now, sig) == 1;
}

bool wait_for(const StopSignals& s, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!s.requested() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return s.requested();
}

// Runs `body` in a child process; its wait status, or -1 when it outlives `seconds` (then killed).
template <typename F>
int in_child(F body, double seconds) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status;
}

TEST(StopSignals, FirstSignalSetsTheFlagAndTheProcessGoesOn) {
  ASSERT_FALSE(blocked_here(SIGTERM));
  {
    StopSignals s;
    EXPECT_FALSE(s.requested());
    EXPECT_EQ(s.signal(), 0);
    EXPECT_TRUE(blocked_here(SIGTERM));
    EXPECT_TRUE(blocked_here(SIGINT));
    ASSERT_EQ(::kill(::getpid(), SIGTERM), 0);
    ASSERT_TRUE(wait_for(s, 10));
    EXPECT_EQ(s.signal(), SIGTERM);
    EXPECT_TRUE(s.flag().load());
  }
  EXPECT_FALSE(blocked_here(SIGTERM));  // the mask as it was
  EXPECT_FALSE(blocked_here(SIGINT));
}

TEST(StopSignals, ThreadsStartedAfterItNeverTakeTheSignals) {
  StopSignals s({SIGUSR1});
  bool blocked = false;
  std::thread t([&] { blocked = blocked_here(SIGUSR1); });
  t.join();
  EXPECT_TRUE(blocked);
  EXPECT_FALSE(blocked_here(SIGTERM));  // only the signals asked for
  ASSERT_EQ(::kill(::getpid(), SIGUSR1), 0);
  ASSERT_TRUE(wait_for(s, 10));
  EXPECT_EQ(s.signal(), SIGUSR1);
}

TEST(StopSignals, SecondSignalEndsTheProcessAsWithoutAHandler) {
  const int status = in_child(
      [] {
        StopSignals s;
        ::kill(::getpid(), SIGINT);
        if (!wait_for(s, 10)) return 3;
        ::kill(::getpid(), SIGINT);
        std::this_thread::sleep_for(std::chrono::seconds(20));
        return 4;  // still alive: wrong
      },
      30);
  ASSERT_NE(status, -1) << "the child outlived 30 s";
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGINT);
}

TEST(StopSignals, RejectsSignalsItCannotTake) {
  EXPECT_THROW(StopSignals(std::vector<int>{}), InvalidArgument);
  EXPECT_THROW(StopSignals(std::vector<int>{SIGKILL}), InvalidArgument);
  EXPECT_THROW(StopSignals(std::vector<int>{0}), InvalidArgument);
}

// Threads of this process and whether each blocks `sig` (/proc/self/task/<tid>/status, SigBlk).
std::map<std::string, bool> threads_blocking(int sig) {
  std::map<std::string, bool> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(e.path() / "status");
    for (std::string line; std::getline(f, line);)
      if (line.rfind("SigBlk:", 0) == 0)
        out[e.path().filename()] = (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  }
  return out;
}

// The regression: dtrain's sidecar evaluator took SIGTERM with a handler, and now and then the
// signal interrupted oneDNN's float32 GEMM (gemm:jit, here for a 1000-row product), which runs with
// its stack pointer on a heap workspace: the signal frame overwrote the heap below it and glibc
// aborted later. With StopSignals no thread started after it can take the signal, so none that
// computes does, and no handler is installed at all: the signal arrives while the products run and
// only sets the flag.
TEST(StopSignals, ComputingThreadsNeverTakeTheSignal) {
  const std::map<std::string, bool> before = threads_blocking(SIGUSR2);
  StopSignals s({SIGUSR2});
  struct sigaction now {};
  ASSERT_EQ(::sigaction(SIGUSR2, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_DFL);  // no handler
  const Tensor a = Tensor::full(Shape{1000, 3136}, 0.01f);
  const Tensor b = Tensor::full(Shape{3136, 128}, 0.02f);
  std::thread other([&] { (void)ops::matmul(a, b); });  // a thread that computes, started after
  other.join();
  (void)ops::matmul(a, b);  // this thread's kernels made before the signal's clock starts
  std::thread sender([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ::kill(::getpid(), SIGUSR2);
  });
  int products = 0;
  for (; !s.requested() && products < 20000; ++products) (void)ops::matmul(a, b);
  sender.join();
  EXPECT_TRUE(s.requested());
  EXPECT_GE(products, 1);  // it arrived while the products ran (the loop ends on the flag)
  EXPECT_LT(products, 20000);
  int checked = 0;
  for (const auto& [tid, blocked] : threads_blocking(SIGUSR2)) {
    if (before.count(tid)) continue;
    std::ifstream comm("/proc/self/task/" + tid + "/comm");
    std::string name;
    std::getline(comm, name);
    if (name == "stop signals") continue;  // in sigwait, which unblocks them while it waits
    EXPECT_TRUE(blocked) << "thread " << tid << " (" << name
                         << "), started after StopSignals, takes SIGUSR2";
    ++checked;
  }
  EXPECT_GE(checked, 1);  // the CPU device's thread, OpenMP's
}

}  // namespace
}  // namespace dtrain
