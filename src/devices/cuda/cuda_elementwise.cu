// Elementwise CUDA kernels: unary ops and activation gradients, broadcasting binary ops, affine,
// fill, dtype casts and the bias add (the layout helpers are in cuda_layout.cu). All use
// grid-stride loops, so launch shapes never depend on the tensor size.
#include <cstdint>
#include <cstring>

#include "devices/cuda/cuda_common.cuh"
#include "devices/cuda/cuda_half.cuh"
#include "devices/cuda/cuda_launch.h"
#include "dtrain/core/error.h"

namespace dtrain::cuda {
namespace {

// --- unary ---

template <UnaryOp kOp>
__device__ __forceinline__ float unary_fn(float x) {
  if constexpr (kOp == UnaryOp::kRelu)
    return x > 0.f ? x : 0.f;
  else if constexpr (kOp == UnaryOp::kTanh)
    return tanhf(x);
  else if constexpr (kOp == UnaryOp::kSigmoid)
    return 1.f / (1.f + expf(-x));
  else if constexpr (kOp == UnaryOp::kNeg)
    return -x;
  else if constexpr (kOp == UnaryOp::kExp)
    return expf(x);
  else if constexpr (kOp == UnaryOp::kLog)
    return logf(x);
  else if constexpr (kOp == UnaryOp::kSquare)
    return x * x;
  else if constexpr (kOp == UnaryOp::kSqrt)
    return sqrtf(x);
  // GELU as x * Phi(x) with Phi written without 1 + (something near -1): for x < -2, 1 + erf(x)
  // and 1 + tanh(u) cancel and lost ~1e-5 relative (found on an H100 against float64).
  else if constexpr (kOp == UnaryOp::kGeluErf)
    return 0.5f * x * erfcf(x * -0.70710678118654752f);
  else if constexpr (kOp == UnaryOp::kGeluTanh)  // 0.5 (1 + tanh u) = sigmoid(2u)
    return x / (1.f + expf(-1.5957691216057307f * (x + 0.044715f * x * x * x)));
  else
    return fabsf(x);  // kAbs
}

template <UnaryOp kOp, bool kVec>
__global__ void unary_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, n / 4) {
      float4 v = load4(x, 4 * q);
      v.x = unary_fn<kOp>(v.x);
      v.y = unary_fn<kOp>(v.y);
      v.z = unary_fn<kOp>(v.z);
      v.w = unary_fn<kOp>(v.w);
      store4(y, 4 * q, v);
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, n) { y[i] = unary_fn<kOp>(x[i]); }
  }
}

template <UnaryOp kOp>
void launch_unary_t(const float* x, float* y, int64_t n, cudaStream_t s) {
  if (vec4_ok(n, {x, y}))
    unary_kernel<kOp, true><<<grid_for(n / 4), kBlock, 0, s>>>(x, y, n);
  else
    unary_kernel<kOp, false><<<grid_for(n), kBlock, 0, s>>>(x, y, n);
  DTRAIN_CHECK_LAUNCH("unary_kernel");
}

// The gradient of activation kOp at v (x, or y for tanh and sigmoid) times d.
template <UnaryOp kOp>
__device__ __forceinline__ float activation_grad(float v, float d) {
  // ReLU: v is x (or y). The CPU's rule, oneDNN's: a NaN v passes d on, a NaN or infinite d at
  // v <= 0 gives NaN, a negative one -0 (gpu_training_kernels_test ReluGradOfSumIsAddThenReluGrad).
  if constexpr (kOp == UnaryOp::kRelu)
    return v <= 0.f ? 0.f * d : d;
  else if constexpr (kOp == UnaryOp::kTanh)
    return d * (1.f - v * v);                   // v is y
  else if constexpr (kOp == UnaryOp::kGeluErf)  // v is x: Phi(x) + x phi(x)
    return d * (0.5f * erfcf(v * -0.70710678118654752f) +
                v * 0.39894228040143268f * expf(-0.5f * v * v));
  else if constexpr (kOp == UnaryOp::kGeluTanh) {  // v is x; s = sigmoid(2u) = 0.5 (1 + tanh u)
    const float s = 1.f / (1.f + expf(-1.5957691216057307f * (v + 0.044715f * v * v * v)));
    // d/dx [x s] = s + x * 2 s (1 - s) * du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    return d *
           (s + 2.f * v * s * (1.f - s) * 0.79788456080286536f * (1.f + 3.f * 0.044715f * v * v));
  } else
    return d * v * (1.f - v);  // sigmoid, v is y
}

