// CudaKernels: argument checking shared by all methods, and the elementwise, reduction, cast and
// fill methods. The arithmetic lives in the .cu launchers (cuda_launch.h).
#include "devices/cuda/cuda_kernels.h"

#include <algorithm>

#include "devices/cuda/cuda_check.h"
#include "devices/cuda/cuda_guard.h"
#include "devices/cuda/cuda_launch.h"
#include "devices/slab_copy.h"
#include "dtrain/core/error.h"
#include "dtrain/core/precision.h"

namespace dtrain::cuda {
namespace {

float* fptr(const Tensor& t) { return static_cast<float*>(t.raw_data()); }

// Fills g for out = a op b under numpy broadcasting: dimensions of size 1 in the output are
// dropped and neighbours that are laid out alike in both inputs are merged, so that typical
// cases (bias add, scalar ops, per-row scaling) become rank 1 or 2.
void build_broadcast(const Shape& out, const Shape& a, const Shape& b, BroadcastGeometry* g) {
  const int rank = out.rank();
  std::vector<int64_t> dims, as, bs;
  int64_t a_stride = 1, b_stride = 1;
  // Walk from the innermost dimension outwards, so strides are known as we go.
  for (int d = rank - 1; d >= 0; --d) {
    const int ad = d - (rank - a.rank()), bd = d - (rank - b.rank());
    const int64_t a_dim = ad >= 0 ? a.dims()[static_cast<size_t>(ad)] : 1;
    const int64_t b_dim = bd >= 0 ? b.dims()[static_cast<size_t>(bd)] : 1;
    const int64_t o = out.dims()[static_cast<size_t>(d)];
    const int64_t sa = a_dim == 1 ? 0 : a_stride;
    const int64_t sb = b_dim == 1 ? 0 : b_stride;
    a_stride *= a_dim;
    b_stride *= b_dim;
    if (o == 1) continue;
    if (!dims.empty() && as.back() * dims.back() == sa && bs.back() * dims.back() == sb) {
      // Mergeable with the inner neighbour (a 0 stride stays 0: broadcast on both sides).
      dims.back() *= o;
      continue;
    }
    dims.push_back(o);
    as.push_back(sa);
    bs.push_back(sb);
  }
  if (static_cast<int>(dims.size()) > kMaxDims)
    throw InvalidArgument(detail::str_cat("binary: broadcasting ", a.to_string(), " with ",
                                          b.to_string(), " needs more than ", kMaxDims,
                                          " dimensions after merging; reshape the operands"));
  g->rank = static_cast<int>(dims.size());
  for (int i = 0; i < g->rank; ++i) {  // dims were collected innermost first
    const size_t src = dims.size() - 1 - static_cast<size_t>(i);
    g->out_dims[i] = dims[src];
    g->a_strides[i] = as[src];
    g->b_strides[i] = bs[src];
  }
}

// The reduction of a row-major tensor of shape s over the axes marked in `reduced`, with
// neighbouring dimensions of the same kind merged (size-1 dimensions do not break contiguity and
// are dropped), so that typical reductions have one kept and one reduced group.
ReduceGeometry reduce_geometry(const Shape& s, const std::vector<bool>& reduced) {
  struct Group {
    bool reduced;
    int64_t size, stride;
  };
  std::vector<Group> groups;  // innermost first, so each group's stride is its innermost dim's
  int64_t stride = 1;
  for (int d = s.rank() - 1; d >= 0; --d) {
    const int64_t size = s.dims()[static_cast<size_t>(d)];
    const bool r = reduced[static_cast<size_t>(d)];
    if (size != 1) {
      if (!groups.empty() && groups.back().reduced == r)
        groups.back().size *= size;
      else
        groups.push_back({r, size, stride});
    }
    stride *= size;
  }
  ReduceGeometry g;
  for (auto it = groups.rbegin(); it != groups.rend(); ++it) {  // outermost first
    int& n = it->reduced ? g.red_rank : g.kept_rank;
    if (n == kMaxDims)
      throw InvalidArgument(detail::str_cat("reduce: axes pattern over shape ", s.to_string(),
                                            " alternates too often; reduce in two steps"));
    (it->reduced ? g.red_dims : g.kept_dims)[n] = it->size;
    (it->reduced ? g.red_strides : g.kept_strides)[n] = it->stride;
    (it->reduced ? g.num_red : g.num_out) *= it->size;
    ++n;
  }
  return g;
}

}  // namespace

// --- argument checks ---

void CudaKernels::check_device(const Tensor& t, const char* op, const char* arg) const {
  if (!t.defined())
    throw InvalidArgument(detail::str_cat(op, ": ", arg, " is an undefined tensor"));
  if (t.device() != ctx_.spec())
    throw InvalidArgument(detail::str_cat(op, ": ", arg, " ", t.to_string(), " is not on ",
                                          ctx_.spec().to_string(), "; move it with .to(",
                                          ctx_.spec().to_string(), ") first"));
}

Tensor CudaKernels::product_operand(const Tensor& t) const {
  if (precision_policy() != Precision::kMixedBFloat16 || t.numel() == 0) return t;
  Tensor r = empty(t.shape());
  launch_round_to_bf16(static_cast<const float*>(t.raw_data()), static_cast<float*>(r.raw_data()),
                       t.numel(), ctx_.stream());
  return r;
}

GemmMath CudaKernels::gemm_math() const {
  if (ctx_.cc_major() < 8) return GemmMath::kFloat32;
  if (precision_policy() == Precision::kMixedBFloat16) return GemmMath::kBFloat16;
  return tensor_float_32_execution_enabled() ? GemmMath::kTensorFloat32 : GemmMath::kFloat32;
}

Tensor CudaKernels::gemm_operand(const Tensor& t, GemmMath math) const {
  if (math != GemmMath::kBFloat16) return rounded_f32(t);
  return as_dtype(t, DType::kBFloat16);
}

Tensor CudaKernels::rounded_f32(const Tensor& t) const {
  return t.dtype() == DType::kBFloat16 ? as_dtype(t, DType::kFloat32) : product_operand(t);
}

Tensor CudaKernels::as_dtype(const Tensor& t, DType dtype) const {
  if (t.dtype() == dtype) return t;
  Tensor r = empty(t.shape(), dtype);
  if (t.numel() > 0)
    launch_cast(t.raw_data(), t.dtype(), r.raw_data(), dtype, t.numel(), ctx_.stream());
  return r;
}

bool CudaKernels::hands_off_bfloat16() const {
  static const bool on = env_switch(
      "DTRAIN_CUDA_BF16_HANDOFFS", true,
      "0 keeps float32 activations and float32 tensors for the backward pass on CUDA GPUs under "
      "mixed_bfloat16, 1 (the default) hands bfloat16 ones on and keeps bfloat16 copies as the "
      "CPU does");
  return on && ctx_.cc_major() >= 8;
}

bool CudaKernels::tensor_cores() const {
  return ctx_.cc_major() >= 8 &&
         (precision_policy() == Precision::kMixedBFloat16 || tensor_float_32_execution_enabled());
}

void CudaKernels::check_f32(const Tensor& t, const char* op, const char* arg) const {
  check_device(t, op, arg);
  if (t.dtype() != DType::kFloat32)
    throw InvalidArgument(detail::str_cat(op, ": ", arg, " has dtype ", dtype_name(t.dtype()),
                                          " but GPU kernels compute in float32; cast it first"));
}

void CudaKernels::check_activation(const Tensor& t, const char* op, const char* arg) const {
  check_device(t, op, arg);
  if (t.dtype() != DType::kFloat32 && t.dtype() != DType::kBFloat16)
    throw InvalidArgument(detail::str_cat(op, ": ", arg, " has dtype ", dtype_name(t.dtype()),
                                          " but GPU kernels take float32 here (or a bfloat16 "
                                          "activation); cast it first"));
}

void CudaKernels::check_same_shape(const Tensor& a, const Tensor& b, const char* op) {
  if (a.shape() != b.shape())
    throw InvalidArgument(detail::str_cat(op, ": shapes differ: ", a.shape().to_string(), " vs ",
                                          b.shape().to_string()));
}

Tensor CudaKernels::empty(const Shape& shape, DType dtype) const {
  return Tensor::empty(shape, dtype, ctx_.spec());
}

// --- elementwise ---

Tensor CudaKernels::unary(UnaryOp op, const Tensor& x) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "unary", "x");
  Tensor y = empty(x.shape());
  launch_unary(op, fptr(x), fptr(y), x.numel(), ctx_.stream());
  return y;
}

