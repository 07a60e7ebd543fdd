// Keras' optimizer classes: each is Optimizer with its update rule (model/update_rules.h).
#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/nn/optimizers.h"

namespace dtrain {
namespace {

// 0 is a rate: a warm-up starts there and a cosine decay with alpha 0 ends there, and a parameter
// server is handed each step's rate.
float checked_lr(float lr) {
  if (!(lr >= 0.f) || !std::isfinite(lr))
    throw InvalidArgument("learning rate must be finite and >= 0, got " + std::to_string(lr));
  return lr;
}
std::shared_ptr<LearningRateSchedule> constant(float lr) {
  return std::make_shared<ConstantSchedule>(checked_lr(lr));
}
OptimizerOptions with_decay(OptimizerOptions o, float wd) {
  o.weight_decay = wd;
  return o;
}

}  // namespace

SGD::SGD(float lr, float momentum, bool nesterov, OptimizerOptions options)
    : SGD(constant(lr), momentum, nesterov, options) {}
SGD::SGD(std::shared_ptr<LearningRateSchedule> s, float momentum, bool nesterov,
         OptimizerOptions options)
    : Optimizer(std::make_shared<SgdRule>(momentum, nesterov), std::move(s), options) {}

Adam::Adam(float lr, float b1, float b2, float eps, OptimizerOptions options)
    : Adam(constant(lr), b1, b2, eps, options) {}
Adam::Adam(std::shared_ptr<LearningRateSchedule> s, float b1, float b2, float eps,
           OptimizerOptions options)
    : Optimizer(std::make_shared<AdamRule>(b1, b2, eps), std::move(s), options) {}

AdamW::AdamW(float lr, float wd, float b1, float b2, float eps, OptimizerOptions options)
    : Optimizer(std::make_shared<AdamRule>(b1, b2, eps, "adamw"), constant(lr),
                with_decay(options, wd)) {}

RMSprop::RMSprop(float lr, float rho, float momentum, float eps, bool centered,
                 OptimizerOptions options)
    : Optimizer(std::make_shared<RmspropRule>(rho, momentum, eps, centered), constant(lr),
                options) {}

Adagrad::Adagrad(float lr, float init, float eps, OptimizerOptions options)
    : Optimizer(std::make_shared<AdagradRule>(init, eps), constant(lr), options) {}

}  // namespace dtrain