// TV: float, or uint16_t for a bfloat16 x or y (a copy kept under mixed_bfloat16).
template <UnaryOp kOp, bool kVec, typename TV>
__global__ void activation_backward_kernel(const TV* __restrict__ xy, const float* __restrict__ dy,
                                           float* __restrict__ dx, int64_t n) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, n / 4) {
      const float4 v = ld4(xy, 4 * q), d = load4(dy, 4 * q);
      store4(dx, 4 * q,
             make_float4(activation_grad<kOp>(v.x, d.x), activation_grad<kOp>(v.y, d.y),
                         activation_grad<kOp>(v.z, d.z), activation_grad<kOp>(v.w, d.w)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, n) { dx[i] = activation_grad<kOp>(ld(xy, i), dy[i]); }
  }
}

template <UnaryOp kOp>
void launch_activation_backward_t(const void* xy, DType xy_type, const float* dy, float* dx,
                                  int64_t n, cudaStream_t s) {
  const bool vec = vec4_ok(n, {xy, dy, dx});
  with_type(xy_type, [&](auto t) {
    using TV = decltype(t);
    const TV* v = static_cast<const TV*>(xy);
    if (vec)
      activation_backward_kernel<kOp, true, TV><<<grid_for(n / 4), kBlock, 0, s>>>(v, dy, dx, n);
    else
      activation_backward_kernel<kOp, false, TV><<<grid_for(n), kBlock, 0, s>>>(v, dy, dx, n);
  });
  DTRAIN_CHECK_LAUNCH("activation_backward_kernel");
}

// ReLU's gradient at y of dy = a + b (Kernels::relu_grad_of_sum): the sum in a register, never
// stored. activation_grad<kRelu>(y, a + b), the bits of launch_binary(kAdd) then
// launch_activation_backward(kRelu) (__fadd_rn: the sum rounded as the binary kernel rounds it).
template <bool kVec, typename TV>
__global__ void relu_grad_of_sum_kernel(const TV* __restrict__ y, const float* __restrict__ a,
                                        const float* __restrict__ b, float* __restrict__ dx,
                                        int64_t n) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, n / 4) {
      const float4 v = ld4(y, 4 * q), p = load4(a, 4 * q), r = load4(b, 4 * q);
      store4(dx, 4 * q,
             make_float4(activation_grad<UnaryOp::kRelu>(v.x, __fadd_rn(p.x, r.x)),
                         activation_grad<UnaryOp::kRelu>(v.y, __fadd_rn(p.y, r.y)),
                         activation_grad<UnaryOp::kRelu>(v.z, __fadd_rn(p.z, r.z)),
                         activation_grad<UnaryOp::kRelu>(v.w, __fadd_rn(p.w, r.w))));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, n) {
      dx[i] = activation_grad<UnaryOp::kRelu>(ld(y, i), __fadd_rn(a[i], b[i]));
    }
  }
}

// --- binary ---

template <BinaryOp kOp>
__device__ __forceinline__ float binary_fn(float a, float b) {
  if constexpr (kOp == BinaryOp::kAdd)
    return a + b;
  else if constexpr (kOp == BinaryOp::kSub)
    return a - b;
  else if constexpr (kOp == BinaryOp::kMul)
    return a * b;
  else if constexpr (kOp == BinaryOp::kDiv)
    return a / b;
  else if constexpr (kOp == BinaryOp::kMax)
    return a < b ? b : a;  // std::max
  else
    return b < a ? b : a;  // std::min
}