Tensor CudaKernels::activation_backward(UnaryOp op, const Tensor& x_or_y, const Tensor& dy) {
  DeviceGuard guard(ctx_.index());
  check_activation(x_or_y, "activation_backward", "x_or_y");  // bfloat16: a kept copy
  check_f32(dy, "activation_backward", "dy");
  check_same_shape(x_or_y, dy, "activation_backward");
  if (op != UnaryOp::kRelu && op != UnaryOp::kTanh && op != UnaryOp::kSigmoid &&
      op != UnaryOp::kGeluErf && op != UnaryOp::kGeluTanh)
    throw InvalidArgument(detail::str_cat(
        "activation_backward: op ", static_cast<int>(op),
        " is not an activation; use kRelu, kTanh, kSigmoid, kGeluErf or kGeluTanh"));
  Tensor dx = empty(dy.shape());
  launch_activation_backward(op, x_or_y.raw_data(), x_or_y.dtype(), fptr(dy), fptr(dx), dy.numel(),
                             ctx_.stream());
  return dx;
}

Tensor CudaKernels::binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  DeviceGuard guard(ctx_.index());
  check_f32(a, "binary", "a");
  check_f32(b, "binary", "b");
  const Shape out_shape =
      a.shape() == b.shape() ? a.shape() : broadcast_shapes(a.shape(), b.shape());
  Tensor out = empty(out_shape);
  const int64_t n = out.numel();
  if (a.shape() == b.shape()) {
    launch_binary(op, fptr(a), fptr(b), fptr(out), n, nullptr, ctx_.stream());
  } else {
    BroadcastGeometry g;
    build_broadcast(out_shape, a.shape(), b.shape(), &g);
    const bool flat = g.rank <= 1 && (g.rank == 0 || (g.a_strides[0] == 1 && g.b_strides[0] == 1));
    launch_binary(op, fptr(a), fptr(b), fptr(out), n, flat ? nullptr : &g, ctx_.stream());
  }
  return out;
}

