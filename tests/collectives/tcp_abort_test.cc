// The TCP transport's abort() called on another thread while a collective runs (what a strategy
// does when one replica fails and the others are inside collectives): the collective must fail at
// once with the abort's reason, abort() must not wait for it, and the peer must fail too: over the
// sockets a half-sent frame ends the stream (the peer reads EOF, never what followed as payload).
// Over the sockets and through shared memory.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "dtrain/collectives/tcp.h"
#include "testing/ports.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

class TcpAbort : public ::testing::TestWithParam<bool> {
 public:
  TcpGroupOptions options(const std::vector<std::string>& addrs, int rank,
                          size_t segment_bytes) const {
    TcpGroupOptions o;
    o.shared_memory = GetParam();
    o.rank = rank;
    o.addresses = addrs;
    o.task_names = {"worker:0", "worker:1"};
    o.token = "0123456789abcdef0123";
    o.connect_timeout = std::chrono::seconds(20);
    o.collective.timeout = std::chrono::seconds(12);  // the peer below is busy for less
    o.segment_bytes = segment_bytes;
    return o;
  }
};
INSTANTIATE_TEST_SUITE_P(Transport, TcpAbort, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "SharedMemory" : "Sockets";
                         });

// Rank 0 starts an all-reduce of `elements` floats while rank 1 computes (issues nothing) for up
// to 8 s; `abort_after` in, another thread of rank 0 aborts. Returns rank 0's error, the seconds
// from the abort to the collective's failure and for abort() itself, and rank 1's error from the
// all-reduce it issues when rank 0 is through, with the seconds it took to fail.
struct Outcome {
  std::string error0, error1;
  double fail_s = -1, abort_s = -1, rank1_s = -1;
  bool rank1_completed = false;
};

Outcome abort_while_peer_busy(const TcpAbort& t, int64_t elements, size_t segment_bytes,
                              std::chrono::milliseconds abort_after) {
  const auto busy = std::chrono::seconds(8);
  const auto addrs = testing::free_loopback_addresses(2);
  Outcome out;
  std::promise<void> rank0_done;
  std::shared_future<void> done = rank0_done.get_future().share();
  std::thread peer([&] {
    try {
      auto c = connect_tcp_group(t.options(addrs, 1, segment_bytes));
      done.wait_for(busy);  // "computing" until rank 0 is through (or `busy` is up)
      Tensor x = Tensor::full(Shape{elements}, 1.f);
      const auto t1 = Clock::now();
      try {
        c->allreduce(x, ReduceOp::kSum).wait();
        out.rank1_completed = true;
      } catch (const std::exception& e) {
        out.rank1_s = since(t1);
        throw;
      }
    } catch (const std::exception& e) {
      out.error1 = e.what();
    }
  });
  try {
    auto c = connect_tcp_group(t.options(addrs, 0, segment_bytes));
    Tensor x = Tensor::full(Shape{elements}, 1.f);
    Work w = c->allreduce(x, ReduceOp::kSum);
    std::this_thread::sleep_for(abort_after);
    const auto t0 = Clock::now();
    std::thread aborter([&] {
      c->abort("replica 1 of worker:0 failed (test)");
      out.abort_s = since(t0);
    });
    try {
      w.wait();
    } catch (const std::exception& e) {
      out.fail_s = since(t0);
      out.error0 = e.what();
    }
    aborter.join();
    rank0_done.set_value();
    peer.join();  // before the communicator closes its sockets: rank 1 fails on what it was sent
  } catch (...) {
    rank0_done.set_value();
    if (peer.joinable()) peer.join();
    throw;
  }
  return out;
}

TEST_P(TcpAbort, AnAbortEndsACollectiveWaitingOnABusyPeerAtOnce) {
  // 1 MB: sent whole into the socket buffers (or the ring), then the wait for the peer's half.
  const Outcome o =
      abort_while_peer_busy(*this, 1 << 18, 256 * 1024, std::chrono::milliseconds(200));
  EXPECT_NE(o.error0.find("replica 1 of worker:0 failed (test)"), std::string::npos) << o.error0;
  EXPECT_GE(o.fail_s, 0);
  EXPECT_LT(o.fail_s, 1.0) << "the collective waited for the peer instead of the abort";
  EXPECT_LT(o.abort_s, 1.0);
  EXPECT_FALSE(o.rank1_completed);
  EXPECT_NE(o.error1.find("worker:0 aborted the job"), std::string::npos) << o.error1;
  std::printf("failed %.3f s after the abort (abort() took %.3f s); rank 1: %s\n", o.fail_s,
              o.abort_s, o.error1.c_str());
}

TEST_P(TcpAbort, AnAbortInTheMiddleOfAFrameReturnsAtOnceAndEndsTheStream) {
  // 64 MB in frames of 16 MB: over the sockets, rank 0 blocks in the middle of a frame once the
  // socket buffers (8 MB each way here) are full: a frame smaller than a third of the send buffer
  // goes whole, as the default 1 MB does. 2 s leave it time to get there. abort() needs that
  // socket's send lock; the frame can never be finished. The peer, when it reads, must fail on the
  // ended stream at once, not take what follows as payload (it failed only on its collective
  // timeout then, having read heartbeats as data).
  const Outcome o = abort_while_peer_busy(*this, int64_t{1} << 24, size_t{16} << 20,
                                          std::chrono::milliseconds(2000));
  EXPECT_NE(o.error0.find("replica 1 of worker:0 failed (test)"), std::string::npos) << o.error0;
  EXPECT_LT(o.fail_s, 1.0);
  EXPECT_LT(o.abort_s, 1.0) << "abort() waited for the half-sent frame";
  EXPECT_FALSE(o.rank1_completed) << "rank 1 completed an all-reduce after rank 0 aborted";
  EXPECT_NE(o.error1.find(GetParam() ? "worker:0 aborted the job" : "closed during"),
            std::string::npos)
      << o.error1;
  EXPECT_GE(o.rank1_s, 0);
  EXPECT_LT(o.rank1_s, 2.0) << "rank 1 did not fail at once: " << o.error1;
  std::printf("failed %.3f s after the abort (abort() took %.3f s); rank 1: %s\n", o.fail_s,
              o.abort_s, o.error1.c_str());
}

}  // namespace
}  // namespace dtrain
