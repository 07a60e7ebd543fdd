#include "dtrain/nn/losses.h"

#include "dtrain/model/ops.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

namespace {
int replicas() {
  ReplicaContext* ctx = get_replica_context();
  return ctx ? ctx->num_replicas_in_sync() : get_strategy().num_replicas_in_sync();
}
}  // namespace

Tensor compute_average_loss(const Tensor& per_example_loss, int64_t global_batch_size) {
  if (per_example_loss.rank() < 1)
    throw InvalidArgument("compute_average_loss expects per-example losses [N], got a scalar");
  if (global_batch_size <= 0) global_batch_size = per_example_loss.shape()[0] * replicas();
  if (global_batch_size <= 0) return ops::sum(per_example_loss);  // empty batch everywhere: 0
  return ops::scale(ops::sum(per_example_loss), 1.f / static_cast<float>(global_batch_size));
}

Tensor scale_regularization_loss(const Tensor& loss) {
  return ops::scale(loss, 1.f / static_cast<float>(replicas()));
}

LossFn get_loss(const std::string& name) {
  if (name == "sparse_categorical_crossentropy")
    return [](const Tensor& logits, const Tensor& labels) {
      if (logits.rank() <= 2) return ops::sparse_softmax_cross_entropy(logits, labels);
      // A sequence [N, T, ..., V]: the example's loss is the mean over its positions (so the
      // batch's average loss is the mean per token, as Keras reduces it).
      std::vector<int> positions;
      for (int i = 1; i < logits.rank() - 1; ++i) positions.push_back(i);
      return ops::mean(ops::sequence_cross_entropy(logits, labels), positions);
    };
  if (name == "mse" || name == "mean_squared_error")
    return [](const Tensor& pred, const Tensor& target) {
      return ops::mean_squared_error(pred, target);
    };
  if (name == "mae" || name == "mean_absolute_error")
    return [](const Tensor& pred, const Tensor& target) {
      if (pred.shape() != target.shape())
        throw InvalidArgument("mean_absolute_error: predictions " + pred.shape().to_string() +
                              " and targets " + target.shape().to_string() + " differ");
      const Tensor d = ops::sub(pred, target);
      // |d| = relu(d) + relu(-d): differentiable everywhere but 0, where its gradient is 0.
      // Per example, the mean over every other axis, as mean_squared_error and Keras (whose
      // mean over the last axis is averaged over the rest by its reduction): the mean over the
      // last axis alone left [N, T, K] predictions' loss T times Keras's, and [N] ones a scalar.
      const Tensor a = ops::add(ops::relu(d), ops::relu(ops::neg(d)));
      if (a.rank() <= 1) return a;
      std::vector<int> axes;
      for (int i = 1; i < a.rank(); ++i) axes.push_back(i);
      return ops::mean(a, axes);
    };
  throw InvalidArgument("unknown loss '" + name +
                        "'; known: sparse_categorical_crossentropy, mean_squared_error (mse), "
                        "mean_absolute_error (mae)");
}

}  // namespace dtrain
