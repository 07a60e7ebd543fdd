// The parameter servers' RPC (src/collectives/tcp/rpc.h) over real sockets on 127.0.0.1, server and
// clients on threads of this process: exact round trips of every dtype, pipelining, typed handler
// errors, concurrency and disconnect callbacks, authentication, garbage and malformed frames (before
// and after the handshake; fed to the wire helpers over a socketpair; fuzzed), MetaReader bounds,
// deadlines and shutdown. Every wait is bounded.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <ostream>
#include <random>
#include <thread>
#include <typeinfo>

#include "collectives/tcp/auth.h"
#include "collectives/tcp/rpc.h"
#include "testing/ports.h"

// The largest operator-new request (string/vector memory): the fuzz test asserts that no malformed
// length becomes a huge allocation. Delete is noinline so GCC does not pair free() with new and warn.
static std::atomic<size_t> g_largest_new{0};
void* operator new(size_t n) {
  for (size_t seen = g_largest_new.load(); n > seen && !g_largest_new.compare_exchange_weak(seen, n);) {
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace dtrain::tcp {
namespace {

using namespace std::chrono_literals;
using Map = std::map<int, int>;
const std::string kToken = "rpc-test-job-token-0123456789";

// addresses = {ps:0, worker:0, worker:1, ...}; rank = index.
TcpGroupOptions options(const std::vector<std::string>& addrs, int rank, const std::string& token = kToken) {
  TcpGroupOptions o;
  o.rank = rank;
  o.addresses = addrs;
  o.task_names = {"ps:0"};
  for (size_t i = 1; i < addrs.size(); ++i) o.task_names.push_back("worker:" + std::to_string(i - 1));
  o.token = token;
  o.connect_timeout = 5s;
  o.collective.timeout = 10s;
  return o;
}

RpcMessage echo(const RpcMessage& m, int) { return m; }

struct Disconnects {  // disconnect callbacks by client rank
  std::mutex mu;
  Map by_rank;
  RpcDisconnect callback() { return [this](int r) { std::lock_guard<std::mutex> l(mu); ++by_rank[r]; }; }
  Map get() { std::lock_guard<std::mutex> l(mu); return by_rank; }
};

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds limit = 5s) {
  for (const auto end = std::chrono::steady_clock::now() + limit; !pred(); std::this_thread::sleep_for(5ms))
    if (std::chrono::steady_clock::now() > end) return false;
  return true;
}

// What f threw. `typed`: it threw an E and `what` is its what(); otherwise `what` says what it threw
// instead (or that it threw nothing), and no comparison with a message succeeds, so a wrong type
// with the right text fails.
struct Thrown {
  bool threw = false;
  bool typed = false;
  std::string what;
  friend bool operator==(const Thrown& t, const std::string& message) { return t.typed && t.what == message; }
  friend std::ostream& operator<<(std::ostream& os, const Thrown& t) {
    return os << (t.typed ? "" : t.threw ? "[WRONG EXCEPTION TYPE] " : "[NO EXCEPTION] ") << t.what;
  }
};

template <typename E>
Thrown what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return {true, true, e.what()};
  } catch (const std::exception& e) {
    return {true, false, std::string(typeid(e).name()) + ": " + e.what()};
  }
  return {false, false, ""};
}

// An E was thrown and its message contains `part`.
::testing::AssertionResult has(const Thrown& t, const std::string& part) {
  if (!t.typed) return ::testing::AssertionFailure() << "not the expected exception type: " << t;
  if (t.what.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << t.what << "' does not contain '" << part << "'";
}

Tensor random_tensor(const Shape& s, DType t, uint64_t seed) {
  Tensor x = Tensor::empty(s, t);
  std::mt19937_64 rng(seed);
  auto* b = static_cast<unsigned char*>(x.raw_data());
  for (size_t i = 0; i < x.nbytes(); ++i) b[i] = static_cast<unsigned char>(rng());
  return x;
}

std::string u64_meta(uint64_t v) { return MetaWriter().u64(v).take(); }
uint64_t meta_u64(const RpcMessage& m) {
  MetaReader r(m.meta, "test meta");
  const uint64_t v = r.u64();
  r.expect_end();
  return v;
}

TEST(Rpc, RoundTripOfEveryDtypeIsBytewiseExact) {
  const auto addrs = testing::free_loopback_addresses(2);
  RpcServer server(options(addrs, 0), echo);
  RpcClient client(options(addrs, 1), 0);
  EXPECT_EQ(client.server_name() + " " + client.server_address(), "ps:0 " + addrs[0]);
  RpcMessage req;
  req.method = 4242;
  req.meta = MetaWriter().u64(~0ull).i64(-7).u8(200).str(std::string("a\0b", 3)).take();
  uint64_t seed = 1;
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt64})
    for (const Shape& s : {Shape{3, 5}, Shape{}, Shape{0}, Shape{2, 0, 3}, Shape{1, 1, 1, 1, 1, 1, 1, 7}})
      req.tensors.push_back(random_tensor(s, t, seed++));  // incl. scalars, empties and rank 8
  req.tensors.push_back(random_tensor(Shape{5 << 20}, DType::kFloat32, 99));  // 20 MB
  const RpcMessage resp = client.call(req);
  EXPECT_EQ(resp.method, req.method);
  EXPECT_EQ(resp.meta, req.meta);
  ASSERT_EQ(resp.tensors.size(), req.tensors.size());
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const Tensor &a = resp.tensors[i], &b = req.tensors[i];
    ASSERT_TRUE(a.dtype() == b.dtype() && a.shape() == b.shape()) << "tensor " << i << ": " << a.to_string();
    EXPECT_TRUE(a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0) << "tensor " << i;
  }
  const RpcMessage empty = client.call(RpcMessage{});  // no meta, no tensors
  EXPECT_TRUE(empty.method == 0 && empty.meta.empty() && empty.tensors.empty());
}

