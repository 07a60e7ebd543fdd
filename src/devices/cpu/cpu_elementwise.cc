// oneDNN-backed elementwise kernels and the CPU's own streaming passes (cpu_stream.h): unary ops
// and activation gradients, broadcasting binary ops, the residual sum with its ReLU and the ReLU
// gradient of a gradient in two parts, affine, casts. (Products: cpu_kernels.cc.)
#include <cstring>
#include <limits>
#include <string>

#include "devices/cpu/cpu_stream.h"
#include "devices/cpu/dnnl_util.h"
#include "dtrain/core/precision.h"

namespace dtrain::cpu {
namespace {

// Whether a memory-bound pass writing `n` floats takes cpu_stream.h's streaming-store loop.
bool streams(int64_t n) { return stream_pass(n); }

// Runs pass(offset, count) over [0, n) in one contiguous part per device thread (for_each_part),
// each a multiple of 32 elements, so that a part's streaming stores start on a 64-byte line where
// the one before ended (the float outputs and add_relu's bfloat16 copy alike). Each part's loop
// ends with its own store fence, before the team's closing barrier. On a 2-thread device the
// streaming loops in parts replaced oneDNN's binary add and ReLU backward primitives, 387 of 4,124
// ms of oneDNN's time in ResNet-50's two steps at batch 32 (ONEDNN_VERBOSE, Zen 5).
template <class Pass>
void in_parts(const CpuKernels::State& state, int64_t n, Pass pass) {
  for_each_part(state.threads, n, 32, pass);
}
// The same for a pass of any size: one part (no OpenMP team) below the device's serial work, as
// its primitives run.
template <class Pass>
void in_parts_or_serial(const CpuKernels::State& state, int64_t n, Pass pass) {
  for_each_part(n < CpuKernels::State::kSerialWork ? 1 : state.threads, n, 32, pass);
}

algorithm eltwise_algorithm(UnaryOp op, float* alpha) {
  *alpha = 0.f;
  switch (op) {
    case UnaryOp::kRelu:
      return algorithm::eltwise_relu;
    case UnaryOp::kTanh:
      return algorithm::eltwise_tanh;
    case UnaryOp::kSigmoid:
      return algorithm::eltwise_logistic;
    case UnaryOp::kNeg:
      *alpha = -1.f;
      return algorithm::eltwise_linear;
    case UnaryOp::kExp:
      return algorithm::eltwise_exp;
    case UnaryOp::kLog:
      return algorithm::eltwise_log;
    case UnaryOp::kSquare:
      return algorithm::eltwise_square;
    case UnaryOp::kSqrt:
      return algorithm::eltwise_sqrt;
    case UnaryOp::kAbs:
      return algorithm::eltwise_abs;
    case UnaryOp::kGeluErf:
      return algorithm::eltwise_gelu_erf;
    case UnaryOp::kGeluTanh:
      return algorithm::eltwise_gelu_tanh;
  }
  throw InvalidArgument("unknown unary op");
}

algorithm binary_algorithm(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd:
      return algorithm::binary_add;
    case BinaryOp::kSub:
      return algorithm::binary_sub;
    case BinaryOp::kMul:
      return algorithm::binary_mul;
    case BinaryOp::kDiv:
      return algorithm::binary_div;
    case BinaryOp::kMax:
      return algorithm::binary_max;
    case BinaryOp::kMin:
      return algorithm::binary_min;
  }
  throw InvalidArgument("unknown binary op");
}

memory::dims padded_dims(const Shape& s, size_t rank) {
  memory::dims d(rank, 1);
  for (int i = 0; i < s.rank(); ++i) d[rank - s.rank() + i] = s.dims()[i];
  return d;
}

struct Eltwise {
  dnnl::eltwise_forward prim;
};
struct EltwiseBwd {
  dnnl::eltwise_backward prim;
};
struct Binary {
  dnnl::binary prim;
};
struct Reorder {
  dnnl::reorder prim;
};
}  // namespace