Tensor CudaKernels::add_relu(const Tensor& a, const Tensor& b, Tensor* rounded) {
  DeviceGuard guard(ctx_.index());
  check_f32(a, "add_relu", "a");
  check_f32(b, "add_relu", "b");
  check_same_shape(a, b, "add_relu");
  Tensor y = empty(a.shape());
  Tensor copy;
  if (rounded) copy = empty(a.shape(), DType::kBFloat16);
  launch_add_relu(fptr(a), fptr(b), fptr(y),
                  rounded ? static_cast<uint16_t*>(copy.raw_data()) : nullptr, y.numel(),
                  ctx_.stream());
  if (rounded) *rounded = copy;
  return y;
}

Tensor CudaKernels::relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) {
  DeviceGuard guard(ctx_.index());
  check_activation(y, "relu_grad_of_sum", "y");  // bfloat16: a kept copy
  check_f32(a, "relu_grad_of_sum", "a");
  check_f32(b, "relu_grad_of_sum", "b");
  check_same_shape(y, a, "relu_grad_of_sum");
  check_same_shape(y, b, "relu_grad_of_sum");
  Tensor dx = empty(y.shape());
  launch_relu_grad_of_sum(y.raw_data(), y.dtype(), fptr(a), fptr(b), fptr(dx), y.numel(),
                          ctx_.stream());
  return dx;
}

