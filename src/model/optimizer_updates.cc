// The update rule of each optimizer. SGD and Adam have fused per-device kernels; the others are
// composed from the device's elementwise kernels, so they run on every device unchanged.
#include <cmath>

#include "config_line.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/optimizers.h"

namespace dtrain {

using detail::kv;

namespace {

void check_lr(float lr) {
  if (!(lr > 0.f)) throw InvalidArgument("learning rate must be > 0, got " + std::to_string(lr));
}
void check_unit(float v, const char* what, bool closed_low = true) {
  if (!((closed_low ? v >= 0.f : v > 0.f) && v < 1.f))
    throw InvalidArgument(std::string(what) + " must be in " + (closed_low ? "[0, 1)" : "(0, 1)") +
                          ", got " + std::to_string(v));
}
void check_positive(float v, const char* what) {
  if (!(v > 0.f))
    throw InvalidArgument(std::string(what) + " must be > 0, got " + std::to_string(v));
}

// Elementwise helpers on the value's device.
struct Ew {
  Kernels& k;
  Tensor mul(const Tensor& a, const Tensor& b) { return k.binary(BinaryOp::kMul, a, b); }
  Tensor add(const Tensor& a, const Tensor& b) { return k.binary(BinaryOp::kAdd, a, b); }
  Tensor sub(const Tensor& a, const Tensor& b) { return k.binary(BinaryOp::kSub, a, b); }
  Tensor div(const Tensor& a, const Tensor& b) { return k.binary(BinaryOp::kDiv, a, b); }
  Tensor axpb(const Tensor& x, float a, float b) { return k.affine(x, a, b); }
  Tensor sq(const Tensor& x) { return k.unary(UnaryOp::kSquare, x); }
  Tensor sqrt(const Tensor& x) { return k.unary(UnaryOp::kSqrt, x); }
};

}  // namespace

// ---- SGD ----

SGD::SGD(float lr, float momentum, bool nesterov, OptimizerOptions options)
    : SGD(std::make_shared<ConstantSchedule>((check_lr(lr), lr)), momentum, nesterov, options) {}
SGD::SGD(std::shared_ptr<LearningRateSchedule> s, float momentum, bool nesterov,
         OptimizerOptions options)
    : Optimizer(std::move(s), options), momentum_(momentum), nesterov_(nesterov) {
  check_unit(momentum, "SGD momentum");
}
std::vector<std::string> SGD::slot_names_impl() const {
  return momentum_ > 0.f ? std::vector<std::string>{"momentum"} : std::vector<std::string>{};
}
std::string SGD::hyper_config() const {
  return kv("momentum", momentum_) + kv("nesterov", nesterov_ ? 1 : 0);
}
void SGD::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t, float lr) {
  kernels_for(value).sgd_update(value, grad, slots.empty() ? nullptr : &slots[0], lr, momentum_,
                                nesterov_);
}

// ---- Adam, AdamW ----

Adam::Adam(float lr, float b1, float b2, float eps, OptimizerOptions options)
    : Adam(std::make_shared<ConstantSchedule>((check_lr(lr), lr)), b1, b2, eps, options) {}
Adam::Adam(std::shared_ptr<LearningRateSchedule> s, float b1, float b2, float eps,
           OptimizerOptions options)
    : Optimizer(std::move(s), options), beta1_(b1), beta2_(b2), epsilon_(eps) {
  check_unit(b1, "Adam beta_1");
  check_unit(b2, "Adam beta_2");
  check_positive(eps, "Adam epsilon");
}
std::string Adam::hyper_config() const {
  return kv("beta_1", beta1_) + kv("beta_2", beta2_) + kv("epsilon", epsilon_);
}
void Adam::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
                  float lr) {
  kernels_for(value).adam_update(value, slots[0], slots[1], grad, lr, beta1_, beta2_, epsilon_,
                                 step);
}

namespace {
OptimizerOptions with_decay(OptimizerOptions o, float wd) {
  o.weight_decay = wd;
  return o;
}
}  // namespace

AdamW::AdamW(float lr, float wd, float b1, float b2, float eps, OptimizerOptions options)
    : Adam(lr, b1, b2, eps, with_decay(options, wd)) {}

// ---- RMSprop ----

RMSprop::RMSprop(float lr, float rho, float momentum, float eps, bool centered,
                 OptimizerOptions options)
    : Optimizer((check_lr(lr), lr), options),
      rho_(rho),
      momentum_(momentum),
      epsilon_(eps),
      centered_(centered) {
  check_unit(rho, "RMSprop rho");
  check_unit(momentum, "RMSprop momentum");
  check_positive(eps, "RMSprop epsilon");
}
std::vector<std::string> RMSprop::slot_names_impl() const {
  std::vector<std::string> s{"velocity"};
  if (momentum_ > 0.f) s.push_back("momentum");
  if (centered_) s.push_back("average_gradient");
  return s;
}
std::string RMSprop::hyper_config() const {
  return kv("rho", rho_) + kv("momentum", momentum_) + kv("epsilon", epsilon_) +
         kv("centered", centered_ ? 1 : 0);
}
void RMSprop::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t,
                     float lr) {
  Ew e{kernels_for(value)};
  Tensor& velocity = slots[0];
  velocity.copy_from(e.add(e.axpb(velocity, rho_, 0.f), e.axpb(e.sq(grad), 1.f - rho_, 0.f)));
  Tensor denominator = velocity;
  if (centered_) {
    Tensor& avg = slots[momentum_ > 0.f ? 2 : 1];
    avg.copy_from(e.add(e.axpb(avg, rho_, 0.f), e.axpb(grad, 1.f - rho_, 0.f)));
    denominator = e.sub(velocity, e.sq(avg));
  }
  const Tensor increment = e.div(e.axpb(grad, lr, 0.f), e.sqrt(e.axpb(denominator, 1.f, epsilon_)));
  if (momentum_ > 0.f) {
    Tensor& m = slots[1];
    m.copy_from(e.add(e.axpb(m, momentum_, 0.f), increment));
    value.copy_from(e.sub(value, m));
  } else {
    value.copy_from(e.sub(value, increment));
  }
}

// ---- Adagrad ----

Adagrad::Adagrad(float lr, float init, float eps, OptimizerOptions options)
    : Optimizer((check_lr(lr), lr), options), initial_(init), epsilon_(eps) {
  if (!(init >= 0.f))
    throw InvalidArgument("Adagrad initial_accumulator_value must be >= 0, got " +
                          std::to_string(init));
  check_positive(eps, "Adagrad epsilon");
}
std::string Adagrad::hyper_config() const {
  return kv("initial_accumulator_value", initial_) + kv("epsilon", epsilon_);
}
void Adagrad::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t,
                     float lr) {
  Ew e{kernels_for(value)};
  Tensor& acc = slots[0];
  acc.copy_from(e.add(acc, e.sq(grad)));
  value.copy_from(e.sub(value, e.div(e.axpb(grad, lr, 0.f), e.sqrt(e.axpb(acc, 1.f, epsilon_)))));
}

}  // namespace dtrain
