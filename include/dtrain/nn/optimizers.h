// Optimizers (Keras semantics). apply_gradients() called inside a replica all-reduces (SUM) the
// gradients through the replica context first, so losses must be scaled by the global batch
// (losses.h: compute_average_loss), exactly as in TF. The optimizer never asks which strategy runs
// it. Slot variables are made with create_variable(), so they live where their variable lives.
//
// One step of apply_gradients, in order (as Keras 3 does it):
//   1. all-reduce the gradients across replicas (SUM), then the gradient aggregator, if one is set
//      (hvd::DistributedOptimizer's all-reduce across processes);
//   2. clip them: clipvalue (each element to [-c, c]), clipnorm (each gradient to L2 norm <= c),
//      global_clipnorm (all gradients together to L2 norm <= c); at most one of the norms;
//   3. lr = the schedule at iterations() (the count before this step);
//   4. decoupled weight decay: var -= lr * weight_decay * var;
//   5. the optimizer's own update with lr;  6. iterations() += 1.
// Under a strategy with an update_partition() (MirroredOptions::sharding, ZeRO) step 1 gives this
// replica only its part of each summed gradient, steps 2-5 run on that part (norms for clipping
// summed across the replicas), the optimizer keeps slots for the part alone (slot_shards()), and
// the strategy all-gathers the updated parts.
//
// Thread-safety: apply_gradients may be called concurrently by the replicas of one strategy.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/model/update_rules.h"
#include "dtrain/model/variable.h"
#include "dtrain/nn/schedules.h"

namespace dtrain {

class ReplicaContext;

// What every optimizer takes beside its own hyper-parameters (keras.optimizers.Optimizer's
// weight_decay, clipnorm, clipvalue, global_clipnorm). 0 = off.
struct DTRAIN_API OptimizerOptions {
  float weight_decay = 0.f;
  float clipnorm = 0.f;
  float clipvalue = 0.f;
  float global_clipnorm = 0.f;
};

// An optimizer is an update rule (model/update_rules.h) with Keras' machinery around it.
class DTRAIN_API Optimizer {
 public:
  // Throws InvalidArgument for a null rule or schedule, or options out of range.
  Optimizer(std::shared_ptr<const UpdateRule> rule, std::shared_ptr<LearningRateSchedule> schedule,
            OptimizerOptions options);
  virtual ~Optimizer() = default;

  // grads[i] belongs to vars[i]; undefined gradients are skipped (as TF skips None).
  // Throws InvalidArgument when the lists differ in length or a shape differs.
  void apply_gradients(const std::vector<Tensor>& grads,
                       const std::vector<std::shared_ptr<Variable>>& vars);
  // Creates slot variables up front (call inside strategy.scope(); apply_gradients does it lazily).
  void build(const std::vector<std::shared_ptr<Variable>>& vars);
  // Number of apply_gradients calls so far (this process's first replica's count).
  int64_t iterations() const;
  // Sets the count (a restored checkpoint's), for every replica; call between steps.
  void set_iterations(int64_t iterations);
  // The rate the next step uses: the schedule at iterations().
  float learning_rate() const;
  // Replaces the schedule with a constant rate (what keras' LearningRateScheduler does).
  void set_learning_rate(float lr);
  void set_schedule(std::shared_ptr<LearningRateSchedule> schedule);
  const std::shared_ptr<LearningRateSchedule>& schedule() const { return schedule_; }
  // Runs on the replica-reduced gradients before clipping and the update (step 1 above). It may
  // return nullopt to apply nothing this call (the iteration count does not move): gradient
  // accumulation. Set it before training; one aggregator at a time (an empty function removes it).
  using GradientAggregator =
      std::function<std::optional<std::vector<Tensor>>(std::vector<Tensor> grads)>;
  void set_gradient_aggregator(GradientAggregator aggregator) {
    aggregator_ = std::move(aggregator);
  }
  const OptimizerOptions& options() const { return options_; }
  // The optimizer's name in configs and checkpoints: "sgd", "adam", "adamw", "rmsprop", "adagrad".
  std::string name() const { return rule_->name(); }
  const UpdateRule& rule() const { return *rule_; }
  // Slot variables in a fixed order: by the order variables were first seen (build() or
  // apply_gradients()), then by slot. Slot i of variable "dense/kernel" is named
  // "optimizer/dense/kernel/<slot_names()[i]>".
  // Under sharded optimizer state (a strategy with an update_partition(), ZeRO), slots are not
  // variables: see slot_shards(); slot_variables() then holds none of them.
  std::vector<std::shared_ptr<Variable>> slot_variables() const;
  // Sharded optimizer state: this process's parts of the slots, one entry per slot and local part,
  // in slot_variables()' order (variables first seen, then slot, then part). `value` aliases the
  // part's memory: the flat elements [first, first + value.numel()) of the whole slot, which is
  // shaped like its variable (`shape`); writing into it sets the slot.
  struct SlotShard {
    std::string name;  // the whole slot's name: "optimizer/<variable>/<slot>"
    Shape shape;       // the whole slot's shape
    int part = 0;      // partition_range(shape.numel(), part, parts)
    int parts = 1;
    int64_t first = 0;
    Tensor value;
  };
  std::vector<SlotShard> slot_shards() const;
  // After the strategy's update partition changed (an elastic job re-formed with another number of
  // workers): forgets the sharded slots made for the old partition, so that build() makes them for
  // the new one, starting afresh. Returns whether any were forgotten. Checkpoint::restore calls it
  // before it fills the slots from the checkpoint. Not while a step runs.
  bool repartition_slots();
  std::vector<std::string> slot_names() const { return rule_->slot_names(); }
  int slots_per_variable() const { return static_cast<int>(rule_->slot_names().size()); }
  // The value slot i starts from (0 for all but Adagrad's accumulator).
  float slot_initial_value(int slot) const { return rule_->slot_initial_value(slot); }

