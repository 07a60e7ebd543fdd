// How long the TCP transport spins before it blocks (next_spin_budget): waits that spinning did not
// end halve the budget down to its floor, one that spinning ended raises it to four times what the
// spin took, within [kMinSpin, kMaxSpin]. The effect on a shaped link (the ranks' CPU time per
// byte) is checked by netns_hosts.
#include <gtest/gtest.h>

#include <chrono>

#include "collectives/tcp/tcp_transport.h"

namespace dtrain::tcp {
namespace {

using us = std::chrono::microseconds;

TEST(TcpSpin, WaitsThatBlockAnywayShrinkTheBudgetToItsFloor) {
  us b = kMaxSpin;
  int waits = 0;
  while (b > kMinSpin) {
    const us next = next_spin_budget(b, b, /*found=*/false);
    EXPECT_LT(next, b);
    b = next;
    ++waits;
  }
  EXPECT_EQ(b, kMinSpin);
  EXPECT_LE(waits, 6);  // 100 us -> 4 us within a handful of slow waits
  EXPECT_EQ(next_spin_budget(kMinSpin, kMinSpin, false), kMinSpin);
}

TEST(TcpSpin, ASpinThatFindsWorkRaisesTheBudgetWithinItsBounds) {
  EXPECT_EQ(next_spin_budget(kMinSpin, us(3), true), us(4 * 3) + kMinSpin);
  EXPECT_EQ(next_spin_budget(kMinSpin, us(60), true), kMaxSpin);  // capped
  EXPECT_EQ(next_spin_budget(us(50), us(1), true), us(50));       // a quick find keeps it
  EXPECT_EQ(next_spin_budget(kMaxSpin, us(0), true), kMaxSpin);
  // A fast link after a slow one: a few waits that spinning ends bring the budget back up.
  us b = kMinSpin;
  for (int i = 0; i < 3; ++i) b = next_spin_budget(b, b, true);
  EXPECT_EQ(b, kMaxSpin);
}

}  // namespace
}  // namespace dtrain::tcp
