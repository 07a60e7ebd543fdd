// The parameter server: variables, their optimizer slots and the job's global step, served over
// tcp::RpcServer to every task of the job. Each variable has its own mutex, so pushes to one
// shard apply atomically and pushes to different shards run in parallel (one thread per
// connection).
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "collectives/tcp/rpc.h"
#include "dtrain/core/logging.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/update_rules.h"
#include "dtrain/strategies/parameter_server_strategy.h"
#include "strategies/ps/ps_protocol.h"
#include "strategies/ps/ps_tasks.h"

namespace dtrain {
namespace {

using tcp::RpcMessage;

struct ServerVar {
  std::mutex mu;
  Tensor value;
  std::vector<Tensor> slots;
  std::string slot_names;  // what `slots` are (UpdateRule::slot_names, comma-joined)
  int64_t updates = 0;     // optimizer steps applied (Adam's step count)
  std::string opt_config;
  UpdateConfig opt;  // the rule of the optimizer config pushed last
};

class PsServer {
 public:
  PsServer(const ClusterResolution& cluster, TcpGroupOptions o)
      : num_workers_(cluster.num_workers()),
        name_(cluster.task_name()),
        workers_(static_cast<size_t>(num_workers_)) {
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
  // Decodes the typed request, serves it, encodes the typed response.
  RpcMessage handle(const RpcMessage& req, int client) {
    switch (req.method) {
      case ps::kCreate:
        return ps::encode(create(ps::decode_create_request(req)));
      case ps::kLookup:
        return ps::encode(lookup(ps::decode_lookup_request(req)));
      case ps::kPull:
        return ps::encode(pull(ps::decode_pull_request(req)));
      case ps::kPush:
        return ps::encode(push(ps::decode_push_request(req)));
      case ps::kAssign:
        return ps::encode(assign(ps::decode_assign_request(req)));
      case ps::kClock:
        return ps::encode(clock(ps::decode_clock_request(req), client));
      case ps::kSetStep:
        return ps::encode(set_step(ps::decode_set_step_request(req)));
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

  ps::CreateResponse create(const ps::CreateRequest& req) {
    std::unique_lock lock(mu_);
    auto it = vars_.find(req.key);
    if (it != vars_.end()) {
      const Tensor& have = it->second->value;
      if (have.shape() != req.value.shape() || have.dtype() != req.value.dtype())
        throw InvalidArgument("variable '" + req.key + "' exists on " + name_ + " as " +
                              describe(have) + " but this worker's model has " +
                              describe(req.value) + ": every worker must build the same model");
      return {.created = false};
    }
    auto v = std::make_shared<ServerVar>();
    v->value = req.value;
    v->slots = req.slots;
    for (const Tensor& s : v->slots)
      if (s.shape() != v->value.shape() || s.dtype() != v->value.dtype())
        throw InvalidArgument("create '" + req.key + "': a slot of " + describe(s) +
                              " for a variable of " + describe(v->value));
    v->slot_names = req.slot_names;
    v->updates = req.updates;
    vars_.emplace(req.key, std::move(v));
    lock.unlock();
    created_.notify_all();
    return {.created = true};
  }

  ps::LookupResponse lookup(const ps::LookupRequest& req) {
    const uint64_t wait_ms = std::min<uint64_t>(req.wait_ms, 5000);
    std::shared_ptr<ServerVar> v;
    {
      std::unique_lock lock(mu_);
      created_.wait_for(lock, std::chrono::milliseconds(wait_ms),
                        [&] { return vars_.count(req.key) != 0; });
      auto it = vars_.find(req.key);
      if (it != vars_.end()) v = it->second;
    }
    ps::LookupResponse out;
    if (v) {
      std::lock_guard lock(v->mu);
      out.found = true;
      out.dtype = v->value.dtype();
      out.shape = v->value.shape();
    }
    return out;
  }

  ps::PullResponse pull(const ps::PullRequest& req) {
    ps::PullResponse out;
    for (const auto& key : req.keys) {
      auto v = find(key);
      std::lock_guard lock(v->mu);
      ps::PulledVariable& got = out.vars.emplace_back();
      got.updates = v->updates;
      got.value = v->value.clone();
      if (req.with_slots) {
        for (const Tensor& s : v->slots) got.slots.push_back(s.clone());
        got.slot_names = v->slot_names;
      }
    }
    return out;
  }

  ps::PushResponse push(const ps::PushRequest& req) {
    for (size_t i = 0; i < req.keys.size(); ++i) {
      auto v = find(req.keys[i]);
      const Tensor& g = req.grads[i];
      std::lock_guard lock(v->mu);
      if (g.shape() != v->value.shape() || g.dtype() != v->value.dtype())
        throw InvalidArgument("gradient of " + describe(g) + " pushed for variable '" +
                              req.keys[i] + "' of " + describe(v->value));
      if (!v->opt.rule || v->opt_config != req.optimizer_config) {
        v->opt = parse_update_config(req.optimizer_config);
        v->opt_config = req.optimizer_config;
      }
      const UpdateRule& rule = *v->opt.rule;
      const std::vector<std::string> names = rule.slot_names();
      std::string joined;
      for (const std::string& n : names) joined += (joined.empty() ? "" : ",") + n;
      // Slots of another kind (restored from a checkpoint another optimizer wrote: SGD's momentum
      // is not RMSprop's velocity, though both are one slot) start afresh, with the step count
      // (Adam's bias correction), as the synchronous strategies' restore does; reused, they sent
      // the loss to NaN. Unnamed slots (a checkpoint written before the names were) are kept when
      // their number fits, as before.
      const bool unnamed = v->slot_names.empty() && !v->slots.empty();
      if (v->slots.size() != names.size() || (!unnamed && v->slot_names != joined)) {
        if (!v->slots.empty() && !warned_slots_.exchange(true)) {
          DTRAIN_LOG(WARNING) << name_ << ": the optimizer slots of '" << req.keys[i] << "' ("
                              << (v->slot_names.empty() ? "unnamed" : v->slot_names) << ") are not "
                              << rule.name() << "'s (" << (joined.empty() ? "none" : joined)
                              << "): they start afresh (said once for all variables)";
        }
        if (!v->slots.empty()) v->updates = 0;
        v->slots.clear();
        for (size_t s = 0; s < names.size(); ++s)
          v->slots.push_back(
              Tensor::full(v->value.shape(), rule.slot_initial_value(static_cast<int>(s))));
      }
      v->slot_names = joined;
      rule.apply(v->value, g, v->slots, ++v->updates, v->opt.learning_rate, v->opt.weight_decay);
    }
    std::lock_guard lock(clock_mu_);
    global_step_ += static_cast<int64_t>(req.step_increment);
    return {.global_step = global_step_};
  }

  ps::AssignResponse assign(const ps::AssignRequest& req) {
    auto v = find(req.key);
    std::lock_guard lock(v->mu);
    const Tensor& t = req.value;
    if (t.shape() != v->value.shape() || t.dtype() != v->value.dtype())
      throw InvalidArgument("assign of " + describe(t) + " to variable '" + req.key + "' of " +
                            describe(v->value));
    if (req.mode == ps::AssignMode::kSet) {
      v->value.copy_from(t);
    } else {
      Kernels& k = kernels_for(v->value);
      v->value.copy_from(k.binary(
          req.mode == ps::AssignMode::kAdd ? BinaryOp::kAdd : BinaryOp::kSub, v->value, t));
    }
    return {};
  }

  ps::ClockResponse clock(const ps::ClockRequest& req, int client) {
    std::lock_guard lock(clock_mu_);
    if (client >= 0 && client < num_workers_) {
      auto& w = workers_[static_cast<size_t>(client)];
      // Done is final for that run of the worker (its evaluation steps must not make it count as
      // training again); a worker that died (Gone) and comes back is active again.
      if (w.state != ps::kDone || req.done) w.state = req.done ? ps::kDone : ps::kActive;
      w.step = req.step;
    }
    int64_t min_step = INT64_MAX;  // the slowest active worker other than the caller
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].state == ps::kActive && static_cast<int>(i) != client)
        min_step = std::min(min_step, workers_[i].step);
    ps::ClockResponse out;
    out.min_active_step = min_step == INT64_MAX ? req.step : min_step;
    out.global_step = global_step_;
    for (const auto& w : workers_) out.states.push_back(w.state);
    return out;
  }

  ps::SetStepResponse set_step(const ps::SetStepRequest& req) {
    std::lock_guard lock(clock_mu_);
    if (global_step_ == 0) global_step_ = req.step;
    return {.global_step = global_step_};
  }

  void on_disconnect(int client) {
    std::lock_guard lock(clock_mu_);
    if (client >= 0 && client < num_workers_) {
      auto& w = workers_[static_cast<size_t>(client)];
      if (w.state == ps::kActive) w.state = ps::kGone;
    }
  }

  struct WorkerClock {
    ps::WorkerState state = ps::kNeverSeen;
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
  std::atomic<bool> warned_slots_{false};
  std::unique_ptr<tcp::RpcServer> rpc_;
};

}  // namespace

void serve_parameter_server(const ClusterResolution& cluster, std::string token) {
  if (cluster.task_type() != TaskType::kPs)
    throw InvalidArgument("serve_parameter_server() runs on a ps task, but this task is " +
                          cluster.task_name());
  TcpGroupOptions o = ps::group_options(cluster, resolve_job_token(std::move(token)));
  // Block the stop signals before any thread starts, so that only sigwait below sees them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigset_t before;
  pthread_sigmask(SIG_BLOCK, &set, &before);
  // The caller's mask again however this returns (a port that cannot be bound throws); a second
  // stop signal still pending (Ctrl-C and the launcher's SIGTERM) is taken first, or unblocking it
  // would kill the process after its clean stop.
  struct RestoreMask {
    const sigset_t& stops;
    const sigset_t& mask;
    ~RestoreMask() {
      const timespec now{0, 0};
      while (sigtimedwait(&stops, nullptr, &now) > 0) {
      }
      pthread_sigmask(SIG_SETMASK, &mask, nullptr);
    }
  } restore{set, before};
  PsServer server(cluster, o);
  DTRAIN_LOG(INFO) << cluster.task_name() << " serving on " << cluster.task_address()
                   << " (parameter server; stop with SIGTERM)";
  int sig = 0;
  sigwait(&set, &sig);
  DTRAIN_LOG(INFO) << cluster.task_name() << " stopping on signal " << sig << " with "
                   << server.num_variables() << " variable(s), global step "
                   << server.global_step();
  server.stop();
}

}  // namespace dtrain
