// TCP collectives between processes (one rank per process): a full mesh of authenticated
// connections, framed messages, and the bandwidth-optimal ring algorithms of
// src/collectives/algorithms (ring, recursive doubling) over the TCP transport (tcp_transport.h).
//
// Every connection proves knowledge of the job token in both directions (HMAC-SHA256 over the
// peer's random nonce) and checks that both sides agree on the protocol version, the world size
// and the job fingerprint (a hash of the ordered address list); anything else is refused and
// logged. Ranks on one host move the data through shared memory (TcpGroupOptions::shared_memory).
// Listeners bind to this rank's address from the cluster spec, not to every interface.
// Every wait has the group's timeout; a peer that dies is detected when its socket closes, and a
// rank that fails a collective tells every peer (an ABORT frame) so that nobody waits for it.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/collectives/communicator.h"
#include "dtrain/core/export.h"

namespace dtrain {

struct DTRAIN_API TcpGroupOptions {
  int rank = 0;
  std::vector<std::string> addresses;   // "host:port" of every rank, in rank order
  std::vector<std::string> task_names;  // for messages, e.g. "worker:1" (defaults to "rank N")
  std::string token;                    // the job token (DTRAIN_JOB_TOKEN); required, >= 16 bytes
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  CollectiveOptions collective;  // per-collective timeout
  size_t max_frame_bytes = size_t{1} << 30;
  size_t segment_bytes = size_t{1} << 20;  // ring pipelining granularity
  // Every rank sends a heartbeat to every peer this often; a peer a collective needs that sends
  // nothing for heartbeat_timeout is reported hung (Unavailable naming it) long before `timeout`.
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds heartbeat_timeout{std::chrono::seconds(5)};
  // When every rank's address names the same host, collective data moves through shared-memory
  // rings (one per direction of each pair, POSIX shm) instead of loopback sockets; the sockets
  // still carry heartbeats, ABORT frames and a dead peer's EOF. The ranks agree on it when they
  // connect and fall back to the sockets when any of them cannot map a peer's segment (another
  // /dev/shm, as in two containers sharing one network namespace). Env DTRAIN_SHARED_MEMORY=0 turns
  // it off.
  bool shared_memory = true;
};

// Listens on addresses[rank], connects to every other rank, authenticates. Throws
// DeadlineExceeded naming the ranks that never showed up, PermissionDenied when a peer proves a
// different token, InvalidArgument for malformed addresses.
DTRAIN_API std::unique_ptr<Communicator> connect_tcp_group(const TcpGroupOptions& options);

}  // namespace dtrain
