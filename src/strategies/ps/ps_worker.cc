// The worker side of the parameter-server strategy: connections, pull, push, the worker clock and
// checkpoint snapshots.
#include <algorithm>
#include <exception>
#include <map>
#include <system_error>
#include <thread>

#include "dtrain/core/logging.h"
#include "strategies/ps/ps_impl.h"
#include "strategies/ps/ps_protocol.h"
#include "strategies/ps/ps_tasks.h"

namespace dtrain {

ParameterServerStrategy::Impl::Impl(ParameterServerOptions o, ClusterResolution c, DeviceSpec d,
                                    const std::string& token)
    : opts(std::move(o)), cluster(std::move(c)), device(d) {
  group = ps::group_options(cluster, token);
  group.connect_timeout = opts.connect_timeout;
  group.collective.timeout = opts.timeout;
  const int n = cluster.cluster().num_tasks(TaskType::kPs);
  for (int i = 0; i < n; ++i) {
    const int rank = ps::rank_of(cluster.cluster(), TaskType::kPs, i);
    ps_names.push_back("ps:" + std::to_string(i));
    ps.push_back(std::make_unique<ps::PsClient>(group, rank));
  }
}

void ParameterServerStrategy::Impl::fail(int i, const Error& e, const char* during) {
  const std::string who = ps_names.at(static_cast<size_t>(i)) + " (" +
                          ps[static_cast<size_t>(i)]->server_address() + ")";
  const std::string what = e.what();
  if (dynamic_cast<const Unavailable*>(&e) || dynamic_cast<const DataLoss*>(&e))
    throw Unavailable("parameter server " + who + " failed while " + during + ": " + what +
                      ". The job cannot continue without it; relaunch the job to resume from the "
                      "last checkpoint");
  if (dynamic_cast<const DeadlineExceeded*>(&e))
    throw DeadlineExceeded("parameter server " + who + " did not answer while " + during +
                           " within " + std::to_string(opts.timeout.count()) + " ms: " + what);
  throw;  // the server refused the request (InvalidArgument, NotFound, ...): its message says why
}

namespace {

// Runs fn(p) for every server p in `servers`: on a thread each when `bytes` (the traffic) is large,
// so that transfers to and from several servers overlap, else in turn. Every server gets its turn;
// then the first failure (in server order) is rethrown through fail(), which names the server.
template <typename Fn>
void for_each_server(ParameterServerStrategy::Impl& m, const std::vector<size_t>& servers,
                     size_t bytes, const char* during, Fn fn) {
  std::vector<std::exception_ptr> errors(servers.size());
  auto run = [&](size_t i) {
    try {
      fn(servers[i]);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  if (servers.size() > 1 &&
      bytes >= (size_t{4} << 20)) {  // below ~4 MB a thread costs more than it saves
    std::vector<std::thread> threads;
    threads.reserve(servers.size());  // (no allocation below while threads run)
    for (size_t i = 1; i < servers.size(); ++i) {
      try {
        threads.emplace_back(run, i);
      } catch (const std::system_error&) {  // out of threads: this server on this one
        run(i);
      }
    }
    run(0);
    for (auto& t : threads) t.join();
  } else {
    for (size_t i = 0; i < servers.size(); ++i) run(i);
  }
  for (size_t i = 0; i < servers.size(); ++i) {
    if (!errors[i]) continue;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      m.fail(static_cast<int>(servers[i]), e, during);
    }
  }
}

}  // namespace

void ParameterServerStrategy::Impl::pull(const std::vector<PsVariable*>& which) {
  // Group the shards by server: one request per server, all in flight at once.
  std::vector<std::vector<std::pair<PsVariable*, int>>> per_ps(ps.size());
  for (PsVariable* v : which)
    for (int s = 0; s < v->num_shards(); ++s)
      per_ps[static_cast<size_t>(v->shards()[static_cast<size_t>(s)].ps)].emplace_back(v, s);
  std::vector<size_t> servers;
  size_t bytes = 0;
  for (size_t p = 0; p < ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    servers.push_back(p);
    for (auto [v, s] : per_ps[p]) bytes += v->shard_of(v->cache(), s).nbytes();
  }
  std::vector<ps::PullRequest> reqs(ps.size());
  for (size_t p : servers)
    for (auto [v, s] : per_ps[p]) reqs[p].keys.push_back(v->shards()[static_cast<size_t>(s)].key);
  std::lock_guard<std::mutex> lock(rpc_mu);
  std::vector<uint64_t> ids(ps.size(), 0);
  for_each_server(*this, servers, 0, "pulling variables",
                  [&](size_t p) { ids[p] = ps[p]->send(reqs[p]); });
  for_each_server(*this, servers, bytes, "pulling variables", [&](size_t p) {
    std::vector<Tensor> dst;  // read the values straight into the caches
    for (auto [v, s] : per_ps[p]) dst.push_back(v->shard_of(v->cache(), s));
    const ps::PullResponse resp = ps[p]->receive_pull(ids[p], reqs[p], &dst);
    for (size_t k = 0; k < per_ps[p].size(); ++k) {
      const Tensor& got = resp.vars[k].value;
      const Tensor& d = dst[k];
      if (got.shape() != d.shape() || got.dtype() != d.dtype())
        throw InvalidArgument(ps_names[p] + " holds '" + reqs[p].keys[k] + "' as " +
                              got.to_string() + " but this worker's model has " + d.to_string() +
                              ": every worker must build the same model");
      if (d.raw_data() != got.raw_data()) dst[k].copy_from(got);
    }
  });
}

void ParameterServerStrategy::Impl::flush() {
  std::vector<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(out_mu);
    pending.swap(outbox);
  }
  if (pending.empty()) return;
  // One request per (server, optimizer); ps:0's first request also counts the step.
  struct Request {
    size_t ps = 0;
    ps::PushRequest push;
    uint64_t id = 0;
  };
  std::vector<Request> reqs;
  auto request_for = [&](size_t p, const std::string& config) -> Request& {
    for (auto& r : reqs)
      if (r.ps == p && r.push.optimizer_config == config) return r;
    reqs.emplace_back().ps = p;
    reqs.back().push.optimizer_config = config;
    return reqs.back();
  };
  for (const Pending& p : pending)
    for (int s = 0; s < p.var->num_shards(); ++s) {
      const auto& shard = p.var->shards()[static_cast<size_t>(s)];
      Request& r = request_for(static_cast<size_t>(shard.ps), p.config);
      r.push.keys.push_back(shard.key);
      r.push.grads.push_back(p.var->shard_of(p.grad, s));
    }
  bool counted = false;
  for (auto& r : reqs)
    if (r.ps == 0) counted = true;
  if (!counted) request_for(0, pending.front().config);  // just the step count
  counted = false;
  std::vector<size_t> servers;
  size_t bytes = 0;
  for (auto& r : reqs) {
    r.push.step_increment = r.ps == 0 && !counted ? 1 : 0;
    if (r.push.step_increment) counted = true;
    for (const Tensor& t : r.push.grads) bytes += t.nbytes();
    if (std::find(servers.begin(), servers.end(), r.ps) == servers.end()) servers.push_back(r.ps);
  }
  std::lock_guard<std::mutex> lock(rpc_mu);
  for_each_server(*this, servers, bytes, "pushing gradients", [&](size_t p) {
    for (auto& r : reqs)
      if (r.ps == p) r.id = ps[p]->send(r.push);
  });
  for_each_server(*this, servers, 0, "pushing gradients", [&](size_t p) {
    for (auto& r : reqs) {
      if (r.ps != p) continue;
      const ps::PushResponse resp = ps[p]->receive_push(r.id);
      if (p == 0) global_step.store(std::max(global_step.load(), resp.global_step));
    }
  });
}

ps::ClockResponse ParameterServerStrategy::Impl::clock(bool done) {
  ps::ClockResponse resp;
  {
    std::lock_guard<std::mutex> lock(rpc_mu);
    try {
      resp = ps[0]->clock({.step = local_steps, .done = done});
    } catch (const Error& e) {
      fail(0, e, "reporting this worker's progress");
    }
  }
  global_step.store(std::max(global_step.load(), resp.global_step));
  return resp;
}

CheckpointData ParameterServerStrategy::Impl::snapshot() {
  // Every shard with its slots, all servers at once; then each variable whole (shards
  // concatenated), so a checkpoint restores into any number of ps tasks or another partitioner.
  std::vector<std::vector<std::pair<PsVariable*, int>>> per_ps(ps.size());
  for (const auto& v : vars)
    for (int s = 0; s < v->num_shards(); ++s)
      per_ps[static_cast<size_t>(v->shards()[static_cast<size_t>(s)].ps)].emplace_back(v.get(), s);
  using Got = ps::PulledVariable;
  std::map<std::pair<PsVariable*, int>, ps::PulledVariable> got;
  {
    std::vector<ps::PullRequest> reqs(ps.size());
    for (size_t p = 0; p < ps.size(); ++p) {
      reqs[p].with_slots = true;
      for (auto [v, s] : per_ps[p]) reqs[p].keys.push_back(v->shards()[static_cast<size_t>(s)].key);
    }
    std::lock_guard<std::mutex> lock(rpc_mu);
    std::vector<uint64_t> ids(ps.size(), 0);
    for (size_t p = 0; p < ps.size(); ++p) {
      if (per_ps[p].empty()) continue;
      try {
        ids[p] = ps[p]->send(reqs[p]);
      } catch (const Error& e) {
        fail(static_cast<int>(p), e, "reading a checkpoint");
      }
    }
    for (size_t p = 0; p < ps.size(); ++p) {
      if (per_ps[p].empty()) continue;
      ps::PullResponse resp;
      try {
        resp = ps[p]->receive_pull(ids[p], reqs[p]);
      } catch (const Error& e) {
        fail(static_cast<int>(p), e, "reading a checkpoint");
      }
      for (size_t k = 0; k < per_ps[p].size(); ++k) got[per_ps[p][k]] = std::move(resp.vars[k]);
    }
  }
  CheckpointData data;
  for (const auto& v : vars) {
    const std::string& key = v->base_key();
    const int n = v->num_shards();
    const Got& first = got.at({v.get(), 0});
    size_t slots = first.slots.size();
    int64_t updates = 0;
    for (int s = 0; s < n; ++s) {
      const Got& g = got.at({v.get(), s});
      slots = std::min(slots, g.slots.size());  // a shard never pushed to has no slots yet
      // Shards whose slots are of different kinds (one not pushed to since a restore into
      // another optimizer): no slots saved, rather than a mix under one name.
      if (g.slot_names != first.slot_names) slots = 0;
      updates = std::max(updates, g.updates);
    }
    auto whole = [&](auto part_of) {
      if (n == 1) return part_of(got.at({v.get(), 0}));
      Tensor t = Tensor::empty(v->shape(), v->dtype());
      for (int s = 0; s < n; ++s) v->shard_of(t, s).copy_from(part_of(got.at({v.get(), s})));
      return t;
    };
    data.tensors.emplace_back(key, whole([](const Got& g) { return g.value; }));
    for (size_t j = 0; j < slots; ++j)
      data.tensors.emplace_back(key + "/slot_" + std::to_string(j),
                                whole([j](const Got& g) { return g.slots[j]; }));
    data.metadata[key + "/updates"] = std::to_string(updates);
    if (slots > 0) data.metadata[key + "/slot_names"] = first.slot_names;
  }
  return data;
}

}  // namespace dtrain
