// Mesh set-up: rank i dials every rank below it and accepts every rank above it; each connection
// is authenticated by auth.h's challenge-response.
#include "collectives/tcp/mesh.h"

#include <poll.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it

#include "collectives/tcp/auth.h"
#include "dtrain/core/logging.h"

namespace dtrain::tcp {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

tcp::endpoint endpoint_of(asio::io_context& io, const std::string& address) {
  std::string host;
  int port = 0;
  split_address(address, &host, &port);
  boost::system::error_code ec;
  tcp::resolver resolver(io);
  auto results = resolver.resolve(host, std::to_string(port), ec);
  if (ec || results.empty())
    throw InvalidArgument("cannot resolve '" + address + "': " + ec.message() +
                          "; use an IP address or a resolvable host name");
  return *results.begin();
}

}  // namespace

namespace {
std::vector<Peer> build_mesh_or_throw(const TcpGroupOptions& o) {
  const int n = static_cast<int>(o.addresses.size());
  if (o.rank < 0 || o.rank >= n)
    throw InvalidArgument(detail::str_cat("rank ", o.rank, " out of range for ", n, " addresses"));
  if (o.token.size() < 16)
    throw InvalidArgument(
        "the job token must be at least 16 characters; set DTRAIN_JOB_TOKEN (dtrain-run generates "
        "one)");
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
    throw Unavailable("cannot listen on " + o.addresses[static_cast<size_t>(o.rank)] + " (" +
                      name_of(o, o.rank) + "): " + ec.message() +
                      "; is the port in use or the address not on this host?");
  acceptor.non_blocking(true);

  std::exception_ptr accept_error;
  std::string accept_failure;  // the last accept() error other than "would block", for the timeout
  bool out_of_descriptors = false;  // ... and whether it was EMFILE or ENFILE
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
        Peer p;
        if (!aec) p.fd = ::dup(s.native_handle());
        if (p.fd >= 0) {  // a passing error (a dialer that gave up) is not the timeout's cause
          std::lock_guard<std::mutex> lock(mu);
          accept_failure.clear();
        }
        if (aec || p.fd < 0) {
          // Out of file descriptors (EMFILE), or a connection reset before we took it: not a
          // reason to spin; wait a little, within the deadline, and say why if it passes.
          {
            std::lock_guard<std::mutex> lock(mu);
            accept_failure = aec ? aec.message() : std::string(std::strerror(errno));
            const int code = aec ? aec.value() : errno;
            out_of_descriptors = code == EMFILE || code == ENFILE;
          }
          if (Clock::now() >= deadline) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          continue;
        }
        p.address = s.remote_endpoint(aec).address().to_string() + ":" +
                    std::to_string(s.remote_endpoint(aec).port());
        p.name = p.address;
        set_nonblocking(p.fd);
        set_socket_options(p.fd);
        try {
          const int r = authenticate(p, o, fp, -1, /*any_rank=*/false,
                                     std::min(deadline, Clock::now() + std::chrono::seconds(10)));
          std::lock_guard<std::mutex> lock(mu);
          if (peers[static_cast<size_t>(r)].fd >= 0) {
            ::close(p.fd);
            DTRAIN_LOG(WARNING) << "refused a second connection claiming to be " << p.name;
            continue;
          }
          peers[static_cast<size_t>(r)] = p;
          --waiting;
        } catch (const Error& e) {
          DTRAIN_LOG(WARNING) << name_of(o, o.rank) << " refused a connection from " << p.address
                              << ": " << e.what();
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
      endpoint_of(io, o.addresses[static_cast<size_t>(r)]);  // a bad address fails now, clearly
      for (;;) {
        const int fd = connect_until(o.addresses[static_cast<size_t>(r)], deadline);
        if (fd >= 0) {
          Peer p;
          p.fd = fd;
          p.address = o.addresses[static_cast<size_t>(r)];
          p.name = name_of(o, r);
          set_nonblocking(p.fd);
          set_socket_options(p.fd);
          bool heard = false;
          try {
            authenticate(p, o, fp, r, false, deadline, &heard);
          } catch (const Unavailable& e) {
            ::close(p.fd);
            p.fd = -1;
            // Closed before rank r's Hello: what answered was a listener on its way out (the
            // port's previous owner, a job relaunched at once), not rank r refusing us; dial
            // again until the deadline. After the Hello a closed connection is rank r's doing.
            if (heard || Clock::now() >= deadline) throw;
            DTRAIN_LOG(INFO) << name_of(o, o.rank) << ": the connection to " << p.name << " ("
                             << p.address << ") closed before its handshake (" << e.what()
                             << "); dialing again";
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            continue;
          } catch (...) {  // refused (PermissionDenied), DataLoss, DeadlineExceeded: not leaked
            if (p.fd >= 0) ::close(p.fd);
            throw;
          }
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
      missing += (missing.empty() ? "" : ", ") + name_of(o, r) + " (" +
                 o.addresses[static_cast<size_t>(r)] + ")";
  if (!missing.empty()) {
    for (auto& p : peers)
      if (p.fd >= 0) ::close(p.fd);
    throw DeadlineExceeded(
        "rendezvous of " + name_of(o, o.rank) + " timed out after " +
        std::to_string(o.connect_timeout.count()) + " ms: never heard from " + missing +
        (accept_failure.empty()
             ? std::string()
             : " (accepting connections failed: " + accept_failure +
                   (out_of_descriptors ? "; raise the open-file limit, ulimit -n" : "") + ")") +
        "; start every task of the job (dtrain-run does) or check the cluster addresses");
  }
  return peers;
}
}  // namespace

std::vector<Peer> build_mesh(const TcpGroupOptions& o) {
  try {
    return build_mesh_or_throw(o);
  } catch (const boost::system::system_error& e) {  // Asio's own (its epoll, out of descriptors)
    throw Unavailable("the rendezvous of " + name_of(o, o.rank) + " failed: " + e.what() +
                      (e.code() == boost::system::errc::too_many_files_open
                           ? "; raise the open-file limit (ulimit -n)"
                           : ""));
  }
}

}  // namespace dtrain::tcp
