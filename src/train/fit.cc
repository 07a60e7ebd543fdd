// fit(): the epoch loop, built from three pieces that each do one thing:
//   TrainStep            one replica's step: forward, loss, gradients, then apply or accumulate;
//   GradientAccumulator  Horovod's backward_passes_per_step: per-replica sums of k batches;
//   StopAgreement        a callback's stop request carried with each step across workers, so that
//                        every worker leaves after the same step.
#include "dtrain/train/fit.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "train/callback_states.h"
#include "train/heads.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

void call(const std::vector<Callback*>& cbs, void (Callback::*hook)(const TrainLogs&),
          const TrainLogs& logs) {
  for (Callback* c : cbs) (c->*hook)(logs);
}

// Sums of row-weighted gradients of the batches of one group, per replica; applied as their mean
// over every row of the group, which equals one batch that many times larger.
class GradientAccumulator {
 public:
  GradientAccumulator(size_t replicas, size_t variables) : sums_(replicas), variables_(variables) {}
  // Adds gradients of a loss averaged over `rows` rows (back to a sum).
  void add(int replica, const std::vector<Tensor>& grads, int64_t rows) {
    std::vector<Tensor>& a = slot(replica);
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      Kernels& k = kernels_for(grads[i]);
      const Tensor weighted = k.affine(grads[i], static_cast<float>(rows), 0.f);
      a[i] = a[i].defined() ? k.binary(BinaryOp::kAdd, a[i], weighted) : weighted;
    }
  }
  // The group's mean gradients for this replica (rows: the group's rows over all replicas), and
  // the sums are cleared.
  std::vector<Tensor> take_mean(int replica, double rows) {
    std::vector<Tensor>& a = slot(replica);
    std::vector<Tensor> g(variables_);
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].defined())
        g[i] = kernels_for(a[i]).affine(a[i], static_cast<float>(1.0 / rows), 0.f);
    a.clear();
    return g;
  }

 private:
  std::vector<Tensor>& slot(int replica) {
    std::vector<Tensor>& a = sums_[static_cast<size_t>(replica) % sums_.size()];
    if (a.empty()) a.assign(variables_, Tensor());
    return a;
  }
  std::vector<std::vector<Tensor>> sums_;
  size_t variables_;
};

// Callbacks may ask to stop on any worker; the request travels with the next step's loss, and
// every worker stops after the step where any asked.
class StopAgreement {
 public:
  StopAgreement(TrainingContext& ctx, bool across_workers) : ctx_(ctx), across_(across_workers) {}
  bool across_workers() const { return across_; }
  bool stopping() const { return across_ ? agreed_ : ctx_.stop_training; }
  // Before a step: what this worker's callbacks ask.
  void begin_step() { requested_ = ctx_.stop_training; }
  // The flag a replica sends with its loss (only across workers).
  Tensor flag(DeviceSpec device) const {
    return Tensor::full(Shape{1}, requested_ ? 1.f : 0.f, device);
  }
  // After a step: the sum of every replica's flag.
  void after_step(double flags) {
    if (across_ && flags > 0) agreed_ = ctx_.stop_training = true;
  }
  // At an epoch's end, from a sum over workers of their requests.
  void agree(bool any) { agreed_ = ctx_.stop_training = any; }

 private:
  TrainingContext& ctx_;
  bool across_;
  bool requested_ = false, agreed_ = false;
};

// One replica's training step (the function strategy.run calls).
class TrainStep {
 public:
  TrainStep(Model& model, Optimizer& optimizer, const detail::Heads& heads, detail::Tally& tally,
            VariableList vars, int accumulate, size_t replicas, StopAgreement& stop)
      : model_(model),
        optimizer_(optimizer),
        heads_(heads),
        tally_(tally),
        vars_(std::move(vars)),
        k_(accumulate),
        acc_(replicas, vars_.size()),
        stop_(stop) {}

  // Set by the loop before each strategy.run: every worker's rows this step, and whether this
  // step ends an accumulation group.
  void prepare(int64_t global_rows, bool apply) {
    rows_ = global_rows;
    group_rows_ += static_cast<double>(global_rows);
    apply_now_ = apply;
  }
  void group_applied() { group_rows_ = 0; }
  bool has_pending_group() const { return group_rows_ > 0; }

