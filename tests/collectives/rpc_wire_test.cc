// The RPC wire against garbage: bytes before the handshake, malformed frames after it, every
// malformed part fed to the wire helpers over a socketpair, fuzzed messages, and MetaReader bounds.
// Every wait is bounded.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <new>

#include "collectives/rpc_test_util.h"

// The largest operator-new request (string/vector memory): the fuzz test asserts that no malformed
// length becomes a huge allocation. Delete is noinline so GCC does not pair free() with new and
// warn.
static std::atomic<size_t> g_largest_new{0};
void* operator new(size_t n) {
  for (size_t seen = g_largest_new.load();
       n > seen && !g_largest_new.compare_exchange_weak(seen, n);) {
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace dtrain::tcp {
namespace {

using namespace std::chrono_literals;

int raw_connect(const std::string& address) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_in a = loopback(std::stoi(address.substr(address.rfind(':') + 1)));
  EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)), 0)
      << std::strerror(errno);
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
  for (const auto end = std::chrono::steady_clock::now() + 3s;
       !closed && std::chrono::steady_clock::now() < end;) {
    pollfd pfd{fd, POLLIN, 0};
    closed = ::poll(&pfd, 1, 100) > 0 && ::recv(fd, buf, sizeof(buf), 0) <= 0;
  }
  ::close(fd);
  return closed;
}

