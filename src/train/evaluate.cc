// evaluate(), predict() and predict_ensemble(): inference under any strategy.
#include <cmath>
#include <cstring>

#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/ops.h"
#include "dtrain/train/fit.h"
#include "train/heads.h"

namespace dtrain {
namespace {

void call(const std::vector<Callback*>& cbs, void (Callback::*hook)(const TrainLogs&),
          const TrainLogs& logs) {
  for (Callback* c : cbs) (c->*hook)(logs);
}

// Under parameter sharding (ZeRO-3) a forward pass takes part in collectives: each sharded layer
// gathers its weights from every replica. A replica whose share of a batch is empty must still
// issue them, so it runs the model on one row of zeros and drops the result.
bool forward_is_collective(const Model& model) {
  for (const auto& v : model.trainable_variables())
    if (v->parameter_gatherer()) return true;
  return false;
}

std::vector<Tensor> one_zero_row(const std::vector<Tensor>& in) {
  std::vector<Tensor> out;
  for (const Tensor& t : in) {
    std::vector<int64_t> dims = t.shape().dims();
    if (!dims.empty()) dims[0] = 1;
    out.push_back(Tensor::zeros(Shape(dims), t.dtype(), t.device()));
  }
  return out;
}

}  // namespace

EvalResult evaluate(Strategy& strategy, Model& model, const Dataset& test, int64_t batch_size,
                    const LossFn& loss, const std::vector<std::string>& metrics,
                    const std::vector<Callback*>& callbacks) {
  FitOptions o;
  o.eval_batch_size = batch_size;
  o.loss = loss;
  o.metrics = metrics;
  o.callbacks = callbacks;
  return evaluate(strategy, model, test, o);
}

EvalResult evaluate(Strategy& strategy, Model& model, const Dataset& test,
                    const FitOptions& options) {
  const int64_t batch_size = options.eval_batch_size;
  if (batch_size < 1)
    throw InvalidArgument("evaluate(): batch_size must be >= 1, got " + std::to_string(batch_size));
  const detail::Heads heads(model, options);
  std::unique_ptr<detail::Tally> tally = heads.make_tally();
  const std::vector<Callback*>& callbacks = options.callbacks;
  TrainLogs logs;
  timeline::Span span("evaluate", "step");
  call(callbacks, &Callback::on_test_begin, logs);
  auto next = strategy.distribute_dataset(test.batch(batch_size, false), batch_size);
  const bool collective = forward_is_collective(model);
  PerReplica batch;
  while (next(&batch)) {
    call(callbacks, &Callback::on_test_batch_begin, logs);
    strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& in) -> std::vector<Tensor> {
          const int64_t rows = in.at(0).shape()[0];
          if (rows == 0) {
            if (collective) heads.forward(model, one_zero_row(in), false);
            return {};
          }
          const std::vector<Tensor> outs = heads.forward(model, in, false);
          heads.update_metrics(*tally, outs, in);
          tally->loss.update(heads.loss_sum(outs, in) / static_cast<double>(rows),
                             static_cast<double>(rows));
          return {};
        },
        batch);
    ++logs.step;
    call(callbacks, &Callback::on_test_batch_end, logs);
  }
  // Every worker evaluated its share of the test set: add the sums, then divide.
  std::vector<double> flat = tally->loss.state();
  for (double v : tally->flat_metric_states()) flat.push_back(v);
  flat = strategy.extended().sum_across_workers(flat);
  EvalResult r;
  r.examples = static_cast<int64_t>(flat[1]);
  if (strategy.extended()
          .independent_replicas())  // every member (of every worker) saw every example
    r.examples /= static_cast<int64_t>(std::max<size_t>(1, strategy.worker_devices().size())) *
                  strategy.extended().num_workers();
  r.loss = flat[1] > 0 ? flat[0] / flat[1] : 0;
  tally->put_results(flat, 2, "", &r.metrics);
  if (auto it = r.metrics.find("accuracy"); it != r.metrics.end())
    r.accuracy = it->second;
  else if (auto it2 = r.metrics.find("sparse_categorical_accuracy"); it2 != r.metrics.end())
    r.accuracy = it2->second;
  logs.values = r.metrics;
  logs.values["loss"] = r.loss;
  call(callbacks, &Callback::on_test_end, logs);
  return r;
}

