// Neural-network ops: convolution, pooling, losses, dropout, batch norm. Their backward passes are
// fused device kernels (first-order only); when an outer tape watches the backward pass they
// record a node that refuses a second differentiation instead of silently returning zero.
#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "model/op_util.h"

namespace dtrain::ops {

Conv2dParams conv_params(const Shape& x, const Shape& w, int sh, int sw, Padding padding) {
  Conv2dParams p;
  p.stride_h = sh;
  p.stride_w = sw;
  if (padding == Padding::kSame) {
    if (x.rank() != 4 || w.rank() < 2) throw InvalidArgument("conv_params: x must be NHWC");
    auto pad = [](int64_t in, int64_t k, int s, int* before, int* after) {
      const int64_t out = (in + s - 1) / s;
      const int64_t total = std::max<int64_t>(0, (out - 1) * s + k - in);
      *before = static_cast<int>(total / 2);  // TF puts the extra row at the end
      *after = static_cast<int>(total - total / 2);
    };
    pad(x[1], w[0], sh, &p.pad_top, &p.pad_bottom);
    pad(x[2], w[1], sw, &p.pad_left, &p.pad_right);
  }
  return p;
}

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, int sh, int sw,
              Padding padding) {
  return conv2d(x, w, bias, conv_params(x.shape(), w.shape(), sh, sw, padding));
}

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p) {
  same_device("conv2d", x, w);
  if (p.stride_h < 1 || p.stride_w < 1 || p.pad_top < 0 || p.pad_bottom < 0 || p.pad_left < 0 ||
      p.pad_right < 0)
    throw InvalidArgument("conv2d: strides must be >= 1 and pads >= 0; got strides " +
                          std::to_string(p.stride_h) + "x" + std::to_string(p.stride_w) +
                          ", pads (top, bottom, left, right) " + std::to_string(p.pad_top) + ", " +
                          std::to_string(p.pad_bottom) + ", " + std::to_string(p.pad_left) + ", " +
                          std::to_string(p.pad_right));
  if (x.rank() == 4 && w.rank() == 4 &&
      (x.shape()[1] + p.pad_top + p.pad_bottom < w.shape()[0] ||
       x.shape()[2] + p.pad_left + p.pad_right < w.shape()[1]))
    throw InvalidArgument("conv2d: the " + w.shape().to_string() + " filter is larger than the " +
                          x.shape().to_string() + " input with its padding");
  Kernels& k = kernels_for(x);
  const bool records = tape::should_record({&x, &w, &bias});
  const bool one_tape = records && tape::recording_tapes({&x, &w, &bias}) == 1;
  // Under mixed_bfloat16 the filter's gradient reads x rounded to bfloat16: only that is kept. On
  // the CPU that is a bfloat16 copy, which the forward pass reads too (its kernel would make the
  // same copy), or x itself where x is already bfloat16 (a batch norm's bfloat16 output).
  const Tensor kept = one_tape ? keep_for_backward(x) : x;
  Conv2dParams kp = p;
  kp.bf16_output = p.bf16_output && one_tape && bf16_activations(x);
  Tensor y = k.conv2d(kept.dtype() == DType::kBFloat16 ? kept : x, w, bias, kp);
  if (records) {
    tape::record("conv2d", {x, w, bias}, {y},
                 [kept, x_shape = x.shape(), w, bias,
                  p](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   Kernels& k = kernels_for(w);
                   Tensor db, dx, dw;
                   const bool want_dx = tape::needs_gradient(0),
                              want_dw = tape::needs_gradient(1) || tape::needs_gradient(2);
                   // Both gradients (and the bias's) read g rounded to bfloat16 under
                   // mixed_bfloat16: on the CPU one copy serves both products (not under an
                   // outer tape, which differentiates g).
                   const Tensor dy = want_dx && want_dw && !tape::should_record({&g[0], &kept, &w})
                                         ? kernel_copy(g[0])
                                         : g[0];
                   // The input's gradient only when the tape wants it: never for the data fed to
                   // the first layer (TF and PyTorch skip it too); the filter's and bias's
                   // likewise.
                   if (want_dx) dx = k.conv2d_backward_input(dy, w, x_shape, p);
                   if (want_dw)
                     dw = k.conv2d_backward_filter(kept, dy, w.shape(), p, bias.defined(), &db);
                   if (tape::should_record({&g[0], &kept, &w})) {
                     std::vector<Tensor> outs;
                     for (const Tensor* t : {&dx, &dw, &db})
                       if (t->defined()) outs.push_back(*t);
                     if (!outs.empty())
                       tape::record_nondifferentiable("conv2d_grad", {g[0], kept, w}, outs);
                   }
                   return {dx, dw, db};
                 });
  }
  return y;
}

