// The optimizers' update rules, apart from Keras' Optimizer (nn/optimizers.h): what one step does
// to one variable's value and slots, given its gradient and a learning rate. Parameter servers
// apply these where the variables live; nn::Optimizer adds replica reduction, clipping, schedules
// and slot variables on top. Nothing here knows strategies or replicas.
//
// Thread-safety: a rule is immutable after construction; apply() may run concurrently on
// different values.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

class DTRAIN_API UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  // The optimizer's name in configs: "sgd", "adam", "adamw", "rmsprop", "adagrad".
  virtual std::string name() const = 0;
  // The slots one variable needs, in order (Adam: "m", "v").
  virtual std::vector<std::string> slot_names() const = 0;
  // The value slot i starts from (0 for all but Adagrad's accumulator).
  virtual float slot_initial_value(int /*slot*/) const { return 0.f; }
  // The rule's own hyper-parameters as " key=value" pairs, in a fixed order.
  virtual std::string hyper_config() const = 0;
  // One step on `value` in place, for the gradient grad_scale * grad (what clipping by norm
  // leaves of it): decoupled weight decay (value -= lr * weight_decay * value) when
  // weight_decay > 0, then the rule's update. `slots` holds slot_names().size() tensors shaped
  // like value; `step` is this variable's 1-based step count. Adam does all of it in one pass.
  // Throws InvalidArgument when the slot count is wrong.
  void apply(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step, float lr,
             float weight_decay, float grad_scale = 1.f) const;

 protected:
  virtual void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
                      float lr) const = 0;
  // The whole of apply() in one pass (value multiplied by decay, the gradient by grad_scale);
  // false where the rule has no such kernel, and apply() scales the two first.
  virtual bool update_scaled(Tensor& /*value*/, const Tensor& /*grad*/,
                             std::vector<Tensor>& /*slots*/, int64_t /*step*/, float /*lr*/,
                             float /*grad_scale*/, float /*decay*/) const {
    return false;
  }
};

// SGD with momentum and Nesterov momentum (keras SGD). Throws InvalidArgument for momentum
// outside [0, 1).
class DTRAIN_API SgdRule : public UpdateRule {
 public:
  explicit SgdRule(float momentum = 0.f, bool nesterov = false);
  std::string name() const override { return "sgd"; }
  std::vector<std::string> slot_names() const override;
  std::string hyper_config() const override;

 protected:
  void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
              float lr) const override;

 private:
  float momentum_;
  bool nesterov_;
};

// Adam (epsilon outside the square root, bias correction folded into the rate); `name` "adamw"
// for AdamW, whose decay is the weight_decay argument of apply().
class DTRAIN_API AdamRule : public UpdateRule {
 public:
  AdamRule(float beta1 = 0.9f, float beta2 = 0.999f, float epsilon = 1e-7f,
           std::string name = "adam");
  std::string name() const override { return name_; }
  std::vector<std::string> slot_names() const override { return {"m", "v"}; }
  std::string hyper_config() const override;

 protected:
  void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
              float lr) const override;
  bool update_scaled(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
                     float lr, float grad_scale, float decay) const override;

 private:
  float beta1_, beta2_, epsilon_;
  std::string name_;
};

// RMSprop: v = rho v + (1-rho) g^2; with centered, a = rho a + (1-rho) g and the denominator is
// v - a^2; step = lr g / sqrt(denominator + epsilon); with momentum, m = momentum m + step and
// var -= m, else var -= step.
class DTRAIN_API RmspropRule : public UpdateRule {
 public:
  RmspropRule(float rho = 0.9f, float momentum = 0.f, float epsilon = 1e-7f, bool centered = false);
  std::string name() const override { return "rmsprop"; }
  std::vector<std::string> slot_names() const override;
  std::string hyper_config() const override;

 protected:
  void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
              float lr) const override;

 private:
  float rho_, momentum_, epsilon_;
  bool centered_;
};

// Adagrad: acc += g^2; var -= lr g / sqrt(acc + epsilon); acc starts at
// initial_accumulator_value.
class DTRAIN_API AdagradRule : public UpdateRule {
 public:
  explicit AdagradRule(float initial_accumulator_value = 0.1f, float epsilon = 1e-7f);
  std::string name() const override { return "adagrad"; }
  std::vector<std::string> slot_names() const override { return {"accumulator"}; }
  float slot_initial_value(int) const override { return initial_; }
  std::string hyper_config() const override;

 protected:
  void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
              float lr) const override;

 private:
  float initial_, epsilon_;
};

// An optimizer config line ("adam learning_rate=0.001 beta_1=0.9 ... global_clipnorm=0", what
// nn::Optimizer::config() writes) parsed: the rule and the numbers beside it.
struct DTRAIN_API UpdateConfig {
  std::unique_ptr<UpdateRule> rule;
  float learning_rate = 0.f;
  float weight_decay = 0.f;
  float clipnorm = 0.f;
  float clipvalue = 0.f;
  float global_clipnorm = 0.f;
};
// Keys left out take Keras' defaults. Throws InvalidArgument naming the line and the problem
// (unknown name or key, a value that is not a number or out of range).
DTRAIN_API UpdateConfig parse_update_config(const std::string& config);

}  // namespace dtrain
