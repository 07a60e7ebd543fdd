#include "dtrain/strategies/strategy.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "data/row_window.h"
#include "dtrain/data/dataset.h"
#include "dtrain/devices/device.h"
#include "strategies/default_strategy.h"
#include "strategies/replica_scope.h"

namespace dtrain {
namespace {

thread_local std::vector<Strategy*> t_scopes;
thread_local ReplicaContext* t_replica_ctx = nullptr;

}  // namespace

namespace detail {

ReplicaThreadScope::ReplicaThreadScope(Strategy* strategy, ReplicaContext* ctx)
    : saved_ctx_(t_replica_ctx), saved_depth_(t_scopes.size()), creator_scope_(strategy) {
  t_scopes.push_back(strategy);
  t_replica_ctx = ctx;
  // The default strategy runs inline on the caller's thread and reads any variable as cross-replica
  // code would (evaluate(get_strategy(), ...) of a model built under Mirrored): no ownership check.
  saved_running_ = set_running_creator(strategy == &default_strategy() ? nullptr : strategy);
}

ReplicaThreadScope::~ReplicaThreadScope() {
  t_scopes.resize(saved_depth_);
  t_replica_ctx = saved_ctx_;
  set_running_creator(saved_running_);
}

Strategy& default_strategy() {
  static auto* s = new DefaultStrategy();  // leaked: variables may outlive main
  return *s;
}

}  // namespace detail

namespace {
// Entering a scope while another strategy's scope is active is an error, as in TF.
Strategy* check_scope(Strategy* s) {
  if (!t_scopes.empty() && t_scopes.back() != s)
    throw FailedPrecondition(
        "cannot enter the scope of strategy '" + s->name() +
        "' inside the scope of a different strategy '" + t_scopes.back()->name() +
        "': mixing strategies is not allowed; leave the first scope (or use one "
        "strategy for the whole model)");
  return s;
}
}  // namespace

ReplicaContext* get_replica_context() {
  if (t_replica_ctx) return t_replica_ctx;
  if (!t_scopes.empty() && t_scopes.back() != &detail::default_strategy()) return nullptr;
  return &static_cast<DefaultStrategy&>(detail::default_strategy()).replica_context();
}

Strategy& get_strategy() {
  return t_scopes.empty() ? detail::default_strategy() : *t_scopes.back();
}

bool has_strategy() { return !t_scopes.empty() && t_scopes.back() != &detail::default_strategy(); }

StrategyScope::StrategyScope(Strategy* s) : strategy_(s), creator_scope_(check_scope(s)) {
  t_scopes.push_back(s);
}

StrategyScope::~StrategyScope() {
  if (strategy_ && !t_scopes.empty()) t_scopes.pop_back();
}

Strategy::Strategy() = default;
Strategy::~Strategy() = default;

StrategyScope Strategy::scope() { return StrategyScope(this); }

int64_t InputContext::get_per_replica_batch_size(int64_t global_batch_size) const {
  if (global_batch_size % num_replicas_in_sync != 0)
    throw InvalidArgument("global batch size " + std::to_string(global_batch_size) +
                          " is not divisible by the " + std::to_string(num_replicas_in_sync) +
                          " replicas");
  return global_batch_size / num_replicas_in_sync;
}

PerReplica Strategy::run(const ReplicaFn& fn, const PerReplica& inputs) {
  if (t_replica_ctx && this != &detail::default_strategy())
    throw FailedPrecondition(
        "strategy.run() called from inside a replica function; call it once "
        "from the training loop (cross-replica context)");
  if (!inputs.values.empty() &&
      static_cast<int>(inputs.values.size()) != static_cast<int>(worker_devices().size()))
    throw InvalidArgument("run(): inputs have " + std::to_string(inputs.values.size()) +
                          " per-replica values but the strategy has " +
                          std::to_string(worker_devices().size()) +
                          " local replicas; use distribute_dataset()");
  return do_run(fn, inputs);
}

std::vector<Tensor> Strategy::reduce(ReduceOp op, const PerReplica& values,
                                     std::optional<int> axis) {
  if (values.values.empty()) throw InvalidArgument("reduce(): no per-replica values");
  if (op != ReduceOp::kSum && op != ReduceOp::kMean)
    throw InvalidArgument("strategy.reduce() supports SUM and MEAN (as in TF), got " +
                          std::string(reduce_op_name(op)));
  const DeviceSpec dst = worker_devices().front();
  const size_t k = values.values.front().size();
  std::vector<Tensor> sums;
  std::vector<int64_t> counts;
  for (size_t j = 0; j < k; ++j) {
    Tensor acc;
    int64_t count = 0;
    for (const auto& rep : values.values) {
      if (rep.size() != k)
        throw InvalidArgument("reduce(): replicas returned different numbers of values");
      Tensor v = rep[j].to(dst);
      Kernels& kern = kernels_for(v);
      if (axis) {
        const int a = *axis < 0 ? *axis + v.rank() : *axis;
        if (a < 0 || a >= v.rank())
          throw InvalidArgument("reduce(): axis " + std::to_string(*axis) + " out of range for " +
                                v.shape().to_string());
        count += v.shape()[a];
        v = kern.reduce(ReductionKind::kSum, v, {a}, false);
      } else {
        count += 1;
      }
      acc = acc.defined() ? kern.binary(BinaryOp::kAdd, acc, v) : v.clone();
    }
    sums.push_back(acc);
    counts.push_back(count);
  }
  extended_.reduce_across_workers(sums, counts);
  if (op == ReduceOp::kMean)
    for (size_t j = 0; j < k; ++j)
      sums[j] = kernels_for(sums[j]).affine(
          sums[j], counts[j] ? 1.f / static_cast<float>(counts[j]) : 0.f, 0.f);
  return sums;
}

std::vector<Tensor> Strategy::gather(const PerReplica& values, int axis) {
  if (values.values.empty()) throw InvalidArgument("gather(): no per-replica values");
  const DeviceSpec dst = worker_devices().front();
  std::vector<Tensor> out;
  for (size_t j = 0; j < values.values.front().size(); ++j) {
    std::vector<Tensor> parts;
    for (const auto& rep : values.values) parts.push_back(rep.at(j).to(DeviceSpec::cpu()));
    const Shape& s0 = parts[0].shape();
    const int a = axis < 0 ? axis + s0.rank() : axis;
    if (a < 0 || a >= s0.rank())
      throw InvalidArgument("gather(): axis " + std::to_string(axis) + " out of range for " +
                            s0.to_string());
    std::vector<int64_t> dims = s0.dims();
    dims[static_cast<size_t>(a)] = 0;
    for (const auto& p : parts) {
      for (int d = 0; d < s0.rank(); ++d)
        if (d != a && p.shape()[d] != s0[d])
          throw InvalidArgument("gather(): replicas' shapes differ outside axis " +
                                std::to_string(a) + ": " + s0.to_string() + " vs " +
                                p.shape().to_string());
      dims[static_cast<size_t>(a)] += p.shape()[a];
    }
    Tensor cat = Tensor::empty(Shape(dims), parts[0].dtype());
    int64_t outer = 1;
    for (int d = 0; d < a; ++d) outer *= s0[d];
    const size_t esize = dtype_size(cat.dtype());
    const size_t out_row = static_cast<size_t>(cat.numel() / std::max<int64_t>(outer, 1)) * esize;
    size_t offset = 0;
    for (const auto& p : parts) {
      const size_t row = static_cast<size_t>(p.numel() / std::max<int64_t>(outer, 1)) * esize;
      for (int64_t o = 0; o < outer; ++o)
        std::memcpy(static_cast<char*>(cat.raw_data()) + static_cast<size_t>(o) * out_row + offset,
                    static_cast<const char*>(p.raw_data()) + static_cast<size_t>(o) * row, row);
      offset += row;
    }
    out.push_back(cat.to(dst));
  }
  return out;
}

std::vector<int64_t> split_batch_sizes(int64_t rows, int64_t global_batch, int n) {
  if (n < 1) throw InvalidArgument("split_batch_sizes: need at least one replica");
  const int64_t per = (global_batch + n - 1) / n;
  std::vector<int64_t> out(static_cast<size_t>(n));
  int64_t left = rows;
  for (auto& s : out) {
    s = std::min(per, std::max<int64_t>(0, left));
    left -= s;
  }
  return out;
}

std::function<bool(PerReplica*)> Strategy::distribute_dataset(const Dataset& dataset,
                                                              int64_t global_batch) {
  if (!dataset.is_batched())
    throw InvalidArgument(
        "distribute_dataset() needs a batched dataset: call .batch(global_batch_size) first");
  // A worker that takes only some rows of each global batch has the pipeline copy only those.
  if (const auto rows = do_input_rows(global_batch)) {
    auto it = std::make_shared<detail::RowWindowIterator>(dataset, rows->first, rows->second);
    return [this, it, global_batch, first = rows->first](PerReplica* out) {
      std::vector<Tensor> part;
      int64_t batch_rows = 0;
      if (!extended_.agree_on_next(it->next(&part, &batch_rows))) return false;
      if (batch_rows > global_batch)
        throw InvalidArgument(
            "distribute_dataset(dataset, global_batch=" + std::to_string(global_batch) +
            "): the dataset yielded a batch of " + std::to_string(batch_rows) +
            " rows; batch the dataset by the global batch size (.batch(" +
            std::to_string(global_batch) + ")) or pass the size it is batched by");
      *out = do_split_batch(part, global_batch, BatchRows{first, batch_rows});
      return true;
    };
  }
  std::shared_ptr<Dataset::Iterator> it = dataset.make_iterator();
  auto gb = std::make_shared<int64_t>(global_batch);
  return [this, it, gb](PerReplica* out) {
    std::vector<Tensor> batch;
    if (!extended_.agree_on_next(it->next(&batch))) return false;
    if (*gb <= 0) *gb = batch.empty() ? 0 : batch.front().shape()[0];
    *out = do_split_batch(batch, *gb, BatchRows{});
    if (out->global_rows < 0) {
      out->global_rows = 0;
      for (const auto& r : out->values)
        if (!r.empty()) out->global_rows += r[0].shape()[0];
    }
    return true;
  };
}

std::function<bool(PerReplica*)> Strategy::distribute_datasets_from_function(
    const std::function<Dataset(const InputContext&)>& fn) {
  if (!fn) throw InvalidArgument("distribute_datasets_from_function: fn is empty");
  const std::vector<DeviceSpec> devices = worker_devices();
  const int local = static_cast<int>(devices.size());
  std::vector<std::shared_ptr<Dataset::Iterator>> its;
  for (int r = 0; r < local; ++r) {
    InputContext ic{extended_.num_workers() * local, extended_.worker_rank() * local + r,
                    num_replicas_in_sync()};
    Dataset ds = fn(ic);
    if (!ds.is_batched())
      throw InvalidArgument("distribute_datasets_from_function: the dataset for input pipeline " +
                            std::to_string(ic.input_pipeline_id) +
                            " is not batched; batch it at the per-replica "
                            "batch size (ic.get_per_replica_batch_size(global_batch))");
    its.push_back(ds.make_iterator());
  }
  const bool multi_worker = extended_.cross_worker() && extended_.num_workers() > 1;
  return [its, devices, multi_worker](PerReplica* out) {
    out->values.assign(its.size(), {});
    out->global_rows = -1;
    int64_t rows = 0;
    for (size_t r = 0; r < its.size(); ++r) {
      std::vector<Tensor> b;
      if (!its[r]->next(&b)) return false;
      if (!b.empty()) rows += b[0].shape()[0];
      for (auto& t : b) out->values[r].push_back(t.to(devices[r]));
    }
    out->global_rows = multi_worker ? -1 : rows;  // other workers' rows are not known here
    return true;
  };
}

PerReplica Strategy::experimental_distribute_values_from_function(
    const std::function<std::vector<Tensor>(const ValueContext&)>& fn) {
  if (!fn) throw InvalidArgument("experimental_distribute_values_from_function: fn is empty");
  const std::vector<DeviceSpec> devices = worker_devices();
  const int local = static_cast<int>(devices.size());
  PerReplica out;
  out.values.resize(devices.size());
  for (int r = 0; r < local; ++r) {
    const ValueContext vc{extended_.worker_rank() * local + r, num_replicas_in_sync()};
    for (const Tensor& t : fn(vc))
      out.values[static_cast<size_t>(r)].push_back(t.to(devices[static_cast<size_t>(r)]));
  }
  return out;
}

}  // namespace dtrain