  std::vector<Tensor> operator()(ReplicaContext& rc, const std::vector<Tensor>& in) {
    std::vector<Tensor> grads;
    Tensor loss;
    {
      GradientTape tape;
      {
        timeline::Span s("forward", "compute");
        const std::vector<Tensor> outs = heads_.forward(model_, in, /*training=*/true);
        loss = heads_.average_loss(outs, in, rows_);
        if (in[0].shape()[0] > 0) heads_.update_metrics(tally_, outs, in);
      }
      timeline::Span s("backward", "compute");
      // Accumulating: the strategy's gradient packs must not start all-reduces of each
      // micro-batch (the one all-reduce is of the accumulated sum, in apply_group).
      GradientHookPause pause(k_ > 1);
      grads = tape.gradient(loss, vars_);
    }
    std::vector<Tensor> out{loss};
    if (stop_.across_workers()) out.push_back(stop_.flag(rc.device()));
    timeline::Span update(k_ == 1 || apply_now_ ? "optimizer update" : "accumulate gradients",
                          "compute");
    if (k_ == 1) {
      optimizer_.apply_gradients(grads, vars_);
      return out;
    }
    acc_.add(rc.replica_id_in_sync_group(), grads, rows_);
    if (apply_now_) apply_group(rc);
    return out;
  }

  // Applies what each replica accumulated (an epoch that ends mid-group).
  void apply_group(ReplicaContext& rc) {
    optimizer_.apply_gradients(acc_.take_mean(rc.replica_id_in_sync_group(), group_rows_), vars_);
  }

 private:
  // Removes the tape's gradient-ready hook for its lifetime (when `active`).
  class GradientHookPause {
   public:
    explicit GradientHookPause(bool active)
        : active_(active), saved_(active ? tape::set_gradient_ready_hook(nullptr) : nullptr) {}
    ~GradientHookPause() {
      if (active_) tape::set_gradient_ready_hook(saved_);
    }
    GradientHookPause(const GradientHookPause&) = delete;
    GradientHookPause& operator=(const GradientHookPause&) = delete;

   private:
    bool active_;
    tape::GradientReadyHook* saved_;
  };

  Model& model_;
  Optimizer& optimizer_;
  const detail::Heads& heads_;
  detail::Tally& tally_;
  const VariableList vars_;
  const int k_;
  GradientAccumulator acc_;
  StopAgreement& stop_;
  int64_t rows_ = 0;
  double group_rows_ = 0;
  bool apply_now_ = true;
};

