// Activation recomputation (gradient checkpointing), as TF's tf.recompute_grad and PyTorch's
// torch.utils.checkpoint: a function's outputs are computed without keeping its intermediate
// tensors for the backward pass; the backward pass runs the function again, under a tape of its
// own, and differentiates that. Memory for a stack of N blocks falls from N blocks' activations to
// N blocks' inputs plus one block's activations, for one more forward pass of compute.
//
// The replay must compute what the first pass did. Layers cooperate through replaying() and
// replayed_draw(): Dropout draws the same masks (its call counter is logged on the first pass and
// read back on the replay), BatchNormalization does not update its moving statistics a second
// time. A function with other side effects must check replaying() itself.
//
// Thread-safety: the state is per thread (each replica's step runs on its own thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

class Variable;

using RecomputeFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;

// Returns f(inputs). When a tape on this thread records (the inputs or `variables` are watched),
// f runs with every tape paused and one node is recorded instead, whose backward runs f again and
// returns the gradients for the inputs and for `variables` (the trainable variables f reads: their
// gradients reach the outer tape as if f had been recorded op by op; the results are bitwise the
// same). Without a recording tape it is f(inputs). First-order only: differentiating the gradient
// again throws Unimplemented.
DTRAIN_API std::vector<Tensor> recompute_grad(
    const RecomputeFn& f, const std::vector<Tensor>& inputs,
    const std::vector<std::shared_ptr<Variable>>& variables);

// Called around the backward pass's replay: before_replay before f runs again, after_replay once
// the replay's gradients are computed (also when that throws). A layer whose variables are
// sharded across replicas gathers them there (PyTorch FSDP's pre- and post-backward hooks).
struct DTRAIN_API RecomputeHooks {
  std::function<void()> before_replay;
  std::function<void()> after_replay;
};
DTRAIN_API std::vector<Tensor> recompute_grad(
    const RecomputeFn& f, const std::vector<Tensor>& inputs,
    const std::vector<std::shared_ptr<Variable>>& variables, RecomputeHooks hooks);

namespace recompute {
// True while a recompute_grad backward pass replays its function on this thread.
DTRAIN_API bool replaying();
// For a layer's random draws: returns fresh() normally; inside a recomputed function's first pass
// it also logs the value, and on the replay returns the logged values in order instead of calling
// fresh(). Throws Internal when a replay asks for more draws than the first pass made.
DTRAIN_API uint64_t replayed_draw(const std::function<uint64_t()>& fresh);
}  // namespace recompute

}  // namespace dtrain
