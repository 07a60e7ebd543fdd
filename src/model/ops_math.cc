// Elementwise, reduction, shape and matmul ops with their gradients. Backward functions use
// recorded ops, so these are differentiable any number of times.
#include <algorithm>

#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "model/op_util.h"

namespace dtrain::ops {

namespace {

Tensor binary_op(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  same_device(name, a, b);
  Tensor y = kernels_for(a).binary(op, a, b);
  if (tape::should_record({&a, &b})) {
    // The backward pass keeps the operands only where it reads them (mul, div): a sum's operands
    // are freed once nothing else holds them. (A residual connection's add kept both branches to
    // the end of the step: 0.85 GB of ResNet-50's 3.5 GB at batch 32.)
    const bool keep = op == BinaryOp::kMul || op == BinaryOp::kDiv;
    tape::record(
        name, {a, b}, {y},
        [op, sa = a.shape(), sb = b.shape(), a = keep ? a : Tensor(),
         b = keep ? b : Tensor()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
          const Tensor& dy = g[0];
          // A side the tape does not want (a causal mask, a constant) gets no gradient: its
          // reduction over a broadcast, a read of all of dy, is skipped. (mul and div compute
          // both: rarely broadcast in training.)
          const bool want_a = tape::needs_gradient(0), want_b = tape::needs_gradient(1);
          switch (op) {
            case BinaryOp::kAdd:
              return {want_a ? sum_to_shape(dy, sa) : Tensor(),
                      want_b ? sum_to_shape(dy, sb) : Tensor()};
            case BinaryOp::kSub:
              return {want_a ? sum_to_shape(dy, sa) : Tensor(),
                      want_b ? sum_to_shape(neg(dy), sb) : Tensor()};
            case BinaryOp::kMul:
              return {sum_to_shape(mul(dy, b), a.shape()), sum_to_shape(mul(dy, a), b.shape())};
            case BinaryOp::kDiv:
              return {sum_to_shape(div(dy, b), a.shape()),
                      sum_to_shape(neg(div(mul(dy, a), mul(b, b))), b.shape())};
            default:
              throw Unimplemented("gradient of max/min");
          }
        });
  }
  return y;
}

Tensor unary_op(UnaryOp op, const char* name, const Tensor& x) {
  Tensor y = kernels_for(x).unary(op, x);
  if (tape::should_record({&x})) {
    // Each gradient reads the input (log, square) or the output (exp, sqrt, tanh, sigmoid), and
    // only that one is kept.
    const bool reads_x = op == UnaryOp::kLog || op == UnaryOp::kSquare;
    const bool reads_y = op == UnaryOp::kExp || op == UnaryOp::kSqrt || op == UnaryOp::kTanh ||
                         op == UnaryOp::kSigmoid;
    tape::record(name, {x}, {y},
                 [op, x = reads_x ? x : Tensor(),
                  y = reads_y ? y : Tensor()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   const Tensor& dy = g[0];
                   switch (op) {
                     case UnaryOp::kNeg:
                       return {neg(dy)};
                     case UnaryOp::kExp:
                       return {mul(dy, y)};
                     case UnaryOp::kLog:
                       return {div(dy, x)};
                     case UnaryOp::kSquare:
                       return {mul(dy, scale(x, 2.f))};
                     case UnaryOp::kSqrt:
                       return {div(dy, scale(y, 2.f))};
                     case UnaryOp::kTanh:
                       if (!tape::should_record({&dy, &y}))  // first order: one fused kernel
                         return {kernels_for(y).activation_backward(UnaryOp::kTanh, y, dy)};
                       return {mul(dy, add_scalar(neg(square(y)), 1.f))};
                     case UnaryOp::kSigmoid:
                       if (!tape::should_record({&dy, &y}))
                         return {kernels_for(y).activation_backward(UnaryOp::kSigmoid, y, dy)};
                       return {mul(dy, mul(y, add_scalar(neg(y), 1.f)))};
                     default:
                       throw Unimplemented("gradient of this unary op");
                   }
                 });
  }
  return y;
}

// dL/dx of relu given dy; itself recorded so that relu is differentiable twice (relu'' = 0).
Tensor relu_grad(const Tensor& x, const Tensor& dy) {
  Tensor dx = kernels_for(x).activation_backward(UnaryOp::kRelu, x, dy);
  if (tape::should_record({&dy})) {
    tape::record("relu_grad", {x, dy}, {dx},
                 [x](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   return {Tensor(), relu_grad(x, g[0])};
                 });
  }
  return dx;
}

std::vector<int> normalize_axes(std::vector<int> axes, int rank, const char* op) {
  if (axes.empty())
    for (int i = 0; i < rank; ++i) axes.push_back(i);
  for (int& a : axes) {
    if (a < -rank || a >= rank)
      throw InvalidArgument(std::string(op) + ": axis " + std::to_string(a) +
                            " out of range for rank " + std::to_string(rank));
    if (a < 0) a += rank;
  }
  std::sort(axes.begin(), axes.end());
  axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
  return axes;
}

Shape keepdims_shape(const Shape& s, const std::vector<int>& axes) {
  std::vector<int64_t> d = s.dims();
  for (int a : axes) d[static_cast<size_t>(a)] = 1;
  return Shape(d);
}

Tensor broadcast_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  Tensor z = Tensor::zeros(shape, DType::kFloat32, x.device());
  return add(z, x);
}

}  // namespace

