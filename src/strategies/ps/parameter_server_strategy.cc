#include "dtrain/strategies/parameter_server_strategy.h"

#include <thread>

#include "dtrain/core/logging.h"
#include "strategies/ps/ps_impl.h"
#include "strategies/ps/ps_protocol.h"
#include "strategies/ps/ps_tasks.h"

namespace dtrain {

namespace {

ClusterResolution resolve(std::optional<ClusterResolution> cluster) {
  if (!cluster) cluster = resolve_cluster();
  if (!cluster)
    throw InvalidArgument(
        "ParameterServerStrategy needs a cluster: set TF_CONFIG with ps and worker tasks, e.g. "
        "{\"cluster\": {\"worker\": [\"127.0.0.1:2222\"], \"ps\": [\"127.0.0.1:2223\"]}, "
        "\"task\": {\"type\": \"worker\", \"index\": 0}} (dtrain-run -np 2 --ps 1 does this)");
  return std::move(*cluster);
}

ClusterResolution check(ClusterResolution c) {
  if (c.cluster().num_tasks(TaskType::kPs) == 0)
    throw InvalidArgument(
        "ParameterServerStrategy needs at least one ps task in the cluster (" +
        c.cluster().to_json() +
        "); add \"ps\": [\"host:port\"] to TF_CONFIG, or use --strategy=multi_worker_mirrored");
  if (c.task_type() == TaskType::kPs)
    throw FailedPrecondition(
        "task " + c.task_name() +
        " is a parameter server, which serves variables instead of "
        "training: start every task through dtrain::run_task() (it serves ps tasks), or run "
        "serve_parameter_server() / the dtrain-ps tool there");
  if (!c.is_training_worker())
    throw FailedPrecondition(
        "task " + c.task_name() +
        " does not train; ParameterServerStrategy runs on the chief and "
        "the workers (run_task() runs an evaluator task's evaluate function instead)");
  return c;
}

// The asynchronous training policy: each worker reads its own shard, and the job trains up to its
// global step, which the chief restores from checkpoints.
class PsTrainingPolicy final : public TrainingPolicy {
 public:
  explicit PsTrainingPolicy(ParameterServerStrategy* s) : s_(s) {}
  bool synchronous() const override { return false; }
  InputShard input_shard() const override {
    return {s_->cluster().num_workers(), s_->cluster().worker_rank()};
  }
  std::optional<int64_t> job_step() const override { return s_->global_step(); }
  void on_training_end() override { s_->finish_training(); }

