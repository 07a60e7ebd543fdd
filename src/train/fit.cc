#include "dtrain/train/fit.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/metrics.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

LossFn default_loss(const LossFn& f) {
  if (f) return f;
  return [](const Tensor& logits, const Tensor& labels) {
    return ops::sparse_softmax_cross_entropy(logits, labels);
  };
}

// Keras compile(): no metrics unless asked, except that dtrain's default (classification) loss
// reports accuracy.
std::vector<std::string> metric_names(const LossFn& user_loss,
                                      const std::vector<std::string>& metrics) {
  if (!metrics.empty()) return metrics;
  if (user_loss) return {};
  return {"accuracy"};
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The loss sum and the metrics of one pass, updated concurrently by replicas.
struct Tally {
  Mean loss{"loss"};
  std::vector<std::unique_ptr<Metric>> metrics;
  explicit Tally(const std::vector<std::string>& names) {
    for (const std::string& n : names) metrics.push_back(make_metric(n));
  }
  void reset() {
    loss.reset_state();
    for (auto& m : metrics) m->reset_state();
  }
  std::map<std::string, std::vector<double>> states() const {
    std::map<std::string, std::vector<double>> out{{"loss", loss.state()}};
    for (const auto& m : metrics) out[m->name()] = m->state();
    return out;
  }
  void set_states(const std::map<std::string, std::vector<double>>& s) {
    for (const auto& [name, state] : s) {
      if (name == "loss") loss.set_state(state);
      for (auto& m : metrics)
        if (m->name() == name) m->set_state(state);
    }
  }
  // Flattened metric states (loss excluded: fit's loss is already global), for one all-reduce.
  std::vector<double> flat_metric_states() const {
    std::vector<double> out;
    for (const auto& m : metrics)
      for (double v : m->state()) out.push_back(v);
    return out;
  }
  // Results of the metrics from flattened (summed) states starting at `at`.
  void put_results(const std::vector<double>& flat, size_t at, const std::string& prefix,
                   std::map<std::string, double>* values) const {
    for (const auto& m : metrics) {
      const size_t n = m->state().size();
      values->insert_or_assign(prefix + m->name(), m->result_of(std::vector<double>(
                                                       flat.begin() + static_cast<long>(at),
                                                       flat.begin() + static_cast<long>(at + n))));
      at += n;
    }
  }
};

void call(const std::vector<Callback*>& cbs, void (Callback::*hook)(const TrainLogs&),
          const TrainLogs& logs) {
  for (Callback* c : cbs) (c->*hook)(logs);
}

}  // namespace

EvalResult evaluate(Strategy& strategy, Model& model, const Dataset& test, int64_t batch_size,
                    const LossFn& loss, const std::vector<std::string>& metrics,
                    const std::vector<Callback*>& callbacks) {
  if (batch_size < 1)
    throw InvalidArgument("evaluate(): batch_size must be >= 1, got " + std::to_string(batch_size));
  const LossFn loss_fn = default_loss(loss);
  Tally tally(metric_names(loss, metrics));
  TrainLogs logs;
  timeline::Span span("evaluate", "step");
  call(callbacks, &Callback::on_test_begin, logs);
  auto next = strategy.distribute_dataset(test.batch(batch_size, false), batch_size);
  PerReplica batch;
  while (next(&batch)) {
    call(callbacks, &Callback::on_test_batch_begin, logs);
    strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& in) -> std::vector<Tensor> {
          const int64_t rows = in[0].shape()[0];
          if (rows == 0) return {};
          Tensor out = model(in[0], false);
          for (auto& m : tally.metrics) m->update_state(out, in[1]);
          const Tensor per_example = loss_fn(out, in[1]);
          tally.loss.update(
              ops::sum(per_example).to(DeviceSpec::cpu()).item() / static_cast<double>(rows),
              static_cast<double>(rows));
          return {};
        },
        batch);
    ++logs.step;
    call(callbacks, &Callback::on_test_batch_end, logs);
  }
  // Every worker evaluated its share of the test set: add the sums, then divide.
  std::vector<double> flat = tally.loss.state();
  for (double v : tally.flat_metric_states()) flat.push_back(v);
  flat = strategy.extended().sum_across_workers(flat);
  EvalResult r;
  r.examples = static_cast<int64_t>(flat[1]);
  if (strategy.extended()
          .independent_replicas())  // every member (of every worker) saw every example
    r.examples /= static_cast<int64_t>(std::max<size_t>(1, strategy.worker_devices().size())) *
                  strategy.extended().num_workers();
  r.loss = flat[1] > 0 ? flat[0] / flat[1] : 0;
  tally.put_results(flat, 2, "", &r.metrics);
  if (auto it = r.metrics.find("accuracy"); it != r.metrics.end())
    r.accuracy = it->second;
  else if (auto it2 = r.metrics.find("sparse_categorical_accuracy"); it2 != r.metrics.end())
    r.accuracy = it2->second;
  logs.values = r.metrics;
  logs.values["loss"] = r.loss;
  call(callbacks, &Callback::on_test_end, logs);
  return r;
}