void same_device(const char* op, const Tensor& a, const Tensor& b) {
  if (a.device() != b.device())
    throw InvalidArgument(std::string(op) + ": operands are on different devices (" +
                          a.device().to_string() + " and " + b.device().to_string() +
                          "); if one is a model weight, the model was built outside the "
                          "strategy.scope() that runs it (build the model and optimizer inside "
                          "that scope); otherwise move one with .to(device)");
}

Tensor add(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::kAdd, "add", a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::kSub, "sub", a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::kMul, "mul", a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::kDiv, "div", a, b); }
Tensor neg(const Tensor& x) { return unary_op(UnaryOp::kNeg, "neg", x); }
Tensor exp(const Tensor& x) { return unary_op(UnaryOp::kExp, "exp", x); }
Tensor log(const Tensor& x) { return unary_op(UnaryOp::kLog, "log", x); }
Tensor square(const Tensor& x) { return unary_op(UnaryOp::kSquare, "square", x); }
Tensor sqrt(const Tensor& x) { return unary_op(UnaryOp::kSqrt, "sqrt", x); }
Tensor tanh(const Tensor& x) { return unary_op(UnaryOp::kTanh, "tanh", x); }
Tensor sigmoid(const Tensor& x) { return unary_op(UnaryOp::kSigmoid, "sigmoid", x); }

namespace {
// relu_grad(y, a + b) for a gradient that arrives in two parts (tape::SumBackwardFn): one pass on
// devices that fuse it, the sum never stored. Under an outer tape (the backward pass
// differentiated) the sum and relu_grad, recorded as ops.
Tensor relu_grad_of_sum(const Tensor& y, const Tensor& a, const Tensor& b) {
  if (tape::should_record({&a, &b})) return relu_grad(y, add(a, b));
  same_device("relu_grad", a, b);
  return kernels_for(y).relu_grad_of_sum(y, a, b);
}
}  // namespace

Tensor relu(const Tensor& x) {
  Tensor y = kernels_for(x).unary(UnaryOp::kRelu, x);
  // The backward pass keeps the output, not the input: y > 0 exactly where x > 0, and the next
  // layer keeps y anyway, so x (a convolution's or batch norm's output) is freed after the forward
  // pass (PyTorch's ReLU(inplace=True) saves the same memory). ResNet-50, batch 32, with batch
  // norm no longer keeping its output either: allocator peak 4,636 -> 3,637 MB.
  // Under mixed_bfloat16 a bfloat16 copy of y, shared with the convolutions that read y (which
  // round it so anyway): y > 0 where its copy is, except below bfloat16's smallest value, 2^-133,
  // which counts as 0.
  if (tape::should_record({&x})) {
    const Tensor kept = tape::recording_tapes({&x}) == 1 ? keep_for_backward(y) : y;
    tape::record_summing(
        "relu", {x}, y,
        [kept](const std::vector<Tensor>& g) -> std::vector<Tensor> {
          return {relu_grad(kept, g[0])};
        },
        [kept](const Tensor& a, const Tensor& b) -> std::vector<Tensor> {
          return {relu_grad_of_sum(kept, a, b)};
        });
  }
  return y;
}

