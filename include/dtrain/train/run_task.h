// run_task: the one entry point that lets the same user binary run every task of a job, as TF's
// programs do. It resolves this process's role once (TF_CONFIG, SLURM, OpenMPI or a single process,
// see make_strategy.h for the settings) and runs it:
//   ps task         serves variables (serve_parameter_server) until SIGTERM/SIGINT, then returns;
//   evaluator task  calls functions.evaluate (TF's sidecar evaluation of the chief's checkpoints);
//   chief, worker, or a single process
//                   builds the strategy `strategy_name` and calls functions.train with it.
// The role comes back as a value; nothing here exits the process.
//
//   dtrain::TaskFunctions f;
//   f.train = [&](dtrain::Strategy& s) { ... build the model in s.scope(), fit ... };
//   f.evaluate = [&](const dtrain::TaskInfo& t) { ... SidecarEvaluator over t.checkpoint_dir ... };
//   dtrain::run_task(flag_strategy, options, f);
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/export.h"
#include "dtrain/strategies/make_strategy.h"

namespace dtrain {

// What a task's function is told about it.
struct DTRAIN_API TaskInfo {
  std::optional<ClusterResolution> cluster;  // nullopt: a single-process job
  std::string checkpoint_dir;  // the job's checkpoint directory (options or DTRAIN_CHECKPOINT_DIR)
};

struct DTRAIN_API TaskFunctions {
  // The chief and the workers (and a single process): train with the strategy.
  std::function<void(Strategy& strategy)> train;
  // An evaluator task. Empty: an evaluator task fails with FailedPrecondition saying so.
  std::function<void(const TaskInfo& task)> evaluate;
};

// What this process was in its job.
enum class TaskRole { kTrainer, kParameterServer, kEvaluator };
DTRAIN_API const char* task_role_name(TaskRole role);

// Runs this process's task (above) and returns its role. Throws what make_strategy, the task's
// function or serve_parameter_server throws; FailedPrecondition for an evaluator without an
// evaluate function and for a task of a job the strategy has no role for (a ps task under
// multi_worker_mirrored).
DTRAIN_API TaskRole run_task(const std::string& strategy_name, const StrategyOptions& options,
                             const TaskFunctions& functions);

}  // namespace dtrain
