// Element types a Tensor can hold. float16/bfloat16 are storage types: kernels compute in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtrain/core/export.h"

namespace dtrain {

enum class DType : uint8_t { kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64 };

// Bytes per element.
DTRAIN_API size_t dtype_size(DType t);
// "float32", "bfloat16", ...
DTRAIN_API const char* dtype_name(DType t);
// Inverse of dtype_name; throws InvalidArgument listing the valid names.
DTRAIN_API DType dtype_from_name(const std::string& name);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kFloat32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kFloat64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kInt32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::kInt64;
}

// Scalar conversions for the 16-bit storage types (round-to-nearest-even).
DTRAIN_API uint16_t float_to_bf16(float f);
DTRAIN_API float bf16_to_float(uint16_t h);
DTRAIN_API uint16_t float_to_f16(float f);
DTRAIN_API float f16_to_float(uint16_t h);
// The same over arrays, with the CPU's F16C instructions where it has them (8 at a time; the
// scalar functions above otherwise and for the tail). Same results, NaN payloads aside.
DTRAIN_API void floats_to_f16(const float* in, uint16_t* out, size_t n);
DTRAIN_API void f16_to_floats(const uint16_t* in, float* out, size_t n);
// bfloat16 likewise, 16 at a time with AVX-512 where the CPU has it, else 8 with AVX2 (the same
// results, NaNs included: every NaN becomes 0x7fc0, as float_to_bf16).
DTRAIN_API void floats_to_bf16(const float* in, uint16_t* out, size_t n);
DTRAIN_API void bf16_to_floats(const uint16_t* in, float* out, size_t n);

}  // namespace dtrain
