// The elastic rendezvous (dtrain/train/elastic.h) with real sockets on 127.0.0.1: who is in a round
// and in which order, when a round forms, what a worker asks between rounds, and the refusals.
#include <gtest/gtest.h>

#include <cstdlib>
#include <future>
#include <thread>

#include "dtrain/core/error.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/train/callbacks.h"
#include "dtrain/train/elastic.h"
#include "testing/ports.h"

namespace dtrain::elastic {
namespace {

const std::string kToken = "elastic-rendezvous-test-token-0123456789";

struct Fixture {
  std::string address = testing::free_loopback_addresses(1)[0];
  std::unique_ptr<RendezvousServer> server;
  explicit Fixture(int min_np, int max_np, int settle_ms = 300) {
    RendezvousOptions o;
    o.address = address;
    o.token = kToken;
    o.min_np = min_np;
    o.max_np = max_np;
    o.settle = std::chrono::milliseconds(settle_ms);
    server = std::make_unique<RendezvousServer>(o);
  }
  // A worker's Job as dtrain-run would start it (the environment is read by the constructor).
  std::unique_ptr<Job> job(int id, const std::string& token = kToken, int timeout_s = 20) {
    ::setenv("DTRAIN_ELASTIC_RENDEZVOUS", address.c_str(), 1);
    ::setenv("DTRAIN_ELASTIC_ID", std::to_string(id).c_str(), 1);
    // A free port: the one test that trains listens on it (a fixed one collided with other tests
    // under ctest -j2).
    ::setenv("DTRAIN_ELASTIC_ADDRESS", testing::free_loopback_addresses(1)[0].c_str(), 1);
    ::setenv("DTRAIN_JOB_TOKEN", token.c_str(), 1);
    ::setenv("DTRAIN_ELASTIC_TIMEOUT", std::to_string(timeout_s).c_str(), 1);
    server->expect(id);
    return std::make_unique<Job>();
  }
};

// Joins on a thread; the round is read from the Job afterwards.
std::future<void> join_async(Job& j) {
  return std::async(std::launch::async, [&j] { j.join(); });
}

TEST(ElasticRendezvous, FirstRoundWaitsForEveryStartedWorkerAndRanksThemById) {
  Fixture f(2, 3);
  auto a = f.job(0), b = f.job(1), c = f.job(2);
  auto fa = join_async(*a), fb = join_async(*b);
  // Two of three have come: the round waits for the third, which was started (settle is 300 ms).
  EXPECT_EQ(fa.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  auto fc = join_async(*c);
  fa.get(), fb.get(), fc.get();
  for (Job* j : {a.get(), b.get(), c.get()}) {
    EXPECT_EQ(j->membership().generation, 1);
    EXPECT_EQ(j->membership().ids, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(j->membership().addresses.size(), 3u);
  }
  EXPECT_EQ(a->membership().rank, 0);
  EXPECT_EQ(c->membership().rank, 2);
  EXPECT_EQ(a->token(), kToken + "/elastic-round-1");
  EXPECT_EQ(f.server->generation(), 1);
  EXPECT_FALSE(a->membership_changing());
}

TEST(ElasticRendezvous, SurvivorsComeFirstThenNewcomers) {
  Fixture f(2, 3);
  auto a = f.job(0), b = f.job(1), c = f.job(2);
  {
    auto fa = join_async(*a), fb = join_async(*b), fc = join_async(*c);
    fa.get(), fb.get(), fc.get();
  }
  // Worker 0 (rank 0) is lost; a newcomer with id 3 is started.
  f.server->lost(0);
  a.reset();
  auto d = f.job(3);
  EXPECT_TRUE(b->membership_changing());
  auto fd = join_async(*d), fc = join_async(*c), fb = join_async(*b);
  fb.get(), fc.get(), fd.get();
  EXPECT_EQ(b->membership().generation, 2);
  EXPECT_EQ(b->membership().ids,
            (std::vector<int>{1, 2, 3}));  // survivors in their old order, then the newcomer
  EXPECT_EQ(b->membership().rank, 0);      // rank 0 holds a committed state
  EXPECT_EQ(d->membership().rank, 2);
  EXPECT_EQ(d->token(), kToken + "/elastic-round-2");
}

TEST(ElasticRendezvous, AtMostMaxNpAndAHungWorkerIsLeftOutAfterTheSettleTime) {
  Fixture f(1, 2, /*settle_ms=*/300);
  auto a = f.job(0, kToken, 2), b = f.job(1, kToken, 2), c = f.job(2, kToken, 2);
  f.job(3, kToken, 2);  // started but never joins (a hung process): the round forms without it
  auto fa = join_async(*a), fb = join_async(*b), fc = join_async(*c);
  int formed = 0, refused = 0;
  for (auto* fu : {&fa, &fb, &fc}) {
    try {
      fu->get();
      ++formed;
    } catch (const DeadlineExceeded& e) {
      ++refused;  // the third waits for a round that never comes
      EXPECT_NE(std::string(e.what()).find("no round of at least --min-np workers formed"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(formed, 2);
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(f.server->workers(), 2);
}

TEST(ElasticRendezvous, TooFewWorkersTimeOutNamingWhy) {
  Fixture f(2, 3);
  auto a = f.job(0, kToken, 1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(a->join(), DeadlineExceeded);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(ElasticRendezvous, NewcomersAloneAreRefusedWhenTheStateIsGone) {
  Fixture f(1, 2);
  auto a = f.job(0);
  a->join();
  f.server->lost(0);
  a.reset();
  auto b = f.job(1);
  try {
    b->join();
    FAIL() << "a round of newcomers only formed";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("state"), std::string::npos) << e.what();
  }
}

TEST(ElasticRendezvous, RefusesAWrongTokenAndMissingSettings) {
  Fixture f(1, 2);
  EXPECT_THROW(f.job(0, "a-different-token-for-another-job-xx"), PermissionDenied);
  ::unsetenv("DTRAIN_ELASTIC_RENDEZVOUS");
  try {
    Job j;
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_ELASTIC_RENDEZVOUS"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("dtrain-run --min-np"), std::string::npos);
  }
  ::setenv("DTRAIN_ELASTIC_RENDEZVOUS", f.address.c_str(), 1);
  ::setenv("DTRAIN_ELASTIC_ID", "64", 1);
  EXPECT_THROW(Job(), InvalidArgument);
  ::setenv("DTRAIN_ELASTIC_ID", "1", 1);
  ::setenv("DTRAIN_JOB_TOKEN", kToken.c_str(), 1);
  Job j;
  EXPECT_THROW(j.token(), FailedPrecondition);  // the token belongs to a round: join() first
}

TEST(ElasticRun, RefusesAStrategyThatBroadcastsInitialValuesBeforeAnyCollective) {
  Fixture f(1, 1);
  auto a = f.job(0);
  const ClusterResolution cluster = a->join();
  for (const bool broadcast : {true, false}) {
    CommunicationOptions comm;
    comm.broadcast_initial_values = broadcast;
    MultiWorkerMirroredStrategy s({}, comm, cluster, a->token());
    Sequential model;
    std::unique_ptr<SGD> opt;
    {
      auto scope = s.scope();
      model.add(std::make_shared<Dense>(2));
      opt = std::make_unique<SGD>(0.1f);
    }
    bool trained = false;
    auto train = [&](Callback&) { trained = true; };
    try {
      run(*a, s, model, *opt, train);
      FAIL() << "ran with broadcast_initial_values=" << broadcast;
    } catch (const FailedPrecondition& e) {
      // true: the strategy is refused; false: the model is not built yet. Neither trains.
      EXPECT_NE(std::string(e.what()).find(broadcast ? "broadcast_initial_values = false"
                                                     : "build the model first"),
                std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(trained);
  }
}

TEST(ElasticRendezvous, RefusesBadBounds) {
  RendezvousOptions o;
  o.address = testing::free_loopback_addresses(1)[0];
  o.token = kToken;
  o.min_np = 3;
  o.max_np = 2;
  EXPECT_THROW(RendezvousServer{o}, InvalidArgument);
}

}  // namespace
}  // namespace dtrain::elastic
