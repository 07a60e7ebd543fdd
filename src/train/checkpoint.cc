#include "dtrain/train/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/strategy.h"
#include "train/callback_states.h"

namespace dtrain {

namespace {

const char* kIterations = "optimizer/iterations";

// By the layer's path ("block_0/dropout"; a direct sublayer's path is its name): layers nested in
// blocks (a GPT's dropouts) were left out, and replayed step 0's masks after a restore.
std::string rng_name(const Layer& l) { return "rng/" + l.path() + "/calls"; }

// Every layer under `root` that draws random numbers, depth-first, each once (a shared one too).
std::vector<std::shared_ptr<Layer>> rng_layers_of(const Layer& root) {
  std::vector<std::shared_ptr<Layer>> out;
  std::vector<const Layer*> seen;
  const std::function<void(const Layer&)> walk = [&](const Layer& l) {
    for (const auto& c : l.layers()) {
      if (std::find(seen.begin(), seen.end(), c.get()) != seen.end()) continue;
      seen.push_back(c.get());
      if (c->rng_calls() >= 0) out.push_back(c);
      walk(*c);
    }
  };
  walk(root);
  return out;
}

// An error's message without its kind ("FailedPrecondition: "), to add to it and throw it again.
std::string without_kind(const Error& e) {
  const std::string m = e.what();
  const size_t colon = m.find(": ");
  return colon == std::string::npos ? m : m.substr(colon + 2);
}

Tensor int64_scalar(int64_t v) { return Tensor::from_vector<int64_t>({v}, Shape{1}); }

int64_t int64_of(const Tensor& t, const std::string& name) {
  if (t.dtype() != DType::kInt64 || t.numel() != 1)
    throw FailedPrecondition("checkpoint entry '" + name + "' should be one int64, got " +
                             t.shape().to_string());
  return t.to_vector<int64_t>()[0];
}

int64_t meta_int(const std::map<std::string, std::string>& m, const std::string& key) {
  auto it = m.find(key);
  if (it == m.end()) return 0;
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    throw DataLoss("checkpoint metadata '" + key + "' is not a number: '" + it->second + "'");
  }
}

std::string describe(const Tensor& t) {
  return std::string(dtype_name(t.dtype())) + " " + t.shape().to_string();
}

// EnsembleStrategy: member m >= 1 of variable v is saved as "ensemble/member_<m>/<v>".
std::string member_name(size_t m, const std::string& v) {
  return "ensemble/member_" + std::to_string(m) + "/" + v;
}

// Members in the whole job (each worker holds worker_devices().size()) and this worker's first.
size_t job_members(const Strategy& s) {
  return s.worker_devices().size() * static_cast<size_t>(s.extended().num_workers());
}
size_t first_member(const Strategy& s) {
  return s.worker_devices().size() * static_cast<size_t>(s.extended().worker_rank());
}
bool is_ensemble(const Strategy& s) {
  return s.extended().independent_replicas() && job_members(s) > 1;
}

// Every member's copy of a variable, in job-wide member order: this worker's copies, and under a
// multi-worker ensemble the other workers' (gathered; collective).
std::vector<Tensor> all_member_copies(Strategy& s, const Variable& v) {
  std::vector<Tensor> copies = v.device_values();
  if (s.extended().num_workers() == 1) {
    for (Tensor& c : copies) c = c.to(DeviceSpec::cpu());
    return copies;
  }
  std::vector<int64_t> dims = v.shape().dims();
  dims.insert(dims.begin(), static_cast<int64_t>(copies.size()));
  Tensor mine = Tensor::empty(Shape(dims), v.dtype());
  for (size_t m = 0; m < copies.size(); ++m) {
    const Tensor h = copies[m].to(DeviceSpec::cpu());
    std::memcpy(static_cast<char*>(mine.raw_data()) + m * h.nbytes(), h.raw_data(), h.nbytes());
  }
  const Tensor all = s.extended().gather_across_workers(mine);
  std::vector<Tensor> out;
  for (int64_t g = 0; g < all.shape()[0]; ++g)
    out.push_back(all.slice_rows(g, g + 1).view(v.shape()).clone());
  return out;
}

// Sharded optimizer state: slot `name` (whole shape `shape`) gathered from this worker's parts
// `mine` and the other workers' (collective: every worker calls it for the same slots in order).
// Worker w's local parts are w L .. w L + L - 1 (replica ids), each padded to the longest part.
Tensor gather_slot(Strategy& s, const std::vector<Optimizer::SlotShard>& mine) {
  const Optimizer::SlotShard& first = mine.front();
  const int64_t count = first.shape.numel(), parts = first.parts;
  const int64_t longest = (count + parts - 1) / parts;
  const int64_t local = static_cast<int64_t>(mine.size());
  Tensor buf = Tensor::zeros(Shape{local * longest}, first.value.dtype());
  for (int64_t j = 0; j < local; ++j) {
    const Tensor part = mine[static_cast<size_t>(j)].value.to(DeviceSpec::cpu());
    if (part.numel() > 0) buf.slice_rows(j * longest, j * longest + part.numel()).copy_from(part);
  }
  const Tensor all = s.extended().gather_across_workers(buf);
  if (all.numel() != parts * longest)
    throw Internal("gathering sharded slot '" + first.name + "': " + std::to_string(parts) +
                   " parts expected, " + std::to_string(all.numel() / longest) + " arrived");
  Tensor whole = Tensor::empty(Shape{count}, first.value.dtype());
  for (int p = 0; p < parts; ++p) {
    const auto [b, e] = partition_range(count, p, static_cast<int>(parts));
    if (e > b) whole.slice_rows(b, e).copy_from(all.slice_rows(p * longest, p * longest + e - b));
  }
  return whole.view(first.shape);
}

// Writes `d` as checkpoint `step` through `manager` where this task writes (the chief); elsewhere
// (manager null) produces this worker's parts of the sharded entries, which the chief's gathers
// need. Returns the path written, or "".
std::string write_on_chief(CheckpointManager* manager, int64_t step, CheckpointData d) {
  if (!manager) {
    for (const auto& st : d.streamed) st.produce();
    return {};
  }
  return manager->save(step, std::move(d));
}

}  // namespace