// F::apply(a[i], b[i]) for arrays of n elements each; kVec: 4 at a time.
template <typename F, bool kVec>
__global__ void same_shape_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                  float* __restrict__ out, int64_t n) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, n / 4) {
      const float4 u = load4(a, 4 * q), v = load4(b, 4 * q);
      store4(out, 4 * q,
             make_float4(F::apply(u.x, v.x), F::apply(u.y, v.y), F::apply(u.z, v.z),
                         F::apply(u.w, v.w)));
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, n) { out[i] = F::apply(a[i], b[i]); }
  }
}

template <typename F>
void launch_same_shape(const float* a, const float* b, float* out, int64_t n, cudaStream_t s,
                       const char* name) {
  if (vec4_ok(n, {a, b, out}))
    same_shape_kernel<F, true><<<grid_for(n / 4), kBlock, 0, s>>>(a, b, out, n);
  else
    same_shape_kernel<F, false><<<grid_for(n), kBlock, 0, s>>>(a, b, out, n);
  DTRAIN_CHECK_LAUNCH(name);
}

template <BinaryOp kOp>
struct BinaryFn {
  __device__ static float apply(float a, float b) { return binary_fn<kOp>(a, b); }
};

// A residual block's end: relu(a + b) with the sum never stored. On ResNet-50 at batch 32, 16
// blocks' outputs of 177 M floats a step, read and written once instead of twice.
struct AddReluFn {
  __device__ static float apply(float a, float b) {
    return unary_fn<UnaryOp::kRelu>(binary_fn<BinaryOp::kAdd>(a, b));
  }
};

// relu(a + b), and the same values rounded to bfloat16 into `rounded` in the same pass: the copy
// the backward pass and the next convolutions read under mixed_bfloat16.
template <bool kVec>
__global__ void add_relu_rounded_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                        float* __restrict__ out, uint16_t* __restrict__ rounded,
                                        int64_t n) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, n / 4) {
      const float4 u = load4(a, 4 * q), v = load4(b, 4 * q);
      const float4 y = make_float4(AddReluFn::apply(u.x, v.x), AddReluFn::apply(u.y, v.y),
                                   AddReluFn::apply(u.z, v.z), AddReluFn::apply(u.w, v.w));
      store4(out, 4 * q, y);
      st4(rounded, 4 * q, y);
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, n) {
      const float y = AddReluFn::apply(a[i], b[i]);
      out[i] = y;
      st(rounded, i, y);
    }
  }
}

template <BinaryOp kOp>
__global__ void binary_broadcast_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                        float* __restrict__ out, int64_t n, BroadcastGeometry g) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) {
    int64_t rest = i, ao = 0, bo = 0;
    for (int d = g.rank - 1; d >= 0; --d) {
      const int64_t coord = rest % g.out_dims[d];
      rest /= g.out_dims[d];
      ao += coord * g.a_strides[d];
      bo += coord * g.b_strides[d];
    }
    out[i] = binary_fn<kOp>(a[ao], b[bo]);
  }
}

template <BinaryOp kOp>
void launch_binary_t(const float* a, const float* b, float* out, int64_t n,
                     const BroadcastGeometry* g, cudaStream_t s) {
  if (g) {
    binary_broadcast_kernel<kOp><<<grid_for(n), kBlock, 0, s>>>(a, b, out, n, *g);
    DTRAIN_CHECK_LAUNCH("binary_broadcast_kernel");
  } else {
    launch_same_shape<BinaryFn<kOp>>(a, b, out, n, s, "binary same-shape kernel");
  }
}

// --- affine, fill, bias ---

__global__ void affine_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n,
                              float alpha, float beta) {
  // Unfused multiply-add, as the CPU computes it, so results are bit-identical.
  DTRAIN_GRID_STRIDE_LOOP(i, n) { y[i] = __fmul_rn(alpha, x[i]) + beta; }
}

template <typename T>
__global__ void fill_kernel(T* __restrict__ x, int64_t n, T value) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) { x[i] = value; }
}

template <bool kVec>  // kVec: cols is a multiple of 4 too, so a float4 never spans two rows
__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t n,
                                int64_t cols) {
  if constexpr (kVec) {
    DTRAIN_GRID_STRIDE_LOOP(q, n / 4) {
      float4 v = load4(y, 4 * q);
      const float4 b = load4(bias, (4 * q) % cols);
      v.x += b.x;
      v.y += b.y;
      v.z += b.z;
      v.w += b.w;
      store4(y, 4 * q, v);
    }
  } else {
    DTRAIN_GRID_STRIDE_LOOP(i, n) { y[i] += bias[i % cols]; }
  }
}

