// CommittedState and its restore plan (elastic_state.h).
#include "train/elastic_state.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <typeinfo>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "train/callback_states.h"

namespace dtrain::elastic::detail {

namespace {
constexpr const char* kLearningRate = "dtrain.learning_rate";
}  // namespace

std::optional<RestorePlan> plan_restore(const std::vector<std::vector<CommitTag>>& held) {
  std::vector<CommitTag> candidates;
  for (const auto& h : held)
    for (const CommitTag& t : h)
      if (t.workers > 0 && t.copies > 0 &&
          std::none_of(candidates.begin(), candidates.end(),
                       [&](const CommitTag& c) { return c.same_commit(t); }))
        candidates.push_back(t);
  if (candidates.empty()) return std::nullopt;
  std::sort(candidates.begin(), candidates.end(), [](const CommitTag& a, const CommitTag& b) {
    return a.global_step != b.global_step ? a.global_step > b.global_step : a.round > b.round;
  });
  std::string why;
  for (const CommitTag& c : candidates) {
    RestorePlan plan;
    plan.commit = c;
    plan.source = -1;
    const int w = c.workers;
    plan.piece_from.assign(static_cast<size_t>(w), -1);
    plan.piece_index.assign(static_cast<size_t>(w), -1);
    plan.piece_slot.assign(static_cast<size_t>(w), -1);
    std::vector<int> load(held.size(), 0);
    std::vector<int> lost;
    for (int k = 0; k < w; ++k) {
      int from = -1, index = -1;
      for (size_t r = 0; r < held.size(); ++r)
        for (const CommitTag& t : held[r]) {
          if (!t.same_commit(c)) continue;
          const int i = ((k - t.rank) % w + w) % w;  // the holder's i-th piece is piece k
          if (i < t.copies && (from < 0 || load[r] < load[static_cast<size_t>(from)])) {
            from = static_cast<int>(r);
            index = i;
          }
        }
      if (from < 0) {
        lost.push_back(k);
        continue;
      }
      plan.piece_from[static_cast<size_t>(k)] = from;
      plan.piece_index[static_cast<size_t>(k)] = index;
      plan.piece_slot[static_cast<size_t>(k)] = load[static_cast<size_t>(from)]++;
    }
    if (lost.empty()) {
      for (size_t r = 0; r < held.size() && plan.source < 0; ++r)
        for (const CommitTag& t : held[r])
          if (t.same_commit(c)) {
            plan.source = static_cast<int>(r);
            plan.commit.rank = t.rank;
          }
      plan.slots = *std::max_element(load.begin(), load.end());
      return plan;
    }
    if (why.empty()) {
      why = "the commit at global step " + std::to_string(c.global_step) + " (round " +
            std::to_string(c.round) + ", " + std::to_string(w) + " workers, each keeping " +
            std::to_string(c.copies) + " of its pieces) lost piece(s)";
      for (int k : lost) why.append(1, ' ').append(std::to_string(k));
      why += ": the workers that kept them have all left";
    }
  }
  throw DataLoss(
      "elastic: the committed state cannot be rebuilt from the workers of this round: " + why +
      ". Sharded jobs keep each piece on two neighbouring workers: two neighbours that "
      "leave together take a piece with them. Restart from a checkpoint "
      "(BackupAndRestore, ModelCheckpoint)");
}

uint64_t content_hash(const Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.raw_data());
  const size_t n = t.nbytes();
  uint64_t h = 1469598103934665603ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h ^ n;
}

CommittedState::CommittedState(MultiWorkerMirroredStrategy& strategy, Model& model,
                               Optimizer& optimizer)
    : strategy_(strategy), model_(model), optimizer_(optimizer) {}

CommittedState::Entry CommittedState::keep(const std::string& name, const Tensor& whole,
                                           const CommitTag& tag) const {
  const Tensor host = whole.to(DeviceSpec::cpu());
  const Tensor flat = host.view(Shape{host.numel()});
  Entry e{name, whole.dtype(), whole.shape(), content_hash(host), {}};
  for (int j = 0; j < tag.copies; ++j) {
    const auto [b, end] = partition_range(host.numel(), (tag.rank + j) % tag.workers, tag.workers);
    e.pieces.push_back(flat.slice_rows(b, end).clone());
  }
  return e;
}