Tensor predict(Strategy& strategy, Model& model, const Dataset& data, int64_t batch_size) {
  if (batch_size < 1)
    throw InvalidArgument("predict(): batch_size must be >= 1, got " + std::to_string(batch_size));
  if (data.is_batched())
    throw InvalidArgument("predict() takes an unbatched dataset; it batches by batch_size");
  if (strategy.extended().independent_replicas())
    return predict_ensemble(strategy, model, data, batch_size).mean;
  const std::vector<DeviceSpec> devices = strategy.worker_devices();
  const int local = static_cast<int>(devices.size());
  auto it = data.batch(batch_size, false).make_iterator();
  std::vector<Tensor> parts;
  std::vector<Tensor> b;
  while (it->next(&b)) {
    const int64_t rows = b.at(0).shape()[0];
    const std::vector<int64_t> sizes = split_batch_sizes(rows, rows, local);
    PerReplica in;
    in.values.resize(static_cast<size_t>(local));
    int64_t begin = 0;
    for (int r = 0; r < local; ++r) {
      const int64_t n = sizes[static_cast<size_t>(r)];
      in.values[static_cast<size_t>(r)].push_back(
          b[0].slice_rows(begin, begin + n).share_to(devices[static_cast<size_t>(r)]));
      begin += n;
    }
    in.global_rows = rows;
    const PerReplica out = strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& x) -> std::vector<Tensor> {
          if (x[0].shape()[0] == 0) return {};
          return {model(x[0], false)};
        },
        in);
    for (const auto& v : out.values)
      if (!v.empty()) parts.push_back(v[0].to(DeviceSpec::cpu()));
  }
  if (parts.empty()) throw InvalidArgument("predict(): the dataset is empty");
  std::vector<int64_t> dims = parts[0].shape().dims();
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

