// Maps the --strategy flag to an implementation, with every setting as data (StrategyOptions).
//
// Environment variables are read in one place, apply_environment(), which make_strategy() calls
// once; a program that builds strategies itself passes the same settings as options:
//   DTRAIN_COLLECTIVE            communication.implementation: ring | nccl | mpi
//   DTRAIN_SHARDING              mirrored.sharding: none | optimizer_state | gradients (0, 1, 2)
//   DTRAIN_RENDEZVOUS_TIMEOUT    communication.connect_timeout, in seconds
//   DTRAIN_CHECKPOINT_DIR        parameter_server.checkpoint_dir (and the evaluator's directory)
//   DTRAIN_JOB_TOKEN             job_token
//   TF_CONFIG, SLURM_*, OMPI_*   cluster (resolve_cluster())
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/export.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/strategies/parameter_server_strategy.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

struct DTRAIN_API StrategyOptions {
  // Replica devices, from parse_devices_flag(); empty = CPU:0.
  std::vector<DeviceSpec> devices;
  // mirrored / central_storage: cross-device ops, pack size, overlap, timeout (devices ignored).
  MirroredOptions mirrored;
  // multi_worker_mirrored: the cross-worker collective (ring, nccl, mpi) and its timeouts.
  CommunicationOptions communication;
  // parameter_server: partitioner, staleness bound, checkpoints, timeouts.
  ParameterServerOptions parameter_server;
  // Multi-process strategies: this task in its job (nullopt = resolve_cluster()), and the job's
  // shared secret ("" = DTRAIN_JOB_TOKEN when the strategy connects).
  std::optional<ClusterResolution> cluster;
  std::string job_token;
  // Set by apply_environment(): the environment has been read into these options (it is read once).
  bool environment_applied = false;
};

// Returns `options` with the environment's DTRAIN_* settings (the list above) applied; the cluster
// is resolved by make_strategy / run_task, for the strategies that need one. Throws InvalidArgument
// naming a malformed variable and its valid values.
DTRAIN_API StrategyOptions apply_environment(StrategyOptions options);

// The --strategy values this build accepts, e.g. {"default", "one_device"}.
DTRAIN_API std::vector<std::string> strategy_names();
// Builds the strategy `name` from apply_environment(options). Throws InvalidArgument naming the
// valid values for an unknown name, and for a device list the strategy cannot use (e.g. one_device
// with two devices); FailedPrecondition when this process is a ps or evaluator task, which do not
// train (run them through run_task(), or serve_parameter_server() for ps); and what the strategy's
// constructor throws. Never exits the process.
DTRAIN_API std::unique_ptr<Strategy> make_strategy(const std::string& name,
                                                   const StrategyOptions& options);

}  // namespace dtrain