namespace {

Pool2dParams pool_params(const Shape& x, int wh, int ww, int sh, int sw, Padding padding) {
  Pool2dParams p;
  p.window_h = wh;
  p.window_w = ww;
  p.stride_h = sh;
  p.stride_w = sw;
  if (padding == Padding::kSame) {
    const Conv2dParams c = conv_params(x, Shape{wh, ww}, sh, sw, padding);
    p.pad_top = c.pad_top;
    p.pad_bottom = c.pad_bottom;
    p.pad_left = c.pad_left;
    p.pad_right = c.pad_right;
  }
  return p;
}

}  // namespace

Tensor max_pool2d(const Tensor& x, int wh, int ww, int sh, int sw, Padding padding) {
  const Pool2dParams p = pool_params(x.shape(), wh, ww, sh, sw, padding);
  Tensor ws;
  Tensor y = kernels_for(x).max_pool2d(x, p, &ws);
  if (tape::should_record({&x})) {
    tape::record("max_pool2d", {x}, {y},
                 [x, ws, p](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   Tensor dx = kernels_for(x).max_pool2d_backward(g[0], x, ws, p);
                   if (tape::should_record({&g[0], &x}))
                     tape::record_nondifferentiable("max_pool2d_grad", {g[0], x}, {dx});
                   return {dx};
                 });
  }
  return y;
}

Tensor conv2d_max_pool2d(const Tensor& x, const Tensor& w, const Tensor& bias, int stride,
                         Padding conv_padding, int window, int pool_stride, Padding pool_padding,
                         bool relu) {
  same_device("conv2d_max_pool2d", x, w);
  if (x.rank() != 4 || w.rank() != 4)
    throw InvalidArgument("conv2d_max_pool2d expects x [N,H,W,C] and w [KH,KW,Cin,Cout], got " +
                          x.shape().to_string() + " and " + w.shape().to_string());
  const Conv2dParams cp = conv_params(x.shape(), w.shape(), stride, stride, conv_padding);
  const Shape conv_shape{x.shape()[0],
                         conv_output_size(x.shape()[1], static_cast<int>(w.shape()[0]), stride,
                                          cp.pad_top, cp.pad_bottom),
                         conv_output_size(x.shape()[2], static_cast<int>(w.shape()[1]), stride,
                                          cp.pad_left, cp.pad_right),
                         w.shape()[3]};
  Kernels& k = kernels_for(x);
  if (relu && !k.fuses_pool_relu())
    return ops::relu(conv2d_max_pool2d(x, w, bias, stride, conv_padding, window, pool_stride,
                                       pool_padding, false));
  Pool2dParams pp = pool_params(conv_shape, window, window, pool_stride, pool_stride, pool_padding);
  pp.relu = relu;
  auto saved = std::make_shared<ConvPoolSaved>();
  Tensor y = k.conv2d_max_pool2d(x, w, bias, cp, pp, saved.get());
  if (tape::should_record({&x, &w, &bias})) {
    tape::record("conv2d_max_pool2d", {x, w, bias}, {y},
                 [x, w, bias, cp, pp, saved](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   const bool want_dx = tape::needs_gradient(0);
                   const bool want_dw = tape::needs_gradient(1) || tape::needs_gradient(2);
                   ConvPoolGrads r = kernels_for(x).conv2d_max_pool2d_backward(
                       g[0], x, w, bias.defined(), *saved, cp, pp, want_dx, want_dw);
                   if (tape::should_record({&g[0], &x, &w})) {
                     std::vector<Tensor> outs;
                     for (const Tensor* t : {&r.dx, &r.dw, &r.db})
                       if (t->defined()) outs.push_back(*t);
                     if (!outs.empty())
                       tape::record_nondifferentiable("conv2d_max_pool2d_grad", {g[0], x, w}, outs);
                   }
                   return {r.dx, r.dw, r.db};
                 });
  }
  return y;
}

