// The parameter servers' RPC (src/collectives/tcp/rpc.h) over real sockets on 127.0.0.1, server and
// clients on threads of this process: exact round trips of every dtype, pipelining, typed handler
// errors, concurrency and disconnect callbacks, authentication, deadlines and shutdown (malformed
// frames and fuzzing: rpc_wire_test.cc). Every wait is bounded.
#include <sys/time.h>

#include "collectives/rpc_test_util.h"
#include "collectives/tcp/tcp_environment.h"

namespace dtrain::tcp {
namespace {

using namespace std::chrono_literals;

TEST(Rpc, RoundTripOfEveryDtypeIsBytewiseExact) {
  const auto addrs = testing::free_loopback_addresses(2);
  RpcServer server(options(addrs, 0), echo);
  RpcClient client(options(addrs, 1), 0);
  EXPECT_EQ(client.server_name() + " " + client.server_address(), "ps:0 " + addrs[0]);
  RpcMessage req;
  req.method = 4242;
  req.meta = MetaWriter().u64(~0ull).i64(-7).u8(200).str(std::string("a\0b", 3)).take();
  uint64_t seed = 1;
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt32, DType::kInt64})
    for (const Shape& s :
         {Shape{3, 5}, Shape{}, Shape{0}, Shape{2, 0, 3}, Shape{1, 1, 1, 1, 1, 1, 1, 7}})
      req.tensors.push_back(random_tensor(s, t, seed++));  // incl. scalars, empties and rank 8
  req.tensors.push_back(random_tensor(Shape{5 << 20}, DType::kFloat32, 99));  // 20 MB
  const RpcMessage resp = client.call(req);
  EXPECT_EQ(resp.method, req.method);
  EXPECT_EQ(resp.meta, req.meta);
  ASSERT_EQ(resp.tensors.size(), req.tensors.size());
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const Tensor &a = resp.tensors[i], &b = req.tensors[i];
    ASSERT_TRUE(a.dtype() == b.dtype() && a.shape() == b.shape())
        << "tensor " << i << ": " << a.to_string();
    EXPECT_TRUE(a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0)
        << "tensor " << i;
  }
  const RpcMessage empty = client.call(RpcMessage{});  // no meta, no tensors
  EXPECT_TRUE(empty.method == 0 && empty.meta.empty() && empty.tensors.empty());
}

TEST(Rpc, PipelinedRequestsAreAnsweredInOrder) {
  const auto addrs = testing::free_loopback_addresses(2);
  RpcServer server(options(addrs, 0), [](const RpcMessage& m, int) {
    const auto x = static_cast<int64_t>(meta_u64(m));
    return RpcMessage{m.method,
                      u64_meta(static_cast<uint64_t>(x * x)),
                      {Tensor::from_vector<int64_t>({x, -x}, Shape{2})}};
  });
  RpcClient client(options(addrs, 1), 0);
  std::vector<uint64_t> ids;
  for (uint64_t x = 0; x < 100; ++x)
    ids.push_back(client.send(RpcMessage{static_cast<uint16_t>(x), u64_meta(x), {}}));
  for (size_t i = 1; i < ids.size(); ++i) ASSERT_GT(ids[i], ids[i - 1]);
  for (int64_t x = 0; x < 100; ++x) {
    std::vector<Tensor> into = {
        Tensor::zeros(Shape{x % 2 ? 2 : 3}, DType::kInt64)};  // odd x: received in place
    const RpcMessage r = client.receive(ids[static_cast<size_t>(x)], &into);
    EXPECT_EQ(r.method, x);
    EXPECT_EQ(meta_u64(r), static_cast<uint64_t>(x * x));
    ASSERT_EQ(r.tensors.size(), 1u);
    EXPECT_EQ(r.tensors[0].to_vector<int64_t>(), (std::vector<int64_t>{x, -x}));
    EXPECT_EQ(r.tensors[0].raw_data() == into[0].raw_data(), x % 2 == 1);
    EXPECT_TRUE(x % 2 == 1 || into[0].to_vector<int64_t>() ==
                                  std::vector<int64_t>(3, 0));  // a mismatch is untouched
  }
  // Skipping an answer (a fan-out that failed elsewhere) keeps the stream in step: the unread
  // answer is discarded; asking again for it, or for an id never sent, is InvalidArgument.
  const uint64_t a = client.send(RpcMessage{1, u64_meta(3), {}});
  const uint64_t b = client.send(RpcMessage{1, u64_meta(4), {}});
  EXPECT_EQ(meta_u64(client.receive(b)), 16u);
  EXPECT_TRUE(
      has(what_of<InvalidArgument>([&] { client.receive(a); }), "no such outstanding request"));
  EXPECT_TRUE(
      has(what_of<InvalidArgument>([&] { client.receive(b + 5); }), "no such outstanding request"));
  EXPECT_EQ(meta_u64(client.call(RpcMessage{1, u64_meta(5), {}})), 25u);
}

