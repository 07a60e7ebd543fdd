// Private to the parameter-server strategy: the worker side (connections to every server, the
// variables, the per-step pull and push) and the variable handle model code sees.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dtrain/core/checkpoint.h"
#include "dtrain/strategies/parameter_server_strategy.h"
#include "strategies/ps/ps_client.h"

namespace dtrain {

class PsVariable;

struct ParameterServerStrategy::Impl {
  ParameterServerOptions opts;
  ClusterResolution cluster;
  TcpGroupOptions group;
  DeviceSpec device;
  std::vector<std::unique_ptr<ps::PsClient>> ps;  // one per ps task, in task order
  std::vector<std::string> ps_names;
  std::mutex rpc_mu;                              // one user of the connections at a time
  std::vector<std::shared_ptr<PsVariable>> vars;  // creation order
  std::set<std::string> used_keys;
  int next_ps = 0;  // round-robin placement
  std::atomic<bool> in_run{false};
  struct Pending {
    PsVariable* var;
    Tensor grad;
    std::string config;  // the optimizer that pushed it (a step may use several)
  };
  std::mutex out_mu;
  std::vector<Pending> outbox;  // pushes queued by the optimizer during run()
  std::atomic<int64_t> global_step{0};
  int64_t local_steps = 0;
  std::unique_ptr<CheckpointManager> checkpoints;
  std::optional<CheckpointData> restored;  // chief: the checkpoint to initialise from
  std::string restored_path;               // its file (not the index's, after a fallback)
  int64_t last_checkpoint_step = 0;
  bool final_checkpoint = false;  // the chief's last: an evaluator stops after it
  bool ended = false;             // on_training_end ran: no more staleness waits
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  Impl(ParameterServerOptions o, ClusterResolution c, DeviceSpec d, const std::string& token);
  // Pulls every shard of `vars` (all servers at once) into their caches.
  void pull(const std::vector<PsVariable*>& vars);
  // Sends the queued pushes (one request per server, the step count to ps:0).
  void flush();
  // Reports this worker's step (and whether it is done) to ps:0; returns ps:0's view of the
  // training workers (and takes the global step from it).
  ps::ClockResponse clock(bool done);
  CheckpointData snapshot();
  // Wraps a transport failure in an error that names the server and what to do.
  [[noreturn]] void fail(int ps_index, const Error& e, const char* during);
};

class PsVariable final : public ShardedVariable {
 public:
  struct Shard {
    int ps = 0;
    std::string key;
    int64_t row_begin = 0, rows = 0;  // of axis 0 (a scalar: one shard of 0 rows)
  };
  PsVariable(VariableSpec spec, const std::shared_ptr<ParameterServerStrategy::Impl>& impl,
             std::vector<Shard> shards, DeviceSpec device);

  // Inside run(): the values pulled at the start of the step; elsewhere pulled now.
  Tensor read_value() const override;
  void do_assign(const Tensor& v) override;
  void do_assign_add(const Tensor& delta) override;
  void do_assign_sub(const Tensor& delta) override;
  void do_update(const std::function<void(Tensor& value, size_t copy_index)>& fn) override;
  bool updates_remotely() const override { return true; }
  void apply_remote_update(const std::string& optimizer_config, const Tensor& grad) override;

  int num_shards() const override { return static_cast<int>(shards_.size()); }
  std::string shard_task(int i) const override;
  Shape shard_shape(int i) const override;
  Tensor read_shard(int i) const override;

  const std::vector<Shard>& shards() const { return shards_; }
  // The variable's name on the servers and in checkpoints (shards add "/part_<i>").
  const std::string& base_key() const { return base_key_; }
  void set_base_key(std::string k) { base_key_ = std::move(k); }
  Tensor& cache() { return cache_; }
  // The rows of `t` (shaped like the variable) that shard i holds.
  Tensor shard_of(const Tensor& t, int i) const;

 private:
  void send_assign(ps::AssignMode mode, const Tensor& v);
  // The strategy's state; FailedPrecondition once the strategy is gone (the model may outlive it).
  std::shared_ptr<ParameterServerStrategy::Impl> impl() const;
  std::weak_ptr<ParameterServerStrategy::Impl> impl_;
  std::vector<Shard> shards_;
  std::string base_key_;
  Tensor cache_;
};

}  // namespace dtrain
