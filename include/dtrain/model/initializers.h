// Seeded weight initializers (Keras names and formulas). Each call to a factory draws a fresh
// Philox stream from the global seed sequence (set_global_seed / --seed), so a model's initial
// weights depend only on the seed and the order layers create weights, not on threads or devices.
#pragma once

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
DTRAIN_API Initializer random_uniform(float low, float high);
DTRAIN_API Initializer random_normal(float mean, float stddev);

// fan_in / fan_out of a dense [in, out] or conv [kh, kw, in, out] kernel.
DTRAIN_API void compute_fans(const Shape& shape, double* fan_in, double* fan_out);

}  // namespace dtrain::initializers
