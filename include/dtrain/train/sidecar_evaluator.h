// SidecarEvaluator: evaluates a model on each new checkpoint a training job writes, while it
// trains (TF's tf.keras.utils.SidecarEvaluator; the `evaluator` task of a ParameterServer job).
//
//   Sequential model = build();  model.build(input_shape);        // plain variables, no strategy
//   SidecarEvaluator eval(model, test, {.checkpoint_dir = "/ckpt"});
//   eval.run();   // until the chief's final checkpoint has been evaluated
//
// Checkpoint entries are matched to the model's variables by name, in creation order, the way
// ParameterServerStrategy names them (a repeated name gets the first free of "_1", "_2", ...;
// variables are stored whole; older files with "<name>/part_<i>" shards are concatenated back).
//
// Thread-safety: one thread runs run(); `stop` may be set from any thread. For SIGTERM, point it at
// StopSignals::flag() (dtrain/core/stop_signals.h), not at a flag a signal handler sets: a handler
// interrupting oneDNN's GEMM kernels corrupts the heap.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/core/checkpoint.h"
#include "dtrain/core/export.h"
#include "dtrain/data/dataset.h"
#include "dtrain/nn/layers.h"
#include "dtrain/train/fit.h"

namespace dtrain {

struct DTRAIN_API SidecarEvaluatorOptions {
  std::string checkpoint_dir;
  int64_t batch_size = 1000;
  std::chrono::milliseconds poll{std::chrono::milliseconds(250)};
  // Give up (DeadlineExceeded) when no new checkpoint appears for this long.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // When set, evaluate the newest checkpoint not yet evaluated and return.
  const std::atomic<bool>* stop = nullptr;
  std::FILE* out = stdout;  // one line per evaluation
  bool json = false;        // the lines as JSON objects
};

struct DTRAIN_API SidecarResult {
  int64_t step = 0;
  bool final = false;
  EvalResult eval;
};

class DTRAIN_API SidecarEvaluator {
 public:
  // The model must be built (its variables exist). Throws InvalidArgument otherwise.
  SidecarEvaluator(Model& model, Dataset test, SidecarEvaluatorOptions options);
  // Evaluates every new checkpoint until one marked final (the chief's last) or `stop`. Returns the
  // results in order. Throws DeadlineExceeded after `timeout` without a new checkpoint, NotFound
  // when a checkpoint lacks one of the model's variables, InvalidArgument on a shape mismatch.
  std::vector<SidecarResult> run();
  // Loads `data` into the model's variables (the matching rules above).
  static void load_into(Model& model, const CheckpointData& data);

 private:
  Model& model_;
  Dataset test_;
  SidecarEvaluatorOptions o_;
};

}  // namespace dtrain
