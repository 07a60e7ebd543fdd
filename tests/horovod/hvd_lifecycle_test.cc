// dtrain::hvd's init() and shutdown() in one process (size 1, no launcher): both may be called from
// any thread, any number of times. Concurrent calls must neither hang (a shutdown joining a
// background thread that a concurrent init() told to keep going) nor leave a half-made runtime.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "dtrain/dtrain.h"

namespace dtrain::hvd {
namespace {

TEST(HvdLifecycle, InitAndShutdownRacingOnTwoThreadsNeitherHangNorCrash) {
  std::atomic<int> reduced{0}, refused{0};
  std::atomic<bool> wrong{false};
  auto cycle = [&] {
    for (int i = 0; i < 3000; ++i) {
      init();
      try {
        if (size() != 1 || rank() != 0) wrong = true;  // read while the other thread may init
        const Tensor t = allreduce(Tensor::full(Shape{8}, 2.f), "", Op::kSum);
        if (t.to_vector<float>() != std::vector<float>(8, 2.f)) wrong = true;
        ++reduced;
      } catch (const FailedPrecondition&) {
        ++refused;  // the other thread shut the runtime down in between: said so, not hung
      }
      shutdown();
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::thread a(cycle), b(cycle);
  a.join();
  b.join();
  EXPECT_FALSE(wrong);
  EXPECT_EQ(reduced + refused, 6000);
  EXPECT_FALSE(is_initialized());
  // The runtime still works after all that.
  init();
  EXPECT_EQ(allreduce(Tensor::full(Shape{3}, 1.f), "after", Op::kSum).to_vector<float>(),
            std::vector<float>(3, 1.f));
  shutdown();
  std::printf("%d all-reduces, %d refused after a concurrent shutdown, %.2f s\n", reduced.load(),
              refused.load(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace
}  // namespace dtrain::hvd
