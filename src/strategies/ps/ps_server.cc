// The parameter server: variables, their optimizer slots and the job's global step, served over
// tcp::RpcServer to every task of the job. Each variable has its own mutex, so pushes to one
// shard apply atomically and pushes to different shards run in parallel (one thread per
// connection).
#include <csignal>
#include <condition_variable>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "collectives/tcp/rpc.h"
#include "dtrain/core/logging.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/optimizers.h"
#include "dtrain/strategies/parameter_server_strategy.h"
#include "strategies/ps/ps_protocol.h"
#include "strategies/ps/ps_tasks.h"

namespace dtrain {
namespace {

using tcp::MetaReader;
using tcp::MetaWriter;
using tcp::RpcMessage;

struct ServerVar {
  std::mutex mu;
  Tensor value;
  std::vector<Tensor> slots;
  int64_t updates = 0;  // optimizer steps applied (Adam's step count)
  std::string opt_config;
  std::unique_ptr<Optimizer> opt;
};

class PsServer {
 public:
  PsServer(const ClusterResolution& cluster, TcpGroupOptions o)
      : num_workers_(cluster.num_workers()), name_(cluster.task_name()), workers_(static_cast<size_t>(num_workers_)) {
    o.task_names = ps::task_names(cluster.cluster());
    rpc_ = std::make_unique<tcp::RpcServer>(
        std::move(o), [this](const RpcMessage& m, int client) { return handle(m, client); },
        [this](int client) { on_disconnect(client); });
  }

  void stop() { rpc_->stop(); }
  size_t num_variables() {
    std::shared_lock lock(mu_);
    return vars_.size();
  }
  int64_t global_step() {
    std::lock_guard lock(clock_mu_);
    return global_step_;
  }

 private:
  RpcMessage handle(const RpcMessage& req, int client) {
    switch (req.method) {
      case ps::kCreate: return create(req);
      case ps::kLookup: return lookup(req);
      case ps::kPull: return pull(req);
      case ps::kPush: return push(req);
      case ps::kAssign: return assign(req);
      case ps::kClock: return clock(req, client);
      case ps::kSetStep: return set_step(req);
      default:
        throw InvalidArgument(detail::str_cat(name_, " got unknown request method ", req.method,
                                              "; run the same dtrain build on every task"));
    }
  }

  std::shared_ptr<ServerVar> find(const std::string& key) {
    std::shared_lock lock(mu_);
    auto it = vars_.find(key);
    if (it == vars_.end())
      throw NotFound("variable '" + key + "' does not exist on " + name_ +
                     "; the chief creates variables: is it running the same model?");
    return it->second;
  }

  static std::string describe(const Tensor& t) {
    return std::string(dtype_name(t.dtype())) + " " + t.shape().to_string();
  }

  RpcMessage create(const RpcMessage& req) {
    MetaReader r(req.meta, "create request");
    const std::string key = r.str();
    const int64_t updates = r.i64();
    r.expect_end();
    if (req.tensors.empty()) throw InvalidArgument("create '" + key + "' carries no initial value");
    RpcMessage out;
    std::unique_lock lock(mu_);
    auto it = vars_.find(key);
    if (it != vars_.end()) {
      const Tensor& have = it->second->value;
      if (have.shape() != req.tensors[0].shape() || have.dtype() != req.tensors[0].dtype())
        throw InvalidArgument("variable '" + key + "' exists on " + name_ + " as " + describe(have) +
                              " but this worker's model has " + describe(req.tensors[0]) +
                              ": every worker must build the same model");
      out.meta = MetaWriter().u8(0).take();
      return out;
    }
    auto v = std::make_shared<ServerVar>();
    v->value = req.tensors[0];
    v->slots.assign(req.tensors.begin() + 1, req.tensors.end());
    for (const Tensor& s : v->slots)
      if (s.shape() != v->value.shape() || s.dtype() != v->value.dtype())
        throw InvalidArgument("create '" + key + "': a slot of " + describe(s) + " for a variable of " + describe(v->value));
    v->updates = updates;
    vars_.emplace(key, std::move(v));
    lock.unlock();
    created_.notify_all();
    out.meta = MetaWriter().u8(1).take();
    return out;
  }

