#include "collectives/tcp/io.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"

namespace dtrain::tcp {
namespace {

int ms_left(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1000));
}

[[noreturn]] void closed(const Peer& p) {
  throw Unavailable("connection to " + p.name + " (" + p.address +
                    ") closed: that task died, was killed, or aborted the job; check its log");
}

void wait_fd(const Peer& p, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd pfd{p.fd, events, 0};
    const int r = ::poll(&pfd, 1, ms_left(deadline));
    if (r > 0) {
      if (pfd.revents & (POLLERR | POLLNVAL)) closed(p);
      return;
    }
    if (r < 0 && errno != EINTR)
      throw Unavailable(std::string("poll failed: ") + std::strerror(errno));
    if (Clock::now() >= deadline)
      throw DeadlineExceeded(
          std::string(what) + " " + p.name + " (" + p.address +
          ") timed out: the peer is stuck or unreachable; check its log, or raise the timeout");
  }
}

// wait_fd, but a wait of more than p.stall_timeout without the socket becoming ready is
// Unavailable: the peer took (or sent) no bytes for that long.
void wait_progress(const Peer& p, short events, Clock::time_point deadline, const char* what) {
  const auto stall = Clock::now() + p.stall_timeout;
  if (p.stall_timeout.count() <= 0 || stall >= deadline) return wait_fd(p, events, deadline, what);
  try {
    wait_fd(p, events, stall, what);
  } catch (const DeadlineExceeded&) {
    throw Unavailable(p.name + " (" + p.address + ") " + (events == POLLOUT ? "took" : "sent") +
                      " no bytes for " + std::to_string(p.stall_timeout.count()) + " ms while " +
                      what + " it: it is stopped or hung, or its link is down");
  }
}

}  // namespace

std::string describe(const FrameHeader& h) {
  // tcp_communicator.cc's ops; a broadcast's `reduce` field holds its root.
  static const char* kOps[] = {"?",      "allreduce",      "allgather", "broadcast",
                               "reduce", "reduce_scatter", "barrier",   "alltoall"};
  static const char* kRed[] = {"SUM", "MEAN", "MAX", "MIN"};
  const std::string what = h.op == 3      ? "root " + std::to_string(h.reduce)
                           : h.reduce < 4 ? std::string(kRed[h.reduce])
                                          : std::string("?");
  return detail::str_cat(h.op < 8 ? kOps[h.op] : "?", " #", h.seq, " (",
                         h.dtype < 6 ? dtype_name(static_cast<DType>(h.dtype)) : "?", " x", h.count,
                         ", ", what, ")");
}

int connect_until(const std::string& address, Clock::time_point deadline) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  std::string host = address.substr(0, colon);
  if (host.size() > 1 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), address.substr(colon + 1).c_str(), &hints, &res) != 0 || !res)
    return -1;
  const auto until = std::min(deadline, Clock::now() + std::chrono::seconds(5));
  int fd = -1;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    bool ok = false;
    if (errno == EINPROGRESS) {
      for (;;) {
        pollfd pfd{fd, POLLOUT, 0};
        const int r = ::poll(&pfd, 1, ms_left(until));
        if (r > 0) {
          int err = 0;
          socklen_t len = sizeof(err);
          ok = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
          break;
        }
        if ((r < 0 && errno != EINTR) || Clock::now() >= until) break;
      }
    }
    if (!ok) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  return fd;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_socket_options(int fd) {
  int one = 1, buf = 4 << 20;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

void write_exact(const Peer& p, const void* data, size_t n, Clock::time_point deadline) {
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(p.fd, c, n, MSG_NOSIGNAL);
    if (w > 0) {
      c += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      wait_progress(p, POLLOUT, deadline, "sending to");
    } else {
      closed(p);
    }
  }
}

void read_exact(const Peer& p, void* data, size_t n, Clock::time_point deadline) {
  char* c = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(p.fd, c, n, 0);
    if (r > 0) {
      c += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      closed(p);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      wait_progress(p, POLLIN, deadline, "waiting for");
    } else {
      closed(p);
    }
  }
}

FrameHeader read_header(const Peer& p, size_t max_payload, Clock::time_point deadline) {
  FrameHeader h;
  read_exact(p, &h, sizeof(h), deadline);
  if (h.magic != kMagic)
    throw DataLoss(detail::str_cat(
        "malformed frame from ", p.name, " (", p.address, "): bad magic 0x", std::hex, h.magic,
        "; is something other than a dtrain task connected to this port?"));
  if (h.version != kVersion)
    throw DataLoss(detail::str_cat("frame from ", p.name, " has protocol version ", h.version,
                                   ", this task speaks ", kVersion,
                                   "; run the same dtrain build on every task"));
  if (h.kind < 1 || h.kind > kMaxFrameKind)
    throw DataLoss(detail::str_cat("malformed frame from ", p.name, ": unknown kind ", h.kind));
  if (h.kind == static_cast<uint16_t>(FrameKind::kAbort)) {
    std::string msg(static_cast<size_t>(std::min<uint64_t>(h.payload_bytes, 4096)), '\0');
    read_exact(p, msg.data(), msg.size(), deadline);
    throw Unavailable(p.name + " aborted the job: " + msg);
  }
  if (h.payload_bytes > max_payload)
    throw DataLoss(detail::str_cat("frame from ", p.name, " announces ", h.payload_bytes,
                                   " payload bytes, over the limit of ", max_payload,
                                   "; refusing it"));
  return h;
}

void split_address(const std::string& a, std::string* host, int* port) {
  const auto colon = a.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == a.size())
    throw InvalidArgument("bad address '" + a +
                          "': expected host:port, e.g. 10.0.0.1:2222 or [::1]:2222");
  *host = a.substr(0, colon);
  if (host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  const std::string p = a.substr(colon + 1);
  char* end = nullptr;
  const long v = std::strtol(p.c_str(), &end, 10);
  if (*end != '\0' || v < 1 || v > 65535)
    throw InvalidArgument("bad port in '" + a + "': must be 1-65535, e.g. 10.0.0.1:2222");
  *port = static_cast<int>(v);
}

int open_listener(const std::string& address, const std::string& who) {
  std::string host;
  int port = 0;
  split_address(address, &host, &port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || !res)
    throw InvalidArgument("cannot resolve '" + address + "': " + ::gai_strerror(rc) +
                          "; use an IP address or a resolvable host name");
  const int fd = ::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok =
      fd >= 0 && ::bind(fd, res->ai_addr, res->ai_addrlen) == 0 && ::listen(fd, 128) == 0;
  const int err = errno;
  ::freeaddrinfo(res);
  if (!ok) {
    if (fd >= 0) ::close(fd);
    throw Unavailable("cannot listen on " + address + " (" + who + "): " + std::strerror(err) +
                      "; is the port in use or the address not on this host?");
  }
  set_nonblocking(fd);
  return fd;
}

// Dead peers are noticed even when no request is in flight (a host that vanished sends no FIN).
void set_keepalive(int fd) {
  int one = 1, idle = 10, interval = 2, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

}  // namespace dtrain::tcp
