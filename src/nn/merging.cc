#include "dtrain/nn/merging.h"

namespace dtrain {
namespace {

void need_two(const Layer& l, const std::vector<Tensor>& xs) {
  if (xs.size() < 2)
    throw InvalidArgument(l.class_name() + " layer '" + l.path() +
                          "' needs at least 2 inputs, got " + std::to_string(xs.size()));
}

// op(a, b, last): last is true for the last input.
template <class Op>
std::vector<Tensor> fold(const Layer& l, const std::vector<Tensor>& xs, Op op) {
  need_two(l, xs);
  Tensor y = xs[0];
  for (size_t i = 1; i < xs.size(); ++i) {
    try {
      y = op(y, xs[i], i + 1 == xs.size());
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(l.class_name() + " layer '" + l.path() + "': input " +
                            std::to_string(i) + " " + xs[i].shape().to_string() +
                            " does not fit input 0 " + xs[0].shape().to_string() + ": " + e.what());
    }
  }
  return {y};
}

}  // namespace

std::vector<Tensor> Add::call(const std::vector<Tensor>& xs, bool) {
  return fold(*this, xs, [](const Tensor& a, const Tensor& b, bool) { return ops::add(a, b); });
}

Layer::FusedCall Add::fuse_with_next(const Layer& next) {
  if (next.activation_spec() != Activation::kRelu || !built() || !next.built()) return {};
  return [this](const std::vector<Tensor>& xs, bool) {
    // The same sums in the same order as Add then ReLU; the last one with the ReLU.
    return fold(*this, xs,
                [](const Tensor& a, const Tensor& b, bool last) {
                  return last ? ops::add_relu(a, b) : ops::add(a, b);
                })
        .at(0);
  };
}

std::vector<Tensor> Multiply::call(const std::vector<Tensor>& xs, bool) {
  return fold(*this, xs, [](const Tensor& a, const Tensor& b, bool) { return ops::mul(a, b); });
}

std::vector<Tensor> Concatenate::call(const std::vector<Tensor>& xs, bool) {
  need_two(*this, xs);
  try {
    return {ops::concat(xs, axis_)};
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("Concatenate layer '" + path() + "': " + e.what());
  }
}

}  // namespace dtrain