void CommittedState::commit(int64_t round, const TrainingPosition& p,
                            const std::map<std::string, std::string>& extra, bool first,
                            const std::map<std::string, CallbackState>& callbacks) {
  CheckpointData d = Checkpoint(model_, &optimizer_, &strategy_).capture(p, extra);
  dtrain::detail::put_callback_states(callbacks, d.metadata, d.tensors);
  // The rate in effect (a LearningRateScheduler's, or one set in on_reset): survivors hold the one
  // of the step they reached, newcomers the initial one; all go on with the commit's.
  // Not a LearningRateWarmup's warming rate (a kind of its own): the warm-up puts the user's
  // schedule back itself after a reset, and targets the user's rate again.
  if (const LearningRateSchedule* schedule = optimizer_.schedule().get();
      schedule && typeid(*schedule) == typeid(ConstantSchedule)) {
    char rate[32];
    std::snprintf(rate, sizeof(rate), "%.9g", static_cast<double>(optimizer_.learning_rate()));
    d.metadata[kLearningRate] = rate;  // 9 digits: the float again, exactly
  }
  const int workers = strategy_.extended().num_workers(), rank = strategy_.extended().worker_rank();
  const bool sharded = strategy_.update_partition().has_value();
  // The first commit is rank 0's alone, whole: the job starts from its state, whatever the others
  // were initialized with (they still take part in the gathers of sharded entries).
  const bool here = !first || rank == 0;
  Held h;
  h.tag = CommitTag{round, p.global_step, workers, rank,
                    sharded && !first ? std::min(2, workers) : workers};
  h.metadata = d.metadata;
  for (const auto& [name, t] : d.tensors)
    if (here) h.entries.push_back(keep(name, t, h.tag));
  for (const auto& st : d.streamed) {
    const Tensor whole = st.produce();
    if (here) h.entries.push_back(keep(st.name, whole, h.tag));
  }
  if (!here) return;
  // A commit that gathered (sharded) may be complete here and not on a worker that failed in it:
  // the one before stays until the next.
  if (!d.streamed.empty())
    previous_ = std::move(current_);
  else
    previous_.reset();
  current_ = std::move(h);
}

Tensor CommittedState::rebuild(const RestorePlan& plan, const Held* mine, const Entry& d,
                               size_t index, Held& next) {
  StrategyExtended& ext = strategy_.extended();
  const int me = ext.worker_rank(), w = plan.commit.workers;
  const int64_t count = d.shape.numel();
  const int64_t longest = (count + w - 1) / w;
  const int64_t row = std::max<int64_t>(1, plan.slots * longest);
  // This worker's row of the all-gather: the pieces the plan asks it for, in its slots.
  Tensor buf = Tensor::zeros(Shape{row}, d.dtype);
  for (int k = 0; k < w; ++k) {
    const auto ku = static_cast<size_t>(k);
    if (plan.piece_from[ku] != me) continue;
    const Entry& m = mine->entries[index];
    if (m.name != d.name)
      throw Internal("elastic: commit entry " + std::to_string(index) + " is '" + m.name +
                     "' here, '" + d.name + "' at the source");
    const Tensor& piece = m.pieces[static_cast<size_t>(plan.piece_index[ku])];
    const int64_t at = plan.piece_slot[ku] * longest;
    if (piece.numel() > 0) buf.slice_rows(at, at + piece.numel()).copy_from(piece);
  }
  const Tensor all = ext.gather_across_workers(buf);
  Tensor whole = Tensor::empty(Shape{count}, d.dtype);
  for (int k = 0; k < w; ++k) {
    const auto [b, e] = partition_range(count, k, w);
    const auto ku = static_cast<size_t>(k);
    const int64_t at = plan.piece_from[ku] * row + plan.piece_slot[ku] * longest;
    if (e > b) whole.slice_rows(b, e).copy_from(all.slice_rows(at, at + e - b));
  }
  if (content_hash(whole) != d.hash)
    throw DataLoss("elastic: '" + d.name +
                   "' rebuilt from the workers' pieces differs from what was committed (hash "
                   "mismatch): a piece was corrupted or came from another commit");
  // Kept with its shape: a reset before this round's first commit restores from it.
  next.entries.push_back(keep(d.name, whole.view(d.shape), next.tag));
  return whole.view(d.shape);
}

