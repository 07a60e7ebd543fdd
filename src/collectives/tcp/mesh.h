// Private to src/collectives/tcp: builds the authenticated full mesh of connections.
#pragma once

#include <vector>

#include "collectives/tcp/io.h"
#include "dtrain/collectives/tcp.h"

namespace dtrain::tcp {

// peers[r] is the connection to rank r (fd -1 for ourselves). See tcp.h for the errors.
std::vector<Peer> build_mesh(const TcpGroupOptions& options);

}  // namespace dtrain::tcp
