// The worker side of the parameter-server strategy: connections, pull, push, the worker clock and
// checkpoint snapshots.
#include <algorithm>
#include <exception>
#include <map>
#include <thread>

#include "dtrain/core/logging.h"
#include "strategies/ps/ps_impl.h"
#include "strategies/ps/ps_protocol.h"
#include "strategies/ps/ps_tasks.h"

namespace dtrain {

using tcp::MetaReader;
using tcp::MetaWriter;
using tcp::RpcMessage;

ParameterServerStrategy::Impl::Impl(ParameterServerOptions o, ClusterResolution c, DeviceSpec d, const std::string& token)
    : opts(std::move(o)), cluster(std::move(c)), device(d) {
  group = ps::group_options(cluster, token);
  group.connect_timeout = opts.connect_timeout;
  group.collective.timeout = opts.timeout;
  const int n = cluster.cluster().num_tasks(TaskType::kPs);
  for (int i = 0; i < n; ++i) {
    const int rank = ps::rank_of(cluster.cluster(), TaskType::kPs, i);
    ps_names.push_back("ps:" + std::to_string(i));
    ps.push_back(std::make_unique<tcp::RpcClient>(group, rank));
  }
}

void ParameterServerStrategy::Impl::fail(int i, const Error& e, const char* during) {
  const std::string who = ps_names.at(static_cast<size_t>(i)) + " (" + ps[static_cast<size_t>(i)]->server_address() + ")";
  const std::string what = e.what();
  if (dynamic_cast<const Unavailable*>(&e) || dynamic_cast<const DataLoss*>(&e))
    throw Unavailable("parameter server " + who + " failed while " + during + ": " + what +
                      ". The job cannot continue without it; relaunch the job to resume from the last checkpoint");
  if (dynamic_cast<const DeadlineExceeded*>(&e))
    throw DeadlineExceeded("parameter server " + who + " did not answer while " + during + " within " +
                           std::to_string(opts.timeout.count()) + " ms: " + what);
  throw;  // the server refused the request (InvalidArgument, NotFound, ...): its message says why
}

namespace {

// Runs fn(p) for every server p in `servers`: on a thread each when `bytes` (the traffic) is large,
// so that transfers to and from several servers overlap, else in turn. Every server gets its turn;
// then the first failure (in server order) is rethrown through fail(), which names the server.
template <typename Fn>
void for_each_server(ParameterServerStrategy::Impl& m, const std::vector<size_t>& servers, size_t bytes,
                     const char* during, Fn fn) {
  std::vector<std::exception_ptr> errors(servers.size());
  auto run = [&](size_t i) {
    try {
      fn(servers[i]);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  if (servers.size() > 1 && bytes >= (size_t{4} << 20)) {  // below ~4 MB a thread costs more than it saves
    std::vector<std::thread> threads;
    for (size_t i = 1; i < servers.size(); ++i) threads.emplace_back(run, i);
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
    for (int s = 0; s < v->num_shards(); ++s) per_ps[static_cast<size_t>(v->shards()[static_cast<size_t>(s)].ps)].emplace_back(v, s);
  std::vector<size_t> servers;
  size_t bytes = 0;
  for (size_t p = 0; p < ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    servers.push_back(p);
    for (auto [v, s] : per_ps[p]) bytes += v->shard_of(v->cache(), s).nbytes();
  }
  std::lock_guard<std::mutex> lock(rpc_mu);
  std::vector<uint64_t> ids(ps.size(), 0);
  for_each_server(*this, servers, 0, "pulling variables", [&](size_t p) {
    MetaWriter w;
    w.u8(0).u64(per_ps[p].size());
    for (auto& [v, s] : per_ps[p]) w.str(v->shards()[static_cast<size_t>(s)].key);
    RpcMessage req;
    req.method = ps::kPull;
    req.meta = w.take();
    ids[p] = ps[p]->send(req);
  });
  for_each_server(*this, servers, bytes, "pulling variables", [&](size_t p) {
    std::vector<Tensor> dst;  // read the values straight into the caches
    for (auto [v, s] : per_ps[p]) dst.push_back(v->shard_of(v->cache(), s));
    RpcMessage resp = ps[p]->receive(ids[p], &dst);
    if (resp.tensors.size() != per_ps[p].size())
      throw DataLoss(ps_names[p] + " answered a pull of " + std::to_string(per_ps[p].size()) + " shards with " +
                     std::to_string(resp.tensors.size()) + " tensors");
    for (size_t k = 0; k < per_ps[p].size(); ++k) {
      auto [v, s] = per_ps[p][k];
      const Tensor& d = dst[k];
      if (resp.tensors[k].shape() != d.shape() || resp.tensors[k].dtype() != d.dtype())
        throw InvalidArgument(ps_names[p] + " holds '" + v->shards()[static_cast<size_t>(s)].key + "' as " +
                              resp.tensors[k].to_string() + " but this worker's model has " + d.to_string() +
                              ": every worker must build the same model");
      if (d.raw_data() != resp.tensors[k].raw_data()) dst[k].copy_from(resp.tensors[k]);
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
    size_t ps;
    std::string config;
    std::vector<std::string> keys;
    RpcMessage msg;
    uint64_t id = 0;
  };
  std::vector<Request> reqs;
  auto request_for = [&](size_t p, const std::string& config) -> Request& {
    for (auto& r : reqs)
      if (r.ps == p && r.config == config) return r;
    reqs.push_back(Request{p, config, {}, {}, 0});
    return reqs.back();
  };
  for (const Pending& p : pending)
    for (int s = 0; s < p.var->num_shards(); ++s) {
      const auto& shard = p.var->shards()[static_cast<size_t>(s)];
      Request& r = request_for(static_cast<size_t>(shard.ps), p.config);
      r.keys.push_back(shard.key);
      r.msg.tensors.push_back(p.var->shard_of(p.grad, s));
    }
  bool counted = false;
  for (auto& r : reqs)
    if (r.ps == 0) counted = true;
  if (!counted) reqs.push_back(Request{0, pending.front().config, {}, {}, 0});  // just the step count
  counted = false;
  std::vector<size_t> servers;
  size_t bytes = 0;
  for (auto& r : reqs) {
    const uint64_t increment = r.ps == 0 && !counted ? 1 : 0;
    if (increment) counted = true;
    MetaWriter w;
    w.str(r.config).u64(increment).u64(r.keys.size());
    for (const auto& k : r.keys) w.str(k);
    r.msg.method = ps::kPush;
    r.msg.meta = w.take();
    for (const Tensor& t : r.msg.tensors) bytes += t.nbytes();
    if (std::find(servers.begin(), servers.end(), r.ps) == servers.end()) servers.push_back(r.ps);
  }
  std::lock_guard<std::mutex> lock(rpc_mu);
  for_each_server(*this, servers, bytes, "pushing gradients", [&](size_t p) {
    for (auto& r : reqs)
      if (r.ps == p) r.id = ps[p]->send(r.msg);
  });
  for_each_server(*this, servers, 0, "pushing gradients", [&](size_t p) {
    for (auto& r : reqs) {
      if (r.ps != p) continue;
      const RpcMessage resp = ps[p]->receive(r.id);
      if (p == 0) {
        MetaReader m(resp.meta, "push response from ps:0");
        global_step.store(std::max(global_step.load(), m.i64()));
      }
    }
  });
}

std::vector<uint8_t> ParameterServerStrategy::Impl::clock(bool done, int64_t* min_active_step) {
  RpcMessage req;
  req.method = ps::kClock;
  req.meta = MetaWriter().i64(local_steps).u8(done ? 1 : 0).take();
  RpcMessage resp;
  {
    std::lock_guard<std::mutex> lock(rpc_mu);
    try {
      resp = ps[0]->call(req);
    } catch (const Error& e) {
      fail(0, e, "reporting this worker's progress");
    }
  }
  MetaReader r(resp.meta, "clock response from ps:0");
  const int64_t min_step = r.i64();
  global_step.store(std::max(global_step.load(), r.i64()));
  const uint64_t n = r.u64();
  if (n > 1u << 20) throw DataLoss("clock response from ps:0 lists " + std::to_string(n) + " workers");
  std::vector<uint8_t> states;
  for (uint64_t i = 0; i < n; ++i) states.push_back(r.u8());
  if (min_active_step) *min_active_step = min_step;
  return states;
}

CheckpointData ParameterServerStrategy::Impl::snapshot() {
  // Every shard with its slots, all servers at once; then each variable whole (shards
  // concatenated), so a checkpoint restores into any number of ps tasks or another partitioner.
  std::vector<std::vector<std::pair<PsVariable*, int>>> per_ps(ps.size());
  for (const auto& v : vars)
    for (int s = 0; s < v->num_shards(); ++s) per_ps[static_cast<size_t>(v->shards()[static_cast<size_t>(s)].ps)].emplace_back(v.get(), s);
  struct Got {
    Tensor value;
    std::vector<Tensor> slots;
    int64_t updates = 0;
  };
  std::map<std::pair<PsVariable*, int>, Got> got;
  {
    std::lock_guard<std::mutex> lock(rpc_mu);
    std::vector<uint64_t> ids(ps.size(), 0);
    for (size_t p = 0; p < ps.size(); ++p) {
      if (per_ps[p].empty()) continue;
      MetaWriter w;
      w.u8(1).u64(per_ps[p].size());
      for (auto [v, s] : per_ps[p]) w.str(v->shards()[static_cast<size_t>(s)].key);
      RpcMessage req;
      req.method = ps::kPull;
      req.meta = w.take();
      try {
        ids[p] = ps[p]->send(req);
      } catch (const Error& e) {
        fail(static_cast<int>(p), e, "reading a checkpoint");
      }
    }
    for (size_t p = 0; p < ps.size(); ++p) {
      if (per_ps[p].empty()) continue;
      RpcMessage resp;
      try {
        resp = ps[p]->receive(ids[p]);
      } catch (const Error& e) {
        fail(static_cast<int>(p), e, "reading a checkpoint");
      }
      MetaReader r(resp.meta, "checkpoint pull from " + ps_names[p]);
      size_t t = 0;
      for (auto entry : per_ps[p]) {
        Got g;
        g.updates = r.i64();
        const uint64_t slots = r.u64();
        if (slots > 16 || t + 1 + slots > resp.tensors.size()) throw DataLoss("checkpoint pull from " + ps_names[p] + " is short");
        g.value = resp.tensors[t++];
        for (uint64_t j = 0; j < slots; ++j) g.slots.push_back(resp.tensors[t++]);
        got[entry] = std::move(g);
      }
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
      data.tensors.emplace_back(key + "/slot_" + std::to_string(j), whole([j](const Got& g) { return g.slots[j]; }));
    data.metadata[key + "/updates"] = std::to_string(updates);
  }
  return data;
}

}  // namespace dtrain
