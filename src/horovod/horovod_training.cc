// dtrain::hvd's training helpers, built on the collectives of horovod.cc: variable and object
// broadcast, fused gradient all-reduce, DistributedOptimizer, DistributedGradientTape, callbacks.
#include <cstring>
#include <optional>

#include "dtrain/devices/device.h"
#include "dtrain/horovod.h"
#include "dtrain/nn/layers.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain::hvd {

void broadcast_variables(const std::vector<std::shared_ptr<Variable>>& vars, int root) {
  std::vector<Handle> hs;
  for (const auto& v : vars)
    hs.push_back(broadcast_async(v->value(), root, "broadcast_variables/" + v->name()));
  for (size_t i = 0; i < vars.size(); ++i)
    vars[i]->assign(hs[i].synchronize().to(vars[i]->value().device()));
}

std::string broadcast_object(const std::string& bytes, int root, const std::string& name) {
  const std::string base = name.empty() ? "broadcast_object" : name;
  const Tensor len =
      broadcast(Tensor::from_vector<int64_t>({static_cast<int64_t>(bytes.size())}, Shape{1}), root,
                base + "/length");
  const int64_t n = len.to_vector<int64_t>()[0];
  std::vector<int64_t> words(static_cast<size_t>((n + 7) / 8), 0);
  if (rank() == root) std::memcpy(words.data(), bytes.data(), bytes.size());
  const Tensor data =
      broadcast(Tensor::from_vector<int64_t>(words, Shape{static_cast<int64_t>(words.size())}),
                root, base + "/bytes");
  return std::string(static_cast<const char*>(data.raw_data()), static_cast<size_t>(n));
}

std::vector<Tensor> allreduce_gradients(const std::vector<Tensor>& grads, Op op,
                                        Compression compression, const std::string& name) {
  const size_t limit = std::max<size_t>(fusion_threshold_bytes(), 1);
  // Pack float32 gradients (in order) into host buffers of at most `limit` bytes; others alone.
  struct Pack {
    std::vector<size_t> members;
    int64_t elements = 0;
  };
  std::vector<Pack> packs;
  std::vector<size_t> singles;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    if (grads[i].dtype() != DType::kFloat32) {
      singles.push_back(i);
      continue;
    }
    const size_t bytes = grads[i].nbytes();
    if (packs.empty() ||
        (packs.back().elements * 4 + static_cast<int64_t>(bytes) > static_cast<int64_t>(limit) &&
         !packs.back().members.empty()))
      packs.emplace_back();
    packs.back().members.push_back(i);
    packs.back().elements += grads[i].numel();
  }
  std::vector<Handle> hs;
  for (size_t p = 0; p < packs.size(); ++p) {
    Tensor buf = Tensor::empty(Shape{packs[p].elements});
    char* dst = static_cast<char*>(buf.raw_data());
    for (size_t i : packs[p].members) {
      const Tensor h = grads[i].to(DeviceSpec::cpu());
      std::memcpy(dst, h.raw_data(), h.nbytes());
      dst += h.nbytes();
    }
    hs.push_back(allreduce_async(buf, name + "/fused." + std::to_string(p), op, compression));
  }
  std::vector<Handle> single_hs;
  for (size_t i : singles)
    single_hs.push_back(allreduce_async(grads[i], name + "/" + std::to_string(i), op, compression));
  std::vector<Tensor> out(grads.size());
  for (size_t p = 0; p < packs.size(); ++p) {
    const Tensor buf = hs[p].synchronize();
    const char* src = static_cast<const char*>(buf.raw_data());
    for (size_t i : packs[p].members) {
      Tensor t = Tensor::empty(grads[i].shape());
      std::memcpy(t.raw_data(), src, t.nbytes());
      src += t.nbytes();
      out[i] = t.to(grads[i].device());
    }
  }
  for (size_t k = 0; k < singles.size(); ++k) out[singles[k]] = single_hs[k].synchronize();
  return out;
}

