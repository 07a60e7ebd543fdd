#include "dtrain/train/fit.h"

#include <chrono>
#include <limits>

#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/losses.h"
#include "dtrain/model/metrics.h"
#include "dtrain/model/ops.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

LossFn default_loss(const LossFn& f) {
  if (f) return f;
  return [](const Tensor& logits, const Tensor& labels) {
    return ops::sparse_softmax_cross_entropy(logits, labels);
  };
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

EvalResult evaluate(Strategy& strategy, Sequential& model, const Dataset& test, int64_t batch_size,
                    const LossFn& loss) {
  const LossFn loss_fn = default_loss(loss);
  SparseCategoricalAccuracy acc;
  Mean mean_loss;
  auto next = strategy.distribute_dataset(test.batch(batch_size, false), batch_size);
  PerReplica batch;
  while (next(&batch)) {
    strategy.run(
        [&](ReplicaContext&, const std::vector<Tensor>& in) -> std::vector<Tensor> {
          const int64_t rows = in[0].shape()[0];
          if (rows == 0) return {};
          Tensor logits = model(in[0], false);
          acc.update(logits, in[1]);
          mean_loss.update(ops::mean(loss_fn(logits, in[1])).item(), static_cast<double>(rows));
          return {};
        },
        batch);
  }
  // Every worker evaluated its share of the test set: combine them.
  const std::vector<double> t = strategy.extended().sum_across_workers(
      {acc.result() * static_cast<double>(acc.count()), static_cast<double>(acc.count()),
       mean_loss.result() * static_cast<double>(acc.count())});
  return EvalResult{t[1] > 0 ? t[0] / t[1] : 0, t[1] > 0 ? t[2] / t[1] : 0, static_cast<int64_t>(t[1])};
}

History fit(Strategy& strategy, Sequential& model, Optimizer& optimizer, const Dataset& train,
            const Dataset* test, const FitOptions& options) {
  if (options.global_batch_size < 1)
    throw InvalidArgument("global_batch_size must be >= 1, got " + std::to_string(options.global_batch_size));
  if (options.epochs < 1 && options.steps < 1)
    throw InvalidArgument("fit() needs epochs >= 1 or steps >= 1");
  const LossFn loss_fn = default_loss(options.loss);

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
  const Dataset epoch_ds = my_train.shuffle(options.shuffle_seed).batch(options.global_batch_size, options.drop_remainder);
  const int64_t steps_per_epoch = epoch_ds.cardinality();
  if (steps_per_epoch == 0) throw InvalidArgument("fit(): no full batch in the training data");
  int epochs = options.epochs;
  if (options.steps > 0 && steps_per_epoch > 0)
    epochs = static_cast<int>((options.steps + steps_per_epoch - 1) / steps_per_epoch);
  const bool async = !ext.synchronous();
  int64_t job_target = 0;
  if (async) {
    job_target = options.steps > 0 ? options.steps : options.epochs * steps_per_epoch * shard.count;
    epochs = options.steps > 0 ? std::numeric_limits<int>::max() : options.epochs;
  }
  auto job_done = [&] { return async && ext.job_step().value_or(0) >= job_target; };
  auto next = strategy.distribute_dataset(epoch_ds.repeat().prefetch(2), options.global_batch_size);

  int64_t rows_this_step = 0;
  const ReplicaFn step = [&](ReplicaContext&, const std::vector<Tensor>& in) -> std::vector<Tensor> {
    GradientTape tape;
    Tensor logits = model(in[0], /*training=*/true);
    Tensor loss = compute_average_loss(loss_fn(logits, in[1]), rows_this_step);
    std::vector<Tensor> grads = tape.gradient(loss, vars);
    optimizer.apply_gradients(grads, vars);
    return {loss};
  };

  History h;
  TrainLogs logs;
  logs.epochs = epochs;
  if (async && options.steps > 0)  // for the progress display: about how many epochs that is
    logs.epochs = static_cast<int>(std::max<int64_t>(1, (options.steps + steps_per_epoch * shard.count - 1) /
                                                            (steps_per_epoch * shard.count)));
  logs.steps_per_epoch = steps_per_epoch;
  for (Callback* c : options.callbacks) c->on_train_begin(logs);
  int64_t timed_images = 0;
  double timed_seconds = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    logs.epoch = epoch;
    logs.step = 0;
    if (options.steps > 0 && !async)
      logs.steps_per_epoch = std::min<int64_t>(steps_per_epoch, options.steps - h.steps);
    for (Callback* c : options.callbacks) c->on_epoch_begin(logs);
    Mean epoch_loss;
    int64_t epoch_images = 0;
    const auto epoch_start = Clock::now();
    PerReplica batch;
    while (logs.step < logs.steps_per_epoch && !job_done()) {
      const auto t0 = Clock::now();  // timed from input fetch to the loss on the host
      if (!next(&batch)) break;
      rows_this_step = batch.global_rows;  // set by distribute_dataset: all workers' rows this step
      DTRAIN_CHECK(rows_this_step >= 0, "distribute_dataset left global_rows unset");
      PerReplica out = strategy.run(step, batch);
      const double loss = strategy.reduce(ReduceOp::kSum, out)[0].item();
      epoch_loss.update(loss, static_cast<double>(rows_this_step));
      if (h.steps >= options.warmup_steps) {
        timed_seconds += seconds_since(t0);
        timed_images += rows_this_step;  // the global batch: images/sec of the whole job
      }
      ++h.steps;
      ++logs.step;
      epoch_images += rows_this_step;
      logs.global_step = h.steps;
      logs.loss = epoch_loss.result();
      logs.images_per_sec = static_cast<double>(epoch_images) / std::max(1e-9, seconds_since(epoch_start));
      for (Callback* c : options.callbacks) c->on_batch_end(logs);
    }
    if (!async || epoch_images > 0 || h.epoch_loss.empty()) h.epoch_loss.push_back(epoch_loss.result());
    const bool last = epoch + 1 == epochs || job_done();
    if (last) ext.on_training_end();
    if (test && (last || !async)) {
      const EvalResult r = evaluate(strategy, model, *test, options.eval_batch_size, loss_fn);
      logs.test_accuracy = h.test_accuracy = r.accuracy;
      logs.test_loss = h.test_loss = r.loss;
    }
    for (Callback* c : options.callbacks) c->on_epoch_end(logs);
    if (last) break;
  }
  h.final_loss = h.epoch_loss.empty() ? 0 : h.epoch_loss.back();
  h.images_per_sec = timed_seconds > 0 ? static_cast<double>(timed_images) / timed_seconds : 0;
  logs.loss = h.final_loss;
  for (Callback* c : options.callbacks) c->on_train_end(logs);
  return h;
}

}  // namespace dtrain
