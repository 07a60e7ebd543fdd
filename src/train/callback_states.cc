// Callbacks' states in a backup (callback_states.h).
#include "train/callback_states.h"

#include <cxxabi.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <set>
#include <typeinfo>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::detail {
namespace {

nlohmann::json encode(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;  // nlohmann writes the shortest text that reads back as the same double
}

double decode(const nlohmann::json& j) {
  if (j.is_number()) return j.get<double>();
  const std::string s = j.get<std::string>();
  if (s == "nan") return NAN;
  if (s == "inf") return INFINITY;
  if (s == "-inf") return -INFINITY;
  throw DataLoss("'" + s + "' is not a number");
}

// A callback's name in messages: its state_key(), else its type's without namespaces
// ("BackupAndRestore").
std::string describe(const Callback& c) {
  if (std::string key = c.state_key(); !key.empty()) return key;
  int status = 0;
  char* name = abi::__cxa_demangle(typeid(c).name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name ? name : typeid(c).name();
  std::free(name);
  const size_t colons = out.rfind("::", out.find('<'));
  return colons == std::string::npos ? out : out.substr(colons + 2);
}

}  // namespace

void put_callback_states(const std::map<std::string, CallbackState>& states,
                         std::map<std::string, std::string>& metadata,
                         std::vector<std::pair<std::string, Tensor>>& tensors) {
  nlohmann::json all = nlohmann::json::object();
  for (const auto& [key, state] : states) {
    if (state.empty()) continue;  // nothing to give back
    nlohmann::json values = nlohmann::json::object();
    for (const auto& [name, v] : state.values) values[name] = encode(v);
    nlohmann::json names = nlohmann::json::array();
    for (const auto& [name, t] : state.tensors) {
      names.push_back(name);
      tensors.emplace_back(kCallbackEntryPrefix + key + "/" + name, t.to(DeviceSpec::cpu()));
    }
    all[key] = {{"values", values}, {"tensors", names}};
  }
  if (!all.empty()) metadata[kCallbackStates] = all.dump();
}

std::map<std::string, CallbackState> take_callback_states(
    const std::map<std::string, std::string>& metadata,
    const std::vector<std::pair<std::string, Tensor>>& entries, const std::string& where) {
  std::map<std::string, CallbackState> states;
  const auto it = metadata.find(kCallbackStates);
  if (it == metadata.end()) return states;
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : entries) by_name[name] = &t;
  try {
    const nlohmann::json all = nlohmann::json::parse(it->second);
    for (const auto& [key, j] : all.items()) {
      CallbackState& s = states[key];
      for (const auto& [name, v] : j.at("values").items()) {
        try {
          s.values[name] = decode(v);
        } catch (const DataLoss& e) {
          throw DataLoss(where + ": callback state '" + key + "', value '" + name +
                         "': " + e.what());
        }
      }
      for (const auto& n : j.at("tensors")) {
        const std::string name = n.get<std::string>();
        const auto t = by_name.find(kCallbackEntryPrefix + key + "/" + name);
        if (t == by_name.end())
          throw DataLoss(where + ": callback state '" + key + "' names tensor '" + name +
                         "', which is not there (entry '" + kCallbackEntryPrefix + key + "/" +
                         name + "')");
        s.tensors[name] = *t->second;
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw DataLoss(where + ": the callbacks' states ('" + std::string(kCallbackStates) +
                   "') are not valid: " + e.what());
  }
  return states;
}

uint64_t callback_states_layout(const std::map<std::string, CallbackState>& states,
                                bool keys_only) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a
  auto mix = [&h](const std::string& s) {
    for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // a separator no name holds
  };
  for (const auto& [key, state] : states) {
    mix(key);
    if (keys_only) continue;
    for (const auto& [name, v] : state.values) mix("v:" + name);
    for (const auto& [name, t] : state.tensors)
      mix("t:" + name + ":" + dtype_name(t.dtype()) + t.shape().to_string());
  }
  return h >> 4;
}

std::string callback_states_keys(const std::map<std::string, CallbackState>& states) {
  std::string keys;
  for (const auto& [key, state] : states)
    keys += (keys.empty() ? "" : ", ") + key + " (" + std::to_string(state.values.size()) +
            " values, " + std::to_string(state.tensors.size()) + " tensors)";
  return keys.empty() ? "none" : keys;
}

std::vector<std::string> callback_state_keys(const std::vector<Callback*>& callbacks) {
  std::vector<std::string> keys;
  std::map<std::string, int> seen;
  for (const Callback* c : callbacks) {
    std::string key = c->state_key();
    if (!key.empty())
      if (const int n = ++seen[key]; n > 1) key.append("#").append(std::to_string(n));
    keys.push_back(std::move(key));
  }
  return keys;
}

void load_callback_states(const std::vector<Callback*>& callbacks,
                          const std::map<std::string, CallbackState>& states) {
  if (states.empty()) return;
  const std::vector<std::string> keys = callback_state_keys(callbacks);
  std::set<std::string> taken;
  for (size_t i = 0; i < callbacks.size(); ++i) {
    if (keys[i].empty()) continue;
    const auto it = states.find(keys[i]);
    if (it == states.end()) continue;
    callbacks[i]->load_state_dict(it->second);
    taken.insert(keys[i]);
  }
  std::string left;
  for (const auto& [key, s] : states)
    if (!taken.count(key)) left += (left.empty() ? "'" : ", '") + key + "'";
  if (!left.empty()) {
    DTRAIN_LOG(WARNING) << "the restored backup holds the state of " << left
                        << ", which no callback of this fit() has (the callbacks changed since); "
                           "it is dropped";
  }
}

void check_callbacks_on_every_worker(const std::vector<Callback*>& callbacks,
                                     StrategyExtended& ext) {
  std::vector<std::string> mine;
  uint64_t h = 14695981039346656037ull;  // FNV-1a of their names, in order
  for (const Callback* c : callbacks) {
    if (!c->must_run_on_every_worker()) continue;
    mine.push_back(describe(*c));
    for (const char ch : mine.back()) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;
  }
  // Each worker's fingerprint (53 bits: exact in a double) and count in its own slots, zeros
  // elsewhere: every worker learns every worker's, exactly.
  const int n = ext.num_workers(), rank = ext.worker_rank();
  std::vector<double> v(2 * static_cast<size_t>(n), 0.0);
  v[static_cast<size_t>(rank)] = static_cast<double>(h >> 11);
  v[static_cast<size_t>(n + rank)] = static_cast<double>(mine.size());
  v = ext.sum_across_workers(std::move(v));
  std::string others;
  for (int w = 0; w < n; ++w) {
    if (v[static_cast<size_t>(w)] == v[static_cast<size_t>(rank)]) continue;
    const auto count = static_cast<int64_t>(v[static_cast<size_t>(n + w)]);
    others += (others.empty() ? "" : "; ") + std::string("worker ") + std::to_string(w) + " runs " +
              (count == 0 ? "none" : std::to_string(count)) +
              (count == static_cast<int64_t>(mine.size()) ? ", others or in another order" : "");
  }
  if (others.empty()) return;
  std::string names;
  for (const std::string& m : mine) names += (names.empty() ? "" : ", ") + m;
  throw FailedPrecondition(
      "fit(): the workers run different callbacks where every worker must run the same: this "
      "worker (" +
      std::to_string(rank) + ") runs " + (names.empty() ? "none" : names) + "; " + others +
      ". Such callbacks take part in collectives (a checkpoint of sharded state, "
      "BackupAndRestore) or change what the replicas train with (the learning rate, "
      "EarlyStopping's restored weights): give them to every worker, in the same order (only the "
      "chief writes files). Callbacks that only print or log may run on some workers only.");
}

}  // namespace dtrain::detail