Tensor add_relu(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return relu(add(a, b));
  same_device("add_relu", a, b);
  const bool records = tape::should_record({&a, &b}),
             one_tape = records && tape::recording_tapes({&a, &b}) == 1;
  // Under mixed_bfloat16 the CPU writes the bfloat16 copy kept below in the sum's own pass (where
  // it streams it); the next block's convolutions share that copy.
  Tensor rounded;
  Tensor y = kernels_for(a).add_relu(a, b, one_tape && bf16_activations(a) ? &rounded : nullptr);
  // As relu: the output (or its bfloat16 copy) is what the backward pass reads.
  if (records) {
    const Tensor kept = one_tape ? keep_for_backward(y, rounded) : y;
    // A residual block's output is the next block's input, whose gradient arrives in two parts
    // (the next shortcut's and its first convolution's): taken as they are, in one pass.
    tape::record_summing(
        "add_relu", {a, b}, y,
        [kept](const std::vector<Tensor>& g) -> std::vector<Tensor> {
          Tensor d = relu_grad(kept, g[0]);
          return {d, d};
        },
        [kept](const Tensor& ga, const Tensor& gb) -> std::vector<Tensor> {
          Tensor d = relu_grad_of_sum(kept, ga, gb);
          return {d, d};
        });
  }
  return y;
}

Tensor scale(const Tensor& x, float alpha) {
  Tensor y = kernels_for(x).affine(x, alpha, 0.f);
  if (tape::should_record({&x}))
    tape::record("scale", {x}, {y}, [alpha](const std::vector<Tensor>& g) -> std::vector<Tensor> {
      return {scale(g[0], alpha)};
    });
  return y;
}

Tensor add_scalar(const Tensor& x, float beta) {
  Tensor y = kernels_for(x).affine(x, 1.f, beta);
  if (tape::should_record({&x}))
    tape::record("add_scalar", {x}, {y},
                 [](const std::vector<Tensor>& g) -> std::vector<Tensor> { return {g[0]}; });
  return y;
}

namespace {
// op(a) @ op(b) on 2-D operands, recorded. `made_a`: a bfloat16 copy of a's values made already
// (a 3-D input's, viewed as a), kept instead of a new one; or undefined.
Tensor matmul_2d(const Tensor& a, const Tensor& b, bool ta, bool tb, const Tensor& made_a) {
  // The bfloat16 copies the kernel reads under mixed_bfloat16, kept for the backward pass.
  const auto [ka, kb] = product_operands(a, b, made_a);
  Tensor c = kernels_for(a).matmul(ka, kb, ta, tb);
  if (tape::should_record({&a, &b})) {
    tape::record("matmul", {a, b}, {c},
                 [a = ka, b = kb, ta, tb](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   const Tensor d = product_gradient(g[0], a, b);
                   if (!ta && !tb) return {matmul(d, b, false, true), matmul(a, d, true, false)};
                   if (ta && !tb) return {matmul(b, d, false, true), matmul(a, d, false, false)};
                   if (!ta && tb) return {matmul(d, b, false, false), matmul(d, a, true, false)};
                   return {matmul(b, d, true, true), matmul(d, a, true, true)};
                 });
  }
  return c;
}
}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  same_device("matmul", a, b);
  if (a.rank() >= 3 && b.rank() == a.rank()) return batch_matmul(a, b, ta, tb);
  if (a.rank() >= 3 && b.rank() == 2 && !ta) {  // [..., K] @ [K, N]: one 2-D product
    std::vector<int64_t> d = a.shape().dims();
    const Tensor a2 = reshape(a, Shape{-1, d.back()});
    // Under mixed_bfloat16 the copy is kept for a itself, not for this reshape of it: every
    // product of a shares it (attention's query, key and value projections of one input made
    // three copies before, one a projection).
    Tensor made;
    if (tape::should_record({&a, &b}) && tape::recording_tapes({&a, &b}) == 1)
      if (const Tensor k = keep_for_backward(a); k.id() != a.id()) made = k.view(a2.shape());
    const Tensor c = matmul_2d(a2, b, false, tb, made);
    d.back() = c.shape()[1];
    return reshape(c, Shape(d));
  }
  return matmul_2d(a, b, ta, tb, Tensor());
}