TEST(Rpc, PipelinedRequestsAreAnsweredInOrder) {
  const auto addrs = testing::free_loopback_addresses(2);
  RpcServer server(options(addrs, 0), [](const RpcMessage& m, int) {
    const auto x = static_cast<int64_t>(meta_u64(m));
    return RpcMessage{m.method, u64_meta(static_cast<uint64_t>(x * x)), {Tensor::from_vector<int64_t>({x, -x}, Shape{2})}};
  });
  RpcClient client(options(addrs, 1), 0);
  std::vector<uint64_t> ids;
  for (uint64_t x = 0; x < 100; ++x) ids.push_back(client.send(RpcMessage{static_cast<uint16_t>(x), u64_meta(x), {}}));
  for (size_t i = 1; i < ids.size(); ++i) ASSERT_GT(ids[i], ids[i - 1]);
  for (int64_t x = 0; x < 100; ++x) {
    std::vector<Tensor> into = {Tensor::zeros(Shape{x % 2 ? 2 : 3}, DType::kInt64)};  // odd x: received in place
    const RpcMessage r = client.receive(ids[static_cast<size_t>(x)], &into);
    EXPECT_EQ(r.method, x);
    EXPECT_EQ(meta_u64(r), static_cast<uint64_t>(x * x));
    ASSERT_EQ(r.tensors.size(), 1u);
    EXPECT_EQ(r.tensors[0].to_vector<int64_t>(), (std::vector<int64_t>{x, -x}));
    EXPECT_EQ(r.tensors[0].raw_data() == into[0].raw_data(), x % 2 == 1);
    EXPECT_TRUE(x % 2 == 1 || into[0].to_vector<int64_t>() == std::vector<int64_t>(3, 0));  // a mismatch is untouched
  }
  // Skipping an answer (a fan-out that failed elsewhere) keeps the stream in step: the unread
  // answer is discarded; asking again for it, or for an id never sent, is InvalidArgument.
  const uint64_t a = client.send(RpcMessage{1, u64_meta(3), {}});
  const uint64_t b = client.send(RpcMessage{1, u64_meta(4), {}});
  EXPECT_EQ(meta_u64(client.receive(b)), 16u);
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { client.receive(a); }), "no such outstanding request"));
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { client.receive(b + 5); }), "no such outstanding request"));
  EXPECT_EQ(meta_u64(client.call(RpcMessage{1, u64_meta(5), {}})), 25u);
}