  RpcMessage lookup(const RpcMessage& req) {
    MetaReader r(req.meta, "lookup request");
    const std::string key = r.str();
    const uint64_t wait_ms = std::min<uint64_t>(r.u64(), 5000);
    r.expect_end();
    std::shared_ptr<ServerVar> v;
    {
      std::unique_lock lock(mu_);
      created_.wait_for(lock, std::chrono::milliseconds(wait_ms), [&] { return vars_.count(key) != 0; });
      auto it = vars_.find(key);
      if (it != vars_.end()) v = it->second;
    }
    RpcMessage out;
    MetaWriter w;
    w.u8(v ? 1 : 0);
    if (v) {
      std::lock_guard lock(v->mu);
      w.u8(static_cast<uint8_t>(v->value.dtype())).u64(static_cast<uint64_t>(v->value.rank()));
      for (int64_t d : v->value.shape().dims()) w.i64(d);
    }
    out.meta = w.take();
    return out;
  }

  RpcMessage pull(const RpcMessage& req) {
    MetaReader r(req.meta, "pull request");
    const bool with_slots = r.u8() != 0;
    const uint64_t n = r.u64();
    if (n > (1u << 16)) throw InvalidArgument(detail::str_cat("pull of ", n, " variables"));
    std::vector<std::string> keys;
    for (uint64_t i = 0; i < n; ++i) keys.push_back(r.str());
    r.expect_end();
    RpcMessage out;
    MetaWriter w;
    for (const auto& key : keys) {
      auto v = find(key);
      std::lock_guard lock(v->mu);
      out.tensors.push_back(v->value.clone());
      w.i64(v->updates).u64(with_slots ? v->slots.size() : 0);
      if (with_slots)
        for (const Tensor& s : v->slots) out.tensors.push_back(s.clone());
    }
    out.meta = w.take();
    return out;
  }

  RpcMessage push(const RpcMessage& req) {
    MetaReader r(req.meta, "push request");
    const std::string config = r.str();
    const uint64_t increment = r.u64();
    const uint64_t n = r.u64();
    if (n != req.tensors.size())
      throw InvalidArgument(detail::str_cat("push of ", n, " variables carries ", req.tensors.size(), " gradients"));
    std::vector<std::string> keys;
    for (uint64_t i = 0; i < n; ++i) keys.push_back(r.str());
    r.expect_end();
    for (uint64_t i = 0; i < n; ++i) {
      auto v = find(keys[i]);
      const Tensor& g = req.tensors[i];
      std::lock_guard lock(v->mu);
      if (g.shape() != v->value.shape() || g.dtype() != v->value.dtype())
        throw InvalidArgument("gradient of " + describe(g) + " pushed for variable '" + keys[i] + "' of " +
                              describe(v->value));
      if (!v->opt || v->opt_config != config) {
        v->opt = Optimizer::from_config(config);
        v->opt_config = config;
      }
      if (static_cast<int>(v->slots.size()) != v->opt->slots_per_variable()) {
        v->slots.clear();
        for (int s = 0; s < v->opt->slots_per_variable(); ++s)
          v->slots.push_back(Tensor::zeros(v->value.shape(), v->value.dtype()));
      }
      v->opt->apply_dense(v->value, g, v->slots, ++v->updates);
    }
    int64_t step;
    {
      std::lock_guard lock(clock_mu_);
      global_step_ += static_cast<int64_t>(increment);
      step = global_step_;
    }
    RpcMessage out;
    out.meta = MetaWriter().i64(step).take();
    return out;
  }

