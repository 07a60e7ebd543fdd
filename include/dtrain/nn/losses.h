// Loss helpers with TF's distributed semantics.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

// TF's tf.nn.compute_average_loss: sum(per_example_loss) / global_batch_size. When
// global_batch_size <= 0 it is per_example_loss.shape[0] * num_replicas_in_sync, which is only
// right for equal per-replica batches; pass the true global batch otherwise. A replica with an
// empty batch returns 0 and still takes part in gradient all-reduces.
DTRAIN_API Tensor compute_average_loss(const Tensor& per_example_loss,
                                       int64_t global_batch_size = 0);
// TF's scale_regularization_loss: loss / num_replicas_in_sync.
DTRAIN_API Tensor scale_regularization_loss(const Tensor& loss);

// A per-example loss of (predictions, labels): [N, ...] -> [N].
using LossFn = std::function<Tensor(const Tensor& predictions, const Tensor& labels)>;

// A loss by Keras' name (keras.losses.get), per example:
//   "sparse_categorical_crossentropy" (logits [N, C] against int32 labels [N]; dtrain's models
//     output logits, so this is Keras' from_logits=True; for sequences, logits [N, T, C] and
//     labels [N, T], each example's loss is its mean over the T positions),
//   "mean_squared_error" / "mse", "mean_absolute_error" / "mae" (mean over the last axis).
// Throws InvalidArgument for another name, listing these.
DTRAIN_API LossFn get_loss(const std::string& name);

}  // namespace dtrain