Tensor sparse_softmax_cross_entropy(const Tensor& logits, const Tensor& labels) {
  same_device("sparse_softmax_cross_entropy", logits, labels);
  Tensor loss, probs;
  kernels_for(logits).softmax_cross_entropy(logits, labels, &loss, &probs);
  if (tape::should_record({&logits})) {
    tape::record(
        "sparse_softmax_cross_entropy", {logits, labels}, {loss},
        [probs, labels](const std::vector<Tensor>& g) -> std::vector<Tensor> {
          Tensor d = kernels_for(probs).softmax_cross_entropy_backward(probs, labels, g[0]);
          if (tape::should_record({&g[0]}))
            tape::record_nondifferentiable("sparse_softmax_cross_entropy_grad", {g[0]}, {d});
          return {d, Tensor()};
        });
  }
  return loss;
}

Tensor mean_squared_error(const Tensor& pred, const Tensor& target) {
  if (pred.shape() != target.shape())
    throw InvalidArgument("mean_squared_error: prediction " + pred.shape().to_string() +
                          " and target " + target.shape().to_string() + " differ");
  Tensor sq = square(sub(pred, target));
  if (sq.rank() <= 1) return sq;
  std::vector<int> axes;
  for (int i = 1; i < sq.rank(); ++i) axes.push_back(i);
  return mean(sq, axes, false);
}

Tensor dropout(const Tensor& x, float rate, bool training, uint64_t seed, uint64_t stream) {
  if (!training || rate == 0.f) return x;
  Tensor mask = kernels_for(x).dropout_mask(x.shape(), rate, seed, stream);
  return mul(x, mask);
}

namespace {
// Batch norm's input. Under mixed_bfloat16 it is rounded to bfloat16 in the forward pass (Keras's
// convolution before it outputs bfloat16) and the backward pass reads the same values: `kept`, a
// bfloat16 copy (which the CPU's kernels read as it is, both ways), or under an outer tape (which
// differentiates the backward pass) the rounded float32 values, with `outer` = x so that that tape
// still sees the backward pass read x.
struct BatchNormInput {
  Tensor x;      // what the forward pass normalizes
  Tensor kept;   // what the backward pass reads (bfloat16 under the policy on the CPU)
  Tensor outer;  // x under an outer tape, else undefined
  // dx's: bfloat16 where x is a convolution's bfloat16 output (Conv2D::bfloat16_output), whose
  // backward kernels read the gradient rounded so; the gradient of a bfloat16 tensor is bfloat16,
  // as in Keras. Else float32.
  DType dx_dtype = DType::kFloat32;
};
BatchNormInput batch_norm_input(const Tensor& x, const Tensor& gamma, const Tensor& beta) {
  BatchNormInput in;
  const int tapes = tape::recording_tapes({&x, &gamma, &beta});
  // (With no tape or an outer one, a copy of its own, so that the kernels read the same values
  // the same way whatever records.)
  in.kept = tapes == 1 ? keep_for_backward(x) : kernel_copy(x);
  if (tapes > 1) in.outer = x;
  if (tapes == 1 && x.dtype() == DType::kBFloat16 && bf16_activations(x))
    in.dx_dtype = DType::kBFloat16;
  // Devices that keep float32 (GPUs) return x itself: round it all the same.
  if (in.kept.id() == x.id()) in.kept = rounded_under_policy(x);
  in.x = in.kept;
  return in;
}
}  // namespace

