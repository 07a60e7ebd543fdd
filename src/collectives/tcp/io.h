// Private to src/collectives/tcp: deadline-bounded socket I/O on non-blocking file descriptors.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "collectives/tcp/frame.h"

namespace dtrain::tcp {

using Clock = std::chrono::steady_clock;

// One connected, authenticated peer.
struct Peer {
  int fd = -1;
  int rank = -1;
  std::string name;     // "worker:1"
  std::string address;  // "127.0.0.1:5000"
  // > 0: a read or write that makes no progress for this long throws Unavailable naming the peer
  // (stopped, hung, or its link is down), however far the deadline is. RPC clients set it to the
  // heartbeat timeout; the servers they talk to send heartbeats between answers.
  std::chrono::milliseconds stall_timeout{0};
};

// Blocks (poll) until all n bytes are written/read or the deadline passes. Throws
// DeadlineExceeded / Unavailable (peer closed or socket error) naming `peer`.
void write_exact(const Peer& peer, const void* data, size_t n, Clock::time_point deadline);
void read_exact(const Peer& peer, void* data, size_t n, Clock::time_point deadline);
// Reads one header and checks magic, version, kind and the payload bound; an ABORT frame is
// turned into Unavailable carrying the peer's message. Throws DataLoss for a malformed frame.
FrameHeader read_header(const Peer& peer, size_t max_payload, Clock::time_point deadline);
void set_nonblocking(int fd);
// A non-blocking TCP connection to "host:port", trying each resolved address, bounded by
// min(deadline, now + 5 s) so that a black-holed host cannot stall the caller's retry loop. Returns
// the connected (non-blocking) fd, or -1 when refused, unreachable or out of time.
int connect_until(const std::string& address, Clock::time_point deadline);
void set_socket_options(int fd);  // TCP_NODELAY, 4 MiB buffers
// Parses "host:port" / "[v6]:port"; throws InvalidArgument quoting the address.
void split_address(const std::string& address, std::string* host, int* port);
// A non-blocking listening socket on "host:port" (SO_REUSEADDR); `who` names the listener in the
// Unavailable thrown when the address cannot be bound.
int open_listener(const std::string& address, const std::string& who);
// TCP keep-alive after 10 s idle, probes every 2 s, 3 lost: dead peers are noticed even when no
// request is in flight (a host that vanished sends no FIN).
void set_keepalive(int fd);

}  // namespace dtrain::tcp
