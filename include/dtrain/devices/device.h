// Device: one place where tensors live and kernels run — a logical CPU device (a worker thread
// plus a oneDNN engine/stream and its own intra-op thread count) or a CUDA GPU (a worker thread, a
// stream, cuBLAS and cuDNN handles). Like TF's logical devices, the CPU can be split into N devices
// so that multi-replica strategies run on any machine.
//
// Thread-safety: all methods are thread-safe. Work submitted with submit() runs in FIFO order on
// the device's own thread; ops called directly run on the calling thread with the device's kernels.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/device_spec.h"
#include "dtrain/core/export.h"
#include "dtrain/devices/kernels.h"

namespace dtrain {

class DTRAIN_API Device {
 public:
  virtual ~Device() = default;
  virtual DeviceSpec spec() const = 0;
  // e.g. "CPU:0 (oneDNN avx512_core, 2 threads)" or "GPU:0 (NVIDIA H100, sm_90)".
  virtual std::string description() const = 0;
  virtual Kernels& kernels() = 0;
  // Runs fn on the device's worker thread (which has the device's thread count and CUDA context
  // set). The future rethrows whatever fn threw.
  virtual std::future<void> submit(std::function<void()> fn) = 0;
  // Blocks until all kernels issued to this device have finished (stream sync on CUDA).
  virtual void synchronize() = 0;
};

struct DTRAIN_API DeviceConfig {
  int num_cpu_devices = 1;         // logical CPU devices
  int threads_per_cpu_device = 0;  // 0 = hardware threads / num_cpu_devices (at least 1)
};

// Sets the logical CPU device layout. Must be called before the first get_device(); throws
// FailedPrecondition afterwards.
DTRAIN_API void configure_devices(const DeviceConfig& config);
// The device for `spec`. Throws NotFound naming the devices that exist.
DTRAIN_API Device& get_device(DeviceSpec spec);
// The CPU devices configured and the CUDA GPUs visible (CUDA_VISIBLE_DEVICES honoured).
DTRAIN_API std::vector<DeviceSpec> list_devices(DeviceType type);
// Parses a --devices flag: "cpu", "cpu:N" (N logical CPU devices), "gpu" (all GPUs), "gpu:0,2",
// "gpu:local" (one GPU per process: LOCAL_RANK mod the visible GPUs; LOCAL_RANK comes from
// dtrain-run or torchrun, else OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID, else 0), or "auto"
// (all GPUs, else the CPU). Configures logical CPU devices as a side effect. Throws
// InvalidArgument with the accepted forms.
DTRAIN_API std::vector<DeviceSpec> parse_devices_flag(const std::string& flag,
                                                      int threads_per_cpu_device = 0);
// Kernels for the device a tensor lives on.
inline Kernels& kernels_for(const Tensor& t) { return get_device(t.device()).kernels(); }

// Implemented by src/devices/cuda when CUDA is compiled in, else by a stub returning 0 / throwing.
DTRAIN_API int cuda_device_count();
DTRAIN_API std::unique_ptr<Device> make_cuda_device(int index);
// pin: bind the device's thread to cores [index*threads, (index+1)*threads) (used when one process
// splits the CPU into several logical devices; never for a lone device, which may share the
// machine with other worker processes).
DTRAIN_API std::unique_ptr<Device> make_cpu_device(int index, int threads, bool pin);

}  // namespace dtrain
