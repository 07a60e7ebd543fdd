// The worker side of the parameter-server strategy: connections, pull, push, the worker clock and
// checkpoint snapshots.
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

void ParameterServerStrategy::Impl::pull(const std::vector<PsVariable*>& which) {
  // Group the shards by server: one request per server, all in flight at once.
  std::vector<std::vector<std::pair<PsVariable*, int>>> per_ps(ps.size());
  for (PsVariable* v : which)
    for (int s = 0; s < v->num_shards(); ++s) per_ps[static_cast<size_t>(v->shards()[static_cast<size_t>(s)].ps)].emplace_back(v, s);
  std::lock_guard<std::mutex> lock(rpc_mu);
  std::vector<uint64_t> ids(ps.size(), 0);
  for (size_t p = 0; p < ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    MetaWriter w;
    w.u8(0).u64(per_ps[p].size());
    for (auto& [v, s] : per_ps[p]) w.str(v->shards()[static_cast<size_t>(s)].key);
    RpcMessage req;
    req.method = ps::kPull;
    req.meta = w.take();
    try {
      ids[p] = ps[p]->send(req);
    } catch (const Error& e) {
      fail(static_cast<int>(p), e, "pulling variables");
    }
  }
  for (size_t p = 0; p < ps.size(); ++p) {
    if (per_ps[p].empty()) continue;
    std::vector<Tensor> dst;  // read the values straight into the caches
    for (auto [v, s] : per_ps[p]) dst.push_back(v->shard_of(v->cache(), s));
    RpcMessage resp;
    try {
      resp = ps[p]->receive(ids[p], &dst);
    } catch (const Error& e) {
      fail(static_cast<int>(p), e, "pulling variables");
    }
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
  }
}

void ParameterServerStrategy::Impl::flush() {
  std::vector<Pending> pending;
  std::string config;
  {
    std::lock_guard<std::mutex> lock(out_mu);
    pending.swap(outbox);
    config = outbox_config;
  }
  if (pending.empty()) return;
  std::vector<RpcMessage> reqs(ps.size());
  std::vector<std::vector<std::string>> keys(ps.size());
  for (const Pending& p : pending)
    for (int s = 0; s < p.var->num_shards(); ++s) {
      const auto& shard = p.var->shards()[static_cast<size_t>(s)];
      keys[static_cast<size_t>(shard.ps)].push_back(shard.key);
      reqs[static_cast<size_t>(shard.ps)].tensors.push_back(p.var->shard_of(p.grad, s));
    }
  std::lock_guard<std::mutex> lock(rpc_mu);
  std::vector<uint64_t> ids(ps.size(), 0);
  for (size_t p = 0; p < ps.size(); ++p) {
    const uint64_t increment = p == 0 ? 1 : 0;  // ps:0 counts the job's steps
    if (keys[p].empty() && increment == 0) continue;
    MetaWriter w;
    w.str(config).u64(increment).u64(keys[p].size());
    for (const auto& k : keys[p]) w.str(k);
    reqs[p].method = ps::kPush;
    reqs[p].meta = w.take();
    try {
      ids[p] = ps[p]->send(reqs[p]);
    } catch (const Error& e) {
      fail(static_cast<int>(p), e, "pushing gradients");
    }
  }
  for (size_t p = 0; p < ps.size(); ++p) {
    if (ids[p] == 0) continue;
    try {
      const RpcMessage resp = ps[p]->receive(ids[p]);
      if (p == 0) {
        MetaReader r(resp.meta, "push response from ps:0");
        global_step.store(r.i64());
      }
    } catch (const Error& e) {
      fail(static_cast<int>(p), e, "pushing gradients");
    }
  }
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
  CheckpointData data;
  std::vector<std::vector<std::string>> keys(ps.size());
  for (const auto& v : vars)
    for (const auto& s : v->shards()) keys[static_cast<size_t>(s.ps)].push_back(s.key);
  std::lock_guard<std::mutex> lock(rpc_mu);
  std::vector<uint64_t> ids(ps.size(), 0);
  for (size_t p = 0; p < ps.size(); ++p) {
    if (keys[p].empty()) continue;
    MetaWriter w;
    w.u8(1).u64(keys[p].size());
    for (const auto& k : keys[p]) w.str(k);
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
    if (keys[p].empty()) continue;
    RpcMessage resp;
    try {
      resp = ps[p]->receive(ids[p]);
    } catch (const Error& e) {
      fail(static_cast<int>(p), e, "reading a checkpoint");
    }
    MetaReader r(resp.meta, "checkpoint pull from " + ps_names[p]);
    size_t t = 0;
    for (const auto& key : keys[p]) {
      const int64_t updates = r.i64();
      const uint64_t slots = r.u64();
      if (t + 1 + slots > resp.tensors.size()) throw DataLoss("checkpoint pull from " + ps_names[p] + " is short");
      data.tensors.emplace_back(key, resp.tensors[t++]);
      for (uint64_t s = 0; s < slots; ++s) data.tensors.emplace_back(key + "/slot_" + std::to_string(s), resp.tensors[t++]);
      data.metadata[key + "/updates"] = std::to_string(updates);
    }
  }
  return data;
}

}  // namespace dtrain