TrainingPosition CommittedState::restore(int64_t round,
                                         std::map<std::string, std::string>* metadata,
                                         std::map<std::string, CallbackState>* callbacks) {
  StrategyExtended& ext = strategy_.extended();
  const int n = ext.num_workers(), me = ext.worker_rank();
  // 1. What every worker holds.
  constexpr int kFields = 5, kHeld = 2;
  std::vector<double> v(static_cast<size_t>(n * kHeld * kFields), 0.0);
  int i = 0;
  for (const std::optional<Held>* h : {&current_, &previous_}) {
    if (!*h) continue;
    const CommitTag& t = (*h)->tag;
    double* f = &v[static_cast<size_t>((me * kHeld + i++) * kFields)];
    f[0] = static_cast<double>(t.round);
    f[1] = static_cast<double>(t.global_step);
    f[2] = t.workers;
    f[3] = t.rank;
    f[4] = t.copies;
  }
  v = ext.sum_across_workers(std::move(v));
  std::vector<std::vector<CommitTag>> held(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < kHeld; ++j) {
      const double* f = &v[static_cast<size_t>((r * kHeld + j) * kFields)];
      if (f[2] > 0)
        held[static_cast<size_t>(r)].push_back(
            CommitTag{static_cast<int64_t>(f[0]), static_cast<int64_t>(f[1]),
                      static_cast<int>(f[2]), static_cast<int>(f[3]), static_cast<int>(f[4])});
    }
  const std::optional<RestorePlan> plan = plan_restore(held);
  if (!plan) {  // the job's first round: rank 0 commits what it has, then all restore it
    commit(round, TrainingPosition{}, {}, /*first=*/true);
    return restore(round, metadata, callbacks);
  }
  const Held* mine = nullptr;
  for (const std::optional<Held>* h : {&current_, &previous_})
    if (*h && (*h)->tag.same_commit(plan->commit)) mine = &**h;

  // 2. The metadata and the entries' names, shapes and hashes, from the plan's source.
  std::string header;
  if (me == plan->source) {
    nlohmann::json j;
    j["metadata"] = mine->metadata;
    j["entries"] = nlohmann::json::array();
    for (const Entry& e : mine->entries)
      j["entries"].push_back({{"name", e.name},
                              {"dtype", dtype_name(e.dtype)},
                              {"shape", e.shape.dims()},
                              {"hash", e.hash}});
    header = j.dump();
  }
  CrossWorkerOps* x = ext.cross_worker();
  if (n > 1) {
    Tensor size = Tensor::from_vector<int64_t>({static_cast<int64_t>(header.size())}, Shape{1});
    x->broadcast(size, plan->source);
    Tensor bytes = Tensor::zeros(Shape{(size.to_vector<int64_t>()[0] + 7) / 8}, DType::kInt64);
    if (me == plan->source) std::memcpy(bytes.raw_data(), header.data(), header.size());
    x->broadcast(bytes, plan->source);
    header.assign(static_cast<const char*>(bytes.raw_data()),
                  static_cast<size_t>(size.to_vector<int64_t>()[0]));
  }
  Held next;
  next.tag = CommitTag{round, plan->commit.global_step, n, me,
                       strategy_.update_partition() ? std::min(2, n) : n};
  std::vector<Entry> declared;
  try {
    const nlohmann::json j = nlohmann::json::parse(header);
    next.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    for (const auto& e : j.at("entries"))
      declared.push_back(Entry{e.at("name").get<std::string>(),
                               dtype_from_name(e.at("dtype").get<std::string>()),
                               Shape(e.at("shape").get<std::vector<int64_t>>()),
                               e.at("hash").get<uint64_t>(),
                               {}});
  } catch (const nlohmann::json::exception& e) {
    throw DataLoss(std::string("elastic: the committed state's header from rank ") +
                   std::to_string(plan->source) + " is malformed: " + e.what());
  }
  if (mine && mine->entries.size() != declared.size())
    throw Internal("elastic: this worker's commit holds " + std::to_string(mine->entries.size()) +
                   " entries, rank " + std::to_string(plan->source) + "'s " +
                   std::to_string(declared.size()));

  // 3. Each entry rebuilt from its pieces when Checkpoint::restore reaches it (one all-gather
  // each), checked against its hash, and cut into this worker's pieces of the new round's commit.
  CheckpointData data;
  data.metadata = next.metadata;
  for (size_t e = 0; e < declared.size(); ++e)
    data.streamed.push_back({declared[e].name, declared[e].dtype, declared[e].shape,
                             [&, e] { return rebuild(*plan, mine, declared[e], e, next); }});
  std::vector<std::pair<std::string, Tensor>> callback_entries;
  const TrainingPosition p =
      Checkpoint(model_, &optimizer_, &strategy_).restore(data, metadata, &callback_entries);
  // The commit decides, the same on every worker (whatever schedule each holds now).
  if (const auto rate = next.metadata.find(kLearningRate); rate != next.metadata.end()) {
    try {
      optimizer_.set_learning_rate(std::stof(rate->second));
    } catch (const std::logic_error&) {
      throw DataLoss("elastic: the commit's learning rate '" + rate->second + "' is not a number");
    }
  }
  if (callbacks)
    *callbacks = dtrain::detail::take_callback_states(next.metadata, callback_entries,
                                                      "elastic: the commit");
  // A sharded round's first commit may be incomplete elsewhere: keep the one it was rebuilt from.
  std::optional<Held> from;
  if (mine && strategy_.update_partition()) from = *mine;
  previous_ = std::move(from);
  current_ = std::move(next);
  DTRAIN_LOG(INFO) << "elastic: restored the commit of global step " << plan->commit.global_step
                   << " (round " << plan->commit.round << ", " << plan->commit.workers
                   << " workers) in round " << round << " of " << n << " workers";
  return p;
}

}  // namespace dtrain::elastic::detail
