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

}  // namespace dtrain