Checkpoint::Checkpoint(Model& model, Optimizer* optimizer, Strategy* strategy)
    : model_(model), optimizer_(optimizer), strategy_(strategy ? strategy : &get_strategy()) {}

CheckpointData Checkpoint::capture(const TrainingPosition& p,
                                   const std::map<std::string, std::string>& extra) const {
  if (!model_.built())
    throw FailedPrecondition("Checkpoint: the model is not built yet; build it (or fit) first");
  CheckpointData d;
  const bool ensemble = is_ensemble(*strategy_);
  auto put = [&](const std::shared_ptr<Variable>& v) {
    if (std::vector<ValuePart> parts = v->value_parts(); !parts.empty() && !ensemble) {
      // Parameters sharded across replicas: gathered from every worker when the writer gets there
      std::vector<Optimizer::SlotShard> shards;
      for (ValuePart& p : parts)
        shards.push_back({v->name(), v->shape(), p.part, p.parts, p.first, std::move(p.value)});
      d.streamed.push_back({v->name(), v->dtype(), v->shape(),
                            [s = strategy_, shards] { return gather_slot(*s, shards); }});
      return;
    }
    if (!ensemble) {
      d.tensors.emplace_back(v->name(), v->value());  // the one model
      return;
    }
    const std::vector<Tensor> copies =
        all_member_copies(*strategy_, *v);         // collective across workers
    d.tensors.emplace_back(v->name(), copies[0]);  // member 0
    for (size_t m = 1; m < copies.size(); ++m)
      d.tensors.emplace_back(member_name(m, v->name()), copies[m]);
  };
  for (const auto& v : model_.variables()) put(v);
  if (ensemble) d.metadata["dtrain.ensemble_members"] = std::to_string(job_members(*strategy_));
  if (optimizer_) {
    for (const auto& s : optimizer_->slot_variables()) put(s);
    // Sharded slots: each whole slot gathered when the writer reaches it, never all at once.
    std::vector<std::vector<Optimizer::SlotShard>> by_slot;
    for (auto& part : optimizer_->slot_shards()) {
      if (by_slot.empty() || by_slot.back().front().name != part.name) by_slot.emplace_back();
      by_slot.back().push_back(std::move(part));
    }
    for (auto& parts : by_slot) {
      const Optimizer::SlotShard& f = parts.front();
      d.streamed.push_back({f.name, f.value.dtype(), f.shape,
                            [s = strategy_, parts] { return gather_slot(*s, parts); }});
    }
    d.tensors.emplace_back(kIterations, int64_scalar(optimizer_->iterations()));
    d.metadata["dtrain.optimizer"] = optimizer_->config();
  }
  for (const auto& l : rng_layers_of(model_))
    d.tensors.emplace_back(rng_name(*l), int64_scalar(l->rng_calls()));
  d.metadata["dtrain.epoch"] = std::to_string(p.epoch);
  d.metadata["dtrain.step"] = std::to_string(p.step);
  d.metadata["dtrain.global_step"] = std::to_string(p.global_step);
  d.metadata["dtrain.strategy"] = strategy_->name();
  d.metadata["dtrain.replicas"] = std::to_string(strategy_->num_replicas_in_sync());
  for (const auto& [k, v] : extra) d.metadata[k] = v;
  return d;
}

