// Private to the parameter-server strategy: the PS RPC protocol, one typed request and response per
// method, and the only code that writes or reads their bytes (ps_protocol.cc).
//
// Every message is a tcp::RpcMessage: the method number, a "meta" byte string of the fields below
// written with tcp::MetaWriter in the order given, and the tensors listed, sent raw as
// RpcMessage::tensors (the structs hold tensor handles, so encoding and decoding copy no tensor
// data).
//
//   method    request meta; tensors                          response meta; tensors
//   kCreate   {key, updates i64, slot_names};                {created u8}
//             [value, slots...]
//   kLookup   {key, wait_ms u64}                             {found u8[, dtype u8, rank u64,
//                                                             dims i64...]}
//   kPull     {with_slots u8, n u64, keys...}                {per key: updates i64, slots u64,
//                                                             slot_names};
//                                                            [value_0, (slots_0...), value_1, ...]
//   kPush     {optimizer config, step_increment u64,         {global_step i64}
//              n u64, keys...}; [grad per key]
//   kAssign   {mode u8, key}; [value]                        {}
//   kClock    {step i64, done u8}                            {min_active_step i64, global_step i64,
//                                                             n u64, state u8 per training worker}
//   kSetStep  {step i64}                                     {global_step i64}
//
// Decoders check everything they read: DataLoss when the meta is short, oversized or has trailing
// bytes (or a response is inconsistent), InvalidArgument when a request is well formed but cannot
// be served (the server answers it with that error). A request decoder names the message
// ("push request"); a response decoder takes the server's name ("ps:1").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/tcp/rpc.h"
#include "dtrain/core/tensor.h"

namespace dtrain::ps {

enum Method : uint16_t {
  kCreate = 1,
  kLookup = 2,
  kPull = 3,
  kPush = 4,
  kAssign = 5,
  kClock = 6,
  kSetStep = 7,
};

// A training worker as ps:0's clock sees it.
enum WorkerState : uint8_t { kNeverSeen = 0, kActive = 1, kDone = 2, kGone = 3 };

// Bounds the decoders enforce.
inline constexpr uint64_t kMaxPullKeys = 1u << 16;  // keys in one pull request
inline constexpr uint64_t kMaxSlots = 16;           // optimizer slots of one pulled variable
inline constexpr uint64_t kMaxRank = 8;             // of a looked-up variable
inline constexpr uint64_t kMaxWorkers = 1u << 20;   // in a clock response

// kCreate: creates the variable unless it exists (then the server checks shape and dtype agree).
struct CreateRequest {
  std::string key;
  int64_t updates = 0;  // optimizer steps already applied (restored from a checkpoint)
  Tensor value;
  std::vector<Tensor> slots;  // restored optimizer slots, shaped like value
  std::string slot_names;     // what they are (UpdateRule::slot_names, comma-joined)
};
struct CreateResponse {
  bool created = false;  // false: it existed
};

// kLookup: waits up to wait_ms (the server caps it) for the variable to be created.
struct LookupRequest {
  std::string key;
  uint64_t wait_ms = 0;
};
struct LookupResponse {
  bool found = false;
  DType dtype = DType::kFloat32;  // when found
  Shape shape;                    // when found
};

// kPull: the current values (and, with_slots, the optimizer slots) of the keys, in order.
struct PullRequest {
  bool with_slots = false;
  std::vector<std::string> keys;
};
struct PulledVariable {
  int64_t updates = 0;
  Tensor value;
  std::vector<Tensor> slots;  // empty unless the request asked for them
  std::string slot_names;     // what they are (UpdateRule::slot_names, comma-joined)
};
struct PullResponse {
  std::vector<PulledVariable> vars;  // one per requested key
};

// kPush: applies one gradient per key with the optimizer the config describes, and adds
// step_increment to the global step.
struct PushRequest {
  std::string optimizer_config;
  uint64_t step_increment = 0;
  std::vector<std::string> keys;
  std::vector<Tensor> grads;  // one per key
};
struct PushResponse {
  int64_t global_step = 0;
};

// kAssign: sets the variable, or adds or subtracts the value, atomically on the server.
enum class AssignMode : uint8_t { kSet = 0, kAdd = 1, kSub = 2 };
struct AssignRequest {
  AssignMode mode = AssignMode::kSet;
  std::string key;
  Tensor value;
};
struct AssignResponse {};

// kClock: reports this worker's step (and whether it is done); answers with ps:0's view of the
// training workers.
struct ClockRequest {
  int64_t step = 0;
  bool done = false;
};
struct ClockResponse {
  int64_t min_active_step = 0;  // the slowest active worker other than the caller (else its step)
  int64_t global_step = 0;
  std::vector<WorkerState> states;  // per training worker rank
};

// kSetStep: sets the global step when it is still 0.
struct SetStepRequest {
  int64_t step = 0;
};
struct SetStepResponse {
  int64_t global_step = 0;
};

tcp::RpcMessage encode(const CreateRequest& r);
tcp::RpcMessage encode(const LookupRequest& r);
tcp::RpcMessage encode(const PullRequest& r);
tcp::RpcMessage encode(const PushRequest& r);
tcp::RpcMessage encode(const AssignRequest& r);
tcp::RpcMessage encode(const ClockRequest& r);
tcp::RpcMessage encode(const SetStepRequest& r);

CreateRequest decode_create_request(const tcp::RpcMessage& m);
LookupRequest decode_lookup_request(const tcp::RpcMessage& m);
PullRequest decode_pull_request(const tcp::RpcMessage& m);
PushRequest decode_push_request(const tcp::RpcMessage& m);
AssignRequest decode_assign_request(const tcp::RpcMessage& m);
ClockRequest decode_clock_request(const tcp::RpcMessage& m);
SetStepRequest decode_set_step_request(const tcp::RpcMessage& m);

tcp::RpcMessage encode(const CreateResponse& r);
tcp::RpcMessage encode(const LookupResponse& r);
tcp::RpcMessage encode(const PullResponse& r);
tcp::RpcMessage encode(const PushResponse& r);
tcp::RpcMessage encode(const AssignResponse& r);
tcp::RpcMessage encode(const ClockResponse& r);
tcp::RpcMessage encode(const SetStepResponse& r);

CreateResponse decode_create_response(const tcp::RpcMessage& m, const std::string& from);
LookupResponse decode_lookup_response(const tcp::RpcMessage& m, const std::string& from);
// `request`: the pull this answers (the response has one variable per key, slots only if asked).
PullResponse decode_pull_response(const tcp::RpcMessage& m, const PullRequest& request,
                                  const std::string& from);
PushResponse decode_push_response(const tcp::RpcMessage& m, const std::string& from);
AssignResponse decode_assign_response(const tcp::RpcMessage& m, const std::string& from);
ClockResponse decode_clock_response(const tcp::RpcMessage& m, const std::string& from);
SetStepResponse decode_set_step_response(const tcp::RpcMessage& m, const std::string& from);

}  // namespace dtrain::ps