  RpcMessage assign(const RpcMessage& req) {
    MetaReader r(req.meta, "assign request");
    const uint8_t mode = r.u8();
    const std::string key = r.str();
    r.expect_end();
    if (mode > 2 || req.tensors.size() != 1) throw InvalidArgument("malformed assign request for '" + key + "'");
    auto v = find(key);
    std::lock_guard lock(v->mu);
    const Tensor& t = req.tensors[0];
    if (t.shape() != v->value.shape() || t.dtype() != v->value.dtype())
      throw InvalidArgument("assign of " + describe(t) + " to variable '" + key + "' of " + describe(v->value));
    if (mode == 0) {
      v->value.copy_from(t);
    } else {
      Kernels& k = kernels_for(v->value);
      v->value.copy_from(k.binary(mode == 1 ? BinaryOp::kAdd : BinaryOp::kSub, v->value, t));
    }
    return RpcMessage{};
  }

  RpcMessage clock(const RpcMessage& req, int client) {
    MetaReader r(req.meta, "clock request");
    const int64_t step = r.i64();
    const bool done = r.u8() != 0;
    r.expect_end();
    std::lock_guard lock(clock_mu_);
    if (client >= 0 && client < num_workers_) {
      auto& w = workers_[static_cast<size_t>(client)];
      // Done is final for that run of the worker (its evaluation steps must not make it count as
      // training again); a worker that died (Gone) and comes back is active again.
      if (w.state != ps::kDone || done) w.state = done ? ps::kDone : ps::kActive;
      w.step = step;
    }
    int64_t min_step = INT64_MAX;  // the slowest active worker other than the caller
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].state == ps::kActive && static_cast<int>(i) != client) min_step = std::min(min_step, workers_[i].step);
    MetaWriter m;
    m.i64(min_step == INT64_MAX ? step : min_step).i64(global_step_).u64(workers_.size());
    for (const auto& w : workers_) m.u8(w.state);
    RpcMessage out;
    out.meta = m.take();
    return out;
  }

  RpcMessage set_step(const RpcMessage& req) {
    MetaReader r(req.meta, "set-step request");
    const int64_t step = r.i64();
    r.expect_end();
    std::lock_guard lock(clock_mu_);
    if (global_step_ == 0) global_step_ = step;
    RpcMessage out;
    out.meta = MetaWriter().i64(global_step_).take();
    return out;
  }

  void on_disconnect(int client) {
    std::lock_guard lock(clock_mu_);
    if (client >= 0 && client < num_workers_) {
      auto& w = workers_[static_cast<size_t>(client)];
      if (w.state == ps::kActive) w.state = ps::kGone;
    }
  }

  struct WorkerClock {
    uint8_t state = ps::kNeverSeen;
    int64_t step = 0;
  };
  const int num_workers_;
  const std::string name_;
  std::shared_mutex mu_;
  std::condition_variable_any created_;
  std::map<std::string, std::shared_ptr<ServerVar>> vars_;
  std::mutex clock_mu_;
  int64_t global_step_ = 0;
  std::vector<WorkerClock> workers_;
  std::unique_ptr<tcp::RpcServer> rpc_;
};

}  // namespace

void serve_parameter_server(const ClusterResolution& cluster, std::string token) {
  if (cluster.task_type() != TaskType::kPs)
    throw InvalidArgument("serve_parameter_server() runs on a ps task, but this task is " + cluster.task_name());
  TcpGroupOptions o = ps::group_options(cluster, resolve_job_token(std::move(token)));
  // Block the stop signals before any thread starts, so that only sigwait below sees them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  PsServer server(cluster, o);
  DTRAIN_LOG(INFO) << cluster.task_name() << " serving on " << cluster.task_address()
                   << " (parameter server; stop with SIGTERM)";
  int sig = 0;
  sigwait(&set, &sig);
  DTRAIN_LOG(INFO) << cluster.task_name() << " stopping on signal " << sig << " with " << server.num_variables()
                   << " variable(s), global step " << server.global_step();
  server.stop();
}

}  // namespace dtrain