// A frame: header (kind, count, payload_bytes = body size unless given) + body.
std::string frame(uint64_t count, const std::string& body, FrameKind kind = FrameKind::kRequest,
                  uint64_t payload = ~0ull) {
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
  Body& put(T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return *this;
  }
  Body& spec(uint8_t dtype, const std::vector<int64_t>& dims) {
    put<uint8_t>(dtype).put<uint8_t>(static_cast<uint8_t>(dims.size()));
    for (int64_t d : dims) put(d);
    return *this;
  }
  Body& bytes(size_t n) {
    s.append(n, 'Z');
    return *this;
  }
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
struct BadFrame {
  const char* name;
  std::string bytes;
  bool unavailable;
  const char* says;
};

std::vector<BadFrame> bad_frames() {
  auto body = [] { return Body().put<uint32_t>(3).bytes(3); };  // meta "ZZZ"
  const std::string good = body().spec(0, {4}).bytes(16).s;
  return {
      {"truncated data", frame(1, good).substr(0, 48 + good.size() - 5), true, "closed"},
      {"truncated header", frame(1, good).substr(0, 30), true, "closed"},
      {"payload < parts", frame(1, good, FrameKind::kRequest, good.size() - 1), false,
       "payload bytes the header announced"},
      {"leftover bytes", frame(1, good + "xyz"), false, "3 payload bytes left over"},
      {"dtype 9", frame(1, body().spec(9, {4}).bytes(16).s), false, "dtype code 9"},
      {"rank 9", frame(1, body().spec(0, {1, 1, 1, 1, 1, 1, 1, 1, 4}).bytes(16).s), false,
       "rank 9"},
      {"negative dim", frame(1, body().spec(0, {2, -3}).bytes(16).s), false,
       "bad or oversized dimension -3"},
      {"product overflows", frame(1, body().spec(0, {1ll << 32, 1ll << 32}).bytes(16).s), false,
       "oversized"},
      {"product > payload", frame(1, body().spec(5, {1000, 1000}).bytes(16).s), false, "oversized"},
      {"count 65537", frame(65537, body().s), false, "65537 tensors (limit 65536)"},
      {"more tensors than parts", frame(3, good), false, "malformed request from "},
      {"meta > payload", frame(0, Body().put<uint32_t>(500000).bytes(10).s), false,
       "payload bytes the header"},
      {"payload over bound", frame(0, "", FrameKind::kRequest, 1ull << 40), false,
       "over the limit"},
      {"bad magic", std::string(48, 'M'), false, "bad magic"},
      {"version 9", frame(0, "").replace(4, 1, "\x09"), false, "protocol version 9"},
      {"abort", frame(0, "go away", FrameKind::kAbort), true, " aborted the job: go away"},
  };
}

TEST(Rpc, GarbageBeforeTheHandshakeNeverHurtsTheServer) {
  const auto addrs = testing::free_loopback_addresses(2);
  Disconnects gone;
  std::atomic<int> handled{0};
  RpcServer server(
      options(addrs, 0),
      [&](const RpcMessage& m, int) {
        ++handled;
        return m;
      },
      gone.callback());
  std::vector<std::string> inputs = {
      "", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", frame(0, "", FrameKind::kAbort, 1ull << 40),
      frame(0, "", FrameKind::kHello, 1ull << 40),  // a Hello announcing 1 TB
      frame(0, "", FrameKind::kHello).substr(0, 20)};
  for (const auto& c : bad_frames()) inputs.push_back(c.bytes);  // requests instead of a Hello
  std::mt19937_64 rng(2024);
  for (int i = 0; i < 200; ++i) {
    std::string s(1 + rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    if (i % 4 == 0 && s.size() >= 8)
      std::memcpy(s.data(), &kMagic, 4);  // get past the magic sometimes
    inputs.push_back(s);
  }
  for (const auto& in : inputs)
    EXPECT_TRUE(server_closes_after(addrs[0], in)) << "input of " << in.size() << " bytes";
  EXPECT_TRUE(wait_until([&] { return server.connections() == 0; })) << server.connections();
  EXPECT_EQ(RpcClient(options(addrs, 1), 0).call(RpcMessage{1, "still here", {}}).meta,
            "still here");
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
    EXPECT_TRUE(
        has(c.unavailable ? what_of<Unavailable>(decode) : what_of<DataLoss>(decode), c.says))
        << c.name;
  }
}

TEST(Rpc, MalformedFramesAfterTheHandshakeCloseOnlyThatConnection) {
  const auto addrs = testing::free_loopback_addresses(3);
  Disconnects gone;
  std::atomic<int> handled{0};
  auto so = options(addrs, 0);
  so.max_frame_bytes = 1 << 20;
  RpcServer server(
      so,
      [&](const RpcMessage& m, int) {
        ++handled;
        return m;
      },
      gone.callback());
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
    const RpcMessage m =
        read_message_body(p, read_header(p, 1 << 20, Clock::now() + 5s), Clock::now() + 5s);
    EXPECT_EQ(m.meta, "ZZ");
    EXPECT_EQ(m.tensors.at(0).shape(), Shape{3});
    ::close(p.fd);
  }
  auto cases = bad_frames();
  cases.push_back(
      {"a response", frame(0, Body().put<uint32_t>(0).s, FrameKind::kResponse), false, ""});
  for (const auto& c : cases) {
    Peer p = connect_authenticated();
    write_exact(p, c.bytes.data(), c.bytes.size(), Clock::now() + 2s);
    if (c.unavailable) ::shutdown(p.fd, SHUT_WR);  // the rest never comes
    char b;  // the server must close this connection itself (Unavailable), not wait for us
             // (DeadlineExceeded)
    EXPECT_TRUE(
        has(what_of<Unavailable>([&] { read_exact(p, &b, 1, Clock::now() + 3s); }), "closed"))
        << c.name;
    ::close(p.fd);
  }
  EXPECT_TRUE(wait_until([&] {
    return gone.get() == Map{{2, static_cast<int>(cases.size()) + 1}};
  })) << gone.get()[2];
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
  m.tensors = {
      random_tensor(Shape{2, 3}, DType::kFloat32, 1), random_tensor(Shape{4}, DType::kInt64, 2),
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
      for (uint64_t k = 0, n = 1 + rng() % 4; k < n; ++k)
        s[rng() % s.size()] ^= static_cast<char>(1 + rng() % 255);
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
  EXPECT_LE(g_largest_new.load(), (size_t{1} << 20) + 64)
      << "an allocation beyond the 1 MiB frame bound";
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
  EXPECT_TRUE(has(meta_error(meta.substr(0, 5), [](MetaReader& m) { m.u64(); }),
                  "its fields end after 5 bytes"));
  const std::string long_str = MetaWriter().str(std::string(5000, 'x')).take();
  EXPECT_TRUE(has(meta_error(long_str, [](MetaReader& m) { m.str(); }),
                  "a string of 5000 bytes (limit 4096)"));
  const Thrown raised_limit =
      meta_error(long_str, [](MetaReader& m) { EXPECT_EQ(m.str(5000).size(), 5000u); });
  EXPECT_FALSE(raised_limit.threw) << raised_limit;
  const std::string claims_all = MetaWriter().u64(~0ull).take() + "abc";
  EXPECT_TRUE(has(meta_error(claims_all, [](MetaReader& m) { m.str(~size_t{0}); }),
                  "its fields end after 11"));
  const std::string trailing = MetaWriter().u64(1).u8(2).take();
  EXPECT_TRUE(has(meta_error(trailing, [](MetaReader& m) { m.u64(), m.expect_end(); }),
                  "malformed pull request: 1 unexpected trailing bytes"));
}

}  // namespace
}  // namespace dtrain::tcp
