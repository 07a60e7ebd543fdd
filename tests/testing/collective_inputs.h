// Inputs for exact-result collective tests: rank r's element i is a small integer, distinct per
// rank and element, so every dtype (float16 and bfloat16 included) holds it and its sums exactly.
#pragma once

#include "dtrain/core/tensor.h"

namespace dtrain::testing {

inline double collective_value(int r, int64_t i) {
  return static_cast<double>((r + 1) * 3 + (i % 17));
}

inline Tensor collective_input(DType t, int64_t n, int r) {
  Tensor x = Tensor::empty(Shape{n}, t);
  for (int64_t i = 0; i < n; ++i) {
    const double d = collective_value(r, i);
    switch (t) {
      case DType::kFloat32:
        x.data<float>()[i] = static_cast<float>(d);
        break;
      case DType::kFloat64:
        x.data<double>()[i] = d;
        break;
      case DType::kInt32:
        x.data<int32_t>()[i] = static_cast<int32_t>(d);
        break;
      case DType::kInt64:
        x.data<int64_t>()[i] = static_cast<int64_t>(d);
        break;
      case DType::kFloat16:
        static_cast<uint16_t*>(x.raw_data())[i] = float_to_f16(static_cast<float>(d));
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(x.raw_data())[i] = float_to_bf16(static_cast<float>(d));
        break;
    }
  }
  return x;
}

}  // namespace dtrain::testing
