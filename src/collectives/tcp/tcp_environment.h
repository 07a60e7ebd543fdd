// Private to src/collectives/tcp: the environment variables every TCP group honours, applied in one
// place (collective groups, parameter-server RPC servers and clients).
#pragma once

#include "dtrain/collectives/tcp.h"

namespace dtrain::tcp {

// `o` with the environment applied:
//   DTRAIN_SHARED_MEMORY=0       collective data over the sockets even between ranks of one host
//   DTRAIN_HEARTBEAT_TIMEOUT=S   a peer silent for S seconds (decimals allowed, >= 0.1) is hung;
//                                heartbeats are then sent at least every S/4
// Throws InvalidArgument naming the variable for a malformed value.
TcpGroupOptions apply_tcp_environment(TcpGroupOptions o);

}  // namespace dtrain::tcp