TEST(Rpc, HandlerErrorsComeBackTypedAndTheConnectionStaysUsable) {
  const auto addrs = testing::free_loopback_addresses(4);
  RpcServer server(options(addrs, 0), [](const RpcMessage& m, int) -> RpcMessage {
    switch (m.method) {
      case 1: throw InvalidArgument("shape [3] does not match [4]");
      case 2: throw NotFound("no variable 'dense/kernel'");
      case 3: throw Unavailable("shard 2 is restarting");
      case 4: throw DeadlineExceeded("lock wait: too long");
      case 5: throw FailedPrecondition("variable not initialised");
      case 6: throw PermissionDenied("read-only");
      case 7: throw DataLoss("checkpoint truncated");
      case 8: throw Unimplemented("method 8");
      case 9: throw Internal("invariant broken");
      case 10: throw std::runtime_error("plain: failure");
      case 11: return RpcMessage{11, "", {Tensor()}};  // a handler bug: an undefined tensor
      case 12: return RpcMessage{12, "", {Tensor::zeros(Shape{1 << 19}, DType::kFloat32)}};  // 2 MiB
      default: return m;
    }
  });
  RpcClient client(options(addrs, 1), 0);
  const std::string from = "ps:0 (" + addrs[0] + "): ";
  auto call = [&](uint16_t method) { return [&client, method] { client.call(RpcMessage{method, "", {}}); }; };
  auto ok = [&] { EXPECT_EQ(client.call(RpcMessage{100, "ok", {Tensor::scalar(1.5f)}}).tensors.at(0).item(), 1.5f); };
  // Each error, then a good call on the same connection (even after the transport-like types).
  EXPECT_EQ(what_of<InvalidArgument>(call(1)), "InvalidArgument: " + from + "shape [3] does not match [4]");
  ok();
  EXPECT_EQ(what_of<NotFound>(call(2)), "NotFound: " + from + "no variable 'dense/kernel'");
  EXPECT_EQ(what_of<Unavailable>(call(3)), "Unavailable: " + from + "shard 2 is restarting");
  ok();
  EXPECT_EQ(what_of<DeadlineExceeded>(call(4)), "DeadlineExceeded: " + from + "lock wait: too long");
  ok();
  EXPECT_EQ(what_of<FailedPrecondition>(call(5)), "FailedPrecondition: " + from + "variable not initialised");
  EXPECT_EQ(what_of<PermissionDenied>(call(6)), "PermissionDenied: " + from + "read-only");
  EXPECT_EQ(what_of<DataLoss>(call(7)), "DataLoss: " + from + "checkpoint truncated");
  ok();
  EXPECT_EQ(what_of<Unimplemented>(call(8)), "Unimplemented: " + from + "method 8");
  EXPECT_EQ(what_of<Internal>(call(9)), "Internal: " + from + "invariant broken");
  EXPECT_EQ(what_of<Internal>(call(10)), "Internal: " + from + "plain: failure");
  ok();
  // A handler answering with an undefined tensor is the server's bug: the server turns it into an
  // Internal error before anything goes on the wire, and the connection stays usable.
  EXPECT_EQ(what_of<Internal>(call(11)), "Internal: " + from + "the server's handler answered with an undefined or device tensor");
  ok();
  // An answer the client must refuse (over its frame bound) costs that connection only: the refusal
  // is DataLoss, every later call on that client is Unavailable naming the cause, and the other
  // connections, old and new, are still served.
  auto po = options(addrs, 2);
  po.max_frame_bytes = 1 << 20;
  RpcClient picky(po, 0);
  EXPECT_EQ(picky.call(RpcMessage{100, "small", {}}).meta, "small");
  EXPECT_TRUE(has(what_of<DataLoss>([&] { picky.call(RpcMessage{12, "", {}}); }), "over the limit of 1048576"));
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
  RpcServer server(options(addrs, 0), [&](const RpcMessage& m, int rank) {
    std::lock_guard<std::mutex> l(mu);
    ++calls_by_rank[rank];
    return RpcMessage{m.method, u64_meta(++counter), {}};
  }, gone.callback());
  std::vector<std::unique_ptr<RpcClient>> clients;
  for (int r = 1; r <= 4; ++r) clients.push_back(std::make_unique<RpcClient>(options(addrs, r), 0));
  EXPECT_EQ(server.connections(), 4);
  std::vector<std::string> errs(4);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < 4; ++i)
    ts.emplace_back([&, i] {
      try {
        for (uint64_t k = 0, last = 0, c; k < 500; ++k, last = c)
          if ((c = meta_u64(clients[i]->call(RpcMessage{7, "", {}}))) <= last) throw Internal("the count went backwards");
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
  EXPECT_TRUE(wait_until([&] { return gone.get().size() == 4 && server.connections() == 0; })) << server.connections();
  server.stop();
  EXPECT_EQ(gone.get(), (Map{{1, 1}, {2, 1}, {3, 1}, {4, 1}}));
}

TEST(Rpc, WrongTokenOrClusterIsRefusedAndTheServerKeepsServing) {
  const auto addrs = testing::free_loopback_addresses(3);
  Disconnects gone;
  RpcServer server(options(addrs, 0), echo, gone.callback());
  const Thrown bad_token = what_of<PermissionDenied>([&] { RpcClient c(options(addrs, 1, "another-jobs-token-999"), 0); });
  EXPECT_TRUE(has(bad_token, "PermissionDenied: ps:0 (" + addrs[0] + ") refused this task's job token"));
  auto other = addrs;
  other[2] = "127.0.0.1:1";  // same size, different job fingerprint
  EXPECT_TRUE(has(what_of<PermissionDenied>([&] { RpcClient c(options(other, 1), 0); }), "job mismatch"));
  auto bigger = addrs;
  bigger.push_back("127.0.0.1:2");
  EXPECT_TRUE(has(what_of<PermissionDenied>([&] { RpcClient c(options(bigger, 1), 0); }), "world size mismatch"));
  // Usage errors are InvalidArgument before any connection; a taken port is Unavailable.
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { RpcClient c(options(addrs, 1, "short"), 0); }), "16 characters"));
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { RpcClient c(options(addrs, 1), 1); }), "bad server index 1"));
  EXPECT_TRUE(has(what_of<InvalidArgument>([&] { RpcServer s(options(addrs, 0, "short"), echo); }), "16 characters"));
  EXPECT_TRUE(has(what_of<Unavailable>([&] { RpcServer s(options(addrs, 0), echo); }), "cannot listen on " + addrs[0]));
  EXPECT_EQ(RpcClient(options(addrs, 2), 0).call(RpcMessage{3, "hello", {}}).meta, "hello");
  server.stop();
  EXPECT_EQ(gone.get(), (Map{{2, 1}}));  // refused connections never were clients
}

