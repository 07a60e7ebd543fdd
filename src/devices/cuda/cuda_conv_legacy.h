// The legacy cuDNN path of CudaKernels' convolutions (cuda_conv_legacy.cc): cuDNN's per-direction
// calls with an algorithm chosen from cuDNN's ranking (deterministic ones first), for problems no
// graph-API execution plan accepts (cuda_conv_plan.h) and under DTRAIN_CUDNN_API=legacy. Private
// to src/devices/cuda.
#pragma once

#include <string>

#include "devices/cuda/cuda_context.h"
#include "devices/cuda/cuda_conv_plan.h"

namespace dtrain::cuda {

// Runs direction d of problem p on device pointers (a, b) -> out: forward x, w -> y; backward data
// w, dy -> dx; backward filter x, dy -> dw (filters KRSC). Uses the cached choice `cached` (-1:
// none) first, else the first of cuDNN's ranked candidates that accepts the problem: with FP32 FMA
// math, falling back with a warning to cuDNN's default math; with tensor_cores, the default math at
// once, passing over Winograd and FFT. Returns the choice to cache. Throws Unimplemented, naming
// `problem`, when no algorithm accepts it. `op` names the calling kernel in descriptor errors.
int legacy_convolve(CudaContext& ctx, ConvDirection d, const ConvPlanProblem& p, int cached,
                    bool tensor_cores, const void* a, const void* b, void* out, const char* op,
                    const std::string& problem);

}  // namespace dtrain::cuda