Tensor CpuKernels::unary(UnaryOp op, const Tensor& x) {
  require_f32(x, "unary", "x");
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  if (y.numel() == 0) return y;
  if (op == UnaryOp::kGeluTanh && own_gelu_tanh()) {
    const float* xp = x.data<float>();
    float* yp = y.data<float>();
    in_parts_or_serial(*state_, y.numel(),
                       [&](int64_t o, int64_t n) { gelu_tanh_forward(xp + o, yp + o, n); });
    return y;
  }
  float alpha;
  const algorithm alg = eltwise_algorithm(op, &alpha);
  const memory::desc md({x.numel()}, dt::f32, tag::a);
  try {
    std::string key = "ew" + std::to_string(static_cast<int>(op)) + ":";
    key_dims(key, {x.numel()});
    auto e = state_->get<Eltwise>(
        key,
        [&] {
          dnnl::eltwise_forward::primitive_desc pd(
              {prop_kind::forward_inference, alg, md, alpha, 0.f}, state_->engine);
          return std::make_shared<Eltwise>(Eltwise{dnnl::eltwise_forward(pd)});
        },
        x.numel());
    e->prim.execute(state_->stream(x.numel()), {{DNNL_ARG_SRC, mem(md, state_->engine, x)},
                                                {DNNL_ARG_DST, mem(md, state_->engine, y)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("unary", err);
  }
  return y;
}

Tensor CpuKernels::activation_backward(UnaryOp op, const Tensor& x_or_y, const Tensor& dy) {
  require_f32(dy, "activation_backward", "dy");
  if (x_or_y.shape() != dy.shape())
    throw InvalidArgument("activation_backward: " + x_or_y.shape().to_string() + " vs dy " +
                          dy.shape().to_string());
  if (op == UnaryOp::kRelu && x_or_y.dtype() == DType::kBFloat16) {
    // ReLU's kept bfloat16 output under mixed_bfloat16 (ops::relu): read as it is where the pass
    // streams, else widened first (the same results).
    require_f32_or_kept_bf16(x_or_y, "activation_backward", "y");
    if (!streams(dy.numel())) return activation_backward(op, cast(x_or_y, DType::kFloat32), dy);
    Tensor dx = Tensor::empty(dy.shape(), DType::kFloat32, spec_);
    const auto* y = static_cast<const uint16_t*>(x_or_y.raw_data());
    const float* g = dy.data<float>();
    float* d = dx.data<float>();
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad(y + o, g + o, d + o, n); });
    return dx;
  }
  // Another activation's bfloat16 x or y (no op keeps one today, but the kernel contract,
  // hands_off_bfloat16, allows it): widened, as oneDNN's primitive below reads float32.
  if (x_or_y.dtype() == DType::kBFloat16)
    return activation_backward(op, cast(x_or_y, DType::kFloat32), dy);
  require_f32(x_or_y, "activation_backward", "x_or_y");
  if (op == UnaryOp::kGeluTanh && own_gelu_tanh()) {
    Tensor dx = Tensor::empty(dy.shape(), DType::kFloat32, spec_);
    const float *xp = x_or_y.data<float>(), *g = dy.data<float>();
    float* d = dx.data<float>();
    in_parts_or_serial(*state_, dx.numel(),
                       [&](int64_t o, int64_t n) { gelu_tanh_backward(xp + o, g + o, d + o, n); });
    return dx;
  }
  algorithm alg;
  int data_arg = DNNL_ARG_SRC;
  switch (op) {
    case UnaryOp::kRelu:
      alg = algorithm::eltwise_relu;
      break;
    case UnaryOp::kTanh:
      alg = algorithm::eltwise_tanh_use_dst_for_bwd;
      data_arg = DNNL_ARG_DST;
      break;
    case UnaryOp::kSigmoid:
      alg = algorithm::eltwise_logistic_use_dst_for_bwd;
      data_arg = DNNL_ARG_DST;
      break;
    case UnaryOp::kGeluErf:
      alg = algorithm::eltwise_gelu_erf;
      break;
    case UnaryOp::kGeluTanh:
      alg = algorithm::eltwise_gelu_tanh;
      break;
    default:
      throw InvalidArgument("activation_backward supports relu, tanh, sigmoid and gelu");
  }
  Tensor dx = Tensor::empty(dy.shape(), DType::kFloat32, spec_);
  if (dx.numel() == 0) return dx;
  if (op == UnaryOp::kRelu && x_or_y.dtype() == DType::kFloat32 && streams(dx.numel())) {
    const float *y = x_or_y.data<float>(), *g = dy.data<float>();
    float* d = dx.data<float>();
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad(y + o, g + o, d + o, n); });
    return dx;
  }
  const memory::desc md({dy.numel()}, dt::f32, tag::a);
  try {
    std::string key = "ewb" + std::to_string(static_cast<int>(op)) + ":";
    key_dims(key, {dy.numel()});
    auto e = state_->get<EltwiseBwd>(
        key,
        [&] {
          dnnl::eltwise_forward::primitive_desc hint(
              {prop_kind::forward_training, alg, md, 0.f, 0.f}, state_->engine);
          dnnl::eltwise_backward::primitive_desc pd({alg, md, md, 0.f, 0.f}, state_->engine, hint);
          return std::make_shared<EltwiseBwd>(EltwiseBwd{dnnl::eltwise_backward(pd)});
        },
        x_or_y.numel());
    e->prim.execute(state_->stream(x_or_y.numel()),
                    {{data_arg, mem(md, state_->engine, x_or_y)},
                     {DNNL_ARG_DIFF_DST, mem(md, state_->engine, dy)},
                     {DNNL_ARG_DIFF_SRC, mem(md, state_->engine, dx)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("activation_backward", err);
  }
  return dx;
}

Tensor CpuKernels::binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  require_f32(a, "binary", "a");
  require_f32(b, "binary", "b");
  const Shape out = broadcast_shapes(a.shape(), b.shape());
  Tensor c = Tensor::empty(out, DType::kFloat32, spec_);
  if (c.numel() == 0) return c;
  if (op == BinaryOp::kAdd && a.shape() == b.shape() &&
      streams(c.numel())) {  // a residual sum, or a gradient's from two paths
    const float *x = a.data<float>(), *y = b.data<float>();
    float* z = c.data<float>();
    in_parts(*state_, c.numel(), [&](int64_t o, int64_t n) { stream_add(x + o, y + o, z + o, n); });
    return c;
  }
  const size_t rank = static_cast<size_t>(std::max(out.rank(), 1));
  memory::dims ad = padded_dims(a.shape(), rank), bd = padded_dims(b.shape(), rank);
  const memory::dims cd = padded_dims(out, rank);
  const Tensor* src0 = &a;
  const Tensor* src1 = &b;
  // oneDNN broadcasts src1 only; commutative ops swap, sub/div with a broadcast lhs use a loop.
  if (ad != cd) {
    const bool commutative = op == BinaryOp::kAdd || op == BinaryOp::kMul || op == BinaryOp::kMax ||
                             op == BinaryOp::kMin;
    if (commutative && bd == cd) {
      std::swap(src0, src1);
      std::swap(ad, bd);
    } else {
      binary_broadcast_loop(op, a, b, c);
      return c;
    }
  }
  try {
    std::string key = "bin" + std::to_string(static_cast<int>(op)) + ":";
    key_dims(key, ad);
    key_dims(key, bd);
    auto e = state_->get<Binary>(
        key,
        [&] {
          dnnl::binary::primitive_desc pd(
              {binary_algorithm(op), plain_md(ad), plain_md(bd), plain_md(cd)}, state_->engine);
          return std::make_shared<Binary>(Binary{dnnl::binary(pd)});
        },
        c.numel());
    e->prim.execute(state_->stream(c.numel()),
                    {{DNNL_ARG_SRC_0, mem(plain_md(ad), state_->engine, *src0)},
                     {DNNL_ARG_SRC_1, mem(plain_md(bd), state_->engine, *src1)},
                     {DNNL_ARG_DST, mem(plain_md(cd), state_->engine, c)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("binary", err);
  }
  return c;
}

// One pass: oneDNN's binary add with a ReLU post-op. ResNet-50 at batch 32, one thread, two steps
// (ONEDNN_VERBOSE): the ReLU primitives' forward time 602 -> 76 ms, the sums' 1,001 -> 1,004 ms
// with the ReLU in them (a ReLU pass over 25.7 M floats took 37 ms, memory-bound).
Tensor CpuKernels::add_relu(const Tensor& a, const Tensor& b, Tensor* rounded) {
  require_f32(a, "add_relu", "a");
  require_f32(b, "add_relu", "b");
  if (a.shape() != b.shape())
    throw InvalidArgument("add_relu: operands of one shape only, got " + a.shape().to_string() +
                          " and " + b.shape().to_string());
  Tensor c = Tensor::empty(a.shape(), DType::kFloat32, spec_);
  if (c.numel() == 0) return c;
  if (streams(c.numel())) {
    const float *x = a.data<float>(), *y = b.data<float>();
    float* z = c.data<float>();
    if (rounded) {
      *rounded = Tensor::empty(a.shape(), DType::kBFloat16, spec_);
      auto* z16 = static_cast<uint16_t*>(rounded->raw_data());
      in_parts(*state_, c.numel(), [&](int64_t o, int64_t n) {
        stream_add_relu_rounded(x + o, y + o, z + o, z16 + o, n);
      });
    } else {
      in_parts(*state_, c.numel(),
               [&](int64_t o, int64_t n) { stream_add_relu(x + o, y + o, z + o, n); });
    }
    return c;
  }
  const memory::desc md({c.numel()}, dt::f32, tag::a);
  try {
    std::string key = "addrelu:";
    key_dims(key, {c.numel()});
    auto e = state_->get<Binary>(
        key,
        [&] {
          dnnl::post_ops po;
          po.append_eltwise(1.f, algorithm::eltwise_relu, 0.f, 0.f);
          dnnl::primitive_attr attr;
          attr.set_post_ops(po);
          dnnl::binary::primitive_desc pd({algorithm::binary_add, md, md, md}, attr,
                                          state_->engine);
          return std::make_shared<Binary>(Binary{dnnl::binary(pd)});
        },
        c.numel());
    e->prim.execute(state_->stream(c.numel()), {{DNNL_ARG_SRC_0, mem(md, state_->engine, a)},
                                                {DNNL_ARG_SRC_1, mem(md, state_->engine, b)},
                                                {DNNL_ARG_DST, mem(md, state_->engine, c)}});
  } catch (const dnnl::error& err) {
    rethrow_dnnl("add_relu", err);
  }
  return c;
}

// Where the pass streams (4 MB and more, as the ReLU gradient's and the sum's own passes): one pass
// reading y, a and b, instead of a sum written and read again: ResNet-50's residual blocks whose
// input is the block before's output (15 of 16; the first reads the stem's pooling), 15 fewer
// passes a step. Elsewhere (and for operands the kernel does not take) the default's two passes,
// which give the same bits.
Tensor CpuKernels::relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) {
  const bool y_ok = y.dtype() == DType::kFloat32 || y.dtype() == DType::kBFloat16;
  if (!y_ok || a.dtype() != DType::kFloat32 || b.dtype() != DType::kFloat32 ||
      a.shape() != y.shape() || b.shape() != y.shape() || !streams(y.numel()))
    return Kernels::relu_grad_of_sum(y, a, b);
  if (y.dtype() == DType::kBFloat16) require_f32_or_kept_bf16(y, "relu_grad_of_sum", "y");
  Tensor dx = Tensor::empty(y.shape(), DType::kFloat32, spec_);
  const float *pa = a.data<float>(), *pb = b.data<float>();
  float* d = dx.data<float>();
  if (y.dtype() == DType::kBFloat16) {
    const auto* py = static_cast<const uint16_t*>(y.raw_data());
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad_sum(py + o, pa + o, pb + o, d + o, n); });
  } else {
    const float* py = y.data<float>();
    in_parts(*state_, dx.numel(),
             [&](int64_t o, int64_t n) { stream_relu_grad_sum(py + o, pa + o, pb + o, d + o, n); });
  }
  return dx;
}

Tensor CpuKernels::affine(const Tensor& x, float alpha, float beta) {
  require_f32(x, "affine", "x");
  Tensor y = Tensor::empty(x.shape(), DType::kFloat32, spec_);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) py[i] = alpha * px[i] + beta;
  return y;
}

