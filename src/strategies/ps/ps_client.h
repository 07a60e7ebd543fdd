// Private to the parameter-server strategy: the client stub of one parameter server, one typed
// method per RPC of the PS protocol (ps_protocol.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/tcp/rpc.h"
#include "strategies/ps/ps_protocol.h"

namespace dtrain::ps {

// One authenticated connection to the parameter server `server` (an index into
// options.addresses). create() ... set_step() send a request and wait for its response. To have
// requests to several servers in flight at once, send() them all, then receive_*() each response
// (a server answers in request order). Throws what tcp::RpcClient throws (the server's error with
// its type, Unavailable, DeadlineExceeded) and DataLoss for a malformed response. Not thread-safe:
// one caller at a time.
class PsClient {
 public:
  PsClient(const TcpGroupOptions& options, int server) : rpc_(options, server) {}
  PsClient(const PsClient&) = delete;
  PsClient& operator=(const PsClient&) = delete;

  CreateResponse create(const CreateRequest& r) { return receive_create(send(r)); }
  LookupResponse lookup(const LookupRequest& r) { return receive_lookup(send(r)); }
  // into: see receive_pull().
  PullResponse pull(const PullRequest& r, const std::vector<Tensor>* into = nullptr) {
    return receive_pull(send(r), r, into);
  }
  PushResponse push(const PushRequest& r) { return receive_push(send(r)); }
  AssignResponse assign(const AssignRequest& r) { return receive_assign(send(r)); }
  ClockResponse clock(const ClockRequest& r) { return receive_clock(send(r)); }
  SetStepResponse set_step(const SetStepRequest& r) { return receive_set_step(send(r)); }

  // Sends a request; returns the id its response is received with.
  template <typename Request>
  uint64_t send(const Request& r) {
    return rpc_.send(encode(r));
  }
  CreateResponse receive_create(uint64_t id);
  LookupResponse receive_lookup(uint64_t id);
  // request: the pull sent as `id`. into: tensors the pulled values (value_0, slots_0..., value_1,
  // ...) are read straight into when shape and dtype match; the response then holds those same
  // tensors (compare raw_data()), saving a copy of large pulls.
  PullResponse receive_pull(uint64_t id, const PullRequest& request,
                            const std::vector<Tensor>* into = nullptr);
  PushResponse receive_push(uint64_t id);
  AssignResponse receive_assign(uint64_t id);
  ClockResponse receive_clock(uint64_t id);
  SetStepResponse receive_set_step(uint64_t id);

  const std::string& server_name() const { return rpc_.server_name(); }
  const std::string& server_address() const { return rpc_.server_address(); }

 private:
  tcp::RpcClient rpc_;
};

}  // namespace dtrain::ps
