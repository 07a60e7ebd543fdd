// fit(): a Keras-like training loop that runs under any strategy. It builds the model and the
// optimizer's slots inside strategy.scope(), distributes the global batch over replicas, runs the
// step (GradientTape, compute_average_loss, apply_gradients) with strategy.run, and evaluates.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/data/dataset.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/strategy.h"
#include "dtrain/train/callbacks.h"

namespace dtrain {

struct DTRAIN_API FitOptions {
  int epochs = 1;     // the epoch to end at (as Keras: also counts restored ones)
  int64_t steps = 0;  // > 0: stop after this many steps in total (repeats data)
  // > 0: an epoch is this many steps, and the next epoch goes on in the data where it stopped
  // (Keras' steps_per_epoch), a new shuffle starting when a pass over the data ends; it must divide
  // the batches of a pass of a finite dataset (InvalidArgument otherwise). 0: an epoch is a pass.
  int64_t steps_per_epoch = 0;
  int64_t global_batch_size = 64;  // split over num_replicas_in_sync
  // Keras' fit(shuffle=True): each epoch visits the examples in an order drawn from shuffle_seed
  // and the epoch; false: in the dataset's order.
  bool shuffle = true;
  uint64_t shuffle_seed = 0;
  bool drop_remainder = false;  // Keras keeps the partial last batch
  int64_t eval_batch_size = 1000;
  int warmup_steps = 5;  // excluded from images_per_sec
  // The datasets give each row as the model's inputs (Model::num_inputs() components), then one
  // label per output (Keras' x, y with y a list for several outputs).
  LossFn loss;  // for every output; default: sparse softmax cross-entropy
  // One loss per output instead (keras compile(loss=[...])); not together with `loss`.
  std::vector<LossFn> losses;
  // The total loss is sum_i loss_weights[i] * loss_i (keras loss_weights); empty: all 1.
  std::vector<float> loss_weights;
  // The same by Model::output_names(), as Keras' compile(loss={"logits": ...}, loss_weights={...})
  // (get_loss("mse") gives Keras' losses by name). With output_losses set, an output it does not
  // name adds no loss (Keras' dict semantics), and neither `loss` nor `losses` may be set. A name
  // that is not an output is refused, listing the outputs.
  std::map<std::string, LossFn> output_losses;
  std::map<std::string, float> output_loss_weights;
  // Metric names (metrics.h: make_metric) computed on the training batches and on the test set,
  // reported in the logs as "<name>" and "val_<name>"; with several outputs, for each output, as
  // "<output>_<name>" (Model::output_names()). Empty: {"accuracy"} with the default loss, none with
  // a user loss.
  std::vector<std::string> metrics;
  // Metrics per output by Model::output_names() (keras compile(metrics={"logits": ["accuracy"]})),
  // logged as "<output>_<name>"; when set, `metrics` is not used.
  std::map<std::string, std::vector<std::string>> output_metrics;
  // Gradient accumulation (Horovod's backward_passes_per_step, DDP's no_sync): gradients of this
  // many consecutive batches are summed on each replica and applied with one all-reduce, which
  // equals one batch that many times larger. Each batch still counts as a step in the logs; an
  // epoch ending mid-group applies what it has.
  int accumulate = 1;
  std::vector<Callback*> callbacks;
  // Transforms each training batch (its components, unbatched datasets' rows stacked) in the input
  // pipeline while earlier steps train (tf.data's map(num_parallel_calls) + prefetch), given the
  // epoch and the batch's step within the epoch: e.g. augment::random_crop_flip. It must depend
  // only on the batch, those two numbers and its own seed (it runs on several threads, and a job
  // resumed mid-epoch must see the batches an uninterrupted run saw). Not applied to evaluation.
  std::function<std::vector<Tensor>(std::vector<Tensor> batch, int epoch, int64_t step)> augment;
  // Threads that run `augment`, up to this many batches ahead (Dataset::kAutotune: one per core);
  // the batches are the same for any number.
  int augment_parallel_calls = Dataset::kAutotune;
};

struct DTRAIN_API History {
  // keras History.history: per epoch run, every log value by key ("loss", "accuracy",
  // "val_loss", "learning_rate", ...).
  std::map<std::string, std::vector<double>> history;
  std::vector<double> epoch_loss;
  int64_t steps = 0;
  double final_loss = 0;      // mean loss of the last epoch (or of the steps run)
  double images_per_sec = 0;  // after warm-up
  double test_accuracy = -1;  // -1 when no test set
  double test_loss = -1;
};

// train: unbatched (features [N,...], labels [N]); test: unbatched or nullptr.
DTRAIN_API History fit(Strategy& strategy, Model& model, Optimizer& optimizer, const Dataset& train,
                       const Dataset* test, const FitOptions& options);

struct DTRAIN_API EvalResult {
  double accuracy = -1, loss = 0;  // accuracy: -1 when not among the metrics
  int64_t examples = 0;
  std::map<std::string, double> metrics;  // by name, over all examples of all workers
};
// Loss and metrics (as FitOptions::metrics; empty: accuracy with the default loss) over the whole
// test set, each worker taking its share, combined exactly. `callbacks` get the test hooks. Under
// EnsembleStrategy every member scores every example and the results are the members' means (the
// accuracy of the ensemble's mean prediction comes from predict()).
DTRAIN_API EvalResult evaluate(Strategy& strategy, Model& model, const Dataset& test,
                               int64_t batch_size, const LossFn& loss = {},
                               const std::vector<std::string>& metrics = {},
                               const std::vector<Callback*>& callbacks = {});
// The same with fit()'s losses, loss weights and metrics (at options.eval_batch_size), for models
// with several outputs.
DTRAIN_API EvalResult evaluate(Strategy& strategy, Model& model, const Dataset& test,
                               const FitOptions& options);

// The model's outputs for every row of `data` (unbatched features, or features and labels: the
// first Model::num_inputs() components are used), in order, one CPU tensor [N, ...] per output
// (Keras' predict() returns a list for a model with several outputs). Each batch is split over the
// local replicas; every worker computes all rows (no cross-worker traffic), so each gets the
// whole result.
// Under EnsembleStrategy: the members' mean (predict_ensemble gives each member and the spread).
DTRAIN_API std::vector<Tensor> predict_outputs(Strategy& strategy, Model& model,
                                               const Dataset& data, int64_t batch_size = 256);
// predict_outputs()' first output: the whole result for a model with one output.
DTRAIN_API Tensor predict(Strategy& strategy, Model& model, const Dataset& data,
                          int64_t batch_size = 256);

// Every ensemble member's outputs for every row (float32 models; the first output of a model with
// several), their mean and their standard deviation (over members, population). Under another
// strategy: one member, the model's output. Members on several workers: collective (every worker
// calls it with the same data) and every worker gets every member, in job-wide member order.
struct DTRAIN_API EnsemblePrediction {
  std::vector<Tensor> members;  // [N, ...] each, on the CPU, member order
  Tensor mean, stddev;
};
DTRAIN_API EnsemblePrediction predict_ensemble(Strategy& strategy, Model& model,
                                               const Dataset& data, int64_t batch_size = 256);

}  // namespace dtrain
