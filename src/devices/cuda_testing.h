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

// While on, a convolution under mixed_bfloat16 whose output is float32 (the input and filter
// gradients, a forward convolution without a bias that hands nothing on) is not tried on a cuDNN
// plan with bfloat16 inputs and a float32 output, as on a cuDNN with no engine for those types: it
// runs with a bfloat16 output, widened after, where cuDNN has a plan for that (a forward
// convolution with a bias takes the TF32 path instead).
void refuse_float32_outputs_of_bfloat16_convs(bool on);
// How many convolutions in this process have run with a bfloat16 output widened to float32 after
// (cuDNN had no plan with a float32 output, or the hook above refused it).
int64_t conv_outputs_widened_from_bfloat16();
// How many convolutions in this process have run on a cuDNN plan for bfloat16 inputs (whatever
// their output), rather than on the TF32 path or cuBLAS: that the plans run at all.
int64_t conv_bfloat16_plan_runs();

}  // namespace dtrain::cuda_testing
