// fit(): a Keras-like training loop that runs under any strategy. It builds the model and the
// optimizer's slots inside strategy.scope(), distributes the global batch over replicas, runs the
// step (GradientTape, compute_average_loss, apply_gradients) with strategy.run, and evaluates.
#pragma once

#include "dtrain/core/export.h"

#include <cstdint>
#include <functional>
#include <vector>

#include "dtrain/data/dataset.h"
#include "dtrain/model/layers.h"
#include "dtrain/model/optimizers.h"
#include "dtrain/strategies/strategy.h"
#include "dtrain/train/callbacks.h"

namespace dtrain {

// Per-example loss from (predictions, labels).
using LossFn = std::function<Tensor(const Tensor& predictions, const Tensor& labels)>;

struct DTRAIN_API FitOptions {
  int epochs = 1;
  int64_t steps = 0;                 // > 0: stop after this many steps in total (repeats data)
  int64_t global_batch_size = 64;    // split over num_replicas_in_sync
  uint64_t shuffle_seed = 0;
  bool drop_remainder = false;       // Keras keeps the partial last batch
  int64_t eval_batch_size = 1000;
  int warmup_steps = 5;              // excluded from images_per_sec
  LossFn loss;                       // default: sparse softmax cross-entropy
  std::vector<Callback*> callbacks;
};

struct DTRAIN_API History {
  std::vector<double> epoch_loss;
  int64_t steps = 0;
  double final_loss = 0;          // mean loss of the last epoch (or of the steps run)
  double images_per_sec = 0;      // after warm-up
  double test_accuracy = -1;      // -1 when no test set
  double test_loss = -1;
};

// train: unbatched (features [N,...], labels [N]); test: unbatched or nullptr.
DTRAIN_API History fit(Strategy& strategy, Sequential& model, Optimizer& optimizer, const Dataset& train,
            const Dataset* test, const FitOptions& options);

struct DTRAIN_API EvalResult {
  double accuracy = 0, loss = 0;
  int64_t examples = 0;
};
DTRAIN_API EvalResult evaluate(Strategy& strategy, Sequential& model, const Dataset& test, int64_t batch_size,
                    const LossFn& loss = {});

}  // namespace dtrain
