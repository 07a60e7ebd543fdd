// Private to src/collectives/tcp and the parameter-server RPC: authenticating a fresh connection
// with the job token, and the fingerprint that makes tasks of different jobs refuse each other.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/tcp/io.h"
#include "dtrain/collectives/tcp.h"

namespace dtrain::tcp {

// FNV-1a over the ordered address list: tasks started with different clusters disagree on it.
uint64_t job_fingerprint(const std::vector<std::string>& addresses);
// o.task_names[r], else "rank r".
std::string name_of(const TcpGroupOptions& o, int r);
// Runs the mutual handshake on a fresh connection and fills p.rank / p.name. `expected` is the
// rank we dialed, or -1 when accepting; an acceptor takes any rank when `any_rank` (RPC servers),
// else only ranks above its own (the mesh). Returns the peer's rank. Throws PermissionDenied for a
// wrong token, world size or job (after telling the peer why), DataLoss for a malformed handshake,
// Unavailable / DeadlineExceeded from the socket. `heard`, when given, is set once the peer's Hello
// has arrived: a dialer whose connection closed before that met no live acceptor (a listener that
// was closing), which is worth dialing again.
int authenticate(Peer& p, const TcpGroupOptions& o, uint64_t fingerprint, int expected,
                 bool any_rank, Clock::time_point deadline, bool* heard = nullptr);

}  // namespace dtrain::tcp