namespace {

// Rows of several batches' results, in order, as one tensor.
Tensor concat_rows(const std::vector<Tensor>& parts) {
  std::vector<int64_t> dims = parts.at(0).shape().dims();
  dims[0] = 0;
  for (const Tensor& p : parts) dims[0] += p.shape()[0];
  Tensor all = Tensor::empty(Shape(dims), parts[0].dtype());
  char* dst = static_cast<char*>(all.raw_data());
  for (const Tensor& p : parts) {
    std::memcpy(dst, p.raw_data(), p.nbytes());
    dst += p.nbytes();
  }
  return all;
}

// One member's results (on the CPU) for every output of the model.
std::vector<Tensor> all_outputs(Model& model, const std::vector<Tensor>& x, size_t inputs) {
  if (x.size() < inputs)
    throw InvalidArgument("model '" + model.name() + "' takes " + std::to_string(inputs) +
                          " inputs; the dataset gives " + std::to_string(x.size()) +
                          " components a row");
  return model(std::vector<Tensor>(x.begin(), x.begin() + static_cast<long>(inputs)), false);
}

// Every member's predictions for every output: [output] -> EnsemblePrediction.
std::vector<EnsemblePrediction> ensemble_outputs(Strategy& strategy, Model& model,
                                                 const Dataset& data, int64_t batch_size) {
  const std::vector<DeviceSpec> devices = strategy.worker_devices();
  const size_t local = devices.size();
  std::vector<std::vector<std::vector<Tensor>>> parts;  // [output][member][batch]
  auto it = data.batch(batch_size, false).make_iterator();
  std::vector<Tensor> b;
  const size_t inputs = static_cast<size_t>(model.num_inputs());
  while (it->next(&b)) {
    PerReplica in;
    for (size_t m = 0; m < devices.size(); ++m) {
      in.values.emplace_back();
      for (size_t c = 0; c < inputs && c < b.size(); ++c)
        in.values.back().push_back(b[c].share_to(devices[m]));
    }
    const PerReplica out = strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& x) -> std::vector<Tensor> {
          return all_outputs(model, x, inputs);
        },
        in);
    if (parts.empty())
      parts.assign(out.values.at(0).size(), std::vector<std::vector<Tensor>>(local));
    for (size_t o = 0; o < parts.size(); ++o)
      for (size_t m = 0; m < local; ++m)
        parts[o][m].push_back(out.values.at(m).at(o).to(DeviceSpec::cpu()));
  }
  if (parts.empty()) throw InvalidArgument("predict_ensemble(): the dataset is empty");
  std::vector<EnsemblePrediction> results;
  StrategyExtended& ext = strategy.extended();
  for (size_t o = 0; o < parts.size(); ++o) {
    if (parts[o][0][0].dtype() != DType::kFloat32)
      throw InvalidArgument(std::string("predict_ensemble(): the model's output ") +
                            std::to_string(o + 1) + " is " + dtype_name(parts[o][0][0].dtype()) +
                            "; the mean and spread are computed for float32 outputs");
    EnsemblePrediction r;
    for (auto& p : parts[o]) r.members.push_back(concat_rows(p));
    // Members on other workers: every worker gets every member's predictions, in member order
    // (worker w's local member i is member w * local + i).
    if (ext.num_workers() > 1) {
      std::vector<int64_t> dims = r.members[0].shape().dims();
      dims.insert(dims.begin(), static_cast<int64_t>(local));
      Tensor mine = Tensor::empty(Shape(dims), DType::kFloat32);
      for (size_t m = 0; m < local; ++m)
        std::memcpy(static_cast<char*>(mine.raw_data()) + m * r.members[m].nbytes(),
                    r.members[m].raw_data(), r.members[m].nbytes());
      const Shape one = r.members[0].shape();
      const Tensor all = ext.gather_across_workers(mine);
      r.members.clear();
      for (int64_t g = 0; g < all.shape()[0]; ++g)
        r.members.push_back(all.slice_rows(g, g + 1).view(one).clone());
    }
    const size_t members = r.members.size();
    const int64_t n = r.members[0].numel();
    std::vector<float> mean(static_cast<size_t>(n), 0.f), sd(static_cast<size_t>(n), 0.f);
    for (const Tensor& t : r.members) {
      const float* p = static_cast<const float*>(t.raw_data());
      for (int64_t i = 0; i < n; ++i)
        mean[static_cast<size_t>(i)] += p[i] / static_cast<float>(members);
    }
    for (const Tensor& t : r.members) {
      const float* p = static_cast<const float*>(t.raw_data());
      for (int64_t i = 0; i < n; ++i) {
        const float d = p[i] - mean[static_cast<size_t>(i)];
        sd[static_cast<size_t>(i)] += d * d / static_cast<float>(members);
      }
    }
    for (float& v : sd) v = std::sqrt(v);
    r.mean = Tensor::from_vector(mean, r.members[0].shape());
    r.stddev = Tensor::from_vector(sd, r.members[0].shape());
    results.push_back(std::move(r));
  }
  return results;
}