EnsemblePrediction predict_ensemble(Strategy& strategy, Model& model, const Dataset& data,
                                    int64_t batch_size) {
  if (batch_size < 1)
    throw InvalidArgument("predict_ensemble(): batch_size must be >= 1, got " +
                          std::to_string(batch_size));
  if (data.is_batched())
    throw InvalidArgument(
        "predict_ensemble() takes an unbatched dataset; it batches by batch_size");
  if (!strategy.extended().independent_replicas()) {  // one model: its predictions, no spread
    EnsemblePrediction one;
    one.mean = predict(strategy, model, data, batch_size);
    one.members.push_back(one.mean);
    one.stddev = Tensor::zeros(one.mean.shape(), one.mean.dtype());
    return one;
  }
  const std::vector<DeviceSpec> devices = strategy.worker_devices();
  const size_t local = devices.size();
  std::vector<std::vector<Tensor>> parts(local);
  auto it = data.batch(batch_size, false).make_iterator();
  std::vector<Tensor> b;
  while (it->next(&b)) {
    PerReplica in;
    for (size_t m = 0; m < devices.size(); ++m) in.values.push_back({b[0].share_to(devices[m])});
    const PerReplica out = strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& x) -> std::vector<Tensor> {
          return {model(x[0], false)};
        },
        in);
    for (size_t m = 0; m < local; ++m)
      parts[m].push_back(out.values.at(m).at(0).to(DeviceSpec::cpu()));
  }
  if (parts[0].empty()) throw InvalidArgument("predict_ensemble(): the dataset is empty");
  if (parts[0][0].dtype() != DType::kFloat32)
    throw InvalidArgument(std::string("predict_ensemble(): the model's outputs are ") +
                          dtype_name(parts[0][0].dtype()) +
                          "; the mean and spread are computed for float32 outputs");
  EnsemblePrediction r;
  for (auto& p : parts) {
    std::vector<int64_t> dims = p[0].shape().dims();
    dims[0] = 0;
    for (const Tensor& t : p) dims[0] += t.shape()[0];
    Tensor all = Tensor::empty(Shape(dims), p[0].dtype());
    char* dst = static_cast<char*>(all.raw_data());
    for (const Tensor& t : p) {
      std::memcpy(dst, t.raw_data(), t.nbytes());
      dst += t.nbytes();
    }
    r.members.push_back(all);
  }
  // Members on other workers: every worker gets every member's predictions, in member order
  // (worker w's local member i is member w * local + i).
  StrategyExtended& ext = strategy.extended();
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
  return r;
}