bool Checkpoint::save(const std::string& path, const TrainingPosition& p,
                      const std::map<std::string, std::string>& extra) const {
  CheckpointData d = capture(p, extra);  // on every worker: reads may take part in collectives
  if (!strategy_->extended().is_chief()) {
    for (const auto& st : d.streamed) st.produce();  // the chief's gathers need this worker's parts
    return false;
  }
  save_safetensors(path, d);
  return true;
}

bool Checkpoint::save(CheckpointManager& manager, const TrainingPosition& p,
                      const std::map<std::string, std::string>& extra) const {
  const bool chief = strategy_->extended().is_chief();
  write_on_chief(chief ? &manager : nullptr, p.global_step, capture(p, extra));
  return chief;
}

TrainingPosition Checkpoint::restore(const std::string& path,
                                     std::map<std::string, std::string>* metadata) const {
  try {
    return restore(load_safetensors(path), metadata);
  } catch (const FailedPrecondition& e) {
    throw FailedPrecondition(without_kind(e) + " (file " + path + ")");
  }
}

TrainingPosition Checkpoint::restore(
    const CheckpointData& d, std::map<std::string, std::string>* metadata,
    std::vector<std::pair<std::string, Tensor>>* callback_entries) const {
  if (!model_.built())
    throw FailedPrecondition(
        "Checkpoint::restore: build the model first (same layers, same input shape)");
  const bool ensemble = is_ensemble(*strategy_);
  // What the checkpoint declares: its tensors, and its streamed entries (produced one at a time
  // while they are applied below).
  struct Entry {
    DType dtype;
    Shape shape;
    const Tensor* tensor = nullptr;  // nullptr: streamed
  };
  std::map<std::string, Entry> entries;
  for (const auto& [name, t] : d.tensors) entries[name] = Entry{t.dtype(), t.shape(), &t};
  for (const auto& st : d.streamed) entries[st.name] = Entry{st.dtype, st.shape, nullptr};
  auto entry = [&](const std::string& name) -> const Entry* {
    auto it = entries.find(name);
    return it == entries.end() ? nullptr : &it->second;
  };
  auto describe_entry = [](const Entry& e) {
    return std::string(dtype_name(e.dtype)) + " " + e.shape.to_string();
  };
  // 1. Check everything before changing anything.
  std::set<std::string> known;
  auto require_like = [&](const std::shared_ptr<Variable>& v, const std::string& name,
                          const Entry& t) {
    if (t.shape != v->shape() || t.dtype != v->dtype())
      throw FailedPrecondition("the checkpoint does not match the model: variable '" + name +
                               "': the model has " + dtype_name(v->dtype()) + " " +
                               v->shape().to_string() + ", the checkpoint " + describe_entry(t));
  };
  auto require_count = [&](const std::string& name, const Entry& t) {
    if (t.dtype != DType::kInt64 || t.shape.numel() != 1)
      throw FailedPrecondition("checkpoint entry '" + name + "' should be one int64, got " +
                               describe_entry(t));
  };
  for (const auto& v : model_.variables()) {
    known.insert(v->name());
    const Entry* t = entry(v->name());
    if (!t)
      throw FailedPrecondition("the checkpoint does not match the model: variable '" + v->name() +
                               "' (" + dtype_name(v->dtype()) + " " + v->shape().to_string() +
                               ") is not in it");
    require_like(v, v->name(), *t);
  }
  // A parameter-server checkpoint's optimizer slots ("<variable>/slot_<j>"): its weights restore
  // here, its slots do not (the optimizer starts afresh, said below).
  const auto ps_slot = [&known](const std::string& name) {
    const size_t at = name.rfind("/slot_");
    return at != std::string::npos && known.count(name.substr(0, at)) &&
           name.find_first_not_of("0123456789", at + 6) == std::string::npos &&
           name.size() > at + 6;
  };
  for (const auto& [name, t] : entries)
    if (!known.count(name) && !ps_slot(name) && name.rfind("optimizer/", 0) != 0 &&
        name.rfind("rng/", 0) != 0 && name.rfind("ensemble/", 0) != 0 &&
        name.rfind(detail::kCallbackEntryPrefix, 0) != 0)
      throw FailedPrecondition("the checkpoint does not match the model: it holds variable '" +
                               name + "' (" + describe_entry(t) +
                               "), which the model does not have");
  // The optimizer's state, when the checkpoint's optimizer is the same kind.
  std::vector<std::shared_ptr<Variable>> slots;
  std::vector<Optimizer::SlotShard> shards;  // sharded state: this process's parts of the slots
  bool same_optimizer = false;
  if (optimizer_) {
    {
      auto scope = strategy_->scope();
      // Slots sharded for another partition (an elastic job re-formed) are remade for this one
      // and filled below.
      optimizer_->repartition_slots();
      optimizer_->build(
          model_.trainable_variables());  // creates missing slots (zero state), changes no weight
    }
    const auto it = d.metadata.find("dtrain.optimizer");
    const std::string saved =
        it == d.metadata.end() ? "" : it->second.substr(0, it->second.find(' '));
    same_optimizer = saved.empty() || saved == optimizer_->name();
    if (!same_optimizer) {
      DTRAIN_LOG(WARNING) << "the checkpoint was written with optimizer '" << saved
                          << "', this one is '" << optimizer_->name()
                          << "': the weights are restored, the optimizer starts afresh";
    } else {
      slots = optimizer_->slot_variables();
      for (const auto& sv : slots)
        if (const Entry* t = entry(sv->name())) require_like(sv, sv->name(), *t);
      shards = optimizer_->slot_shards();
      for (const auto& p : shards)
        if (const Entry* t = entry(p.name))
          if (t->shape != p.shape || t->dtype != p.value.dtype())
            throw FailedPrecondition("the checkpoint does not match the optimizer: slot '" +
                                     p.name + "': the model's is " + dtype_name(p.value.dtype()) +
                                     " " + p.shape.to_string() + ", the checkpoint's " +
                                     describe_entry(*t));
      if (const Entry* t = entry(kIterations)) {
        require_count(kIterations, *t);
        if (t->tensor) int64_of(*t->tensor, kIterations);
      }
    }
  }
  std::vector<std::shared_ptr<Variable>> all = model_.variables();
  all.insert(all.end(), slots.begin(), slots.end());
  // Ensemble: this worker's local copy m is member first + m of the job ("ensemble/member_<g>/",
  // member 0 under the plain name).
  const size_t first = ensemble ? first_member(*strategy_) : 0;
  auto member_tensor = [&](const std::shared_ptr<Variable>& v, size_t g) -> const Tensor* {
    return g == 0 ? d.find(v->name()) : d.find(member_name(g, v->name()));
  };
  if (ensemble)
    for (const auto& v : all)
      for (size_t m = 0; m < v->device_values().size(); ++m)
        if (first + m > 0)
          if (const Tensor* t = member_tensor(v, first + m))
            require_like(v, member_name(first + m, v->name()), Entry{t->dtype(), t->shape(), t});
  std::map<std::string, std::shared_ptr<Layer>> rng_layers;
  for (const auto& l : rng_layers_of(model_))
    if (l->rng_calls() >= 0)
      if (const Entry* t = entry(rng_name(*l))) {
        require_count(rng_name(*l), *t);
        if (t->tensor) int64_of(*t->tensor, rng_name(*l));
        rng_layers.emplace(rng_name(*l), l);
      }

  // 2. Apply: every copy gets the saved value (member 0's); ensemble checkpoints then give each
  // member its own.
  std::map<std::string, std::shared_ptr<Variable>> by_name;
  for (const auto& v : all) by_name.emplace(v->name(), v);
  std::optional<int64_t> iterations;
  if (callback_entries) callback_entries->clear();
  auto apply = [&](const std::string& name, const Tensor& t) {
    if (name.rfind(detail::kCallbackEntryPrefix, 0) == 0) {
      if (callback_entries) callback_entries->emplace_back(name, t);
      return;
    }
    if (auto v = by_name.find(name); v != by_name.end()) {
      if (v->second->value_parts().empty())
        v->second->assign(t.to(v->second->value().device()));
      else
        v->second->assign(t);  // each replica's part takes its range (Sharding::kParameters)
      return;
    }
    if (name == kIterations) {
      if (same_optimizer) iterations = int64_of(t, name);
      return;
    }
    if (auto l = rng_layers.find(name); l != rng_layers.end()) {
      l->second->set_rng_calls(int64_of(t, name));
      return;
    }
    // Sharded slots: each part takes its range of the whole slot, whatever the saving shard count.
    for (auto& p : shards)
      if (p.name == name) {
        const Tensor range =
            t.view(Shape{t.numel()}).slice_rows(p.first, p.first + p.value.numel());
        p.value.copy_from(range.to(p.value.device()));
      }
  };
  for (const auto& [name, t] : d.tensors) apply(name, t);
  for (const auto& st : d.streamed) {
    const Tensor t = st.produce();  // every entry, in order: producing may be collective
    if (t.dtype() != st.dtype || t.shape() != st.shape)
      throw Internal("streamed checkpoint entry '" + st.name + "' declared " +
                     dtype_name(st.dtype) + " " + st.shape.to_string() + ", produced " +
                     describe(t));
    apply(st.name, t);
  }
  int members_found = 0;
  std::vector<std::string> missing;
  for (const auto& v : all) {
    if (!entry(v->name())) {
      missing.push_back(v->name());
      continue;
    }
    if (!ensemble) continue;
    for (size_t m = 0; m < v->device_values().size(); ++m)
      if (first + m > 0)
        if (const Tensor* tm = member_tensor(v, first + m)) {
          v->update([&](Tensor& value, size_t copy) {
            if (copy == m) value.copy_from(tm->to(value.device()));
          });
          ++members_found;
        }
  }
  for (const auto& p : shards)
    if (!entry(p.name) && p.first == 0) missing.push_back(p.name);
  // An ensemble of another size: said, with what each side's extra members get (they were
  // silently member 0's copies, or silently dropped).
  const auto saved_members = d.metadata.find("dtrain.ensemble_members");
  const int64_t job = ensemble ? static_cast<int64_t>(job_members(*strategy_)) : 1;
  const int64_t had = saved_members == d.metadata.end()
                          ? 0
                          : std::strtoll(saved_members->second.c_str(), nullptr, 10);
  if (ensemble && members_found == 0 && had <= 1) {
    DTRAIN_LOG(WARNING) << "the checkpoint holds one model; every ensemble member starts from it";
  } else if (had > 1 && had != job) {
    const auto range = [](int64_t a, int64_t b) {
      return a == b ? "member " + std::to_string(a)
                    : "members " + std::to_string(a) + ".." + std::to_string(b);
    };
    DTRAIN_LOG(WARNING) << "the checkpoint holds an ensemble of " << had << " members, this "
                        << (ensemble ? "ensemble has " + std::to_string(job)
                                     : std::string("job trains one model"))
                        << ": "
                        << (had < job
                                ? range(had, job - 1) + (had == job - 1 ? " starts" : " start") +
                                      " from member 0"
                                : range(job, had - 1) + " of the checkpoint not restored" +
                                      (ensemble ? "" : " (member 0 is)"));
  }

  if (iterations) optimizer_->set_iterations(*iterations);
  if (!missing.empty()) {
    DTRAIN_LOG(WARNING) << "checkpoint holds no optimizer state for " << missing.size()
                        << " slot(s) (first: '" << missing.front()
                        << "'); they start afresh (a checkpoint written under "
                        << "parameter_server keeps slots on the servers)";
  }
  if (metadata) *metadata = d.metadata;
  TrainingPosition p;
  p.epoch = meta_int(d.metadata, "dtrain.epoch");
  p.step = meta_int(d.metadata, "dtrain.step");
  p.global_step = meta_int(d.metadata, "dtrain.global_step");
  return p;
}