Tensor CpuKernels::cast(const Tensor& x, DType to) {
  Tensor y = Tensor::empty(x.shape(), to, spec_);
  if (y.numel() == 0 || x.dtype() == to) {
    if (y.numel()) y.copy_from(x);
    return y;
  }
  // float32 <-> float16 with F16C (oneDNN 2.6's reorder for f16 is its reference loop: 50x slower).
  if (x.dtype() == DType::kFloat32 && to == DType::kFloat16) {
    floats_to_f16(x.data<float>(), static_cast<uint16_t*>(y.raw_data()),
                  static_cast<size_t>(x.numel()));
    return y;
  }
  if (x.dtype() == DType::kFloat16 && to == DType::kFloat32) {
    f16_to_floats(static_cast<const uint16_t*>(x.raw_data()), y.data<float>(),
                  static_cast<size_t>(x.numel()));
    return y;
  }
  // float32 <-> bfloat16 (mixed_bfloat16's kept copies): AVX-512 loops with streaming stores for
  // large outputs (dtype.cc; widening 2x oneDNN 2.6's reorder), split over the device's threads
  // as a primitive would be.
  const bool narrow = x.dtype() == DType::kFloat32 && to == DType::kBFloat16;
  if (narrow || (x.dtype() == DType::kBFloat16 && to == DType::kFloat32)) {
    const int64_t n = x.numel();
    const int threads = n < State::kSerialWork ? 1 : state_->threads;
    const int64_t chunk = ((n + threads - 1) / threads + 15) / 16 * 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int t = 0; t < threads; ++t) {
      const int64_t b = std::min(n, t * chunk), len = std::min(n, b + chunk) - b;
      if (len <= 0) continue;
      if (narrow)
        floats_to_bf16(x.data<float>() + b, static_cast<uint16_t*>(y.raw_data()) + b,
                       static_cast<size_t>(len));
      else
        bf16_to_floats(static_cast<const uint16_t*>(x.raw_data()) + b, y.data<float>() + b,
                       static_cast<size_t>(len));
    }
    return y;
  }
  const dt from_dt = dnnl_type(x.dtype()), to_dt = dnnl_type(to);
  if (from_dt == dt::undef || to_dt == dt::undef) {  // float64 / int64: no oneDNN type
    cast_loop(x, y);
    return y;
  }
  try {
    const memory::desc src({x.numel()}, from_dt, tag::a), dst({x.numel()}, to_dt, tag::a);
    std::string key = std::string("cast") + dtype_name(x.dtype()) + dtype_name(to);
    key_dims(key, {x.numel()});
    auto e = state_->get<Reorder>(
        key,
        [&] {
          return std::make_shared<Reorder>(Reorder{dnnl::reorder(
              dnnl::reorder::primitive_desc(state_->engine, src, state_->engine, dst))});
        },
        x.numel());
    memory sm = mem(src, state_->engine, x), dm = mem(dst, state_->engine, y);
    e->prim.execute(state_->stream(x.numel()), sm, dm);
  } catch (const dnnl::error& err) {
    rethrow_dnnl("cast", err);
  }
  return y;
}

}  // namespace dtrain::cpu