History fit(Strategy& strategy, Model& model, Optimizer& optimizer, const Dataset& train,
            const Dataset* test, const FitOptions& options) {
  if (options.global_batch_size < 1)
    throw InvalidArgument("global_batch_size must be >= 1, got " +
                          std::to_string(options.global_batch_size));
  if (options.epochs < 1 && options.steps < 1)
    throw InvalidArgument("fit() needs epochs >= 1 or steps >= 1");
  if (options.accumulate < 1)
    throw InvalidArgument("fit(): accumulate must be >= 1, got " +
                          std::to_string(options.accumulate));
  const LossFn loss_fn = default_loss(options.loss);
  const std::vector<std::string> names = metric_names(options.loss, options.metrics);

  // Weights and slots are created once, in cross-replica context, inside the strategy's scope.
  {
    auto scope = strategy.scope();
    if (!model.built()) {
      std::vector<Tensor> first;
      auto it = train.take(1).batch(1).make_iterator();
      if (!it->next(&first)) throw InvalidArgument("fit(): the training dataset is empty");
      model.build(first[0].shape());
    }
    optimizer.build(model.trainable_variables());
  }
  const VariableList vars = model.trainable_variables();

  // Asynchronous strategies: each worker trains on its own shard of the data, and the job stops
  // when its global step (which survives restarts) reaches the target.
  StrategyExtended& ext = strategy.extended();
  const InputShard shard = ext.input_shard();
  const Dataset my_train = shard.count > 1 ? train.shard(shard.count, shard.index) : train;
  const int64_t B = options.global_batch_size;
  const int64_t steps_per_epoch = my_train.batch(B, options.drop_remainder).cardinality();
  if (steps_per_epoch == 0) throw InvalidArgument("fit(): no full batch in the training data");
  int epochs = options.epochs;
  if (options.steps > 0 && steps_per_epoch > 0)
    epochs = static_cast<int>(std::min<int64_t>(
        (options.steps + steps_per_epoch - 1) / steps_per_epoch, std::numeric_limits<int>::max()));
  const bool async = !ext.synchronous();
  const bool across_workers = !async && ext.num_workers() > 1;
  const bool independent = ext.independent_replicas();  // ensemble members
  // Ensemble members in the whole job (every worker holds as many).
  const double members = static_cast<double>(strategy.worker_devices().size() *
                                             static_cast<size_t>(ext.num_workers()));
  int64_t job_target = 0;
  if (async) {
    job_target = options.steps > 0 ? options.steps : options.epochs * steps_per_epoch * shard.count;
    epochs = options.steps > 0 ? std::numeric_limits<int>::max() : options.epochs;
  }
  auto job_done = [&] { return async && ext.job_step().value_or(0) >= job_target; };

  timeline::set_thread_name("training loop");
  Tally tally(names);
  TrainingContext ctx;
  ctx.strategy = &strategy;
  ctx.model = &model;
  ctx.optimizer = &optimizer;
  ctx.is_chief = ext.is_chief();
  ctx.shuffle_seed = options.shuffle_seed;
  ctx.global_batch_size = options.global_batch_size;
  ctx.epoch_state = [&tally] { return tally.states(); };
  for (Callback* c : options.callbacks) c->set_context(&ctx);

  // Gradient accumulation: each replica sums rows-weighted gradients of `accumulate` batches.
  const int k = options.accumulate;
  std::vector<std::vector<Tensor>> acc(strategy.worker_devices().size());
  double acc_rows = 0;
  bool apply_now = true;
  auto apply_accumulated = [&](ReplicaContext& rc) {
    std::vector<Tensor>& a = acc[static_cast<size_t>(rc.replica_id_in_sync_group()) % acc.size()];
    if (a.empty()) a.assign(vars.size(), Tensor());
    std::vector<Tensor> g(vars.size());
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].defined())
        g[i] = kernels_for(a[i]).affine(a[i], static_cast<float>(1.0 / acc_rows), 0.f);
    optimizer.apply_gradients(g, vars);
    a.clear();
  };

  int64_t rows_this_step = 0;
  bool request_stop = false;  // this worker's callbacks asked to stop (sent with the next step)
  bool agreed_stop = false;   // every worker knows a stop was asked: all leave after the same step
  auto stopping = [&] { return across_workers ? agreed_stop : ctx.stop_training; };
  const ReplicaFn step = [&](ReplicaContext& rc,
                             const std::vector<Tensor>& in) -> std::vector<Tensor> {
    std::vector<Tensor> grads;
    Tensor loss;
    {
      GradientTape tape;
      {
        timeline::Span s("forward", "compute");
        Tensor out = model(in[0], /*training=*/true);
        loss = compute_average_loss(loss_fn(out, in[1]), rows_this_step);
        if (in[0].shape()[0] > 0)
          for (auto& m : tally.metrics) m->update_state(ops::stop_gradient(out), in[1]);
      }
      timeline::Span s("backward", "compute");
      // Accumulating: the strategy's gradient packs must not start all-reduces of each micro-batch
      // (the one all-reduce is of the accumulated sum, in apply_accumulated).
      tape::GradientReadyHook* hook = k > 1 ? tape::set_gradient_ready_hook(nullptr) : nullptr;
      try {
        grads = tape.gradient(loss, vars);
      } catch (...) {
        if (k > 1) tape::set_gradient_ready_hook(hook);
        throw;
      }
      if (k > 1) tape::set_gradient_ready_hook(hook);
    }
    // Across workers, each step also carries whether this worker's callbacks asked to stop, so that
    // every worker stops after the same step.
    auto outputs = [&](Tensor l) {
      std::vector<Tensor> o{std::move(l)};
      if (across_workers)
        o.push_back(Tensor::full(Shape{1}, request_stop ? 1.f : 0.f, rc.device()));
      return o;
    };
    timeline::Span update(k == 1 || apply_now ? "optimizer update" : "accumulate gradients",
                          "compute");
    if (k == 1) {
      optimizer.apply_gradients(grads, vars);
      return outputs(loss);
    }
    std::vector<Tensor>& a = acc[static_cast<size_t>(rc.replica_id_in_sync_group()) % acc.size()];
    if (a.empty()) a.assign(vars.size(), Tensor());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      Kernels& kern = kernels_for(grads[i]);
      const Tensor weighted =
          kern.affine(grads[i], static_cast<float>(rows_this_step), 0.f);  // back to a sum
      a[i] = a[i].defined() ? kern.binary(BinaryOp::kAdd, a[i], weighted) : weighted;
    }
    if (apply_now) apply_accumulated(rc);
    return outputs(loss);
  };
  int micro = 0;  // batches accumulated and not yet applied
  auto flush = [&] {
    if (micro == 0) return;
    apply_now = true;
    strategy.run([&](ReplicaContext& rc, const std::vector<Tensor>&) -> std::vector<Tensor> {
      apply_accumulated(rc);
      return {};
    });
    micro = 0;
    acc_rows = 0;
  };

  History h;
  TrainLogs logs;
  logs.epochs = epochs;
  if (async && options.steps > 0)  // for the progress display: about how many epochs that is
    logs.epochs = static_cast<int>(std::max<int64_t>(
        1, (options.steps + steps_per_epoch * shard.count - 1) / (steps_per_epoch * shard.count)));
  logs.steps_per_epoch = steps_per_epoch;
  logs.learning_rate = optimizer.learning_rate();
  call(options.callbacks, &Callback::on_train_begin, logs);
  const int first_epoch = ctx.initial_epoch;
  h.steps = ctx.initial_global_step;
  int64_t timed_images = 0;
  double timed_seconds = 0;
  bool ended = false;  // ext.on_training_end() called
  for (int epoch = first_epoch; epoch < epochs && !ctx.stop_training; ++epoch) {
    const int64_t first_step = epoch == first_epoch ? ctx.initial_step : 0;
    logs.epoch = epoch;
    logs.step = first_step;
    logs.values.clear();
    if (options.steps > 0 && !async)
      logs.steps_per_epoch = std::min<int64_t>(
          steps_per_epoch, options.steps - static_cast<int64_t>(epoch) * steps_per_epoch);
    tally.reset();
    if (epoch == first_epoch) tally.set_states(ctx.initial_epoch_state);
    call(options.callbacks, &Callback::on_epoch_begin, logs);
    // The data order depends only on (seed, epoch, step): epoch e is shuffle(seed)'s pass e.
    auto epoch_data = [&](uint64_t seed) {
      return (options.shuffle ? my_train.shuffle(seed, false, static_cast<uint64_t>(epoch))
                              : my_train)
          .skip(first_step * B)
          .batch(B, options.drop_remainder)
          .prefetch(2);
    };
    // Ensemble members: each its own shuffle (seed + member) of all the data, at the full batch.
    auto next =
        independent ? strategy.distribute_datasets_from_function([&](const InputContext& ic) {
          return epoch_data(options.shuffle_seed + static_cast<uint64_t>(ic.input_pipeline_id));
        })
                    : strategy.distribute_dataset(epoch_data(options.shuffle_seed), B);
    int64_t epoch_images = 0;
    double epoch_seconds = 0;
    const auto epoch_start = Clock::now();
    PerReplica batch;
    while (logs.step < logs.steps_per_epoch && !job_done() && !stopping()) {
      logs.learning_rate = optimizer.learning_rate();
      call(options.callbacks, &Callback::on_train_batch_begin, logs);
      const auto t0 = Clock::now();  // timed from input fetch to the loss on the host
      timeline::Span step_span("step " + std::to_string(h.steps + 1), "step");
      {
        timeline::Span data_span("input batch", "data");
        if (!next(&batch)) break;
      }
      rows_this_step = batch.global_rows;  // set by distribute_dataset: all workers' rows this step
      if (independent)
        rows_this_step = batch.values.at(0).empty() ? 0 : batch.values[0][0].shape()[0];
      DTRAIN_CHECK(rows_this_step >= 0, "distribute_dataset left global_rows unset");
      acc_rows += static_cast<double>(rows_this_step);
      apply_now = k == 1 || ++micro == k;
      request_stop = ctx.stop_training;
      PerReplica out = strategy.run(step, batch);
      if (apply_now) {
        micro = 0;
        acc_rows = 0;
      }
      const std::vector<Tensor> reduced = strategy.reduce(ReduceOp::kSum, out);
      double loss = reduced[0].item();
      if (independent) loss /= members;  // the members' mean
      if (across_workers && reduced.at(1).item() > 0) agreed_stop = ctx.stop_training = true;
      tally.loss.update(loss, static_cast<double>(rows_this_step));
      const double secs = seconds_since(t0);
      if (h.steps - ctx.initial_global_step >= options.warmup_steps) {
        timed_seconds += secs;
        timed_images += rows_this_step;  // the global batch: images/sec of the whole job
      }
      epoch_seconds += secs;
      ++h.steps;
      ++logs.step;
      epoch_images += rows_this_step;
      logs.global_step = h.steps;
      logs.loss = tally.loss.result();
      logs.images_per_sec =
          static_cast<double>(epoch_images) / std::max(1e-9, seconds_since(epoch_start));
      logs.seconds_per_step = epoch_seconds / static_cast<double>(logs.step - first_step);
      logs.values["loss"] = logs.loss;
      for (const auto& m : tally.metrics)
        logs.values[m->name()] = m->result();  // this worker's so far
      ctx.accumulating = micro != 0;
      call(options.callbacks, &Callback::on_train_batch_end, logs);
    }
    flush();
    ctx.accumulating = false;
    const bool ran = !async || epoch_images > 0 || h.epoch_loss.empty();
    if (ran) h.epoch_loss.push_back(tally.loss.result());
    // The epoch's metrics over all workers' examples, and whether any worker stops: one all-reduce.
    std::vector<double> flat = tally.flat_metric_states();
    flat.push_back(ctx.stop_training ? 1.0 : 0.0);
    if (across_workers) flat = ext.sum_across_workers(flat);
    agreed_stop = ctx.stop_training = flat.back() > 0;
    logs.values.clear();
    logs.loss = tally.loss.result();
    logs.values["loss"] = logs.loss;
    tally.put_results(flat, 0, "", &logs.values);
    const bool last = epoch + 1 == epochs || job_done() || ctx.stop_training;
    if (last) {
      ext.on_training_end();
      ended = true;
    }
    if (test && (last || !async)) {
      const EvalResult r = evaluate(strategy, model, *test, options.eval_batch_size, options.loss,
                                    names, options.callbacks);
      logs.test_accuracy = h.test_accuracy = r.accuracy;
      logs.test_loss = h.test_loss = r.loss;
      logs.values["val_loss"] = r.loss;
      for (const auto& [name, v] : r.metrics) logs.values["val_" + name] = v;
    }
    logs.learning_rate = optimizer.learning_rate();
    logs.values["learning_rate"] = logs.learning_rate;
    ctx.epoch_logs = &logs.values;  // callbacks may change them (hvd::MetricAverageCallback)
    call(options.callbacks, &Callback::on_epoch_end, logs);
    ctx.epoch_logs = nullptr;
    if (ran)
      for (const auto& [key, v] : logs.values) h.history[key].push_back(v);
    if (last) break;
    if (across_workers)  // a stop asked in on_epoch_end: every worker learns of it before the next
                         // epoch
      agreed_stop = ctx.stop_training =
          ext.sum_across_workers({ctx.stop_training ? 1.0 : 0.0})[0] > 0;
  }
  if (!ended) ext.on_training_end();  // a callback stopped training at an epoch's end
  h.final_loss = h.epoch_loss.empty() ? 0 : h.epoch_loss.back();
  h.images_per_sec = timed_seconds > 0 ? static_cast<double>(timed_images) / timed_seconds : 0;
  logs.loss = h.final_loss;
  call(options.callbacks, &Callback::on_train_end, logs);
  for (Callback* c : options.callbacks) c->set_context(nullptr);
  if (timeline::enabled()) timeline::flush_timeline();  // what a later kill would lose
  return h;
}

}  // namespace dtrain
