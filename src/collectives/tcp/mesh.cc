// Mesh set-up: rank i dials every rank below it and accepts every rank above it. Each connection
// runs a mutual challenge-response: both send Hello(nonce, world size, job fingerprint, rank); the
// dialer sends Proof = HMAC-SHA256(token, acceptor's nonce | dialer rank | fingerprint); the
// acceptor verifies it before answering with its own Proof, or sends ABORT and closes.
#include "collectives/tcp/mesh.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <unistd.h>

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <cstring>
#include <mutex>
#include <thread>

#include "dtrain/core/logging.h"

namespace dtrain::tcp {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

#pragma pack(push, 1)
struct Hello {
  unsigned char nonce[32];
  uint32_t world;
  uint64_t fingerprint;
  uint32_t rank;
};
#pragma pack(pop)

uint64_t job_fingerprint(const std::vector<std::string>& addresses) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the ordered address list
  for (const auto& a : addresses) {
    for (unsigned char c : a) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  }
  return h;
}

std::string name_of(const TcpGroupOptions& o, int r) {
  return r < static_cast<int>(o.task_names.size()) ? o.task_names[static_cast<size_t>(r)] : "rank " + std::to_string(r);
}

void send_frame(const Peer& p, FrameKind kind, uint32_t sender, const void* payload, size_t n, Clock::time_point dl) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(kind);
  h.sender = sender;
  h.payload_bytes = n;
  write_exact(p, &h, sizeof(h), dl);
  if (n) write_exact(p, payload, n, dl);
}

template <typename T>
T read_payload(const Peer& p, FrameKind kind, Clock::time_point dl) {
  const FrameHeader h = read_header(p, sizeof(T), dl);
  if (h.kind != static_cast<uint16_t>(kind) || h.payload_bytes != sizeof(T))
    throw DataLoss(detail::str_cat("malformed handshake from ", p.address, ": expected frame kind ",
                                   static_cast<int>(kind), " of ", sizeof(T), " bytes"));
  T t;
  read_exact(p, &t, sizeof(T), dl);
  return t;
}

struct Proof {
  unsigned char mac[32];
};

Proof prove(const std::string& token, const unsigned char* peer_nonce, uint32_t rank, uint64_t fp) {
  unsigned char msg[32 + 4 + 8];
  std::memcpy(msg, peer_nonce, 32);
  std::memcpy(msg + 32, &rank, 4);
  std::memcpy(msg + 36, &fp, 8);
  Proof p;
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), msg, sizeof(msg), p.mac, &len);
  return p;
}

bool verify(const Proof& got, const Proof& want) { return CRYPTO_memcmp(got.mac, want.mac, 32) == 0; }