TEST(Rpc, HandlerErrorsComeBackTypedAndTheConnectionStaysUsable) {
  const auto addrs = testing::free_loopback_addresses(4);
  RpcServer server(options(addrs, 0), [](const RpcMessage& m, int) -> RpcMessage {
    switch (m.method) {
      case 1:
        throw InvalidArgument("shape [3] does not match [4]");
      case 2:
        throw NotFound("no variable 'dense/kernel'");
      case 3:
        throw Unavailable("shard 2 is restarting");
      case 4:
        throw DeadlineExceeded("lock wait: too long");
      case 5:
        throw FailedPrecondition("variable not initialised");
      case 6:
        throw PermissionDenied("read-only");
      case 7:
        throw DataLoss("checkpoint truncated");
      case 8:
        throw Unimplemented("method 8");
      case 9:
        throw Internal("invariant broken");
      case 10:
        throw std::runtime_error("plain: failure");
      case 11:
        return RpcMessage{11, "", {Tensor()}};  // a handler bug: an undefined tensor
      case 12:
        return RpcMessage{12, "", {Tensor::zeros(Shape{1 << 19}, DType::kFloat32)}};  // 2 MiB
      default:
        return m;
    }
  });
  RpcClient client(options(addrs, 1), 0);
  const std::string from = "ps:0 (" + addrs[0] + "): ";
  auto call = [&](uint16_t method) {
    return [&client, method] { client.call(RpcMessage{method, "", {}}); };
  };
  auto ok = [&] {
    EXPECT_EQ(client.call(RpcMessage{100, "ok", {Tensor::scalar(1.5f)}}).tensors.at(0).item(),
              1.5f);
  };
  // Each error, then a good call on the same connection (even after the transport-like types).
  EXPECT_EQ(what_of<InvalidArgument>(call(1)),
            "InvalidArgument: " + from + "shape [3] does not match [4]");
  ok();
  EXPECT_EQ(what_of<NotFound>(call(2)), "NotFound: " + from + "no variable 'dense/kernel'");
  EXPECT_EQ(what_of<Unavailable>(call(3)), "Unavailable: " + from + "shard 2 is restarting");
  ok();
  EXPECT_EQ(what_of<DeadlineExceeded>(call(4)),
            "DeadlineExceeded: " + from + "lock wait: too long");
  ok();
  EXPECT_EQ(what_of<FailedPrecondition>(call(5)),
            "FailedPrecondition: " + from + "variable not initialised");
  EXPECT_EQ(what_of<PermissionDenied>(call(6)), "PermissionDenied: " + from + "read-only");
  EXPECT_EQ(what_of<DataLoss>(call(7)), "DataLoss: " + from + "checkpoint truncated");
  ok();
  EXPECT_EQ(what_of<Unimplemented>(call(8)), "Unimplemented: " + from + "method 8");
  EXPECT_EQ(what_of<Internal>(call(9)), "Internal: " + from + "invariant broken");
  EXPECT_EQ(what_of<Internal>(call(10)), "Internal: " + from + "plain: failure");
  ok();
  // A handler answering with an undefined tensor is the server's bug: the server turns it into an
  // Internal error before anything goes on the wire, and the connection stays usable.
  EXPECT_EQ(
      what_of<Internal>(call(11)),
      "Internal: " + from + "the server's handler answered with an undefined or device tensor");
  ok();
  // An answer the client must refuse (over its frame bound) costs that connection only: the refusal
  // is DataLoss, every later call on that client is Unavailable naming the cause, and the other
  // connections, old and new, are still served.
  auto po = options(addrs, 2);
  po.max_frame_bytes = 1 << 20;
  RpcClient picky(po, 0);
  EXPECT_EQ(picky.call(RpcMessage{100, "small", {}}).meta, "small");
  EXPECT_TRUE(has(what_of<DataLoss>([&] {
                    picky.call(RpcMessage{12, "", {}});
                  }),
                  "over the limit of 1048576"));
  const Thrown after = what_of<Unavailable>([&] { picky.call(RpcMessage{100, "again", {}}); });
  EXPECT_TRUE(has(after, "unusable after an earlier failure"));
  EXPECT_TRUE(has(after, "over the limit of 1048576"));
  ok();
  RpcClient other(options(addrs, 3), 0);
  EXPECT_EQ(other.call(RpcMessage{100, "still serving", {}}).meta, "still serving");
}

