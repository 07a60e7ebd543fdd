// The process-wide device registry: logical CPU devices as configured, GPUs as discovered.
#include "dtrain/devices/device.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "core/usable_cores.h"
#include "dtrain/core/logging.h"
#include "dtrain/core/strings.h"

namespace dtrain {
namespace {

struct Registry {
  std::mutex mu;
  DeviceConfig config;
  bool frozen = false;      // set by configure_devices() or the first device creation
  bool configured = false;  // configure_devices() has been called (not only defaults used)
  std::vector<std::unique_ptr<Device>> cpus;
  std::vector<std::unique_ptr<Device>> gpus;
  bool gpus_probed = false;
  int gpu_count = 0;
};

Registry& registry() {
  static auto* r = new Registry();  // leaked: devices outlive static tensors
  return *r;
}

// The threads this process's CPU devices share by default: the cores it may run on (its affinity
// mask: a launcher such as dtrain-run or taskset may have given it a share of the machine), or
// OMP_NUM_THREADS when the user set fewer.
int hardware_threads() {
  int cores = detail::usable_cores();
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(omp);
    if (n > 0 && n < cores) cores = n;
  }
  return cores;
}

int threads_per_cpu(const DeviceConfig& c) {
  if (c.threads_per_cpu_device > 0) return c.threads_per_cpu_device;
  return std::max(1, hardware_threads() / std::max(1, c.num_cpu_devices));
}

void create_cpus_locked(Registry& r) {
  if (!r.cpus.empty()) return;
  r.frozen = true;
  const int threads = threads_per_cpu(r.config);
  const bool pin = r.config.num_cpu_devices > 1;
  for (int i = 0; i < r.config.num_cpu_devices; ++i)
    r.cpus.push_back(make_cpu_device(i, threads, pin));
  DTRAIN_LOG(INFO) << r.config.num_cpu_devices << " logical CPU device(s), " << threads
                   << " thread(s) each";
}

int gpu_count_locked(Registry& r) {
  if (!r.gpus_probed) {
    r.gpus_probed = true;
    r.gpu_count = cuda_device_count();
    r.gpus.resize(static_cast<size_t>(r.gpu_count));
  }
  return r.gpu_count;
}

}  // namespace

void configure_devices(const DeviceConfig& config) {
  if (config.num_cpu_devices < 1)
    throw InvalidArgument("num_cpu_devices must be >= 1, got " +
                          std::to_string(config.num_cpu_devices));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.frozen) {
    if (config.num_cpu_devices == r.config.num_cpu_devices &&
        threads_per_cpu(config) == threads_per_cpu(r.config))
      return;
    const std::string have = std::to_string(r.config.num_cpu_devices) +
                             " logical CPU device(s) with " +
                             std::to_string(threads_per_cpu(r.config)) + " thread(s) each";
    const std::string want = std::to_string(config.num_cpu_devices) + " with " +
                             std::to_string(threads_per_cpu(config)) + " thread(s) each";
    if (r.configured)
      throw FailedPrecondition(
          "the device layout was already configured in this process (" + have +
          ") and cannot change to " + want +
          ": the layout is set once per process; call "
          "configure_devices() (or parse_devices_flag / --devices) once and reuse its devices");
    throw FailedPrecondition("devices are already in use with the default layout (" + have +
                             "), so it cannot "
                             "change to " +
                             want +
                             ": call configure_devices() (or pass --devices) before "
                             "creating any tensor or strategy");
  }
  r.config = config;
  r.configured = true;
  r.frozen = true;  // tensors may already name these devices: the layout is fixed from here on
}

Device& get_device(DeviceSpec spec) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (spec.type == DeviceType::kCPU) {
    create_cpus_locked(r);
    if (spec.index < 0 || spec.index >= static_cast<int>(r.cpus.size()))
      throw NotFound(spec.to_string() + " does not exist: " + std::to_string(r.cpus.size()) +
                     " logical CPU device(s) are configured; use --devices=cpu:N to make N");
    return *r.cpus[static_cast<size_t>(spec.index)];
  }
  const int n = gpu_count_locked(r);
  if (spec.index < 0 || spec.index >= n)
    throw NotFound(spec.to_string() + " does not exist: " + std::to_string(n) +
                   " CUDA GPU(s) are visible (CUDA_VISIBLE_DEVICES is honoured); use --devices=cpu "
                   "or a valid GPU index");
  auto& slot = r.gpus[static_cast<size_t>(spec.index)];
  if (!slot) slot = make_cuda_device(spec.index);
  return *slot;
}