std::optional<TrainingPosition> Checkpoint::restore_latest(
    const CheckpointManager& manager, std::map<std::string, std::string>* metadata,
    std::vector<std::pair<std::string, Tensor>>* callback_entries) const {
  std::string path;
  std::optional<CheckpointData> d = manager.restore_latest(nullptr, &path);
  if (!d) return std::nullopt;
  try {
    return restore(*d, metadata, callback_entries);
  } catch (const FailedPrecondition& e) {
    throw FailedPrecondition(without_kind(e) + " (file " + path +
                             "; restore with the model that wrote it, or start afresh in another "
                             "directory than " +
                             manager.directory() + ")");
  }
}

// ---- ModelCheckpoint ----

ModelCheckpoint::ModelCheckpoint(std::string directory, std::string monitor, bool save_best_only,
                                 MonitorMode mode, int64_t save_freq, int max_to_keep)
    : directory_(std::move(directory)),
      monitor_(std::move(monitor)),
      save_best_only_(save_best_only),
      mode_(mode),
      save_freq_(save_freq),
      max_to_keep_(max_to_keep) {
  if (directory_.empty()) throw InvalidArgument("ModelCheckpoint: the directory is empty");
  if (save_freq < 0)
    throw InvalidArgument("ModelCheckpoint: save_freq must be >= 0 (0 = every epoch)");
  maximize_ = mode == MonitorMode::kMax ||
              (mode == MonitorMode::kAuto && monitor_.find("acc") != std::string::npos);
}