Tensor batch_norm_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                           Tensor* batch_mean, Tensor* batch_var) {
  const BatchNormInput in = batch_norm_input(x, gamma, beta);
  BatchNormForward f = kernels_for(x).batch_norm_training(in.x, gamma, beta, eps);
  *batch_mean = f.mean;
  *batch_var = f.var;
  if (tape::should_record({&x, &gamma, &beta})) {
    tape::record("batch_norm", {x, gamma, beta}, {f.y},
                 [kept = in.kept, outer = in.outer, gamma, mean = f.mean, var = f.var, eps,
                  dx_t = in.dx_dtype](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   // (not f: its output y need not live until the backward pass)
                   BatchNormBackward b = kernels_for(gamma).batch_norm_backward(
                       g[0], kept, gamma, mean, var, eps, dx_t);
                   const Tensor& read = outer.defined() ? outer : kept;
                   if (tape::should_record({&g[0], &read, &gamma}))
                     tape::record_nondifferentiable("batch_norm_grad", {g[0], read, gamma},
                                                    {b.dx, b.dgamma, b.dbeta});
                   return {b.dx, b.dgamma, b.dbeta};
                 });
  }
  return f.y;
}

Tensor batch_norm_relu_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                                Tensor* batch_mean, Tensor* batch_var, bool bf16_output) {
  Tensor mask;
  const BatchNormInput in = batch_norm_input(x, gamma, beta);
  const bool bf16_y = bf16_output && tape::recording_tapes({&x, &gamma, &beta}) == 1 &&
                      tape::should_record({&x, &gamma, &beta}) && bf16_activations(x);
  BatchNormForward f = kernels_for(x).batch_norm_relu_training(
      in.x, gamma, beta, eps, &mask, bf16_y ? DType::kBFloat16 : DType::kFloat32);
  *batch_mean = f.mean;
  *batch_var = f.var;
  if (tape::should_record({&x, &gamma, &beta})) {
    tape::record("batch_norm_relu", {x, gamma, beta}, {f.y},
                 [kept = in.kept, outer = in.outer, gamma, mean = f.mean, var = f.var, eps, mask,
                  dx_t = in.dx_dtype](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   BatchNormBackward b = kernels_for(gamma).batch_norm_relu_backward(
                       g[0], kept, gamma, mean, var, eps, mask, dx_t);
                   const Tensor& read = outer.defined() ? outer : kept;
                   if (tape::should_record({&g[0], &read, &gamma}))
                     tape::record_nondifferentiable("batch_norm_relu_grad", {g[0], read, gamma},
                                                    {b.dx, b.dgamma, b.dbeta});
                   return {b.dx, b.dgamma, b.dbeta};
                 });
  }
  return f.y;
}

Tensor batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            const Tensor& mean, const Tensor& var, float eps) {
  // Under mixed_bfloat16 on x rounded to bfloat16, as in training.
  const Tensor xr = rounded_under_policy(x);
  Tensor y = kernels_for(x).batch_norm_inference(xr, gamma, beta, mean, var, eps);
  if (tape::should_record({&x, &gamma, &beta})) {
    // An affine map per channel (the last axis), y = (x - mean) * gamma / sqrt(var + eps) + beta,
    // with the moving statistics constant: fine-tuning with frozen statistics, saliency maps and
    // adversarial inputs through a model called with training=false differentiate it. Written
    // with ops, so an outer tape differentiates it again.
    tape::record("batch_norm_inference", {x, gamma, beta}, {y},
                 [xr, gamma, mean, var, eps, x_dtype = x.dtype()](const std::vector<Tensor>& g) {
                   const Tensor f32 =
                       g[0].dtype() == DType::kFloat32 ? g[0] : cast(g[0], DType::kFloat32);
                   std::vector<int> axes(static_cast<size_t>(f32.shape().rank() - 1));
                   for (size_t i = 0; i < axes.size(); ++i) axes[i] = static_cast<int>(i);
                   const Tensor inv = div(ones_like(var), sqrt(add_scalar(var, eps)));
                   Tensor dx = mul(f32, mul(gamma, inv));
                   const Tensor xf = xr.dtype() == DType::kFloat32 ? xr : cast(xr, DType::kFloat32);
                   Tensor dgamma = sum(mul(f32, mul(sub(xf, mean), inv)), axes);
                   Tensor dbeta = sum(f32, axes);
                   if (x_dtype != DType::kFloat32) dx = cast(dx, x_dtype);
                   return std::vector<Tensor>{dx, dgamma, dbeta};
                 });
  }
  return y;
}

}  // namespace dtrain::ops