sockaddr_in loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

int raw_connect(const std::string& address) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_in a = loopback(std::stoi(address.substr(address.rfind(':') + 1)));
  EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
  return fd;
}

// Connects, sends, half-closes and reads until the server closes, so that the server really parses
// the bytes (closing at once could reset the connection first). False if it stayed open for 3 s.
bool server_closes_after(const std::string& address, const std::string& bytes) {
  const int fd = raw_connect(address);
  for (size_t off = 0; off < bytes.size();) {
    const ssize_t w = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (w <= 0) break;  // the server may close first: fine
    off += static_cast<size_t>(w);
  }
  ::shutdown(fd, SHUT_WR);
  char buf[4096];
  bool closed = false;
  for (const auto end = std::chrono::steady_clock::now() + 3s; !closed && std::chrono::steady_clock::now() < end;) {
    pollfd pfd{fd, POLLIN, 0};
    closed = ::poll(&pfd, 1, 100) > 0 && ::recv(fd, buf, sizeof(buf), 0) <= 0;
  }
  ::close(fd);
  return closed;
}

// A frame: header (kind, count, payload_bytes = body size unless given) + body.
std::string frame(uint64_t count, const std::string& body, FrameKind kind = FrameKind::kRequest, uint64_t payload = ~0ull) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(kind);
  h.seq = 1;
  h.count = count;
  h.payload_bytes = payload == ~0ull ? body.size() : payload;
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h)) + body;
}