bool ModelCheckpoint::must_run_on_every_worker() const {
  const Strategy& s = strategy();
  return s.update_partition().has_value() ||
         (is_ensemble(s) && s.extended().num_workers() > 1);  // capture() gathers
}

void ModelCheckpoint::on_train_begin(const TrainLogs&) {
  best_.reset();
  // The chief writes. A worker that was the chief of an elastic job's earlier round and is not
  // now writes no longer (its parts of sharded state go to the new chief's writer).
  if (!is_chief())
    manager_.reset();
  else if (!manager_)
    manager_.emplace(directory_, max_to_keep_);
}

CallbackState ModelCheckpoint::state_dict() const {
  if (!save_best_only_ || !best_) return {};
  return CallbackState{{{"best", *best_}}, {}};
}

void ModelCheckpoint::load_state_dict(const CallbackState& state) {
  const auto it = state.values.find("best");
  if (it == state.values.end())
    throw FailedPrecondition("ModelCheckpoint(" + directory_ +
                             "): the backup's state has no 'best'");
  if (save_best_only_) best_ = it->second;
}

void ModelCheckpoint::save(const TrainLogs& logs, int64_t epoch, int64_t step) {
  if (save_best_only_) {
    const double v = logs.get(monitor_);
    if (best_ && !(maximize_ ? v > *best_ : v < *best_)) return;
    best_ = v;
  }
  TrainingPosition p{epoch, step, logs.global_step};
  const Checkpoint ckpt(model(), &optimizer(), &strategy());
  const std::string written = write_on_chief(manager_ ? &*manager_ : nullptr, p.global_step,
                                             ckpt.capture(p, {{"dtrain.monitor", monitor_}}));
  if (manager_) last_saved_ = written;
}

