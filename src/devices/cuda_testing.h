// Hooks for the GPU tests (internal; tests linked INTERNAL): failures a test cannot bring about on
// purpose otherwise. Without CUDA they do nothing (cuda_stub.cc).
#pragma once

#include <cstdint>

namespace dtrain::cuda_testing {

// While on, the first run of each cuDNN graph-API plan reports CUDNN_STATUS_NOT_SUPPORTED instead
// of running, as a plan cuDNN finalized but will not run: the convolution must take its fallback.
void fail_first_conv_plan_runs(bool on);
// How many plans have failed at their first run in this process (injected or not), each then
// counted as no plan.
int64_t conv_plans_failed_at_first_run();

}  // namespace dtrain::cuda_testing