std::vector<DeviceSpec> list_devices(DeviceType type) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<DeviceSpec> out;
  if (type == DeviceType::kCPU) {
    for (int i = 0; i < r.config.num_cpu_devices; ++i) out.push_back(DeviceSpec::cpu(i));
  } else {
    for (int i = 0; i < gpu_count_locked(r); ++i) out.push_back(DeviceSpec::gpu(i));
  }
  return out;
}

std::vector<DeviceSpec> parse_devices_flag(const std::string& flag, int threads) {
  const std::string usage =
      "; accepted: --devices=cpu, --devices=cpu:N (N logical CPU devices), --devices=gpu (all "
      "GPUs), --devices=gpu:0,1, --devices=gpu:local (the GPU of this process's local rank), "
      "--devices=auto";
  std::string f = flag;
  std::transform(f.begin(), f.end(), f.begin(), [](unsigned char c) { return std::tolower(c); });
  if (f == "auto") {
    const int n = cuda_device_count();
    if (n > 0) return parse_devices_flag("gpu", threads);
    return parse_devices_flag("cpu", threads);
  }
  auto parse_int = [&](const std::string& s) {
    if (s.empty() || !std::all_of(s.begin(), s.end(), ::isdigit))
      throw InvalidArgument("bad --devices value '" + flag + "'" + usage);
    return std::stoi(s);
  };
  if (f == "cpu" || f.rfind("cpu:", 0) == 0) {
    const int n = f == "cpu" ? 1 : parse_int(f.substr(4));
    if (n < 1) throw InvalidArgument("--devices=cpu:N needs N >= 1, got '" + flag + "'" + usage);
    configure_devices({n, threads});
    std::vector<DeviceSpec> out;
    for (int i = 0; i < n; ++i) out.push_back(DeviceSpec::cpu(i));
    return out;
  }
  if (f == "gpu" || f.rfind("gpu:", 0) == 0) {
    const int visible = cuda_device_count();
    std::vector<DeviceSpec> out;
    if (f == "gpu:local") {
      // One GPU per process, by local rank (Horovod's pinning): the launcher's LOCAL_RANK
      // (dtrain-run, torchrun), OpenMPI's or SLURM's; 0 when started alone.
      int local = 0;
      for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
        if (const char* v = std::getenv(name); v && *v) {
          const std::string sv = v;
          if (!std::all_of(sv.begin(), sv.end(), ::isdigit))
            throw InvalidArgument(std::string("--devices=gpu:local: ") + name + "='" + sv +
                                  "' is not a local rank");
          local = std::stoi(sv);
          break;
        }
      if (visible == 0)
        throw Unavailable(
            "--devices=gpu:local asks for this process's GPU (local rank " + std::to_string(local) +
            ") but none is visible (no CUDA device or no CUDA in this build); use --devices=cpu");
      out.push_back(DeviceSpec::gpu(local % visible));
      configure_devices({1, threads});
      return out;
    }
    if (f == "gpu") {
      for (int i = 0; i < visible; ++i) out.push_back(DeviceSpec::gpu(i));
    } else {
      for (const std::string_view index : split_list(std::string_view(f).substr(4)))
        out.push_back(DeviceSpec::gpu(parse_int(std::string(index))));
    }
    if (out.empty())
      throw Unavailable("--devices=" + flag + " asks for GPUs but none is visible (" +
                        std::string(visible == 0 ? "no CUDA device or no CUDA in this build" : "") +
                        "); use --devices=cpu or --devices=cpu:N");
    for (const auto& d : out)
      if (d.index >= visible)
        throw NotFound(d.to_string() + " requested but only " + std::to_string(visible) +
                       " GPU(s) are visible" + usage);
    configure_devices({1, threads});
    return out;
  }
  throw InvalidArgument("bad --devices value '" + flag + "'" + usage);
}

}  // namespace dtrain
