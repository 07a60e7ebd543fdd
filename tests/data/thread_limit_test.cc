// The input pipeline's own threads (map(fn, N), a reader's parallel batch reads) when the process
// may start no more (a pids cgroup, RLIMIT_NPROC): a typed error saying so, not std::terminate
// from a half-built thread vector (one thread started, the second refused) nor a bare
// std::system_error. Each case runs in a child process made to run as `nobody` with a limit of two
// (root only: the limit does not bind root; skipped otherwise).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <iterator>
#include <string>
#include <system_error>
#include <thread>

#include "dtrain/dtrain.h"

namespace dtrain {
namespace {

// Threads of this process, from /proc (-1 where /proc is not mounted).
int threads_here() {
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", ec), end; !ec && it != end;
       it.increment(ec))
    ++n;
  return ec ? -1 : n;
}

// Runs `body` in a child that can start one thread and no second; its exit code (-1: killed by a
// signal, e.g. SIGABRT from std::terminate). 0: it threw Unavailable naming `needle`; 77: the child
// could not be limited (not root, or the limit is not enforced here).
int in_a_child_without_threads(const std::function<void()>& body, const std::string& needle) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -2;
  if (pid == 0) {
    ::alarm(30);             // a child that hangs is killed (SIGALRM: reported as -1)
    const rlimit two{2, 2};  // this process and one thread
    if (::setrlimit(RLIMIT_NPROC, &two) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)
      ::_exit(77);
    int code = 3;  // body returned without an error
    try {  // nothing may leave this block: gtest would go on running the other tests in the child
      {    // the limit must bind (not in some sandboxes): a first thread, then no second
        std::promise<void> go;
        std::thread first;
        try {
          first = std::thread([f = go.get_future()]() mutable { f.wait(); });
        } catch (const std::system_error&) {
          ::_exit(77);  // not even one (other processes of nobody count too)
        }
        bool second_refused = false;
        try {
          std::thread([] {}).join();
        } catch (const std::system_error&) {
          second_refused = true;
        }
        go.set_value();
        first.join();
        if (!second_refused) ::_exit(77);
      }
      // The kernel frees a joined thread's slot a moment after join(): wait for it, so that the
      // body starts one thread and is refused the second (the half-built case). Without /proc (a
      // bare chroot), a fixed 20 ms.
      for (int i = 0, n = threads_here(); i < 1000 && n != 1; ++i, n = threads_here()) {
        ::usleep(n < 0 ? 20000 : 1000);
        if (n < 0) break;
      }
      body();
    } catch (const Unavailable& e) {
      code = std::string(e.what()).find(needle) != std::string::npos ? 0 : 4;
      if (code) std::fprintf(stderr, "%s\n", e.what());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      code = 5;
    } catch (...) {
      code = 5;
    }
    ::_exit(code);
  }
  int st = 0;
  pid_t w;
  while ((w = ::waitpid(pid, &st, 0)) < 0 && errno == EINTR) {
  }
  if (w != pid) return -2;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

class ThreadLimit : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef __SANITIZE_THREAD__
    GTEST_SKIP() << "ThreadSanitizer does not start threads in a child of a threaded process";
#endif
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a child as nobody with RLIMIT_NPROC";
  }
};

// Reading d's first batch in such a child fails with Unavailable naming `needle`.
void expect_the_first_batch_to_say(const Dataset& d, const std::string& needle) {
  const int code = in_a_child_without_threads(
      [&] {
        std::vector<Tensor> out;
        d.make_iterator()->next(&out);
      },
      needle);
  if (code == 77) GTEST_SKIP() << "could not run a child as nobody with a binding process limit";
  EXPECT_EQ(code, 0) << "exit code (-1: killed by a signal, std::terminate before the fix)";
}

TEST_F(ThreadLimit, ParallelMapSaysItCannotStartItsThreads) {
  const Dataset d = Dataset::from_tensors({Tensor::full(Shape{8, 2}, 1.f)})
                        .batch(2)
                        .map([](std::vector<Tensor> x) { return x; }, 4);
  expect_the_first_batch_to_say(d, "Dataset::map: cannot start thread");
}

TEST_F(ThreadLimit, ParallelReadsSayTheyCannotStartTheirThreads) {
  Dataset::ReaderOptions o;
  o.num_parallel_calls = 3;
  const Dataset d = Dataset::from_reader(
                        8, {Dataset::RowSpec{Shape{2}, DType::kFloat32}},
                        [](int64_t row, uint64_t, void* const* dst) {
                          static_cast<float*>(dst[0])[0] = static_cast<float>(row);
                          static_cast<float*>(dst[0])[1] = 0.f;
                          return true;
                        },
                        o)
                        .batch(4);
  expect_the_first_batch_to_say(d, "cannot start reader thread");
}

}  // namespace
}  // namespace dtrain