struct Body {  // the parts of a request body
  std::string s;
  template <typename T>
  Body& put(T v) { s.append(reinterpret_cast<const char*>(&v), sizeof(v)); return *this; }
  Body& spec(uint8_t dtype, const std::vector<int64_t>& dims) {
    put<uint8_t>(dtype).put<uint8_t>(static_cast<uint8_t>(dims.size()));
    for (int64_t d : dims) put(d);
    return *this;
  }
  Body& bytes(size_t n) { s.append(n, 'Z'); return *this; }
};

struct Pipe {  // two ends of a socketpair as Peers, for the wire helpers
  Peer w, r;
  Pipe() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    w = Peer{sv[0], 1, "writer", "socketpair"};
    r = Peer{sv[1], 7, "worker:7", "socketpair"};
    set_nonblocking(sv[0]), set_nonblocking(sv[1]);
  }
  ~Pipe() { ::close(w.fd), ::close(r.fd); }
  // Writes the bytes and closes the writing side, so that a short message ends in EOF, not a wait.
  void feed(const std::string& bytes) {
    write_exact(w, bytes.data(), bytes.size(), Clock::now() + 2s);
    ::shutdown(w.fd, SHUT_WR);
  }
  RpcMessage decode() {  // as the server does: the header's bound (1 MiB here) first, then the body
    const auto deadline = Clock::now() + 2s;
    return read_message_body(r, read_header(r, 1 << 20, deadline), deadline);
  }
};

// `unavailable`: ends early (the sender closes) or aborts: Unavailable; else malformed: DataLoss.
struct BadFrame { const char* name; std::string bytes; bool unavailable; const char* says; };

std::vector<BadFrame> bad_frames() {
  auto body = [] { return Body().put<uint32_t>(3).bytes(3); };  // meta "ZZZ"
  const std::string good = body().spec(0, {4}).bytes(16).s;
  return {
      {"truncated data", frame(1, good).substr(0, 48 + good.size() - 5), true, "closed"},
      {"truncated header", frame(1, good).substr(0, 30), true, "closed"},
      {"payload < parts", frame(1, good, FrameKind::kRequest, good.size() - 1), false, "payload bytes the header announced"},
      {"leftover bytes", frame(1, good + "xyz"), false, "3 payload bytes left over"},
      {"dtype 9", frame(1, body().spec(9, {4}).bytes(16).s), false, "dtype code 9"},
      {"rank 9", frame(1, body().spec(0, {1, 1, 1, 1, 1, 1, 1, 1, 4}).bytes(16).s), false, "rank 9"},
      {"negative dim", frame(1, body().spec(0, {2, -3}).bytes(16).s), false, "bad or oversized dimension -3"},
      {"product overflows", frame(1, body().spec(0, {1ll << 32, 1ll << 32}).bytes(16).s), false, "oversized"},
      {"product > payload", frame(1, body().spec(5, {1000, 1000}).bytes(16).s), false, "oversized"},
      {"count 65537", frame(65537, body().s), false, "65537 tensors (limit 65536)"},
      {"more tensors than parts", frame(3, good), false, "malformed request from "},
      {"meta > payload", frame(0, Body().put<uint32_t>(500000).bytes(10).s), false, "payload bytes the header"},
      {"payload over bound", frame(0, "", FrameKind::kRequest, 1ull << 40), false, "over the limit"},
      {"bad magic", std::string(48, 'M'), false, "bad magic"},
      {"version 9", frame(0, "").replace(4, 1, "\x09"), false, "protocol version 9"},
      {"abort", frame(0, "go away", FrameKind::kAbort), true, " aborted the job: go away"},
  };
}