// --- casts ---

// Casts follow the CPU device pair by pair. It converts float32/float16/bfloat16/int32 among
// themselves with oneDNN reorders (float -> int32 rounds to nearest even and saturates) and
// everything involving float64 or int64 through a double with static_cast (truncation).
//
// Widen gives the value a source element is converted through: float for the 16-bit storage
// types (exact), double for int64 (the CPU's path), the element itself otherwise.
template <typename T>
struct Widen {
  __device__ static T get(T v) { return v; }
};
template <>
struct Widen<int64_t> {
  __device__ static double get(int64_t v) { return static_cast<double>(v); }
};
template <>
struct Widen<Half16> {
  __device__ static float get(Half16 v) { return half_bits_to_float(v.bits); }
};
template <>
struct Widen<BFloat16> {
  __device__ static float get(BFloat16 v) { return bf16_bits_to_float(v.bits); }
};

template <typename T>
struct Narrow {
  template <typename V>
  __device__ static T from(V v) {
    return static_cast<T>(v);
  }
};
template <>
struct Narrow<int32_t> {
  __device__ static int32_t from(float v) {  // from float32/float16/bfloat16: oneDNN's rule
    const float r = rintf(v);
    if (r >= 2147483648.f) return INT32_MAX;
    if (r <= -2147483648.f) return INT32_MIN;
    return static_cast<int32_t>(r);
  }
  template <typename V>
  __device__ static int32_t from(V v) {
    return static_cast<int32_t>(v);
  }
};
template <>
struct Narrow<Half16> {
  template <typename V>
  __device__ static Half16 from(V v) {
    return Half16{float_to_half_bits(static_cast<float>(v))};
  }
};
template <>
struct Narrow<BFloat16> {
  template <typename V>
  __device__ static BFloat16 from(V v) {
    return BFloat16{float_to_bf16_bits(static_cast<float>(v))};
  }
};

template <typename Src, typename Dst>
__global__ void cast_kernel(const Src* __restrict__ x, Dst* __restrict__ y, int64_t n) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) { y[i] = Narrow<Dst>::from(Widen<Src>::get(x[i])); }
}

template <typename Src, typename Dst>
void launch_cast_t(const void* x, void* y, int64_t n, cudaStream_t s) {
  cast_kernel<Src, Dst>
      <<<grid_for(n), kBlock, 0, s>>>(static_cast<const Src*>(x), static_cast<Dst*>(y), n);
  DTRAIN_CHECK_LAUNCH("cast_kernel");
}

template <typename Src>
void launch_cast_from(const void* x, DType to, void* y, int64_t n, cudaStream_t s) {
  switch (to) {
    case DType::kFloat32:
      return launch_cast_t<Src, float>(x, y, n, s);
    case DType::kFloat64:
      return launch_cast_t<Src, double>(x, y, n, s);
    case DType::kFloat16:
      return launch_cast_t<Src, Half16>(x, y, n, s);
    case DType::kBFloat16:
      return launch_cast_t<Src, BFloat16>(x, y, n, s);
    case DType::kInt32:
      return launch_cast_t<Src, int32_t>(x, y, n, s);
    case DType::kInt64:
      return launch_cast_t<Src, int64_t>(x, y, n, s);
  }
  throw InvalidArgument(detail::str_cat("cast to unknown dtype ", static_cast<int>(to)));
}

__global__ void round_to_bf16_kernel(const float* x, float* y, int64_t n) {
  DTRAIN_GRID_STRIDE_LOOP(i, n) { y[i] = bf16_bits_to_float(float_to_bf16_bits(x[i])); }
}

}  // namespace

