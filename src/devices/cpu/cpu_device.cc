// A logical CPU device: its own worker thread with its own OpenMP thread count, and its own
// oneDNN primitive cache.
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include "devices/cpu/cpu_kernels.h"
#include "devices/worker_thread.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

class CpuDevice final : public Device {
 public:
  CpuDevice(int index, int threads)
      : spec_(DeviceSpec::cpu(index)),
        threads_(threads),
        kernels_(spec_),
        worker_([threads] { omp_set_num_threads(threads); }) {}

  DeviceSpec spec() const override { return spec_; }
  std::string description() const override {
    const dnnl_version_t* v = dnnl_version();
    return spec_.to_string() + " (oneDNN " + std::to_string(v->major) + "." +
           std::to_string(v->minor) + ", " + std::to_string(threads_) + " thread" +
           (threads_ == 1 ? "" : "s") + ")";
  }
  Kernels& kernels() override { return kernels_; }
  std::future<void> submit(std::function<void()> fn) override { return worker_.submit(std::move(fn)); }
  void synchronize() override {}  // CPU kernels complete before they return

 private:
  DeviceSpec spec_;
  int threads_;
  cpu::CpuKernels kernels_;
  WorkerThread worker_;
};

}  // namespace

std::unique_ptr<Device> make_cpu_device(int index, int threads) {
  return std::make_unique<CpuDevice>(index, threads);
}

}  // namespace dtrain