  // The optimizer and all its hyper-parameters as one line, e.g.
  // "adam learning_rate=0.001 beta_1=0.9 beta_2=0.999 epsilon=1e-07 weight_decay=0 clipnorm=0
  // clipvalue=0 global_clipnorm=0", with the learning rate the next step uses; from_config() turns
  // it back into an equal optimizer (how a parameter server learns the job's optimizer, and what
  // --optimizer parses). Keys left out take their defaults. Throws InvalidArgument naming the
  // line and the problem (unknown name or key, a value that is not a number or out of range).
  std::string config() const;
  static std::unique_ptr<Optimizer> from_config(const std::string& config);

  // One update of `value` in place with learning rate `lr`, with `slots` (slots_per_variable()
  // tensors shaped like value, set to slot_initial_value() before the first step) and the 1-based
  // step count of this variable. Weight decay included; clipping is not (it needs all gradients).
  void apply_dense(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
                   float lr);
  // The same with the rate config() carried (parameter servers).
  void apply_dense(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step) {
    apply_dense(value, grad, slots, step, learning_rate());
  }

  // Keras' exclude_from_weight_decay(var_names=...): variables whose name contains one of these
  // strings get no weight decay (language models exclude biases, norms and embeddings:
  // {"bias", "gamma", "beta", "embeddings"}). Call before training.
  void exclude_from_weight_decay(std::vector<std::string> var_names) {
    decay_excluded_ = std::move(var_names);
  }
  // The weight decay `variable` gets: options().weight_decay unless excluded.
  float weight_decay_for(const Variable& variable) const;

