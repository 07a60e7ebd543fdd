// A logical CPU device: its own worker thread with its own OpenMP thread count, and its own
// oneDNN primitive cache.
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <thread>
#include <vector>

#include "devices/cpu/cpu_kernels.h"
#include "devices/cpu/dnnl_util.h"
#include "devices/worker_thread.h"
#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

// Logical device i with t threads runs on the i-th t cores of those this process may use (its
// affinity mask, which a launcher may have narrowed), when there are that many, so replicas do not
// migrate across each other's cores. Skipped when DTRAIN_NO_PIN is set.
void pin_to_cores(int index, int threads) {
  cpu_set_t allowed;
  if (std::getenv("DTRAIN_NO_PIN") || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  const int n = static_cast<int>(cores.size());
  if ((index + 1) * threads > n || threads >= n) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int i = index * threads; i < (index + 1) * threads; ++i)
    CPU_SET(cores[static_cast<size_t>(i)], &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

class CpuDevice final : public Device {
 public:
  CpuDevice(int index, int threads, bool pin)
      : spec_(DeviceSpec::cpu(index)),
        threads_(threads),
        kernels_(spec_, threads),
        worker_([index, threads, pin] {
          omp_set_num_threads(threads);
          if (pin) pin_to_cores(index, threads);
          timeline::set_thread_name("CPU:" + std::to_string(index) + " device");
        }) {}

  DeviceSpec spec() const override { return spec_; }
  std::string description() const override {
    const dnnl_version_t* v = dnnl_version();
    return spec_.to_string() + " (oneDNN " + std::to_string(v->major) + "." +
           std::to_string(v->minor) + ", " + std::to_string(threads_) + " thread" +
           (threads_ == 1 ? "" : "s") +
           (!cpu::mixed_bf16()           ? ""
            : cpu::bf16_kernels_native() ? ", mixed_bfloat16 on oneDNN's bfloat16 kernels"
                                         : ", mixed_bfloat16 emulated: " + emulation_reason() +
                                               ", so float32 kernels run on inputs rounded to "
                                               "bfloat16") +
           ")";
  }
  Kernels& kernels() override { return kernels_; }
  static std::string emulation_reason() {
    const std::string& why = cpu::bf16_kernel_choice().why;
    return why.empty() ? "oneDNN's bfloat16 kernels set aside by a test" : why;
  }
  std::future<void> submit(std::function<void()> fn) override {
    return worker_.submit(std::move(fn));
  }
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