// Runs the handshake on a fresh connection. `expected` is the rank we dialed (-1 when accepting).
// Returns the peer's rank.
int handshake(Peer& p, const TcpGroupOptions& o, uint64_t fp, int expected, Clock::time_point dl) {
  Hello mine{};
  if (RAND_bytes(mine.nonce, sizeof(mine.nonce)) != 1) throw Internal("RAND_bytes failed");
  mine.world = static_cast<uint32_t>(o.addresses.size());
  mine.fingerprint = fp;
  mine.rank = static_cast<uint32_t>(o.rank);
  send_frame(p, FrameKind::kHello, mine.rank, &mine, sizeof(mine), dl);
  const Hello theirs = read_payload<Hello>(p, FrameKind::kHello, dl);
  auto refuse = [&](const std::string& why) {
    try {
      send_frame(p, FrameKind::kAbort, mine.rank, why.data(), why.size(), dl);
    } catch (const Error&) {
    }
    throw PermissionDenied(why);
  };
  if (theirs.world != mine.world)
    refuse(detail::str_cat("world size mismatch: ", p.address, " believes the job has ", theirs.world,
                           " tasks, this task (", name_of(o, o.rank), ") has ", mine.world,
                           "; give every task the same TF_CONFIG cluster"));
  if (theirs.fingerprint != fp)
    refuse("job mismatch: " + p.address + " was started with a different cluster address list than " +
           name_of(o, o.rank) + "; give every task the same TF_CONFIG cluster");
  const int peer = static_cast<int>(theirs.rank);
  if (peer < 0 || peer >= static_cast<int>(mine.world) || peer == o.rank || (expected >= 0 && peer != expected) ||
      (expected < 0 && peer < o.rank))
    refuse(detail::str_cat("unexpected rank ", peer, " connecting from ", p.address));
  p.rank = peer;
  p.name = name_of(o, peer);
  if (expected >= 0) {  // dialer: prove first, then check the acceptor's proof
    const Proof mp = prove(o.token, theirs.nonce, mine.rank, fp);
    send_frame(p, FrameKind::kProof, mine.rank, &mp, sizeof(mp), dl);
    Proof tp;
    try {
      tp = read_payload<Proof>(p, FrameKind::kProof, dl);
    } catch (const Unavailable& e) {
      throw PermissionDenied(p.name + " (" + p.address + ") refused this task's job token: " + e.what() +
                             ". Set the same DTRAIN_JOB_TOKEN on every task (dtrain-run does this)");
    }
    if (!verify(tp, prove(o.token, mine.nonce, theirs.rank, fp)))
      throw PermissionDenied(p.name + " (" + p.address + ") could not prove the job token; is another job using "
                             "that address? Set the same DTRAIN_JOB_TOKEN on every task");
  } else {  // acceptor: check the dialer's proof before proving ourselves
    const Proof tp = read_payload<Proof>(p, FrameKind::kProof, dl);
    if (!verify(tp, prove(o.token, mine.nonce, theirs.rank, fp)))
      refuse("job token mismatch: the connection from " + p.address + " claiming to be " + p.name +
             " was refused");
    const Proof mp = prove(o.token, theirs.nonce, mine.rank, fp);
    send_frame(p, FrameKind::kProof, mine.rank, &mp, sizeof(mp), dl);
  }
  return peer;
}

tcp::endpoint endpoint_of(asio::io_context& io, const std::string& address) {
  std::string host;
  int port = 0;
  split_address(address, &host, &port);
  boost::system::error_code ec;
  tcp::resolver resolver(io);
  auto results = resolver.resolve(host, std::to_string(port), ec);
  if (ec || results.empty())
    throw InvalidArgument("cannot resolve '" + address + "': " + ec.message() + "; use an IP address or a resolvable host name");
  return *results.begin();
}

}  // namespace

void split_address(const std::string& a, std::string* host, int* port) {
  const auto colon = a.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == a.size())
    throw InvalidArgument("bad address '" + a + "': expected host:port, e.g. 10.0.0.1:2222 or [::1]:2222");
  *host = a.substr(0, colon);
  if (host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  const std::string p = a.substr(colon + 1);
  char* end = nullptr;
  const long v = std::strtol(p.c_str(), &end, 10);
  if (*end != '\0' || v < 1 || v > 65535)
    throw InvalidArgument("bad port in '" + a + "': must be 1-65535, e.g. 10.0.0.1:2222");
  *port = static_cast<int>(v);
}