TEST(Rpc, ConcurrentClientsAreCountedExactlyAndDisconnectOnce) {
  const auto addrs = testing::free_loopback_addresses(5);
  std::mutex mu;
  uint64_t counter = 0;
  Map calls_by_rank;
  Disconnects gone;
  RpcServer server(
      options(addrs, 0),
      [&](const RpcMessage& m, int rank) {
        std::lock_guard<std::mutex> l(mu);
        ++calls_by_rank[rank];
        return RpcMessage{m.method, u64_meta(++counter), {}};
      },
      gone.callback());
  std::vector<std::unique_ptr<RpcClient>> clients;
  for (int r = 1; r <= 4; ++r) clients.push_back(std::make_unique<RpcClient>(options(addrs, r), 0));
  EXPECT_EQ(server.connections(), 4);
  std::vector<std::string> errs(4);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < 4; ++i)
    ts.emplace_back([&, i] {
      try {
        for (uint64_t k = 0, last = 0, c; k < 500; ++k, last = c)
          if ((c = meta_u64(clients[i]->call(RpcMessage{7, "", {}}))) <= last)
            throw Internal("the count went backwards");
      } catch (const std::exception& e) {
        errs[i] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (const auto& e : errs) EXPECT_EQ(e, "");
  EXPECT_EQ(counter, 2000u);
  EXPECT_EQ(calls_by_rank, (Map{{1, 500}, {2, 500}, {3, 500}, {4, 500}}));
  EXPECT_TRUE(gone.get().empty());
  clients.clear();
  EXPECT_TRUE(wait_until([&] { return gone.get().size() == 4 && server.connections() == 0; }))
      << server.connections();
  server.stop();
  EXPECT_EQ(gone.get(), (Map{{1, 1}, {2, 1}, {3, 1}, {4, 1}}));
}

TEST(Rpc, WrongTokenOrClusterIsRefusedAndTheServerKeepsServing) {
  const auto addrs = testing::free_loopback_addresses(3);
  Disconnects gone;
  RpcServer server(options(addrs, 0), echo, gone.callback());
  const Thrown bad_token = what_of<PermissionDenied>(
      [&] { RpcClient c(options(addrs, 1, "another-jobs-token-999"), 0); });
  EXPECT_TRUE(
      has(bad_token, "PermissionDenied: ps:0 (" + addrs[0] + ") refused this task's job token"));
  auto other = addrs;
  other[2] = "127.0.0.1:1";  // same size, different job fingerprint
  EXPECT_TRUE(
      has(what_of<PermissionDenied>([&] { RpcClient c(options(other, 1), 0); }), "job mismatch"));
  auto bigger = addrs;
  bigger.push_back("127.0.0.1:2");
  EXPECT_TRUE(has(what_of<PermissionDenied>([&] { RpcClient c(options(bigger, 1), 0); }),
                  "world size mismatch"));
  // Usage errors are InvalidArgument before any connection; a taken port is Unavailable.
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { RpcClient c(options(addrs, 1, "short"), 0); }),
                  "16 characters"));
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { RpcClient c(options(addrs, 1), 1); }),
                  "bad server index 1"));
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { RpcServer s(options(addrs, 0, "short"), echo); }),
                  "16 characters"));
  EXPECT_TRUE(has(what_of<Unavailable>([&] { RpcServer s(options(addrs, 0), echo); }),
                  "cannot listen on " + addrs[0]));
  EXPECT_EQ(RpcClient(options(addrs, 2), 0).call(RpcMessage{3, "hello", {}}).meta, "hello");
  server.stop();
  EXPECT_EQ(gone.get(), (Map{{2, 1}}));  // refused connections never were clients
}

