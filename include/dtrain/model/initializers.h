// Seeded weight initializers (Keras names and formulas). Each call to a factory draws a fresh
// Philox stream from the global seed sequence (set_global_seed / --seed), so a model's initial
// weights depend only on the seed and the order layers create weights, not on threads or devices.
#pragma once

#include <string>

#include "dtrain/core/export.h"
#include "dtrain/model/variable.h"

namespace dtrain::initializers {

DTRAIN_API Initializer zeros();
DTRAIN_API Initializer ones();
DTRAIN_API Initializer constant(float value);
// U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out)) (Keras default for Dense and Conv2D).
DTRAIN_API Initializer glorot_uniform();
// Truncated normal (|z| <= 2), stddev sqrt(2 / fan_in) / 0.87962566 (Keras he_normal).
DTRAIN_API Initializer he_normal();
// keras.initializers.VarianceScaling: variance scale / n, n the kernel's fan_in, fan_out or their
// mean (mode "fan_in", "fan_out", "fan_avg"); distribution "truncated_normal" (|z| <= 2, stddev
// divided by 0.87962566 as Keras does), "untruncated_normal" or "uniform" (limit sqrt(3 scale /
// n)). variance_scaling(2, "fan_out", "untruncated_normal") is torch.nn.init.kaiming_normal_(mode=
// "fan_out", nonlinearity="relu"), torchvision's ResNet convolutions. Throws InvalidArgument for
// another mode or distribution, or scale <= 0.
DTRAIN_API Initializer variance_scaling(double scale, const std::string& mode,
                                        const std::string& distribution);
DTRAIN_API Initializer random_uniform(float low, float high);
DTRAIN_API Initializer random_normal(float mean, float stddev);

// fan_in / fan_out of a dense [in, out] or conv [kh, kw, in, out] kernel.
DTRAIN_API void compute_fans(const Shape& shape, double* fan_in, double* fan_out);

}  // namespace dtrain::initializers