 private:
  std::vector<std::shared_ptr<Variable>>& slots_for(const Variable* v);
  // One local part's slots of a variable (sharded state).
  struct PartSlots {
    int part = 0, parts = 1;
    int64_t first = 0, count = 0;
    std::vector<Tensor> slots;
  };
  // The part's slots, made at slot_initial_value() on `device` when new (caller holds mu_).
  // Throws FailedPrecondition when the variable's slots were made for another partition.
  PartSlots& part_slots_for(const Variable& v, int part, int parts, const DeviceSpec& device);
  // The sharded update (a strategy with an update_partition()).
  void apply_partitioned(ReplicaContext& ctx, const std::vector<Tensor>& grads,
                         const std::vector<std::shared_ptr<Variable>>& vars);
  // Clipping: clipvalue on `grads` in place, and the factor clipping by norm multiplies each by
  // (1 where it does not), which the update rule applies in its own pass over the gradient.
  std::vector<float> clip(std::vector<Tensor>& grads) const;
  // clip() for the parts of gradients one replica holds: norms are summed across the replicas.
  std::vector<float> clip_parts(ReplicaContext& ctx, std::vector<Tensor>& parts) const;
  // The update of this replica's slices of variables whose replicas share memory (see
  // ReplicaContext::reduce_scatter_for_update); ends with ctx.end_sharded_update().
  void apply_slices(ReplicaContext& ctx, const std::vector<Tensor>& grads,
                    const std::vector<int64_t>& offsets,
                    const std::vector<std::shared_ptr<Variable>>& vars, bool partitioned = false);
  std::shared_ptr<const UpdateRule> rule_;
  std::shared_ptr<LearningRateSchedule> schedule_;
  OptimizerOptions options_;
  GradientAggregator aggregator_;
  mutable std::mutex mu_;
  std::vector<std::string> decay_excluded_;
  std::map<const Variable*, size_t> slot_index_;
  std::deque<std::vector<std::shared_ptr<Variable>>>
      slots_;  // in first-seen order; stable references
  struct VariableParts {
    std::string name;
    Shape shape;
    std::deque<PartSlots> parts;  // this process's, in the order made; stable references
  };
  std::map<const Variable*, size_t> part_index_;
  std::deque<VariableParts> part_slots_;  // in first-seen order; stable references
  int64_t base_iterations_ = 0;
  std::map<int, int64_t> steps_;  // per replica id
};

// Stochastic gradient descent, with momentum and Nesterov momentum (keras SGD).
class DTRAIN_API SGD : public Optimizer {
 public:
  explicit SGD(float learning_rate = 0.01f, float momentum = 0.f, bool nesterov = false,
               OptimizerOptions options = {});
  SGD(std::shared_ptr<LearningRateSchedule> schedule, float momentum = 0.f, bool nesterov = false,
      OptimizerOptions options = {});
};

// Adam (keras Adam; epsilon outside the square root, bias correction folded into the rate).
class DTRAIN_API Adam : public Optimizer {
 public:
  explicit Adam(float learning_rate = 1e-3f, float beta1 = 0.9f, float beta2 = 0.999f,
                float epsilon = 1e-7f, OptimizerOptions options = {});
  Adam(std::shared_ptr<LearningRateSchedule> schedule, float beta1 = 0.9f, float beta2 = 0.999f,
       float epsilon = 1e-7f, OptimizerOptions options = {});
};

// AdamW: Adam with decoupled weight decay (keras AdamW; weight_decay defaults to 0.004).
class DTRAIN_API AdamW : public Optimizer {
 public:
  explicit AdamW(float learning_rate = 1e-3f, float weight_decay = 0.004f, float beta1 = 0.9f,
                 float beta2 = 0.999f, float epsilon = 1e-7f, OptimizerOptions options = {});
};

// RMSprop (keras RMSprop): v = rho v + (1-rho) g^2; with centered, a = rho a + (1-rho) g and the
// denominator is v - a^2; step = lr g / sqrt(denominator + epsilon); with momentum,
// m = momentum m + step and var -= m, else var -= step.
class DTRAIN_API RMSprop : public Optimizer {
 public:
  explicit RMSprop(float learning_rate = 1e-3f, float rho = 0.9f, float momentum = 0.f,
                   float epsilon = 1e-7f, bool centered = false, OptimizerOptions options = {});
};

// Adagrad (keras Adagrad): acc += g^2; var -= lr g / sqrt(acc + epsilon); acc starts at
// initial_accumulator_value.
class DTRAIN_API Adagrad : public Optimizer {
 public:
  explicit Adagrad(float learning_rate = 1e-3f, float initial_accumulator_value = 0.1f,
                   float epsilon = 1e-7f, OptimizerOptions options = {});
};

// Horovod's rule for data parallelism: the rate multiplied by the number of replicas in sync
// (hvd.size()), for use with a global batch that grows with the replicas.
DTRAIN_API float scale_learning_rate(float learning_rate, int num_replicas_in_sync);

}  // namespace dtrain