TEST(Rpc, SlowHandlerIsADeadlineAndShutdownIsUnavailable) {
  const auto addrs = testing::free_loopback_addresses(3);
  Disconnects gone;
  RpcServer server(
      options(addrs, 0),
      [](const RpcMessage& m, int) {
        if (m.method == 1) std::this_thread::sleep_for(900ms);
        return m;
      },
      gone.callback());
  auto co = options(addrs, 1);
  co.collective.timeout = 300ms;
  RpcClient client(co, 0), idle(options(addrs, 2), 0);
  EXPECT_EQ(client.call(RpcMessage{2, "fast", {}}).meta, "fast");
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<DeadlineExceeded>([&] {
                    client.call(RpcMessage{1, "slow", {}});
                  }),
                  "ps:0 (" + addrs[0] + ")"));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 1s);
  // Intended: a late answer would desynchronise the stream, so the client refuses further use.
  EXPECT_TRUE(has(what_of<Unavailable>([&] { client.call(RpcMessage{2, "again", {}}); }), "ps:0"));
  // Shutdown (waits for the slow handler) while `idle` is connected: its next call is Unavailable.
  EXPECT_EQ(idle.call(RpcMessage{2, "x", {}}).meta, "x");
  server.stop();
  server.stop();  // idempotent
  EXPECT_EQ(gone.get(), (Map{{1, 1}, {2, 1}}));
  EXPECT_EQ(server.connections(), 0);
  t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<Unavailable>([&] {
                    idle.call(RpcMessage{2, "y", {}});
                  }),
                  "ps:0 (" + addrs[0] + ")"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
}

TEST(Rpc, ABusyServerKeepsItsClientWaitingASilentOneIsNamedAfterTheHeartbeatTimeout) {
  // The server's heartbeats (every 100 ms) keep a client waiting 1.2 s for a slow answer under a
  // 400 ms heartbeat timeout; a server that sends none (its heartbeats an hour apart, as when it is
  // SIGSTOPped or its link is down) is named Unavailable after the heartbeat timeout, not the
  // collective timeout.
  const auto addrs = testing::free_loopback_addresses(4);
  auto slow = [](const RpcMessage& m, int) {
    if (m.method == 1) std::this_thread::sleep_for(1200ms);
    return m;
  };
  auto so = options(addrs, 0);
  so.heartbeat_interval = 100ms;
  RpcServer busy(so, slow);
  auto co = options(addrs, 1);
  co.heartbeat_timeout = 400ms;
  RpcClient client(co, 0);
  EXPECT_EQ(client.call(RpcMessage{1, "slow but alive", {}}).meta, "slow but alive");

  const std::vector<std::string> other{addrs[3], addrs[1], addrs[2]};  // ps:0 = a second server
  auto quiet = options(other, 0);
  quiet.heartbeat_interval = std::chrono::hours(1);
  RpcServer silent(quiet, slow);
  auto c2 = options(other, 1);
  c2.heartbeat_timeout = 400ms;
  RpcClient waiting(c2, 0);
  const auto t0 = std::chrono::steady_clock::now();
  const Thrown e = what_of<Unavailable>([&] { waiting.call(RpcMessage{1, "never", {}}); });
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(has(e, "ps:0 (" + other[0] + ") sent nothing, not even a heartbeat, for 400 ms"))
      << e;
  EXPECT_GE(took, 350ms);
  EXPECT_LT(took, 1100ms);
}

TEST(Rpc, UnreachableServerIsADeadlineNamingIt) {
  const auto addrs = testing::free_loopback_addresses(2);  // nobody listens on addrs[0]
  auto o = options(addrs, 1);
  o.connect_timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<DeadlineExceeded>([&] { RpcClient c(o, 0); }),
                  "worker:0 could not reach ps:0 (" + addrs[0] + ") within 500 ms"));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 450ms);
  EXPECT_LT(took, 2s);
}