void check_predict_args(const char* what, const Dataset& data, int64_t batch_size) {
  if (batch_size < 1)
    throw InvalidArgument(std::string(what) + "(): batch_size must be >= 1, got " +
                          std::to_string(batch_size));
  if (data.is_batched())
    throw InvalidArgument(std::string(what) +
                          "() takes an unbatched dataset; it batches by batch_size");
}

}  // namespace

std::vector<Tensor> predict_outputs(Strategy& strategy, Model& model, const Dataset& data,
                                    int64_t batch_size) {
  check_predict_args("predict", data, batch_size);
  if (strategy.extended().independent_replicas()) {
    std::vector<Tensor> means;
    for (EnsemblePrediction& e : ensemble_outputs(strategy, model, data, batch_size))
      means.push_back(std::move(e.mean));
    return means;
  }
  const std::vector<DeviceSpec> devices = strategy.worker_devices();
  const int local = static_cast<int>(devices.size());
  const size_t inputs = static_cast<size_t>(model.num_inputs());
  auto it = data.batch(batch_size, false).make_iterator();
  const bool collective = forward_is_collective(model);
  std::vector<std::vector<Tensor>> parts;  // [output][batch part]
  std::vector<Tensor> b;
  while (it->next(&b)) {
    const int64_t rows = b.at(0).shape()[0];
    const std::vector<int64_t> sizes = split_batch_sizes(rows, rows, local);
    PerReplica in;
    in.values.resize(static_cast<size_t>(local));
    int64_t begin = 0;
    for (int r = 0; r < local; ++r) {
      const int64_t n = sizes[static_cast<size_t>(r)];
      for (size_t c = 0; c < inputs && c < b.size(); ++c)
        in.values[static_cast<size_t>(r)].push_back(
            b[c].slice_rows(begin, begin + n).share_to(devices[static_cast<size_t>(r)]));
      begin += n;
    }
    in.global_rows = rows;
    const PerReplica out = strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& x) -> std::vector<Tensor> {
          if (x[0].shape()[0] == 0) {
            if (collective) all_outputs(model, one_zero_row(x), inputs);
            return {};
          }
          return all_outputs(model, x, inputs);
        },
        in);
    for (const auto& v : out.values) {
      if (v.empty()) continue;
      if (parts.empty()) parts.resize(v.size());
      for (size_t o = 0; o < v.size(); ++o) parts[o].push_back(v[o].to(DeviceSpec::cpu()));
    }
  }
  if (parts.empty()) throw InvalidArgument("predict(): the dataset is empty");
  std::vector<Tensor> results;
  for (const auto& p : parts) results.push_back(concat_rows(p));
  return results;
}

Tensor predict(Strategy& strategy, Model& model, const Dataset& data, int64_t batch_size) {
  return predict_outputs(strategy, model, data, batch_size).at(0);
}

EnsemblePrediction predict_ensemble(Strategy& strategy, Model& model, const Dataset& data,
                                    int64_t batch_size) {
  check_predict_args("predict_ensemble", data, batch_size);
  if (!strategy.extended().independent_replicas()) {  // one model: its predictions, no spread
    EnsemblePrediction one;
    one.mean = predict(strategy, model, data, batch_size);
    one.members.push_back(one.mean);
    one.stddev = Tensor::zeros(one.mean.shape(), one.mean.dtype());
    return one;
  }
  return ensemble_outputs(strategy, model, data, batch_size).at(0);
}

}  // namespace dtrain
