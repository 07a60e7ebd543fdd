// Sharding::kParameters (ZeRO-3, FSDP's FULL_SHARD): the variables of a layer marked
// shard_parameters are kept as one part per replica between the layer's calls. gather() gives each
// replica's copy whole memory again (Tensor::adopt_memory, so the handle a tape follows stays the
// same) from one all-gather of the parts; release() drops it (Tensor::release_memory). A copy is
// whole until its first release, which carves its part out of it.
//
// Prefetch: each replica records the order in which groups were gathered during a step (forward,
// then the backward pass's replays in reverse); in the next step, gathering group k starts the
// all-gather of the group that followed k last time on the replica's communication thread, which
// runs it while this replica computes. Every replica records the same order (they run the same
// program), so their communication threads issue the same collectives in the same order.
#include <algorithm>
#include <map>
#include <set>

#include "dtrain/core/logging.h"
#include "dtrain/core/timeline.h"
#include "strategies/mirrored_impl.h"
#include "strategies/mirrored_variables.h"

namespace dtrain {

struct ShardedParameters::Replica {
  std::map<const Variable*, std::vector<std::shared_ptr<Variable>>> groups;  // by first variable
  std::vector<const Variable*> order_prev, order_now;
  size_t cursor = 0;  // where this step is in order_prev; kOffOrder once it went another way
  std::map<const Variable*, std::future<std::vector<Tensor>>> prefetched;
  std::vector<std::shared_ptr<Variable>> held;  // gathered, released at the update's end
};

namespace {

constexpr size_t kOffOrder = ~size_t{0};

MirroredVariable& mirrored(const std::shared_ptr<Variable>& v) {
  auto* m = dynamic_cast<MirroredVariable*>(v.get());
  if (!m || !v->parameter_gatherer())  // Layer::call_gathered passes only this gatherer's
    throw Internal("variable '" + v->name() + "' is not a parameter-sharded MirroredVariable");
  return *m;
}

// The variables of `vars` whose copy l holds only its part and no whole memory.
std::vector<std::shared_ptr<Variable>> to_gather(const std::vector<std::shared_ptr<Variable>>& vars,
                                                 size_t l) {
  std::vector<std::shared_ptr<Variable>> out;
  for (const auto& v : vars)
    if (mirrored(v).holds_part(l) && !mirrored(v).copy(l).has_memory()) out.push_back(v);
  return out;
}

// The whole values of `vars` from every replica's parts (this replica's are its copies' parts).
std::future<std::vector<Tensor>> all_gather(MirroredReplicaContext& ctx,
                                            const std::vector<std::shared_ptr<Variable>>& vars,
                                            bool deferred) {
  const size_t l = static_cast<size_t>(ctx.local_replica());
  const int n = ctx.num_replicas_in_sync(), me = ctx.replica_id_in_sync_group();
  std::vector<Tensor> parts;
  std::vector<Shape> shapes;
  for (const auto& v : vars) {
    const ValuePart& p = mirrored(v).part(l);
    if (p.parts != n || p.part != me)
      throw FailedPrecondition("variable '" + v->name() + "' holds part " + std::to_string(p.part) +
                               " of " + std::to_string(p.parts) +
                               " (Sharding::kParameters), but this replica is " +
                               std::to_string(me) + " of " + std::to_string(n) +
                               ": the job re-formed; restore the state (elastic::run, "
                               "Checkpoint::restore) before training on");
    parts.push_back(mirrored(v).part(l).value);
    shapes.push_back(v->shape());
  }
  return ctx.gather_parameters_async(std::move(parts), std::move(shapes), deferred);
}

}  // namespace

ShardedParameters::ShardedParameters(MirroredStrategy* owner, MirroredStrategy::Impl* impl)
    : owner_(owner), impl_(impl) {
  for (size_t r = 0; r < impl->devices.size(); ++r)
    replicas_.push_back(std::make_unique<Replica>());
}

// The strategy is going (this gatherer dies with it): the variables it gathered outlive it in a
// model a function returned, and without it no replica context will gather them again. Where this
// process holds every part, each becomes whole again, an unsharded mirrored variable that reads,
// trains (tapes follow its copies) and updates as any; across workers they keep their parts.
ShardedParameters::~ShardedParameters() {
  std::set<Variable*> done;
  for (const auto& r : replicas_)
    for (const auto& [key, vars] : r->groups)
      for (const auto& v : vars) {
        auto* m = dynamic_cast<MirroredVariable*>(v.get());  // (mirrored() asks the gatherer)
        if (!m || !done.insert(m).second) continue;
        try {
          m->make_whole_locally();
        } catch (const std::exception& e) {  // out of memory: it keeps its parts, reads assemble
          DTRAIN_LOG(WARNING) << "variable '" << v->name()
                              << "' stays sharded after its strategy: " << e.what();
        }
      }
}

MirroredReplicaContext* ShardedParameters::context() const {
  ReplicaContext* ctx = get_replica_context();
  if (!ctx || &ctx->strategy() != owner_) return nullptr;
  return static_cast<MirroredReplicaContext*>(ctx);
}

bool ShardedParameters::pending(int local) const {
  return !replicas_[static_cast<size_t>(local)]->prefetched.empty();
}

void ShardedParameters::start_gather(MirroredReplicaContext& ctx, Replica& r, const Variable* key) {
  if (r.prefetched.count(key)) return;
  const auto g = r.groups.find(key);
  if (g == r.groups.end()) return;
  const std::vector<std::shared_ptr<Variable>> vars =
      to_gather(g->second, static_cast<size_t>(ctx.local_replica()));
  if (!vars.empty()) r.prefetched.emplace(key, all_gather(ctx, vars, /*deferred=*/false));
}

void ShardedParameters::gather(const std::vector<std::shared_ptr<Variable>>& vars) {
  if (vars.empty()) return;
  MirroredReplicaContext* ctx = context();
  if (!ctx) {
    // Cross-replica context (a model called outside strategy.run()): copy 0 gets the whole
    // value from the local parts when they are all here; otherwise the read throws, naming why.
    for (const auto& v : vars) {
      MirroredVariable& m = mirrored(v);
      if (m.holds_part(0) && !m.copy(0).has_memory()) m.copy(0).adopt_memory(v->value());
    }
    return;
  }
  const size_t l = static_cast<size_t>(ctx->local_replica());
  Replica& r = *replicas_[l];
  const Variable* key = vars.front().get();
  for (const auto& v : vars) mirrored(v).set_managed();
  r.groups.emplace(key, vars);
  // Steps without an update (evaluation, prediction) never end the order: keep it bounded.
  if (r.order_now.size() > 4 * r.groups.size() + 64) r.order_now.clear();
  r.order_now.push_back(key);
  const std::vector<std::shared_ptr<Variable>> need = to_gather(vars, l);
  if (!need.empty()) {
    std::vector<Tensor> wholes;
    auto pre = r.prefetched.find(key);
    if (pre != r.prefetched.end()) {
      timeline::Span span("wait for prefetched parameters", "collective");
      wholes = pre->second.get();
      r.prefetched.erase(pre);
    } else {
      wholes = all_gather(*ctx, need, /*deferred=*/ctx->comm_idle()).get();
    }
    if (wholes.size() != need.size())
      throw Internal("gathered " + std::to_string(wholes.size()) + " parameters for " +
                     std::to_string(need.size()) + " of '" + key->name() + "''s group");
    for (size_t i = 0; i < need.size(); ++i) mirrored(need[i]).copy(l).adopt_memory(wholes[i]);
  }
  for (const auto& v : vars)
    if (std::find(r.held.begin(), r.held.end(), v) == r.held.end()) r.held.push_back(v);
  // Prefetch what came next in the previous step.
  if (r.cursor < r.order_prev.size() && r.order_prev[r.cursor] == key) {
    ++r.cursor;
    if (r.cursor < r.order_prev.size() && r.order_prev[r.cursor] != key)
      start_gather(*ctx, r, r.order_prev[r.cursor]);
  } else {
    r.cursor = kOffOrder;  // another order this step: no more prefetching
  }
}

void ShardedParameters::release(const std::vector<std::shared_ptr<Variable>>& vars) {
  MirroredReplicaContext* ctx = context();
  if (!ctx) {
    for (const auto& v : vars)
      if (mirrored(v).holds_part(0)) mirrored(v).copy(0).release_memory();
    return;
  }
  const size_t l = static_cast<size_t>(ctx->local_replica());
  const int n = ctx->num_replicas_in_sync(), me = ctx->replica_id_in_sync_group();
  Replica& r = *replicas_[l];
  for (const auto& v : vars) {
    mirrored(v).release_copy(l, me, n);
    r.held.erase(std::remove(r.held.begin(), r.held.end(), v), r.held.end());
  }
}

void ShardedParameters::end_step(MirroredReplicaContext& ctx) {
  const size_t l = static_cast<size_t>(ctx.local_replica());
  Replica& r = *replicas_[l];
  for (auto& [key, f] : r.prefetched) f.get();  // collectives every replica issued: finish them
  r.prefetched.clear();
  release(std::vector<std::shared_ptr<Variable>>(r.held));
  if (!r.order_now.empty()) r.order_prev = std::move(r.order_now);
  r.order_now.clear();
  r.cursor = 0;
}

void ShardedParameters::reset() {
  for (auto& r : replicas_) {
    r->prefetched.clear();
    r->order_prev.clear();
    r->order_now.clear();
    r->cursor = 0;
  }
}

}  // namespace dtrain
