// Callbacks' states (Callback::state_dict) in a backup: BackupAndRestore's file and elastic::run's
// commits. Private to src/train.
//
// The values go into the metadata as one JSON object, "dtrain.callbacks":
//   {"EarlyStopping(val_loss)": {"values": {"wait": 1, "best": 0.31}, "tensors": ["weights/..."]}}
// (non-finite values as the strings "inf", "-inf" and "nan"), each tensor as the entry
// "callbacks/<key>/<tensor name>".
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/strategies/strategy_extended.h"
#include "dtrain/train/callbacks.h"

namespace dtrain::detail {

inline constexpr const char* kCallbackStates = "dtrain.callbacks";
inline constexpr const char* kCallbackEntryPrefix = "callbacks/";

// Adds `states` (the empty ones left out) to a backup's metadata and tensors.
void put_callback_states(const std::map<std::string, CallbackState>& states,
                         std::map<std::string, std::string>& metadata,
                         std::vector<std::pair<std::string, Tensor>>& tensors);

// The states put there (none when the metadata has no "dtrain.callbacks": a backup made before
// callbacks kept state). `entries`: the backup's "callbacks/" entries. Throws DataLoss naming
// `where` when the JSON is malformed or names an entry that is not there.
std::map<std::string, CallbackState> take_callback_states(
    const std::map<std::string, std::string>& metadata,
    const std::vector<std::pair<std::string, Tensor>>& entries, const std::string& where);

// What `states` hold, without the values: every key, value name, tensor name, dtype and shape (the
// keys alone with keys_only), as a 60-bit fingerprint (elastic commits check that every worker's
// is the same) and as text (its keys, for the message when they differ).
uint64_t callback_states_layout(const std::map<std::string, CallbackState>& states,
                                bool keys_only = false);
std::string callback_states_keys(const std::map<std::string, CallbackState>& states);

// Each callback's key in a backup: state_key(), with "#2", "#3", ... appended to repeats in the
// list's order; "" for a callback without state.
std::vector<std::string> callback_state_keys(const std::vector<Callback*>& callbacks);

// fit(): gives each callback the state `states` holds under its key (after on_train_begin), and
// says once, as a WARNING, which states no callback of this fit() took.
void load_callback_states(const std::vector<Callback*>& callbacks,
                          const std::map<std::string, CallbackState>& states);

// fit() under a synchronous multi-worker strategy, before on_train_begin (collective: one small
// sum across the workers): throws FailedPrecondition naming them unless every worker runs the
// same callbacks that must_run_on_every_worker(), in the same order.
void check_callbacks_on_every_worker(const std::vector<Callback*>& callbacks,
                                     StrategyExtended& ext);

}  // namespace dtrain::detail
