// Built when CUDA is not compiled in: no GPUs, and asking for one says how to get them.
#include "devices/cuda_testing.h"
#include "dtrain/core/error.h"
#include "dtrain/devices/device.h"

namespace dtrain {

int cuda_device_count() { return 0; }

std::unique_ptr<Device> make_cuda_device(int index) {
  throw Unavailable("GPU:" + std::to_string(index) +
                    " requested but this dtrain build has no CUDA support; rebuild with "
                    "-DDTRAIN_WITH_CUDA=ON on a machine with the CUDA toolkit and cuDNN, or use "
                    "--devices=cpu");
}

}  // namespace dtrain

namespace dtrain::cuda_testing {
void fail_first_conv_plan_runs(bool) {}
int64_t conv_plans_failed_at_first_run() { return 0; }
void refuse_float32_outputs_of_bfloat16_convs(bool) {}
int64_t conv_outputs_widened_from_bfloat16() { return 0; }
int64_t conv_bfloat16_plan_runs() { return 0; }
}  // namespace dtrain::cuda_testing