Tensor CudaKernels::affine(const Tensor& x, float alpha, float beta) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "affine", "x");
  Tensor y = empty(x.shape());
  launch_affine(fptr(x), fptr(y), x.numel(), alpha, beta, ctx_.stream());
  return y;
}

// --- reductions ---

Tensor CudaKernels::reduce(ReductionKind kind, const Tensor& x, const std::vector<int>& axes,
                           bool keepdims) {
  DeviceGuard guard(ctx_.index());
  check_f32(x, "reduce", "x");
  const Shape& s = x.shape();
  const int rank = s.rank();
  std::vector<bool> reduced(static_cast<size_t>(rank), false);
  for (int a : axes) {  // as on the CPU: axes in [0, rank); a repeated axis is harmless
    if (a < 0 || a >= rank)
      throw InvalidArgument(
          detail::str_cat("reduce: axis ", a, " out of range for shape ", s.to_string()));
    reduced[static_cast<size_t>(a)] = true;
  }

  std::vector<int64_t> out_dims;
  for (int d = 0; d < rank; ++d) {
    if (!reduced[static_cast<size_t>(d)])
      out_dims.push_back(s.dims()[static_cast<size_t>(d)]);
    else if (keepdims)
      out_dims.push_back(1);
  }
  Tensor out = empty(Shape(out_dims));

  const ReduceGeometry g = reduce_geometry(s, reduced);
  launch_reduce(kind, fptr(x), fptr(out), g, ctx_);
  return out;
}

// --- cast / fill ---

Tensor CudaKernels::cast(const Tensor& x, DType dtype) {
  DeviceGuard guard(ctx_.index());
  check_device(x, "cast", "x");
  Tensor y = empty(x.shape(), dtype);
  if (x.numel() == 0) return y;
  if (dtype == x.dtype()) {
    DTRAIN_CUDA_CALL(cudaMemcpyAsync(y.raw_data(), x.raw_data(), x.nbytes(),
                                     cudaMemcpyDeviceToDevice, ctx_.stream()));
  } else {
    launch_cast(x.raw_data(), x.dtype(), y.raw_data(), dtype, x.numel(), ctx_.stream());
  }
  return y;
}

void CudaKernels::fill(Tensor& x, float value) {
  DeviceGuard guard(ctx_.index());
  check_device(x, "fill", "x");
  launch_fill(x.raw_data(), x.dtype(), x.numel(), value, ctx_.stream());
}

// One strided copy on the stream (the base class makes one copy per index before `axis`: at
// ZeroPadding2D's 32 x 230 rows that was 7,360 cudaMemcpyAsync calls per concat, most of a
// ResNet-50 step's host time). Tensors elsewhere go through the base class.
void CudaKernels::copy_slab(const Tensor& src, int axis, int64_t src_begin, Tensor& dst,
                            int64_t dst_begin, int64_t count) {
  if (src.device() != ctx_.spec() || dst.device() != ctx_.spec()) {
    Kernels::copy_slab(src, axis, src_begin, dst, dst_begin, count);
    return;
  }
  const detail::SlabCopy c = detail::slab_copy(src, axis, src_begin, dst, dst_begin, count);
  if (c.empty()) return;
  DeviceGuard guard(ctx_.index());
  DTRAIN_CUDA_CALL(cudaMemcpy2DAsync(c.to, c.dst_pitch, c.from, c.src_pitch, c.row_bytes,
                                     static_cast<size_t>(c.rows), cudaMemcpyDeviceToDevice,
                                     ctx_.stream()));
}

}  // namespace dtrain::cuda
