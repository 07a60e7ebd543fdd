// Batch normalisation over the global batch of all replicas in sync (see sync_batch_norm.cc).
#pragma once

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {
class ReplicaContext;
namespace ops {
// Training-mode batch norm over all but the last axis, with statistics of the global batch.
// Every replica must call it (it all-reduces in forward and backward); replicas may have 0 rows.
DTRAIN_API Tensor sync_batch_norm_training(ReplicaContext& ctx, const Tensor& x,
                                           const Tensor& gamma, const Tensor& beta, float epsilon,
                                           Tensor* batch_mean, Tensor* batch_var);
}  // namespace ops
}  // namespace dtrain