Tensor bias_add(const Tensor& x, const Tensor& b) {
  if (b.rank() != 1 || x.rank() < 1 || x.shape()[-1] != b.shape()[0])
    throw InvalidArgument("bias_add: bias " + b.shape().to_string() +
                          " must be 1-D matching the last dimension of x " + x.shape().to_string());
  return add(x, b);
}

Tensor sum(const Tensor& x, std::vector<int> axes, bool keepdims) {
  axes = normalize_axes(std::move(axes), x.rank(), "sum");
  Tensor y = kernels_for(x).reduce(ReductionKind::kSum, x, axes, keepdims);
  if (tape::should_record({&x})) {
    const Shape kshape = keepdims_shape(x.shape(), axes);
    tape::record("sum", {x}, {y}, [x, kshape](const std::vector<Tensor>& g) -> std::vector<Tensor> {
      return {broadcast_to(reshape(g[0], kshape), x.shape())};
    });
  }
  return y;
}

Tensor mean(const Tensor& x, std::vector<int> axes, bool keepdims) {
  axes = normalize_axes(std::move(axes), x.rank(), "mean");
  Tensor y = kernels_for(x).reduce(ReductionKind::kMean, x, axes, keepdims);
  if (tape::should_record({&x})) {
    const Shape kshape = keepdims_shape(x.shape(), axes);
    const int64_t count = kshape.numel() == 0 ? 0 : x.numel() / kshape.numel();
    tape::record("mean", {x}, {y},
                 [x, kshape, count](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   return {broadcast_to(
                       scale(reshape(g[0], kshape), count ? 1.f / static_cast<float>(count) : 0.f),
                       x.shape())};
                 });
  }
  return y;
}

Tensor sum_to_shape(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int lead = g.rank() - shape.rank();
  if (lead < 0)
    throw InvalidArgument("sum_to_shape: cannot reduce " + g.shape().to_string() + " to " +
                          shape.to_string());
  std::vector<int> axes;
  for (int i = 0; i < g.rank(); ++i)
    if (i < lead || (shape.dims()[static_cast<size_t>(i - lead)] == 1 &&
                     g.shape().dims()[static_cast<size_t>(i)] != 1))
      axes.push_back(i);
  if (axes.empty()) return reshape(g, shape);
  return reshape(sum(g, axes, false), shape);
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  std::vector<int64_t> d = shape.dims();
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] == -1) {
      if (infer >= 0) throw InvalidArgument("reshape: only one -1 allowed in " + shape.to_string());
      infer = static_cast<int>(i);
    } else {
      known *= d[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || x.numel() % known != 0)
      throw InvalidArgument("reshape: cannot reshape " + x.shape().to_string() + " to " +
                            shape.to_string());
    d[static_cast<size_t>(infer)] = x.numel() / known;
  }
  Tensor y = x.view(Shape(d));
  if (tape::should_record({&x}))
    tape::record("reshape", {x}, {y},
                 [s = x.shape()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   return {reshape(g[0], s)};
                 });
  return y;
}

Tensor flatten(const Tensor& x) {
  if (x.rank() < 1) throw InvalidArgument("flatten needs rank >= 1, got a scalar");
  int64_t rest = 1;
  for (int i = 1; i < x.rank(); ++i) rest *= x.shape()[i];
  return reshape(x, Shape{x.shape()[0], rest});  // explicit, so an empty batch flattens too
}

Tensor stop_gradient(const Tensor& x) { return x.view(x.shape()); }

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor y = kernels_for(x).cast(x, dtype);
  if (tape::should_record({&x}))
    tape::record("cast", {x}, {y},
                 [from = x.dtype()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   return {cast(g[0], from)};
                 });
  return y;
}

Tensor ones_like(const Tensor& x) {
  Tensor t = Tensor::empty(x.shape(), DType::kFloat32, x.device());
  kernels_for(t).fill(t, 1.f);
  return t;
}

Tensor zeros_like(const Tensor& x) { return Tensor::zeros(x.shape(), DType::kFloat32, x.device()); }

}  // namespace dtrain::ops