 private:
  ParameterServerStrategy* s_;  // owns this policy (through its extended())
};

using Impl = ParameterServerStrategy::Impl;

// The variable's key on the servers and in checkpoints. Names repeat when a model is built twice;
// the creation order makes keys agree across workers (and with SidecarEvaluator, which names the
// same way).
std::string claim_key(Impl& m, const std::string& name) {
  std::string key = name;
  for (int n = 1; m.used_keys.count(key); ++n) key = name + "_" + std::to_string(n);
  m.used_keys.insert(key);
  return key;
}

// How many shards the variable is split into along axis 0: the partitioner's answer, at most one
// per row.
int shard_count(const Impl& m, const VariableSpec& spec) {
  if (!m.opts.partitioner || spec.shape.rank() == 0 || spec.shape[0] <= 1) return 1;
  return static_cast<int>(std::clamp<int64_t>(
      m.opts.partitioner(spec.shape, spec.dtype, static_cast<int>(m.ps.size())), 1, spec.shape[0]));
}

// The rows of each of the `shards` shards of the variable `base`, placed on the servers round
// robin, continuing from the previous variable.
std::vector<PsVariable::Shard> place_shards(Impl& m, const VariableSpec& spec,
                                            const std::string& base, int shards) {
  const int num_ps = static_cast<int>(m.ps.size());
  const std::vector<int64_t> rows =
      spec.shape.rank() > 0 ? shard_rows(spec.shape[0], shards) : std::vector<int64_t>{0};
  std::vector<PsVariable::Shard> layout;
  int64_t begin = 0;
  for (int s = 0; s < shards; ++s) {
    PsVariable::Shard sh;
    sh.ps = m.next_ps;
    m.next_ps = (m.next_ps + 1) % num_ps;
    sh.key = shards == 1 ? base : base + "/part_" + std::to_string(s);
    sh.row_begin = begin;
    sh.rows = rows[static_cast<size_t>(s)];
    begin += sh.rows;
    layout.push_back(sh);
  }
  return layout;
}

// A variable as the chief's checkpoint holds it (whole: shards concatenated, so a job may restore
// into a different number of ps tasks or another partitioner).
struct SavedVariable {
  const Tensor* value = nullptr;
  std::vector<const Tensor*> slots;
  std::string slot_names;  // what they are; empty in checkpoints older than the record
  int64_t updates = 0;
};

// The chief's checkpointed value of the variable `key`; nullopt when the chief is not restoring.
// Throws FailedPrecondition when the checkpoint has no such variable (another model wrote it).
std::optional<SavedVariable> find_saved(const Impl& m, const VariableSpec& spec,
                                        const std::string& key) {
  if (!m.restored) return std::nullopt;
  const Tensor* saved = m.restored->find(key);
  if (!saved || saved->shape() != spec.shape || saved->dtype() != spec.dtype)
    throw FailedPrecondition(
        "the checkpoint " + m.restored_path + " has no variable '" + key + "' of " +
        dtype_name(spec.dtype) + " " + spec.shape.to_string() +
        (saved ? std::string(" (it has ") + saved->to_string() + ")" : std::string()) +
        ": it was written by a different model; use another --checkpoint-dir or remove it");
  SavedVariable out;
  out.value = saved;
  for (int j = 0; const Tensor* slot = m.restored->find(key + "/slot_" + std::to_string(j)); ++j)
    out.slots.push_back(slot);
  auto it = m.restored->metadata.find(key + "/updates");
  if (it != m.restored->metadata.end()) out.updates = std::atoll(it->second.c_str());
  it = m.restored->metadata.find(key + "/slot_names");
  if (it != m.restored->metadata.end()) out.slot_names = it->second;
  return out;
}

// The initializer's value of a new variable, on the CPU.
Tensor initial_value(const VariableSpec& spec) {
  Tensor init = spec.initializer(spec.shape, spec.dtype, DeviceSpec::cpu()).to(DeviceSpec::cpu());
  if (init.shape() != spec.shape || init.dtype() != spec.dtype)
    throw InvalidArgument("initializer of variable '" + spec.name + "' returned " +
                          init.to_string() + ", expected shape " + spec.shape.to_string());
  return init;
}

// The chief: creates every shard of `var` on its server, from the checkpoint when restoring, else
// from the initializer.
void create_shards(Impl& m, const VariableSpec& spec, const PsVariable& var) {
  const std::optional<SavedVariable> saved = find_saved(m, spec, var.base_key());
  const Tensor init = saved ? Tensor() : initial_value(spec);
  for (int s = 0; s < var.num_shards(); ++s) {
    const auto& sh = var.shards()[static_cast<size_t>(s)];
    ps::CreateRequest req;
    req.key = sh.key;
    req.updates = saved ? saved->updates : 0;
    if (saved) {
      req.value = var.shard_of(*saved->value, s).clone();
      for (const Tensor* slot : saved->slots) req.slots.push_back(var.shard_of(*slot, s).clone());
      req.slot_names = saved->slot_names;
    } else {
      req.value = var.shard_of(init, s).clone();
    }
    std::lock_guard<std::mutex> lock(m.rpc_mu);
    try {
      m.ps[static_cast<size_t>(sh.ps)]->create(req);
    } catch (const Error& e) {
      m.fail(sh.ps, e, "creating a variable");
    }
  }
}

// Any other worker: waits (connect_timeout) for the chief to create every shard of `var`, then
// checks that this worker's model agrees with it.
void await_shards(Impl& m, const VariableSpec& spec, const PsVariable& var) {
  const auto deadline = std::chrono::steady_clock::now() + m.opts.connect_timeout;
  for (int s = 0; s < var.num_shards(); ++s) {
    const auto& sh = var.shards()[static_cast<size_t>(s)];
    const std::string& server = m.ps_names[static_cast<size_t>(sh.ps)];
    for (;;) {
      ps::LookupResponse found;
      {
        std::lock_guard<std::mutex> lock(m.rpc_mu);
        try {
          found = m.ps[static_cast<size_t>(sh.ps)]->lookup({.key = sh.key, .wait_ms = 1000});
        } catch (const Error& e) {
          m.fail(sh.ps, e, "looking up a variable");
        }
      }
      if (!found.found) {
        // While waiting on one server, ask the others too (a lookup that does not wait): a ps
        // killed meanwhile, which may be why the chief never creates the variable, is named now
        // rather than at the deadline.
        std::lock_guard<std::mutex> lock(m.rpc_mu);
        for (size_t other = 0; other < m.ps.size(); ++other) {
          if (static_cast<int>(other) == sh.ps) continue;
          try {
            m.ps[other]->lookup({.key = sh.key, .wait_ms = 0});
          } catch (const Error& e) {
            m.fail(static_cast<int>(other), e, "waiting for the chief to create a variable");
          }
        }
      }
      if (found.found) {
        if (found.shape != var.shard_shape(s) || found.dtype != spec.dtype)
          throw InvalidArgument(
              "variable '" + sh.key + "' on " + server + " is " + dtype_name(found.dtype) + " " +
              found.shape.to_string() + " but this worker's model has " + dtype_name(spec.dtype) +
              " " + var.shard_shape(s).to_string() + ": every worker must build the same model");
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline)
        throw DeadlineExceeded(
            "variable '" + sh.key + "' was not created on " + server + " within " +
            std::to_string(m.opts.connect_timeout.count()) +
            " ms: the chief creates the variables; is it running, with the same model?");
    }
  }
}

}  // namespace

ParameterServerStrategy::ParameterServerStrategy(ParameterServerOptions options, DeviceSpec device,
                                                 std::optional<ClusterResolution> cluster,
                                                 std::string token)
    : OneDeviceStrategy(device) {
  if (options.checkpoint_every < 1)
    throw InvalidArgument("checkpoint_every must be >= 1 global steps, got " +
                          std::to_string(options.checkpoint_every));
  ClusterResolution c = check(resolve(std::move(cluster)));
  assemble(StrategyExtended(c, nullptr, std::make_shared<PsTrainingPolicy>(this)));
  impl_ = std::make_shared<Impl>(std::move(options), std::move(c), device,
                                 resolve_job_token(std::move(token)));
  Impl& m = *impl_;
  if (m.cluster.is_chief() && !m.opts.checkpoint_dir.empty()) {
    m.checkpoints = std::make_unique<CheckpointManager>(m.opts.checkpoint_dir);
    int64_t step = 0;
    m.restored = m.checkpoints->restore_latest(&step, &m.restored_path);
    if (m.restored) {
      std::lock_guard<std::mutex> lock(m.rpc_mu);
      try {
        m.global_step = m.ps[0]->set_step({.step = step}).global_step;
      } catch (const Error& e) {
        m.fail(0, e, "restoring the global step");
      }
      m.last_checkpoint_step = m.global_step.load();
      DTRAIN_LOG(INFO) << m.cluster.task_name() << ": restoring from checkpoint " << m.restored_path
                       << " (global step " << step << ")";
    }
  }
  // Register with ps:0. A worker that (re)joins a running job starts at the slowest other worker's
  // step, so that a staleness bound does not hold everyone back until it has caught up.
  m.local_steps = std::max<int64_t>(m.local_steps, m.clock(false).min_active_step);
  DTRAIN_LOG(INFO) << m.cluster.task_name() << ": parameter-server training with " << m.ps.size()
                   << " ps task(s), global step " << m.global_step.load();
}

ParameterServerStrategy::~ParameterServerStrategy() = default;

std::string ParameterServerStrategy::name() const {
  return "ParameterServerStrategy(" + impl_->cluster.task_name() + ", " +
         std::to_string(impl_->ps.size()) + " ps, " + OneDeviceStrategy::name() + ")";
}

const ClusterResolution& ParameterServerStrategy::cluster() const { return impl_->cluster; }
int64_t ParameterServerStrategy::global_step() const { return impl_->global_step.load(); }

std::shared_ptr<Variable> ParameterServerStrategy::do_create_variable(const VariableSpec& spec) {
  Impl& m = *impl_;
  const int shards = shard_count(m, spec);
  const std::string base = claim_key(m, spec.name);
  auto var =
      std::make_shared<PsVariable>(spec, impl_, place_shards(m, spec, base, shards), device());
  var->set_base_key(base);
  if (m.cluster.is_chief())
    create_shards(m, spec, *var);
  else
    await_shards(m, spec, *var);
  m.vars.push_back(var);
  m.pull(
      {var.get()});  // the cache holds the real values even if the variable is first used mid-step
  return var;
}

PerReplica ParameterServerStrategy::do_run(const ReplicaFn& fn, const PerReplica& inputs) {
  Impl& m = *impl_;
  if (m.opts.max_staleness >= 0 && !m.ended) {
    const auto deadline = std::chrono::steady_clock::now() + m.opts.timeout;
    for (;;) {
      const ps::ClockResponse clock = m.clock(false);
      const std::vector<ps::WorkerState>& states = clock.states;
      int64_t slowest = clock.min_active_step;
      // A worker that has not connected yet counts as at step 0 while workers may still be starting
      // (connect_timeout), so a fast starter cannot run away before the others arrive.
      if (std::chrono::steady_clock::now() - m.started < m.opts.connect_timeout)
        for (size_t w = 0; w < states.size(); ++w)
          if (states[w] == ps::kNeverSeen && static_cast<int>(w) != m.cluster.worker_rank())
            slowest = 0;
      if (m.local_steps - slowest <= m.opts.max_staleness) break;
      if (std::chrono::steady_clock::now() >= deadline)
        throw DeadlineExceeded(m.cluster.task_name() + " waited " +
                               std::to_string(m.opts.timeout.count()) +
                               " ms for the slowest worker (step " + std::to_string(slowest) +
                               ", this worker at " + std::to_string(m.local_steps) +
                               ", max_staleness " + std::to_string(m.opts.max_staleness) + ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  std::vector<PsVariable*> all;
  for (const auto& v : m.vars) all.push_back(v.get());
  m.pull(all);
  PerReplica out;
  m.in_run = true;
  try {
    out = OneDeviceStrategy::do_run(fn, inputs);
  } catch (...) {
    m.in_run = false;
    std::lock_guard<std::mutex> lock(m.out_mu);
    m.outbox.clear();
    throw;
  }
  m.in_run = false;
  bool pushed;
  {
    std::lock_guard<std::mutex> lock(m.out_mu);
    pushed = !m.outbox.empty();
  }
  if (pushed) {
    m.flush();
    ++m.local_steps;
    if (m.checkpoints && m.global_step.load() - m.last_checkpoint_step >= m.opts.checkpoint_every)
      save_checkpoint();
  }
  return out;
}

std::string ParameterServerStrategy::save_checkpoint() {
  Impl& m = *impl_;
  if (!m.cluster.is_chief())
    throw FailedPrecondition("only the chief writes checkpoints; this is " + m.cluster.task_name());
  if (!m.checkpoints)
    throw FailedPrecondition(
        "no checkpoint directory: set ParameterServerOptions::checkpoint_dir or "
        "DTRAIN_CHECKPOINT_DIR");
  const int64_t step = m.global_step.load();
  CheckpointData data = m.snapshot();
  data.metadata["global_step"] = std::to_string(step);
  if (m.final_checkpoint)
    data.metadata.insert_or_assign(
        "final", std::string(1, '1'));  // not = "1": GCC 12 -Wrestrict false positive
  const std::string path = m.checkpoints->save(step, std::move(data));
  m.last_checkpoint_step = step;
  DTRAIN_LOG(INFO) << m.cluster.task_name() << ": wrote checkpoint " << path << " at global step "
                   << step;
  return path;
}

void ParameterServerStrategy::finish_training() {
  Impl& m = *impl_;
  m.ended = true;
  m.clock(true);
  if (!m.cluster.is_chief()) return;
  // The chief waits for the other workers (done, or gone: a dead worker does not stop the job).
  const auto start = std::chrono::steady_clock::now();
  auto last_log = start;
  for (;;) {
    const std::vector<ps::WorkerState> states = m.clock(true).states;
    // Training workers wait up to join_timeout; one that never showed up (it may have failed to
    // start, and the job goes on without it) only as long as a worker may take to connect.
    const auto now = std::chrono::steady_clock::now();
    const bool still_arriving = now - start < m.opts.connect_timeout;
    std::string waiting;
    for (size_t w = 0; w < states.size(); ++w)
      if (states[w] == ps::kActive || (states[w] == ps::kNeverSeen && still_arriving))
        waiting += (waiting.empty() ? "" : ", ") + ps::task_names(m.cluster.cluster()).at(w);
    if (waiting.empty()) break;
    if (now - start >= m.opts.join_timeout) {
      DTRAIN_LOG(WARNING) << "chief gave up waiting for " << waiting << " after "
                          << std::chrono::duration_cast<std::chrono::seconds>(now - start).count()
                          << " s";
      break;
    }
    if (now - last_log >= std::chrono::seconds(10)) {
      DTRAIN_LOG(INFO) << "chief waiting for " << waiting << " to finish";
      last_log = now;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  m.final_checkpoint = true;
  if (m.checkpoints) save_checkpoint();
}

// --- Partitioners ----------------------------------------------------------------------------

std::vector<int64_t> shard_rows(int64_t rows, int shards) {
  if (shards < 1)
    throw InvalidArgument("shard_rows: need at least one shard, got " + std::to_string(shards));
  std::vector<int64_t> out(static_cast<size_t>(shards), rows / shards);
  for (int64_t i = 0; i < rows % shards; ++i) ++out[static_cast<size_t>(i)];
  return out;
}

Partitioner fixed_shards_partitioner(int num_shards) {
  if (num_shards < 1)
    throw InvalidArgument("fixed_shards_partitioner: num_shards must be >= 1, got " +
                          std::to_string(num_shards));
  return [num_shards](const Shape&, DType, int) { return num_shards; };
}

Partitioner min_size_partitioner(int64_t min_shard_bytes, int max_shards) {
  if (min_shard_bytes < 1 || max_shards < 1)
    throw InvalidArgument("min_size_partitioner: min_shard_bytes and max_shards must be >= 1");
  return [=](const Shape& shape, DType dtype, int) {
    const int64_t bytes = shape.numel() * static_cast<int64_t>(dtype_size(dtype));
    return static_cast<int>(std::clamp<int64_t>(bytes / min_shard_bytes, 1, max_shards));
  };
}

Partitioner max_size_partitioner(int64_t max_shard_bytes, int max_shards) {
  if (max_shard_bytes < 1)
    throw InvalidArgument("max_size_partitioner: max_shard_bytes must be >= 1");
  return [=](const Shape& shape, DType dtype, int) {
    const int64_t bytes = shape.numel() * static_cast<int64_t>(dtype_size(dtype));
    const int64_t rows = std::max<int64_t>(shape.rank() > 0 ? shape[0] : 1, 1);
    const int64_t row_bytes = std::max<int64_t>(bytes / rows, 1);
    // Shards hold whole rows: the fewest shards whose largest (ceil(rows / n) rows) fits.
    const int64_t rows_per_shard = std::max<int64_t>(max_shard_bytes / row_bytes, 1);
    int64_t n = (rows + rows_per_shard - 1) / rows_per_shard;
    if (max_shards > 0) n = std::min<int64_t>(n, max_shards);
    return static_cast<int>(std::max<int64_t>(n, 1));
  };
}

}  // namespace dtrain