TEST(Rpc, GarbageBeforeTheHandshakeNeverHurtsTheServer) {
  const auto addrs = testing::free_loopback_addresses(2);
  Disconnects gone;
  std::atomic<int> handled{0};
  RpcServer server(options(addrs, 0), [&](const RpcMessage& m, int) { ++handled; return m; }, gone.callback());
  std::vector<std::string> inputs = {"", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", frame(0, "", FrameKind::kAbort, 1ull << 40),
                                     frame(0, "", FrameKind::kHello, 1ull << 40),  // a Hello announcing 1 TB
                                     frame(0, "", FrameKind::kHello).substr(0, 20)};
  for (const auto& c : bad_frames()) inputs.push_back(c.bytes);  // requests instead of a Hello
  std::mt19937_64 rng(2024);
  for (int i = 0; i < 200; ++i) {
    std::string s(1 + rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    if (i % 4 == 0 && s.size() >= 8) std::memcpy(s.data(), &kMagic, 4);  // get past the magic sometimes
    inputs.push_back(s);
  }
  for (const auto& in : inputs) EXPECT_TRUE(server_closes_after(addrs[0], in)) << "input of " << in.size() << " bytes";
  EXPECT_TRUE(wait_until([&] { return server.connections() == 0; })) << server.connections();
  EXPECT_EQ(RpcClient(options(addrs, 1), 0).call(RpcMessage{1, "still here", {}}).meta, "still here");
  EXPECT_EQ(handled.load(), 1);
  // A connection that never says anything must not hold up stop() for the 10 s handshake bound.
  const int idle = raw_connect(addrs[0]);
  ASSERT_TRUE(wait_until([&] { return server.connections() == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  server.stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  ::close(idle);
  EXPECT_EQ(gone.get(), (Map{{1, 1}}));
}

TEST(Rpc, ReadMessageBodyRejectsEveryMalformedPart) {
  for (const auto& c : bad_frames()) {
    Pipe p;
    p.feed(c.bytes);
    const auto decode = [&] { p.decode(); };
    EXPECT_TRUE(has(c.unavailable ? what_of<Unavailable>(decode) : what_of<DataLoss>(decode), c.says)) << c.name;
  }
}

TEST(Rpc, MalformedFramesAfterTheHandshakeCloseOnlyThatConnection) {
  const auto addrs = testing::free_loopback_addresses(3);
  Disconnects gone;
  std::atomic<int> handled{0};
  auto so = options(addrs, 0);
  so.max_frame_bytes = 1 << 20;
  RpcServer server(so, [&](const RpcMessage& m, int) { ++handled; return m; }, gone.callback());
  auto connect_authenticated = [&] {  // as worker:1, proving the token by hand
    Peer p{raw_connect(addrs[0]), -1, "", addrs[0]};
    set_nonblocking(p.fd);
    set_socket_options(p.fd);  // TCP_NODELAY, as the real client: no Nagle stalls in the handshake
    authenticate(p, options(addrs, 2), job_fingerprint(addrs), 0, false, Clock::now() + 5s);
    return p;
  };
  {  // Control: a well-formed request over the same raw path is answered.
    Peer p = connect_authenticated();
    const std::string f = frame(1, Body().put<uint32_t>(2).bytes(2).spec(4, {3}).bytes(12).s);
    write_exact(p, f.data(), f.size(), Clock::now() + 2s);
    const RpcMessage m = read_message_body(p, read_header(p, 1 << 20, Clock::now() + 5s), Clock::now() + 5s);
    EXPECT_EQ(m.meta, "ZZ");
    EXPECT_EQ(m.tensors.at(0).shape(), Shape{3});
    ::close(p.fd);
  }
  auto cases = bad_frames();
  cases.push_back({"a response", frame(0, Body().put<uint32_t>(0).s, FrameKind::kResponse), false, ""});
  for (const auto& c : cases) {
    Peer p = connect_authenticated();
    write_exact(p, c.bytes.data(), c.bytes.size(), Clock::now() + 2s);
    if (c.unavailable) ::shutdown(p.fd, SHUT_WR);  // the rest never comes
    char b;  // the server must close this connection itself (Unavailable), not wait for us (DeadlineExceeded)
    EXPECT_TRUE(has(what_of<Unavailable>([&] { read_exact(p, &b, 1, Clock::now() + 3s); }), "closed")) << c.name;
    ::close(p.fd);
  }
  EXPECT_TRUE(wait_until([&] { return gone.get() == Map{{2, static_cast<int>(cases.size()) + 1}}; })) << gone.get()[2];
  EXPECT_EQ(handled.load(), 1);
  RpcClient good(options(addrs, 1), 0);
  EXPECT_EQ(good.call(RpcMessage{1, "alive", {}}).meta, "alive");
  EXPECT_EQ(server.connections(), 1);
}

// The bytes write_message puts on the wire.
std::string encode(const RpcMessage& m) {
  Pipe p;
  write_message(p.w, FrameKind::kRequest, 77, 3, 0, m, Clock::now() + 2s);
  FrameHeader h;
  read_exact(p.r, &h, sizeof(h), Clock::now() + 2s);
  std::string body(h.payload_bytes, '\0');
  read_exact(p.r, body.data(), body.size(), Clock::now() + 2s);
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h)) + body;
}

TEST(Rpc, FuzzedMessagesDecodeOrThrowTypedErrors) {
  RpcMessage m{9, MetaWriter().u64(12345).str("dense/kernel:0").take(), {}};
  m.tensors = {random_tensor(Shape{2, 3}, DType::kFloat32, 1), random_tensor(Shape{4}, DType::kInt64, 2),
               random_tensor(Shape{}, DType::kBFloat16, 3), random_tensor(Shape{0, 5}, DType::kFloat64, 4)};
  const std::string valid = encode(m);
  Pipe control;
  control.feed(valid);
  EXPECT_EQ(control.decode().tensors.size(), 4u);
  std::mt19937_64 rng(7);
  const uint64_t extremes[] = {0, 1, ~0ull, 1ull << 63, 1ull << 40, 0xffffffffull, 65537, 9};
  int decoded = 0, rejected = 0;
  g_largest_new = 0;
  for (int i = 0; i < 500; ++i) {
    std::string s = valid;
    if (i % 5 == 0) {  // flip 1-4 bytes
      for (uint64_t k = 0, n = 1 + rng() % 4; k < n; ++k) s[rng() % s.size()] ^= static_cast<char>(1 + rng() % 255);
    } else if (i % 5 == 1) {  // an extreme value over any 8 bytes after the magic
      const uint64_t v = extremes[rng() % 8];
      std::memcpy(s.data() + 8 + rng() % (s.size() - 16), &v, 8);
    } else if (i % 5 == 2) {  // truncate
      s.resize(rng() % s.size());
    } else if (i % 5 == 3) {  // insert random bytes into the body
      std::string junk(1 + rng() % 16, '\0');
      for (char& c : junk) c = static_cast<char>(rng());
      s.insert(48 + rng() % (s.size() - 48), junk);
    } else {  // a random byte in the tensor specs (dtype, rank, dims)
      s[48 + 4 + m.meta.size() + rng() % 40] = static_cast<char>(rng());
    }
    Pipe p;
    p.feed(s);
    try {
      const RpcMessage out = p.decode();
      ++decoded;
      size_t total = out.meta.size();
      for (const Tensor& t : out.tensors) total += t.nbytes();
      EXPECT_LE(total, s.size()) << "mutation " << i;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "mutation " << i << " threw a non-dtrain exception: " << e.what();
    }
  }
  EXPECT_GT(decoded, 0);
  EXPECT_GT(rejected, 250);
  EXPECT_LE(g_largest_new.load(), (size_t{1} << 20) + 64) << "an allocation beyond the 1 MiB frame bound";
}

// The DataLoss of reading `bytes` with f, or what went wrong instead.
Thrown meta_error(const std::string bytes, const std::function<void(MetaReader&)>& f) {
  MetaReader r(bytes, "pull request");
  return what_of<DataLoss>([&] { f(r); });
}

TEST(Rpc, MetaReaderRejectsShortOversizedAndTrailingFields) {
  const std::string meta = MetaWriter().u64(1ull << 60).i64(-5).u8(7).str("ps/var").take();
  MetaReader r(meta, "push request from worker:1");
  EXPECT_EQ(r.u64(), 1ull << 60);
  EXPECT_EQ(r.i64(), -5);
  EXPECT_EQ(r.u8(), 7);
  EXPECT_EQ(r.str(), "ps/var");
  r.expect_end();
  EXPECT_TRUE(has(what_of<DataLoss>([&] { r.u8(); }), "malformed push request from worker:1"));
  EXPECT_TRUE(has(meta_error(meta.substr(0, 5), [](MetaReader& m) { m.u64(); }), "its fields end after 5 bytes"));
  const std::string long_str = MetaWriter().str(std::string(5000, 'x')).take();
  EXPECT_TRUE(has(meta_error(long_str, [](MetaReader& m) { m.str(); }), "a string of 5000 bytes (limit 4096)"));
  const Thrown raised_limit = meta_error(long_str, [](MetaReader& m) { EXPECT_EQ(m.str(5000).size(), 5000u); });
  EXPECT_FALSE(raised_limit.threw) << raised_limit;
  const std::string claims_all = MetaWriter().u64(~0ull).take() + "abc";
  EXPECT_TRUE(has(meta_error(claims_all, [](MetaReader& m) { m.str(~size_t{0}); }), "its fields end after 11"));
  const std::string trailing = MetaWriter().u64(1).u8(2).take();
  EXPECT_TRUE(has(meta_error(trailing, [](MetaReader& m) { m.u64(), m.expect_end(); }),
                  "malformed pull request: 1 unexpected trailing bytes"));
}

TEST(Rpc, SlowHandlerIsADeadlineAndShutdownIsUnavailable) {
  const auto addrs = testing::free_loopback_addresses(3);
  Disconnects gone;
  RpcServer server(options(addrs, 0), [](const RpcMessage& m, int) {
    if (m.method == 1) std::this_thread::sleep_for(900ms);
    return m;
  }, gone.callback());
  auto co = options(addrs, 1);
  co.collective.timeout = 300ms;
  RpcClient client(co, 0), idle(options(addrs, 2), 0);
  EXPECT_EQ(client.call(RpcMessage{2, "fast", {}}).meta, "fast");
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<DeadlineExceeded>([&] { client.call(RpcMessage{1, "slow", {}}); }), "ps:0 (" + addrs[0] + ")"));
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
  EXPECT_TRUE(has(what_of<Unavailable>([&] { idle.call(RpcMessage{2, "y", {}}); }), "ps:0 (" + addrs[0] + ")"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
}

TEST(Rpc, UnreachableServerIsADeadlineNamingIt) {
  const auto addrs = testing::free_loopback_addresses(2);  // nobody listens on addrs[0]
  auto o = options(addrs, 1);
  o.connect_timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(has(what_of<DeadlineExceeded>([&] { RpcClient c(o, 0); }), "worker:0 could not reach ps:0 (" + addrs[0] + ") within 500 ms"));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 450ms);
  EXPECT_LT(took, 2s);
}

TEST(Rpc, ConnectTimeoutHoldsWhenTheServerDropsConnections) {
  // A peer that drops SYNs (a host down, a firewall, a full accept queue): the connect is bounded by
  // connect_timeout (a blocking connect once waited 134 s here for 500 ms).
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

}  // namespace
}  // namespace dtrain::tcp