TEST(Rpc, ConnectTimeoutHoldsWhenTheServerDropsConnections) {
  // A peer that drops SYNs (a host down, a firewall, a full accept queue): the connect is bounded
  // by connect_timeout (a blocking connect once waited 134 s here for 500 ms).
  const auto addrs = testing::free_loopback_addresses(2);
  const int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_in a = loopback(std::stoi(addrs[0].substr(addrs[0].rfind(':') + 1)));
  ASSERT_EQ(::bind(l, reinterpret_cast<const sockaddr*>(&a), sizeof(a)), 0);
  ::listen(l, 0);  // never accepts; fill its queue so that further SYNs are dropped
  std::vector<int> fill(8);
  for (int& fd : fill) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  }
  auto o = options(addrs, 1);
  o.connect_timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<DeadlineExceeded>([&] { RpcClient c(o, 0); }), "could not reach ps:0"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  for (int fd : fill) ::close(fd);
  ::close(l);
}

// A job relaunched at once: the port's previous owner still listens, accepts the client's first
// connection and drops it before any handshake, then goes; the client dials again and reaches the
// real server (a chaos run's relaunch failed on this, in the collective mesh's same dial loop).
TEST(Rpc, AConnectionDroppedBeforeTheHandshakeIsDialedAgain) {
  const auto addrs = testing::free_loopback_addresses(2);
  const int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in a = loopback(std::stoi(addrs[0].substr(addrs[0].rfind(':') + 1)));
  ASSERT_EQ(::bind(l, reinterpret_cast<const sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(l, 8), 0);
  const timeval limit{20, 0};  // accept() gives up after 20 s rather than hang the test
  ::setsockopt(l, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  std::string err;
  std::thread client([&] {
    try {
      RpcClient c(options(addrs, 1), 0);
      EXPECT_EQ(c.call(RpcMessage{7, "x", {}}).meta, "x");
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  const int dropped = ::accept(l, nullptr, nullptr);
  EXPECT_GE(dropped, 0);
  if (dropped >= 0) {
    const linger hard{1, 0};  // an RST, as from a process killed with connections in its backlog
    ::setsockopt(dropped, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
    ::close(dropped);
  }
  ::close(l);
  std::this_thread::sleep_for(300ms);
  {
    RpcServer server(options(addrs, 0), echo);
    client.join();
  }
  EXPECT_EQ(err, "");
}

// DTRAIN_HEARTBEAT_TIMEOUT shortens (or lengthens) the time after which a silent peer is hung, for
// every TCP group; heartbeats follow at a quarter of it. Malformed values are refused by name.
TEST(Rpc, HeartbeatTimeoutFromTheEnvironment) {
  const TcpGroupOptions defaults;
  ::unsetenv("DTRAIN_HEARTBEAT_TIMEOUT");
  EXPECT_EQ(apply_tcp_environment(defaults).heartbeat_timeout, defaults.heartbeat_timeout);
  ::setenv("DTRAIN_HEARTBEAT_TIMEOUT", "1.5", 1);
  const TcpGroupOptions o = apply_tcp_environment(defaults);
  EXPECT_EQ(o.heartbeat_timeout, 1500ms);
  EXPECT_EQ(o.heartbeat_interval, 375ms);
  ::setenv("DTRAIN_HEARTBEAT_TIMEOUT", "60", 1);
  EXPECT_EQ(apply_tcp_environment(defaults).heartbeat_interval, defaults.heartbeat_interval);
  for (const char* bad : {"abc", "0", "-2", "1s", "nan"}) {
    ::setenv("DTRAIN_HEARTBEAT_TIMEOUT", bad, 1);
    EXPECT_TRUE(has(what_of<InvalidArgument>([&] { apply_tcp_environment(defaults); }),
                    std::string("DTRAIN_HEARTBEAT_TIMEOUT='") + bad + "' must be"))
        << bad;
  }
  // A client built under it is told about a server that sends no heartbeat after 400 ms.
  ::unsetenv("DTRAIN_HEARTBEAT_TIMEOUT");
  const auto addrs = testing::free_loopback_addresses(2);
  auto quiet = options(addrs, 0);
  quiet.heartbeat_interval = std::chrono::hours(1);
  RpcServer server(quiet, [](const RpcMessage& m, int) {
    std::this_thread::sleep_for(1200ms);
    return m;
  });
  ::setenv("DTRAIN_HEARTBEAT_TIMEOUT", "0.4", 1);
  RpcClient client(options(addrs, 1), 0);
  ::unsetenv("DTRAIN_HEARTBEAT_TIMEOUT");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<Unavailable>([&] {
                    client.call(RpcMessage{1, "never", {}});
                  }),
                  "sent nothing, not even a heartbeat, for 400 ms"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1100ms);
}

}  // namespace
}  // namespace dtrain::tcp
