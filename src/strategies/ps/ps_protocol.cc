// The PS protocol's encoders and decoders (the wire format is in ps_protocol.h). The only place
// that writes or reads a PS message's meta bytes.
#include "strategies/ps/ps_protocol.h"

#include "dtrain/core/error.h"

namespace dtrain::ps {

using tcp::MetaReader;
using tcp::MetaWriter;
using tcp::RpcMessage;

namespace {

RpcMessage message(Method method, std::string meta, std::vector<Tensor> tensors = {}) {
  RpcMessage m;
  m.method = method;
  m.meta = std::move(meta);
  m.tensors = std::move(tensors);
  return m;
}

std::string response_of(const char* method, const std::string& from) {
  return std::string(method) + " response from " + from;
}

}  // namespace

// --- Requests --------------------------------------------------------------------------------

RpcMessage encode(const CreateRequest& r) {
  std::vector<Tensor> tensors{r.value};
  tensors.insert(tensors.end(), r.slots.begin(), r.slots.end());
  return message(kCreate, MetaWriter().str(r.key).i64(r.updates).str(r.slot_names).take(),
                 std::move(tensors));
}

CreateRequest decode_create_request(const RpcMessage& m) {
  MetaReader r(m.meta, "create request");
  CreateRequest out;
  out.key = r.str();
  out.updates = r.i64();
  out.slot_names = r.str();
  r.expect_end();
  if (m.tensors.empty()) throw InvalidArgument("create '" + out.key + "' carries no initial value");
  out.value = m.tensors[0];
  out.slots.assign(m.tensors.begin() + 1, m.tensors.end());
  return out;
}

RpcMessage encode(const LookupRequest& r) {
  return message(kLookup, MetaWriter().str(r.key).u64(r.wait_ms).take());
}

LookupRequest decode_lookup_request(const RpcMessage& m) {
  MetaReader r(m.meta, "lookup request");
  LookupRequest out;
  out.key = r.str();
  out.wait_ms = r.u64();
  r.expect_end();
  return out;
}

RpcMessage encode(const PullRequest& r) {
  MetaWriter w;
  w.u8(r.with_slots ? 1 : 0).u64(r.keys.size());
  for (const auto& k : r.keys) w.str(k);
  return message(kPull, w.take());
}

PullRequest decode_pull_request(const RpcMessage& m) {
  MetaReader r(m.meta, "pull request");
  PullRequest out;
  out.with_slots = r.u8() != 0;
  const uint64_t n = r.u64();
  if (n > kMaxPullKeys) throw InvalidArgument(detail::str_cat("pull of ", n, " variables"));
  for (uint64_t i = 0; i < n; ++i) out.keys.push_back(r.str());
  r.expect_end();
  return out;
}

RpcMessage encode(const PushRequest& r) {
  MetaWriter w;
  w.str(r.optimizer_config).u64(r.step_increment).u64(r.keys.size());
  for (const auto& k : r.keys) w.str(k);
  return message(kPush, w.take(), r.grads);
}

PushRequest decode_push_request(const RpcMessage& m) {
  MetaReader r(m.meta, "push request");
  PushRequest out;
  out.optimizer_config = r.str();
  out.step_increment = r.u64();
  const uint64_t n = r.u64();
  if (n != m.tensors.size())
    throw InvalidArgument(
        detail::str_cat("push of ", n, " variables carries ", m.tensors.size(), " gradients"));
  for (uint64_t i = 0; i < n; ++i) out.keys.push_back(r.str());
  r.expect_end();
  out.grads = m.tensors;
  return out;
}

RpcMessage encode(const AssignRequest& r) {
  return message(kAssign, MetaWriter().u8(static_cast<uint8_t>(r.mode)).str(r.key).take(),
                 {r.value});
}

AssignRequest decode_assign_request(const RpcMessage& m) {
  MetaReader r(m.meta, "assign request");
  const uint8_t mode = r.u8();
  AssignRequest out;
  out.key = r.str();
  r.expect_end();
  if (mode > static_cast<uint8_t>(AssignMode::kSub) || m.tensors.size() != 1)
    throw InvalidArgument("malformed assign request for '" + out.key + "'");
  out.mode = static_cast<AssignMode>(mode);
  out.value = m.tensors[0];
  return out;
}

RpcMessage encode(const ClockRequest& r) {
  return message(kClock, MetaWriter().i64(r.step).u8(r.done ? 1 : 0).take());
}

ClockRequest decode_clock_request(const RpcMessage& m) {
  MetaReader r(m.meta, "clock request");
  ClockRequest out;
  out.step = r.i64();
  out.done = r.u8() != 0;
  r.expect_end();
  return out;
}

RpcMessage encode(const SetStepRequest& r) {
  return message(kSetStep, MetaWriter().i64(r.step).take());
}

SetStepRequest decode_set_step_request(const RpcMessage& m) {
  MetaReader r(m.meta, "set-step request");
  SetStepRequest out;
  out.step = r.i64();
  r.expect_end();
  return out;
}

// --- Responses -------------------------------------------------------------------------------

RpcMessage encode(const CreateResponse& r) {
  return message(kCreate, MetaWriter().u8(r.created ? 1 : 0).take());
}

CreateResponse decode_create_response(const RpcMessage& m, const std::string& from) {
  MetaReader r(m.meta, response_of("create", from));
  CreateResponse out;
  out.created = r.u8() != 0;
  r.expect_end();
  return out;
}

RpcMessage encode(const LookupResponse& r) {
  MetaWriter w;
  w.u8(r.found ? 1 : 0);
  if (r.found) {
    w.u8(static_cast<uint8_t>(r.dtype)).u64(static_cast<uint64_t>(r.shape.rank()));
    for (int64_t d : r.shape.dims()) w.i64(d);
  }
  return message(kLookup, w.take());
}

LookupResponse decode_lookup_response(const RpcMessage& m, const std::string& from) {
  MetaReader r(m.meta, response_of("lookup", from));
  LookupResponse out;
  out.found = r.u8() != 0;
  if (out.found) {
    out.dtype = static_cast<DType>(r.u8());
    const uint64_t rank = r.u64();
    if (rank > kMaxRank)
      throw DataLoss("lookup response from " + from + " has rank " + std::to_string(rank));
    std::vector<int64_t> dims(rank);
    for (auto& d : dims) d = r.i64();
    out.shape = Shape(std::move(dims));
  }
  r.expect_end();
  return out;
}

RpcMessage encode(const PullResponse& r) {
  MetaWriter w;
  std::vector<Tensor> tensors;
  for (const PulledVariable& v : r.vars) {
    w.i64(v.updates).u64(v.slots.size()).str(v.slot_names);
    tensors.push_back(v.value);
    tensors.insert(tensors.end(), v.slots.begin(), v.slots.end());
  }
  return message(kPull, w.take(), std::move(tensors));
}

PullResponse decode_pull_response(const RpcMessage& m, const PullRequest& request,
                                  const std::string& from) {
  MetaReader r(m.meta, response_of("pull", from));
  const size_t n = request.keys.size();
  PullResponse out;
  out.vars.resize(n);
  std::vector<uint64_t> slots(n);
  uint64_t tensors = 0;
  for (size_t i = 0; i < n; ++i) {
    out.vars[i].updates = r.i64();
    slots[i] = r.u64();
    out.vars[i].slot_names = r.str();
    if (slots[i] > (request.with_slots ? kMaxSlots : 0))
      throw DataLoss(detail::str_cat(
          "pull response from ", from, " lists ", slots[i], " slots for '", request.keys[i],
          request.with_slots ? "'" : "', which the pull did not ask for"));
    tensors += 1 + slots[i];
  }
  r.expect_end();
  if (tensors != m.tensors.size())
    throw DataLoss(detail::str_cat(
        from, " answered a pull of ", n, " shards with ", m.tensors.size(), " tensors",
        tensors == n ? "" : detail::str_cat(" (", tensors, " with their slots)")));
  auto next = m.tensors.begin();
  for (size_t i = 0; i < n; ++i) {
    out.vars[i].value = *next++;
    out.vars[i].slots.assign(next, next + static_cast<std::ptrdiff_t>(slots[i]));
    next += static_cast<std::ptrdiff_t>(slots[i]);
  }
  return out;
}

RpcMessage encode(const PushResponse& r) {
  return message(kPush, MetaWriter().i64(r.global_step).take());
}

PushResponse decode_push_response(const RpcMessage& m, const std::string& from) {
  MetaReader r(m.meta, response_of("push", from));
  PushResponse out;
  out.global_step = r.i64();
  r.expect_end();
  return out;
}

RpcMessage encode(const AssignResponse&) { return message(kAssign, std::string()); }

AssignResponse decode_assign_response(const RpcMessage& m, const std::string& from) {
  MetaReader(m.meta, response_of("assign", from)).expect_end();
  return AssignResponse{};
}

RpcMessage encode(const ClockResponse& r) {
  MetaWriter w;
  w.i64(r.min_active_step).i64(r.global_step).u64(r.states.size());
  for (WorkerState s : r.states) w.u8(s);
  return message(kClock, w.take());
}

ClockResponse decode_clock_response(const RpcMessage& m, const std::string& from) {
  MetaReader r(m.meta, response_of("clock", from));
  ClockResponse out;
  out.min_active_step = r.i64();
  out.global_step = r.i64();
  const uint64_t n = r.u64();
  if (n > kMaxWorkers)
    throw DataLoss("clock response from " + from + " lists " + std::to_string(n) + " workers");
  for (uint64_t i = 0; i < n; ++i) out.states.push_back(static_cast<WorkerState>(r.u8()));
  r.expect_end();
  return out;
}

RpcMessage encode(const SetStepResponse& r) {
  return message(kSetStep, MetaWriter().i64(r.global_step).take());
}

SetStepResponse decode_set_step_response(const RpcMessage& m, const std::string& from) {
  MetaReader r(m.meta, response_of("set-step", from));
  SetStepResponse out;
  out.global_step = r.i64();
  r.expect_end();
  return out;
}

}  // namespace dtrain::ps