std::unique_ptr<Optimizer> DistributedOptimizer(std::unique_ptr<Optimizer> optimizer,
                                                Compression compression, int passes, Op op) {
  if (!optimizer) throw InvalidArgument("hvd::DistributedOptimizer: the optimizer is null");
  if (passes < 1)
    throw InvalidArgument("hvd::DistributedOptimizer: backward_passes_per_step must be >= 1, got " +
                          std::to_string(passes));
  struct Accumulation {
    std::vector<Tensor> sum;
    int count = 0;
  };
  auto acc = std::make_shared<Accumulation>();
  optimizer->set_gradient_aggregator([=](std::vector<Tensor> g)
                                         -> std::optional<std::vector<Tensor>> {
    if (ReplicaContext* ctx = get_replica_context(); ctx && ctx->num_replicas_in_sync() > 1)
      throw FailedPrecondition(
          "hvd::DistributedOptimizer runs one replica per process, as Horovod does; here " +
          std::to_string(ctx->num_replicas_in_sync()) +
          " replicas are in sync (use OneDeviceStrategy per rank, or MultiWorkerMirroredStrategy "
          "without hvd)");
    if (passes == 1) return allreduce_gradients(g, op, compression, "DistributedOptimizer");
    if (acc->sum.empty()) {
      acc->sum.resize(g.size());
      for (size_t i = 0; i < g.size(); ++i)
        if (g[i].defined()) acc->sum[i] = g[i].clone();
    } else {
      for (size_t i = 0; i < g.size(); ++i)
        if (g[i].defined())
          acc->sum[i] = acc->sum[i].defined()
                            ? kernels_for(g[i]).binary(BinaryOp::kAdd, acc->sum[i], g[i])
                            : g[i].clone();
    }
    if (++acc->count < passes) return std::nullopt;
    std::vector<Tensor> mean(acc->sum.size());
    for (size_t i = 0; i < mean.size(); ++i)
      if (acc->sum[i].defined())
        mean[i] =
            kernels_for(acc->sum[i]).affine(acc->sum[i], 1.f / static_cast<float>(passes), 0.f);
    acc->sum.clear();
    acc->count = 0;
    return allreduce_gradients(mean, op, compression, "DistributedOptimizer");
  });
  return optimizer;
}

DistributedGradientTape::DistributedGradientTape(Compression compression, Op op, bool persistent)
    : tape_(persistent), compression_(compression), op_(op) {}

std::vector<Tensor> DistributedGradientTape::gradient(
    const Tensor& target, const std::vector<std::shared_ptr<Variable>>& sources) {
  return allreduce_gradients(tape_.gradient(target, sources), op_, compression_,
                             "DistributedGradientTape");
}

void BroadcastGlobalVariablesCallback::on_train_begin(const TrainLogs&) {
  broadcast_variables(model().variables(), root_);
  broadcast_variables(optimizer().slot_variables(), root_);
  const Tensor it = broadcast(Tensor::from_vector<int64_t>({optimizer().iterations()}, Shape{1}),
                              root_, "BroadcastGlobalVariablesCallback/iterations");
  optimizer().set_iterations(it.to_vector<int64_t>()[0]);
}

void MetricAverageCallback::on_epoch_end(const TrainLogs& logs) {
  std::map<std::string, double>* values = context().epoch_logs;
  if (!values || values->empty()) return;
  std::vector<double> v;
  for (const auto& [k, x] : *values) v.push_back(x);
  const Tensor avg =
      allreduce(Tensor::from_vector<double>(v, Shape{static_cast<int64_t>(v.size())}),
                "MetricAverageCallback/epoch." + std::to_string(logs.epoch), Op::kAverage);
  const std::vector<double> a = avg.to_vector<double>();
  size_t i = 0;
  for (auto& [k, x] : *values) x = a[i++];
}

LearningRateWarmupCallback::LearningRateWarmupCallback(double warmup_epochs, int verbose)
    : LearningRateWarmup(warmup_epochs, verbose, size()) {}

}  // namespace dtrain::hvd