// Builds the model (from the dataset's first row) and the optimizer's slots inside the scope.
void build(Strategy& strategy, Model& model, Optimizer& optimizer, const Dataset& train) {
  auto scope = strategy.scope();
  if (!model.built()) {
    std::vector<Tensor> first;
    auto it = train.take(1).batch(1).make_iterator();
    if (!it->next(&first)) throw InvalidArgument("fit(): the training dataset is empty");
    const size_t inputs = static_cast<size_t>(model.num_inputs());
    if (first.size() < inputs)
      throw InvalidArgument("fit(): model '" + model.name() + "' takes " + std::to_string(inputs) +
                            " inputs; the dataset gives " + std::to_string(first.size()) +
                            " components a row");
    std::vector<Shape> shapes;
    for (size_t i = 0; i < inputs; ++i) shapes.push_back(first[i].shape());
    model.build(shapes);
  }
  optimizer.build(model.trainable_variables());
}

}  // namespace

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
  build(strategy, model, optimizer, train);  // first: a subclass's outputs are known once built
  const detail::Heads heads(model, options);
  const VariableList vars = model.trainable_variables();

  // Asynchronous strategies: each worker trains on its own shard of the data, and the job stops
  // when its global step (which survives restarts) reaches the target.
  StrategyExtended& ext = strategy.extended();
  const InputShard shard = ext.input_shard();
  const Dataset my_train = shard.count > 1 ? train.shard(shard.count, shard.index) : train;
  const int64_t B = options.global_batch_size;
  // Batches in a pass over the data; an epoch is a pass, or options.steps_per_epoch of its batches
  // (Keras' steps_per_epoch: the next epoch goes on where this one stopped).
  const int64_t pass_steps = my_train.batch(B, options.drop_remainder).cardinality();
  if (pass_steps == 0) throw InvalidArgument("fit(): no full batch in the training data");
  if (options.steps_per_epoch > 0 && pass_steps < 0)
    throw InvalidArgument(
        "fit(): steps_per_epoch over an infinite dataset (" + train.to_string() +
        ") is not supported: give the finite dataset, and fit() goes on through its passes");
  if (options.steps_per_epoch < 0 ||
      (options.steps_per_epoch > 0 && pass_steps % options.steps_per_epoch != 0))
    throw InvalidArgument("fit(): steps_per_epoch " + std::to_string(options.steps_per_epoch) +
                          " must divide the " + std::to_string(pass_steps) +
                          " batches of a pass over this worker's data (or be 0: a whole pass)");
  const int64_t steps_per_epoch =
      options.steps_per_epoch > 0 ? options.steps_per_epoch : pass_steps;
  const int64_t epochs_per_pass = pass_steps > 0 ? pass_steps / steps_per_epoch : 1;
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
  std::unique_ptr<detail::Tally> tally_owner = heads.make_tally();
  detail::Tally& tally = *tally_owner;
  TrainingContext ctx;
  ctx.strategy = &strategy;
  ctx.model = &model;
  ctx.optimizer = &optimizer;
  ctx.is_chief = ext.is_chief();
  ctx.shuffle_seed = options.shuffle_seed;
  ctx.global_batch_size = options.global_batch_size;
  ctx.epoch_state = [&tally] { return tally.states(); };
  ctx.callback_states = [&callbacks = options.callbacks] {
    std::map<std::string, CallbackState> states;
    const std::vector<std::string> keys = detail::callback_state_keys(callbacks);
    for (size_t i = 0; i < callbacks.size(); ++i)
      if (!keys[i].empty())
        states[keys[i]] = callbacks[i]->state_dict();  // empty ones too: their keys are compared
    return states;
  };
  for (Callback* c : options.callbacks) c->set_context(&ctx);
  // However fit() ends (an exception from a step, a collective, a callback, the input pipeline),
  // no callback keeps a pointer to this frame's context: context() throws FailedPrecondition after.
  struct ForgetContext {
    const std::vector<Callback*>& callbacks;
    ~ForgetContext() {
      for (Callback* c : callbacks) c->set_context(nullptr);
    }
  } forget_context{options.callbacks};

  const int k = options.accumulate;
  StopAgreement stop(ctx, across_workers);
  TrainStep step(model, optimizer, heads, tally, vars, k, strategy.worker_devices().size(), stop);
  const ReplicaFn step_fn = [&step](ReplicaContext& rc, const std::vector<Tensor>& in) {
    return step(rc, in);
  };
  int micro = 0;  // batches accumulated and not yet applied
  auto flush = [&] {
    if (micro == 0) return;
    strategy.run([&](ReplicaContext& rc, const std::vector<Tensor>&) -> std::vector<Tensor> {
      step.apply_group(rc);
      return {};
    });
    micro = 0;
    step.group_applied();
  };

  History h;
  TrainLogs logs;
  logs.epochs = epochs;
  if (async && options.steps > 0)  // for the progress display: about how many epochs that is
    logs.epochs = static_cast<int>(std::max<int64_t>(
        1, (options.steps + steps_per_epoch * shard.count - 1) / (steps_per_epoch * shard.count)));
  logs.steps_per_epoch = steps_per_epoch;
  logs.learning_rate = optimizer.learning_rate();
  // Before any callback's collective: the ones that must run on every worker do.
  if (across_workers) detail::check_callbacks_on_every_worker(options.callbacks, ext);
  call(options.callbacks, &Callback::on_train_begin, logs);
  // Batch and epoch ends: the callbacks that save a backup last, so that it holds what the others
  // did at that point (EarlyStopping's count of the epoch just ended).
  std::vector<Callback*> ends = options.callbacks;
  std::stable_partition(ends.begin(), ends.end(), [](Callback* c) { return !c->saves_backup(); });
  // Asynchronous training (parameter servers): each worker's callbacks decide for it alone, and a
  // backup holds the chief's; the others start theirs afresh.
  if (!async || ctx.is_chief)
    detail::load_callback_states(options.callbacks, ctx.initial_callback_states);
  const int first_epoch = ctx.initial_epoch;
  h.steps = ctx.initial_global_step;
  logs.global_step = h.steps;  // a resumed fit's first batch begins after the restored steps
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
    // The data order depends only on (seed, epoch, step): epoch e is shuffle(seed)'s pass e, or,
    // with steps_per_epoch, the e-th run of that many batches through the passes.
    const uint64_t pass = static_cast<uint64_t>(epoch / epochs_per_pass);
    const int64_t pass_offset = (epoch % epochs_per_pass) * steps_per_epoch;
    auto epoch_data = [&](uint64_t seed) {
      Dataset d = options.shuffle ? my_train.shuffle(seed, false, pass) : my_train;
      d = d.with_epoch(static_cast<uint64_t>(epoch));  // a reader's random augmentation
      d = d.skip((pass_offset + first_step) * B);
      if (epochs_per_pass > 1) d = d.take((steps_per_epoch - first_step) * B);
      d = d.batch(B, options.drop_remainder);
      if (options.augment)  // one pipeline per epoch: the batch's index counts from first_step
        d = d.map_with_index(
            [f = options.augment, epoch, first_step](std::vector<Tensor> batch, int64_t i) {
              return f(std::move(batch), epoch, first_step + i);
            },
            options.augment_parallel_calls);
      return d.prefetch(2);
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
    while (logs.step < logs.steps_per_epoch && !job_done() && !stop.stopping()) {
      logs.learning_rate = optimizer.learning_rate();
      call(options.callbacks, &Callback::on_train_batch_begin, logs);
      const auto t0 = Clock::now();  // timed from input fetch to the loss on the host
      timeline::Span step_span("step " + std::to_string(h.steps + 1), "step");
      {
        timeline::Span data_span("input batch", "data");
        if (!next(&batch)) break;
      }
      // Set by distribute_dataset: all workers' rows this step.
      int64_t rows = batch.global_rows;
      if (independent) rows = batch.values.at(0).empty() ? 0 : batch.values[0][0].shape()[0];
      DTRAIN_CHECK(rows >= 0, "distribute_dataset left global_rows unset");
      const bool apply_now = k == 1 || ++micro == k;
      step.prepare(rows, apply_now);
      stop.begin_step();
      PerReplica out = strategy.run(step_fn, batch);
      if (apply_now) {
        micro = 0;
        step.group_applied();
      }
      const std::vector<Tensor> reduced = strategy.reduce(ReduceOp::kSum, out);
      double loss = reduced[0].item();
      if (independent) loss /= members;  // the members' mean
      if (across_workers) stop.after_step(reduced.at(1).item());
      tally.loss.update(loss, static_cast<double>(rows));
      const double secs = seconds_since(t0);
      if (h.steps - ctx.initial_global_step >= options.warmup_steps) {
        timed_seconds += secs;
        timed_images += rows;  // the global batch: images/sec of the whole job
      }
      epoch_seconds += secs;
      ++h.steps;
      ++logs.step;
      epoch_images += rows;
      logs.global_step = h.steps;
      logs.loss = tally.loss.result();
      logs.images_per_sec =
          static_cast<double>(epoch_images) / std::max(1e-9, seconds_since(epoch_start));
      logs.seconds_per_step = epoch_seconds / static_cast<double>(logs.step - first_step);
      logs.values["loss"] = logs.loss;
      tally.put_local_results(&logs.values);  // this worker's so far
      ctx.accumulating = micro != 0;
      call(ends, &Callback::on_train_batch_end, logs);
    }
    flush();
    ctx.accumulating = false;
    const bool ran = !async || epoch_images > 0 || h.epoch_loss.empty();
    if (ran) h.epoch_loss.push_back(tally.loss.result());
    // The epoch's metrics over all workers' examples, and whether any worker stops: one all-reduce.
    std::vector<double> flat = tally.flat_metric_states();
    flat.push_back(ctx.stop_training ? 1.0 : 0.0);
    if (across_workers) flat = ext.sum_across_workers(flat);
    stop.agree(flat.back() > 0);
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
      const EvalResult r = evaluate(strategy, model, *test, options);
      logs.test_accuracy = h.test_accuracy = r.accuracy;
      logs.test_loss = h.test_loss = r.loss;
      logs.values["val_loss"] = r.loss;
      for (const auto& [name, v] : r.metrics) logs.values["val_" + name] = v;
    }
    logs.learning_rate = optimizer.learning_rate();
    logs.values["learning_rate"] = logs.learning_rate;
    ctx.epoch_logs = &logs.values;  // callbacks may change them (hvd::MetricAverageCallback)
    call(ends, &Callback::on_epoch_end, logs);
    ctx.epoch_logs = nullptr;
    if (ran)
      for (const auto& [key, v] : logs.values) h.history[key].push_back(v);
    if (last) break;
    // A stop asked in on_epoch_end: every worker learns of it before the next epoch.
    if (across_workers) stop.agree(ext.sum_across_workers({ctx.stop_training ? 1.0 : 0.0})[0] > 0);
  }
  if (!ended) ext.on_training_end();  // a callback stopped training at an epoch's end
  h.final_loss = h.epoch_loss.empty() ? 0 : h.epoch_loss.back();
  h.images_per_sec = timed_seconds > 0 ? static_cast<double>(timed_images) / timed_seconds : 0;
  logs.loss = h.final_loss;
  call(options.callbacks, &Callback::on_train_end, logs);
  if (timeline::enabled()) timeline::flush_timeline();  // what a later kill would lose
  return h;
}

}  // namespace dtrain
