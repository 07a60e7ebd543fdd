// Image augmentation for input pipelines, on the CPU batches a Dataset yields (float32 NHWC). The
// random draws are a function of (seed, epoch, step, image in the batch) only, so a job resumed
// mid-epoch augments each batch exactly as the uninterrupted run did; use them from
// FitOptions::augment, which runs on a pool of input-pipeline threads while earlier steps train
// (tf.data's map(num_parallel_calls) + prefetch).
#pragma once

#include <cstdint>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain::augment {

// He et al. 2015's CIFAR augmentation: each image padded with `pad` zeros on every side, a random
// window of the original size cropped from it, and flipped left to right with probability 1/2.
// Returns a new tensor. Throws InvalidArgument for a tensor that is not float32 [N, H, W, C] on
// the CPU, or pad < 0.
DTRAIN_API Tensor random_crop_flip(const Tensor& images, int pad, uint64_t seed, uint64_t epoch,
                                   uint64_t step);

}  // namespace dtrain::augment
