// The update rule of each optimizer. SGD and Adam have fused per-device kernels; the others are
// composed from the device's elementwise kernels, so they run on every device unchanged.
#include "dtrain/model/update_rules.h"

#include <cmath>

#include "dtrain/devices/device.h"
#include "model/config_line.h"

namespace dtrain {

using detail::kv;

namespace {

void check_unit(float v, const char* what) {
  if (!(v >= 0.f && v < 1.f))
    throw InvalidArgument(std::string(what) + " must be in [0, 1), got " + std::to_string(v));
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

void UpdateRule::apply(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
                       float lr, float weight_decay, float grad_scale) const {
  const size_t want = slot_names().size();
  if (slots.size() != want)
    throw InvalidArgument(name() + " needs " + std::to_string(want) + " slots per variable, got " +
                          std::to_string(slots.size()));
  const float decay = weight_decay > 0.f ? 1.f - lr * weight_decay : 1.f;
  if (update_scaled(value, grad, slots, step, lr, grad_scale, decay)) return;
  if (decay != 1.f) value.copy_from(kernels_for(value).affine(value, decay, 0.f));
  update(value, grad_scale == 1.f ? grad : kernels_for(grad).affine(grad, grad_scale, 0.f), slots,
         step, lr);
}

// ---- SGD ----

SgdRule::SgdRule(float momentum, bool nesterov) : momentum_(momentum), nesterov_(nesterov) {
  check_unit(momentum, "SGD momentum");
}
std::vector<std::string> SgdRule::slot_names() const {
  return momentum_ > 0.f ? std::vector<std::string>{"momentum"} : std::vector<std::string>{};
}
std::string SgdRule::hyper_config() const {
  return kv("momentum", momentum_) + kv("nesterov", nesterov_ ? 1 : 0);
}
void SgdRule::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t,
                     float lr) const {
  kernels_for(value).sgd_update(value, grad, slots.empty() ? nullptr : &slots[0], lr, momentum_,
                                nesterov_);
}

// ---- Adam, AdamW ----

AdamRule::AdamRule(float b1, float b2, float eps, std::string name)
    : beta1_(b1), beta2_(b2), epsilon_(eps), name_(std::move(name)) {
  check_unit(b1, "Adam beta_1");
  check_unit(b2, "Adam beta_2");
  check_positive(eps, "Adam epsilon");
}
std::string AdamRule::hyper_config() const {
  return kv("beta_1", beta1_) + kv("beta_2", beta2_) + kv("epsilon", epsilon_);
}
void AdamRule::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step,
                      float lr) const {
  update_scaled(value, grad, slots, step, lr, 1.f, 1.f);
}
bool AdamRule::update_scaled(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots,
                             int64_t step, float lr, float grad_scale, float decay) const {
  kernels_for(value).adam_update(value, slots[0], slots[1], grad, lr, beta1_, beta2_, epsilon_,
                                 step, grad_scale, decay);
  return true;
}

// ---- RMSprop ----

RmspropRule::RmspropRule(float rho, float momentum, float eps, bool centered)
    : rho_(rho), momentum_(momentum), epsilon_(eps), centered_(centered) {
  check_unit(rho, "RMSprop rho");
  check_unit(momentum, "RMSprop momentum");
  check_positive(eps, "RMSprop epsilon");
}
std::vector<std::string> RmspropRule::slot_names() const {
  std::vector<std::string> s{"velocity"};
  if (momentum_ > 0.f) s.push_back("momentum");
  if (centered_) s.push_back("average_gradient");
  return s;
}
std::string RmspropRule::hyper_config() const {
  return kv("rho", rho_) + kv("momentum", momentum_) + kv("epsilon", epsilon_) +
         kv("centered", centered_ ? 1 : 0);
}
void RmspropRule::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t,
                         float lr) const {
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

AdagradRule::AdagradRule(float init, float eps) : initial_(init), epsilon_(eps) {
  if (!(init >= 0.f))
    throw InvalidArgument("Adagrad initial_accumulator_value must be >= 0, got " +
                          std::to_string(init));
  check_positive(eps, "Adagrad epsilon");
}
std::string AdagradRule::hyper_config() const {
  return kv("initial_accumulator_value", initial_) + kv("epsilon", epsilon_);
}
void AdagradRule::update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t,
                         float lr) const {
  Ew e{kernels_for(value)};
  Tensor& acc = slots[0];
  acc.copy_from(e.add(acc, e.sq(grad)));
  value.copy_from(e.sub(value, e.div(e.axpb(grad, lr, 0.f), e.sqrt(e.axpb(acc, 1.f, epsilon_)))));
}

// ---- config lines ----

UpdateConfig parse_update_config(const std::string& config) {
  detail::ConfigLine c(config, "optimizer config");
  const std::string n = c.name();
  const std::string common = "learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm";
  try {
    const bool adamw = n == "adamw";
    UpdateConfig out;
    auto f = [&](const char* key, double fallback) {
      return static_cast<float>(c.number(key, fallback));
    };
    out.learning_rate = f("learning_rate", n == "sgd" ? 0.01 : 1e-3);
    out.weight_decay = f("weight_decay", adamw ? 0.004 : 0.0);
    out.clipnorm = f("clipnorm", 0);
    out.clipvalue = f("clipvalue", 0);
    out.global_clipnorm = f("global_clipnorm", 0);
    if (n == "sgd") {
      const float momentum = f("momentum", 0);
      const bool nesterov = c.number("nesterov", 0) != 0;
      c.finish(common + ", momentum, nesterov");
      out.rule = std::make_unique<SgdRule>(momentum, nesterov);
    } else if (n == "adam" || adamw) {
      const float b1 = f("beta_1", 0.9), b2 = f("beta_2", 0.999), eps = f("epsilon", 1e-7);
      c.finish(common + ", beta_1, beta_2, epsilon");
      out.rule = std::make_unique<AdamRule>(b1, b2, eps, n);
    } else if (n == "rmsprop") {
      const float rho = f("rho", 0.9), momentum = f("momentum", 0), eps = f("epsilon", 1e-7);
      const bool centered = c.number("centered", 0) != 0;
      c.finish(common + ", rho, momentum, epsilon, centered");
      out.rule = std::make_unique<RmspropRule>(rho, momentum, eps, centered);
    } else if (n == "adagrad") {
      const float init = f("initial_accumulator_value", 0.1), eps = f("epsilon", 1e-7);
      c.finish(common + ", initial_accumulator_value, epsilon");
      out.rule = std::make_unique<AdagradRule>(init, eps);
    } else {
      throw c.error("unknown optimizer '" + n + "' (sgd, adam, adamw, rmsprop, adagrad)");
    }
    // 0 is a rate (a warm-up's start, a decay's end: a parameter server gets each step's).
    if (!(out.learning_rate >= 0.f) || !std::isfinite(out.learning_rate))
      throw InvalidArgument("learning rate must be finite and >= 0, got " +
                            std::to_string(out.learning_rate));
    return out;
  } catch (const InvalidArgument& e) {
    if (std::string(e.what()).rfind("malformed", 0) == 0) throw;
    throw c.error(e.what());
  }
}

}  // namespace dtrain