void ModelCheckpoint::on_train_batch_end(const TrainLogs& logs) {
  if (save_freq_ > 0 && logs.global_step % save_freq_ == 0 && !context().accumulating)
    save(logs, logs.epoch, logs.step);
}

void ModelCheckpoint::on_epoch_end(const TrainLogs& logs) {
  if (save_freq_ == 0) save(logs, logs.epoch + 1, 0);
}

// ---- BackupAndRestore ----

BackupAndRestore::BackupAndRestore(std::string dir, int64_t save_freq, bool delete_checkpoint)
    : dir_(std::move(dir)), save_freq_(save_freq), delete_(delete_checkpoint) {
  if (dir_.empty()) throw InvalidArgument("BackupAndRestore: the backup directory is empty");
  if (save_freq < 0)
    throw InvalidArgument("BackupAndRestore: save_freq must be >= 0 (0 = every epoch)");
}

void BackupAndRestore::on_train_begin(const TrainLogs&) {
  restored_.reset();
  if (!manager_) manager_.emplace(dir_, 1);
  TrainingContext& ctx = context();
  std::map<std::string, std::string> meta;
  std::vector<std::pair<std::string, Tensor>> callback_entries;
  const Checkpoint ckpt(model(), &optimizer(), &strategy());
  std::optional<TrainingPosition> p = ckpt.restore_latest(*manager_, &meta, &callback_entries);
  // Every worker must resume from the same place (a backup directory all of them can read).
  const std::vector<double> agree = strategy().extended().sum_across_workers(
      {p ? 1.0 : 0.0, p ? static_cast<double>(p->global_step) : 0.0});
  const double workers = static_cast<double>(strategy().extended().num_workers());
  const bool synchronous = strategy().extended().synchronous();
  if (synchronous && workers > 1 &&
      (agree[0] != 0 &&
       (agree[0] != workers || agree[1] != workers * static_cast<double>(p ? p->global_step : 0))))
    throw FailedPrecondition(
        "BackupAndRestore: the workers found different backups in '" + dir_ + "' (" +
        std::to_string(static_cast<int>(agree[0])) + " of " +
        std::to_string(static_cast<int>(workers)) +
        " found one); every worker must read the same directory (a shared file system)");
  if (!p) return;
  if (auto it = meta.find("dtrain.global_batch");
      it != meta.end() && it->second != std::to_string(ctx.global_batch_size))
    throw FailedPrecondition(
        "BackupAndRestore: the backup in '" + dir_ + "' was made with global batch " + it->second +
        ", this run uses " + std::to_string(ctx.global_batch_size) +
        " (the data position would be wrong); run the same command again, or remove the directory");
  if (auto it = meta.find("dtrain.shuffle_seed");
      it != meta.end() && it->second != std::to_string(ctx.shuffle_seed))
    throw FailedPrecondition(
        "BackupAndRestore: the backup in '" + dir_ + "' was made with shuffle seed " + it->second +
        ", this run uses " + std::to_string(ctx.shuffle_seed) +
        "; run the same command again, or remove the directory to start afresh");
  ctx.initial_epoch = static_cast<int>(p->epoch);
  ctx.initial_step = p->step;
  ctx.initial_global_step = p->global_step;
  ctx.initial_epoch_state.clear();
  if (auto it = meta.find("dtrain.epoch_state"); it != meta.end()) {
    try {
      const nlohmann::json state = nlohmann::json::parse(it->second);
      for (const auto& [k, v] : state.items())
        ctx.initial_epoch_state[k] = v.get<std::vector<double>>();
    } catch (const nlohmann::json::exception& e) {
      throw DataLoss("BackupAndRestore: the backup's epoch state is not valid JSON: " +
                     std::string(e.what()));
    }
  }
  ctx.initial_callback_states =
      detail::take_callback_states(meta, callback_entries, "BackupAndRestore '" + dir_ + "'");
  restored_ = p;
  if (is_chief()) {
    DTRAIN_LOG(INFO) << "BackupAndRestore: resuming from " << dir_ << " at epoch " << p->epoch + 1
                     << ", step " << p->step << " (global step " << p->global_step << ")";
  }
}

