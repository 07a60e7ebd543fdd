// Loss helpers with TF's distributed semantics.
#pragma once

#include <cstdint>

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

}  // namespace dtrain