void launch_unary(UnaryOp op, const float* x, float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  switch (op) {
    case UnaryOp::kRelu:
      return launch_unary_t<UnaryOp::kRelu>(x, y, n, s);
    case UnaryOp::kTanh:
      return launch_unary_t<UnaryOp::kTanh>(x, y, n, s);
    case UnaryOp::kSigmoid:
      return launch_unary_t<UnaryOp::kSigmoid>(x, y, n, s);
    case UnaryOp::kNeg:
      return launch_unary_t<UnaryOp::kNeg>(x, y, n, s);
    case UnaryOp::kExp:
      return launch_unary_t<UnaryOp::kExp>(x, y, n, s);
    case UnaryOp::kLog:
      return launch_unary_t<UnaryOp::kLog>(x, y, n, s);
    case UnaryOp::kSquare:
      return launch_unary_t<UnaryOp::kSquare>(x, y, n, s);
    case UnaryOp::kSqrt:
      return launch_unary_t<UnaryOp::kSqrt>(x, y, n, s);
    case UnaryOp::kAbs:
      return launch_unary_t<UnaryOp::kAbs>(x, y, n, s);
    case UnaryOp::kGeluErf:
      return launch_unary_t<UnaryOp::kGeluErf>(x, y, n, s);
    case UnaryOp::kGeluTanh:
      return launch_unary_t<UnaryOp::kGeluTanh>(x, y, n, s);
  }
  throw InvalidArgument(detail::str_cat("unary: unknown op ", static_cast<int>(op)));
}

void launch_activation_backward(UnaryOp op, const void* x_or_y, DType xy_type, const float* dy,
                                float* dx, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  switch (op) {
    case UnaryOp::kRelu:
      launch_activation_backward_t<UnaryOp::kRelu>(x_or_y, xy_type, dy, dx, n, s);
      break;
    case UnaryOp::kTanh:
      launch_activation_backward_t<UnaryOp::kTanh>(x_or_y, xy_type, dy, dx, n, s);
      break;
    case UnaryOp::kSigmoid:
      launch_activation_backward_t<UnaryOp::kSigmoid>(x_or_y, xy_type, dy, dx, n, s);
      break;
    case UnaryOp::kGeluErf:
      launch_activation_backward_t<UnaryOp::kGeluErf>(x_or_y, xy_type, dy, dx, n, s);
      break;
    case UnaryOp::kGeluTanh:
      launch_activation_backward_t<UnaryOp::kGeluTanh>(x_or_y, xy_type, dy, dx, n, s);
      break;
    default:
      throw InvalidArgument(detail::str_cat(
          "activation_backward: op ", static_cast<int>(op),
          " is not an activation (use kRelu, kTanh, kSigmoid, kGeluErf, kGeluTanh)"));
  }
}

void launch_binary(BinaryOp op, const float* a, const float* b, float* out, int64_t n,
                   const BroadcastGeometry* g, cudaStream_t s) {
  if (n == 0) return;
  switch (op) {
    case BinaryOp::kAdd:
      return launch_binary_t<BinaryOp::kAdd>(a, b, out, n, g, s);
    case BinaryOp::kSub:
      return launch_binary_t<BinaryOp::kSub>(a, b, out, n, g, s);
    case BinaryOp::kMul:
      return launch_binary_t<BinaryOp::kMul>(a, b, out, n, g, s);
    case BinaryOp::kDiv:
      return launch_binary_t<BinaryOp::kDiv>(a, b, out, n, g, s);
    case BinaryOp::kMax:
      return launch_binary_t<BinaryOp::kMax>(a, b, out, n, g, s);
    case BinaryOp::kMin:
      return launch_binary_t<BinaryOp::kMin>(a, b, out, n, g, s);
  }
  throw InvalidArgument(detail::str_cat("binary: unknown op ", static_cast<int>(op)));
}

void launch_relu_grad_of_sum(const void* y, DType y_type, const float* a, const float* b, float* dx,
                             int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const bool vec = vec4_ok(n, {y, a, b, dx});
  with_type(y_type, [&](auto t) {
    using TV = decltype(t);
    const TV* v = static_cast<const TV*>(y);
    if (vec)
      relu_grad_of_sum_kernel<true, TV><<<grid_for(n / 4), kBlock, 0, s>>>(v, a, b, dx, n);
    else
      relu_grad_of_sum_kernel<false, TV><<<grid_for(n), kBlock, 0, s>>>(v, a, b, dx, n);
  });
  DTRAIN_CHECK_LAUNCH("relu_grad_of_sum_kernel");
}

