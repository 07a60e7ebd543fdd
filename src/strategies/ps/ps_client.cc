#include "strategies/ps/ps_client.h"

namespace dtrain::ps {

// Each response is received into a named message: the decoders' MetaReader keeps a reference.

CreateResponse PsClient::receive_create(uint64_t id) {
  const tcp::RpcMessage m = rpc_.receive(id);
  return decode_create_response(m, server_name());
}

LookupResponse PsClient::receive_lookup(uint64_t id) {
  const tcp::RpcMessage m = rpc_.receive(id);
  return decode_lookup_response(m, server_name());
}

PullResponse PsClient::receive_pull(uint64_t id, const PullRequest& request,
                                    const std::vector<Tensor>* into) {
  const tcp::RpcMessage m = rpc_.receive(id, into);
  return decode_pull_response(m, request, server_name());
}

PushResponse PsClient::receive_push(uint64_t id) {
  const tcp::RpcMessage m = rpc_.receive(id);
  return decode_push_response(m, server_name());
}

AssignResponse PsClient::receive_assign(uint64_t id) {
  const tcp::RpcMessage m = rpc_.receive(id);
  return decode_assign_response(m, server_name());
}

ClockResponse PsClient::receive_clock(uint64_t id) {
  const tcp::RpcMessage m = rpc_.receive(id);
  return decode_clock_response(m, server_name());
}

SetStepResponse PsClient::receive_set_step(uint64_t id) {
  const tcp::RpcMessage m = rpc_.receive(id);
  return decode_set_step_response(m, server_name());
}

}  // namespace dtrain::ps
