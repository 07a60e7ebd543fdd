#include "dtrain/train/run_task.h"

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain {

const char* task_role_name(TaskRole role) {
  switch (role) {
    case TaskRole::kTrainer:
      return "trainer";
    case TaskRole::kParameterServer:
      return "parameter server";
    case TaskRole::kEvaluator:
      return "evaluator";
  }
  return "?";
}

TaskRole run_task(const std::string& strategy_name, const StrategyOptions& given,
                  const TaskFunctions& functions) {
  StrategyOptions options = apply_environment(given);
  // The role is decided here, once. A single-process strategy in a broken job environment still
  // runs (it needs no cluster), and says so in one line.
  if (!options.cluster) {
    const bool mpi =
        options.communication.implementation == CommunicationOptions::Implementation::kMpi;
    if (strategy_name == "multi_worker_mirrored" || strategy_name == "parameter_server") {
      options.cluster = resolve_cluster(mpi);
    } else {
      try {
        options.cluster = resolve_cluster(mpi);
      } catch (const Error& e) {
        DTRAIN_LOG(WARNING) << "ignoring the job environment for --strategy=" << strategy_name
                            << ", which runs in one process: " << e.what();
      }
    }
  }
  const std::optional<ClusterResolution>& cluster = options.cluster;
  if (cluster && cluster->task_type() == TaskType::kPs) {
    if (strategy_name != "parameter_server")
      throw FailedPrecondition(
          "this process is task " + cluster->task_name() + " but --strategy=" + strategy_name +
          " has no parameter servers; use --strategy=parameter_server, or remove the ps job "
          "from the cluster");
    // The same binary started as a ps task serves variables until told to stop (TF's
    // tf.distribute.Server(...).join()).
    serve_parameter_server(*cluster, options.job_token);
    return TaskRole::kParameterServer;
  }
  if (cluster && cluster->task_type() == TaskType::kEvaluator) {
    if (!functions.evaluate)
      throw FailedPrecondition(
          "this process is task " + cluster->task_name() +
          ", and the program gave run_task() no "
          "evaluate function; set TaskFunctions::evaluate or leave the evaluator out of the job");
    functions.evaluate(TaskInfo{cluster, options.parameter_server.checkpoint_dir});
    return TaskRole::kEvaluator;
  }
  if (!functions.train) throw InvalidArgument("run_task(): TaskFunctions::train is empty");
  std::unique_ptr<Strategy> strategy = make_strategy(strategy_name, options);
  functions.train(*strategy);
  return TaskRole::kTrainer;
}

}  // namespace dtrain