void launch_add_relu(const float* a, const float* b, float* out, uint16_t* rounded, int64_t n,
                     cudaStream_t s) {
  if (n == 0) return;
  if (!rounded) {
    launch_same_shape<AddReluFn>(a, b, out, n, s, "add_relu kernel");
    return;
  }
  if (vec4_ok(n, {a, b, out, rounded}))
    add_relu_rounded_kernel<true><<<grid_for(n / 4), kBlock, 0, s>>>(a, b, out, rounded, n);
  else
    add_relu_rounded_kernel<false><<<grid_for(n), kBlock, 0, s>>>(a, b, out, rounded, n);
  DTRAIN_CHECK_LAUNCH("add_relu_rounded_kernel");
}

void launch_affine(const float* x, float* y, int64_t n, float alpha, float beta, cudaStream_t s) {
  if (n == 0) return;
  affine_kernel<<<grid_for(n), kBlock, 0, s>>>(x, y, n, alpha, beta);
  DTRAIN_CHECK_LAUNCH("affine_kernel");
}

void launch_fill(void* x, DType dtype, int64_t n, float value, cudaStream_t s) {
  if (n == 0) return;
  // The element's bits are computed on the host with the same conversions the CPU device uses.
  switch (dtype) {
    case DType::kFloat32:
      fill_kernel<float><<<grid_for(n), kBlock, 0, s>>>(static_cast<float*>(x), n, value);
      break;
    case DType::kFloat64:
      fill_kernel<double>
          <<<grid_for(n), kBlock, 0, s>>>(static_cast<double*>(x), n, static_cast<double>(value));
      break;
    case DType::kFloat16:
      fill_kernel<uint16_t>
          <<<grid_for(n), kBlock, 0, s>>>(static_cast<uint16_t*>(x), n, float_to_f16(value));
      break;
    case DType::kBFloat16:
      fill_kernel<uint16_t>
          <<<grid_for(n), kBlock, 0, s>>>(static_cast<uint16_t*>(x), n, float_to_bf16(value));
      break;
    case DType::kInt32:
      fill_kernel<int32_t>
          <<<grid_for(n), kBlock, 0, s>>>(static_cast<int32_t*>(x), n, static_cast<int32_t>(value));
      break;
    case DType::kInt64:
      fill_kernel<int64_t>
          <<<grid_for(n), kBlock, 0, s>>>(static_cast<int64_t*>(x), n, static_cast<int64_t>(value));
      break;
  }
  DTRAIN_CHECK_LAUNCH("fill_kernel");
}

void launch_cast(const void* x, DType from, void* y, DType to, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  switch (from) {
    case DType::kFloat32:
      return launch_cast_from<float>(x, to, y, n, s);
    case DType::kFloat64:
      return launch_cast_from<double>(x, to, y, n, s);
    case DType::kFloat16:
      return launch_cast_from<Half16>(x, to, y, n, s);
    case DType::kBFloat16:
      return launch_cast_from<BFloat16>(x, to, y, n, s);
    case DType::kInt32:
      return launch_cast_from<int32_t>(x, to, y, n, s);
    case DType::kInt64:
      return launch_cast_from<int64_t>(x, to, y, n, s);
  }
  throw InvalidArgument(detail::str_cat("cast from unknown dtype ", static_cast<int>(from)));
}

void launch_round_to_bf16(const float* x, float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  round_to_bf16_kernel<<<grid_for(n), kBlock, 0, s>>>(x, y, n);
  DTRAIN_CHECK_LAUNCH("round_to_bf16_kernel");
}

void launch_add_bias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t s) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  if (vec4_ok(cols, {y, bias}))
    add_bias_kernel<true><<<grid_for(n / 4), kBlock, 0, s>>>(y, bias, n, cols);
  else
    add_bias_kernel<false><<<grid_for(n), kBlock, 0, s>>>(y, bias, n, cols);
  DTRAIN_CHECK_LAUNCH("add_bias_kernel");
}

}  // namespace dtrain::cuda
