#include "dtrain/strategies/make_strategy.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "dtrain/core/logging.h"
#include "dtrain/strategies/ensemble_strategy.h"
#include "dtrain/strategies/one_device_strategy.h"
#include "strategies/default_strategy.h"

namespace dtrain {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

}  // namespace

StrategyOptions apply_environment(StrategyOptions o) {
  using Impl = CommunicationOptions::Implementation;
  if (o.environment_applied) return o;
  o.environment_applied = true;
  if (const char* v = env("DTRAIN_COLLECTIVE")) {
    const std::string s = v;
    if (s == "mpi")
      o.communication.implementation = Impl::kMpi;
    else if (s == "nccl")
      o.communication.implementation = Impl::kNccl;
    else if (s == "ring")
      o.communication.implementation = Impl::kRing;
    else
      throw InvalidArgument("DTRAIN_COLLECTIVE='" + s +
                            "': valid values are ring (TCP), nccl (GPUs; the default "
                            "for GPU devices) and mpi (OpenMPI, when launched by mpirun)");
  }
  if (const char* v = env("DTRAIN_COMPRESSION")) {
    try {
      o.communication.compression = parse_compression(v);
    } catch (const InvalidArgument&) {
      throw InvalidArgument(
          std::string("DTRAIN_COMPRESSION='") + v +
          "': valid values are none, fp16 and bf16 (cross-worker gradient compression)");
    }
  }
  if (const char* v = env("DTRAIN_BYTES_PER_PACK");
      v && !o.mirrored.bytes_per_pack && !o.communication.bytes_per_pack) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long bytes = std::strtoull(v, &end, 10);
    if (!std::isdigit(static_cast<unsigned char>(v[0])) || *end != '\0' || errno == ERANGE)
      throw InvalidArgument(std::string("DTRAIN_BYTES_PER_PACK='") + v +
                            "': the gradient pack size in bytes (0: one pack; unset: chosen by "
                            "the number of workers)");
    o.mirrored.bytes_per_pack = static_cast<size_t>(bytes);
  }
  if (const char* v = env("DTRAIN_SHARDING")) {
    try {
      o.mirrored.sharding = parse_sharding(v);
    } catch (const InvalidArgument&) {
      throw InvalidArgument(std::string("DTRAIN_SHARDING='") + v +
                            "': valid values are none (0), optimizer_state (1: ZeRO-1) and "
                            "gradients (2: ZeRO-2)");
    }
  }
  if (const char* v = env("DTRAIN_RENDEZVOUS_TIMEOUT")) {  // seconds
    char* end = nullptr;
    const long secs = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || secs < 1)
      throw InvalidArgument(std::string("DTRAIN_RENDEZVOUS_TIMEOUT='") + v +
                            "' must be a positive number of seconds");
    o.communication.connect_timeout = std::chrono::seconds(secs);
  }
  if (const char* v = env("DTRAIN_CHECKPOINT_DIR")) o.parameter_server.checkpoint_dir = v;
  if (o.job_token.empty())
    if (const char* v = env("DTRAIN_JOB_TOKEN")) o.job_token = v;
  return o;
}

std::vector<std::string> strategy_names() {
  return {"default",          "one_device", "mirrored", "central_storage", "multi_worker_mirrored",
          "parameter_server", "ensemble"};
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, const StrategyOptions& given) {
  const std::vector<std::string> names = strategy_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string valid;
    for (const auto& n : names) valid += (valid.empty() ? "" : ", ") + n;
    throw InvalidArgument("unknown --strategy '" + name + "'; valid values: " + valid);
  }
  StrategyOptions options = apply_environment(given);
  // Only the multi-process strategies need this task's place in a job: a single-process strategy
  // does not read TF_CONFIG / SLURM / OpenMPI variables, so a job environment cannot break it.
  // (ensemble reads it below: its members span the workers of a job when there is one.)
  const bool multi_process = name == "multi_worker_mirrored" || name == "parameter_server";
  if (multi_process && !options.cluster)
    options.cluster = resolve_cluster(options.communication.implementation ==
                                      CommunicationOptions::Implementation::kMpi);
  if (options.cluster && !options.cluster->is_training_worker())
    throw FailedPrecondition(
        "this process is task " + options.cluster->task_name() + " of its job (" +
        options.cluster->source() + "), which does not train, so make_strategy(\"" + name +
        "\") has nothing to build: start every task through dtrain::run_task(), which serves "
        "a ps task and runs an evaluator's evaluate function");
  const std::vector<DeviceSpec> devices =
      options.devices.empty() ? std::vector<DeviceSpec>{DeviceSpec::cpu(0)} : options.devices;
  if (name == "default") return std::make_unique<DefaultStrategy>();
  if (name == "one_device") {
    if (devices.size() != 1)
      throw InvalidArgument("--strategy=one_device uses exactly one device but --devices gave " +
                            std::to_string(devices.size()) +
                            "; pass --devices=cpu or --devices=gpu:0");
    return std::make_unique<OneDeviceStrategy>(devices[0]);
  }
  if (name == "mirrored" || name == "central_storage") {
    MirroredOptions m = options.mirrored;
    m.devices = options.devices;  // empty: all GPUs, else CPU:0
    if (name == "mirrored") return std::make_unique<MirroredStrategy>(m);
    return std::make_unique<CentralStorageStrategy>(m, DeviceSpec::cpu(0));
  }
  if (name == "ensemble") {
    // Under dtrain-run (a TF_CONFIG naming several training workers) the members span the workers.
    std::optional<ClusterResolution> c = options.cluster;
    if (!c)
      c = resolve_cluster(options.communication.implementation ==
                          CommunicationOptions::Implementation::kMpi);
    if (c && !c->is_training_worker())
      throw FailedPrecondition(
          "this process is task " + c->task_name() + " of its job (" + c->source() +
          "), which does not train, so make_strategy(\"ensemble\") has nothing to build: "
          "start every task through dtrain::run_task()");
    if (c && c->num_workers() > 1)
      return std::make_unique<EnsembleStrategy>(devices, std::move(*c), options.communication,
                                                options.job_token);
    return std::make_unique<EnsembleStrategy>(devices);
  }
  if (name == "multi_worker_mirrored") {
    MirroredOptions m = options.mirrored;
    m.devices = options.devices;
    CommunicationOptions c = options.communication;
    if (!c.bytes_per_pack) c.bytes_per_pack = m.bytes_per_pack;
    return std::make_unique<MultiWorkerMirroredStrategy>(m, c, options.cluster, options.job_token);
  }
  // parameter_server
  if (devices.size() != 1)
    throw InvalidArgument(
        "--strategy=parameter_server trains on one device per worker but --devices gave " +
        std::to_string(devices.size()) + "; pass --devices=cpu or --devices=gpu:0");
  return std::make_unique<ParameterServerStrategy>(options.parameter_server, devices[0],
                                                   options.cluster, options.job_token);
}

}  // namespace dtrain
