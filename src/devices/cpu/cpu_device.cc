// A logical CPU device: its own worker thread with its own OpenMP thread count, and its own
// oneDNN primitive cache.
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <cstdlib>
#include <thread>

#include <oneapi/dnnl/dnnl.hpp>

#include "devices/cpu/cpu_kernels.h"
#include "devices/worker_thread.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

// Logical device i with t threads runs on cores [i*t, (i+1)*t) when the machine has that many, so
// replicas do not migrate across each other's cores. Skipped when DTRAIN_NO_PIN is set.
void pin_to_cores(int index, int threads) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (std::getenv("DTRAIN_NO_PIN") || (index + 1) * threads > cores || threads >= cores) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c = index * threads; c < (index + 1) * threads; ++c) CPU_SET(c, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

class CpuDevice final : public Device {
 public:
  CpuDevice(int index, int threads, bool pin)
      : spec_(DeviceSpec::cpu(index)),
        threads_(threads),
        kernels_(spec_),
        worker_([index, threads, pin] {
          omp_set_num_threads(threads);
          if (pin) pin_to_cores(index, threads);
        }) {}

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

std::unique_ptr<Device> make_cpu_device(int index, int threads, bool pin) {
  return std::make_unique<CpuDevice>(index, threads, pin);
}

}  // namespace dtrain
