// Private to the parameter-server strategy: the request methods of the PS RPC protocol. Fields
// are written with tcp::MetaWriter in the order given; tensors travel as RpcMessage::tensors.
#pragma once

#include <cstdint>

namespace dtrain::ps {

enum Method : uint16_t {
  // meta {key, updates i64}; tensors [value, slots...] -> meta {created u8}
  // Creates the variable unless it exists (then checks shape and dtype agree).
  kCreate = 1,
  // meta {key, wait_ms u64} -> meta {found u8[, dtype u8, rank u64, dims i64...]}
  kLookup = 2,
  // meta {with_slots u8, n u64, keys...} -> meta {per key: updates i64, slots u64};
  // tensors [value_0, (slots_0...), value_1, ...] (slots only when with_slots)
  kPull = 3,
  // meta {optimizer config, step_increment u64, n u64, keys...}; tensors [grad per key]
  // -> meta {global_step i64}
  kPush = 4,
  // meta {mode u8 (0 set, 1 add, 2 sub), key}; tensors [value] -> meta {}
  kAssign = 5,
  // meta {step i64, done u8} -> meta {min_active_step i64, global_step i64, n u64, per training
  // worker rank < n: state u8 (0 never seen, 1 active, 2 done, 3 gone)}
  kClock = 6,
  // meta {step i64} -> meta {global_step i64}: sets the global step when it is still 0.
  kSetStep = 7,
};

enum WorkerState : uint8_t { kNeverSeen = 0, kActive = 1, kDone = 2, kGone = 3 };

}  // namespace dtrain::ps