std::vector<Peer> build_mesh(const TcpGroupOptions& o) {
  const int n = static_cast<int>(o.addresses.size());
  if (o.rank < 0 || o.rank >= n)
    throw InvalidArgument(detail::str_cat("rank ", o.rank, " out of range for ", n, " addresses"));
  if (o.token.size() < 16)
    throw InvalidArgument("the job token must be at least 16 characters; set DTRAIN_JOB_TOKEN (dtrain-run generates one)");
  const uint64_t fp = job_fingerprint(o.addresses);
  const auto deadline = Clock::now() + o.connect_timeout;
  std::vector<Peer> peers(static_cast<size_t>(n));
  std::mutex mu;
  asio::io_context io;

  // Listen on our own address only.
  tcp::acceptor acceptor(io);
  const tcp::endpoint me = endpoint_of(io, o.addresses[static_cast<size_t>(o.rank)]);
  boost::system::error_code ec;
  acceptor.open(me.protocol(), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(me, ec);
  if (!ec) acceptor.listen(64, ec);
  if (ec)
    throw Unavailable("cannot listen on " + o.addresses[static_cast<size_t>(o.rank)] + " (" + name_of(o, o.rank) +
                      "): " + ec.message() + "; is the port in use or the address not on this host?");
  acceptor.non_blocking(true);

  std::exception_ptr accept_error;
  std::thread accepter([&] {
    try {
      int waiting = n - 1 - o.rank;
      while (waiting > 0) {
        tcp::socket s(io);
        boost::system::error_code aec;
        acceptor.accept(s, aec);
        if (aec == asio::error::would_block || aec == asio::error::try_again) {
          pollfd pfd{acceptor.native_handle(), POLLIN, 0};
          if (Clock::now() >= deadline) break;
          ::poll(&pfd, 1, 100);
          continue;
        }
        if (aec) continue;
        Peer p;
        p.fd = ::dup(s.native_handle());
        p.address = s.remote_endpoint(aec).address().to_string() + ":" + std::to_string(s.remote_endpoint(aec).port());
        p.name = p.address;
        set_nonblocking(p.fd);
        set_socket_options(p.fd);
        try {
          const int r = handshake(p, o, fp, -1, std::min(deadline, Clock::now() + std::chrono::seconds(10)));
          std::lock_guard<std::mutex> lock(mu);
          if (peers[static_cast<size_t>(r)].fd >= 0) {
            ::close(p.fd);
            DTRAIN_LOG(WARNING) << "refused a second connection claiming to be " << p.name;
            continue;
          }
          peers[static_cast<size_t>(r)] = p;
          --waiting;
        } catch (const Error& e) {
          DTRAIN_LOG(WARNING) << name_of(o, o.rank) << " refused a connection from " << p.address << ": " << e.what();
          ::close(p.fd);
        }
      }
    } catch (...) {
      accept_error = std::current_exception();
    }
  });

  std::exception_ptr dial_error;
  try {
    for (int r = 0; r < o.rank; ++r) {
      const tcp::endpoint target = endpoint_of(io, o.addresses[static_cast<size_t>(r)]);
      for (;;) {
        tcp::socket s(io);
        boost::system::error_code cec;
        s.connect(target, cec);
        if (!cec) {
          Peer p;
          p.fd = ::dup(s.native_handle());
          p.address = o.addresses[static_cast<size_t>(r)];
          p.name = name_of(o, r);
          set_nonblocking(p.fd);
          set_socket_options(p.fd);
          handshake(p, o, fp, r, deadline);
          std::lock_guard<std::mutex> lock(mu);
          peers[static_cast<size_t>(r)] = p;
          break;
        }
        if (Clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  } catch (...) {
    dial_error = std::current_exception();
  }
  accepter.join();
  if (dial_error || accept_error) {
    for (auto& p : peers)
      if (p.fd >= 0) ::close(p.fd);
    std::rethrow_exception(dial_error ? dial_error : accept_error);
  }
  std::string missing;
  for (int r = 0; r < n; ++r)
    if (r != o.rank && peers[static_cast<size_t>(r)].fd < 0)
      missing += (missing.empty() ? "" : ", ") + name_of(o, r) + " (" + o.addresses[static_cast<size_t>(r)] + ")";
  if (!missing.empty()) {
    for (auto& p : peers)
      if (p.fd >= 0) ::close(p.fd);
    throw DeadlineExceeded("rendezvous of " + name_of(o, o.rank) + " timed out after " +
                           std::to_string(o.connect_timeout.count()) + " ms: never heard from " + missing +
                           "; start every task of the job (dtrain-run does) or check the cluster addresses");
  }
  return peers;
}

}  // namespace dtrain::tcp