void BackupAndRestore::backup(const TrainLogs&, const TrainingPosition& p) {
  std::map<std::string, std::string> extra{
      {"dtrain.shuffle_seed", std::to_string(context().shuffle_seed)},
      {"dtrain.global_batch", std::to_string(context().global_batch_size)}};
  if (p.step > 0 && context().epoch_state) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [k, v] : context().epoch_state()) j[k] = v;
    extra["dtrain.epoch_state"] = j.dump();
  }
  const Checkpoint ckpt(model(), &optimizer(), &strategy());
  CheckpointData d = ckpt.capture(p, extra);  // on every worker: reads may take part in collectives
  if (context().callback_states)
    detail::put_callback_states(context().callback_states(), d.metadata, d.tensors);
  write_on_chief(strategy().extended().is_chief() ? &*manager_ : nullptr, p.global_step,
                 std::move(d));
}

void BackupAndRestore::on_train_batch_end(const TrainLogs& logs) {
  if (save_freq_ > 0 && logs.global_step % save_freq_ == 0 && !context().accumulating &&
      logs.step != logs.steps_per_epoch)  // the epoch's end backs up on its own
    backup(logs, TrainingPosition{logs.epoch, logs.step, logs.global_step});
}

void BackupAndRestore::on_epoch_end(const TrainLogs& logs) {
  backup(logs, TrainingPosition{logs.epoch + 1, 0, logs.global_step});
}

void BackupAndRestore::on_train_end(const TrainLogs&) {
  if (!delete_ || !is_chief()) return;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string n = e.path().filename().string();
    if (n == "checkpoint" || n.rfind("ckpt-", 0) == 0) std::filesystem::remove(e.path(), ec);
  }
}

}  // namespace dtrain
