#include "dtrain/nn/schedules.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "model/config_line.h"

namespace dtrain {

using detail::kv;

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument(what);
}

std::string join(const auto& values) {
  std::string out;
  char buf[32];
  for (size_t i = 0; i < values.size(); ++i) {
    std::snprintf(buf, sizeof(buf), "%s%.9g", i ? ";" : "", static_cast<double>(values[i]));
    out += buf;
  }
  return out;
}

}  // namespace

ConstantSchedule::ConstantSchedule(float lr) : lr_(lr) {
  require(lr >= 0.f && std::isfinite(lr),
          "learning rate must be finite and >= 0, got " + std::to_string(lr));
}
std::string ConstantSchedule::config() const { return "constant" + kv("learning_rate", lr_); }

PiecewiseConstantDecay::PiecewiseConstantDecay(std::vector<int64_t> boundaries,
                                               std::vector<float> values)
    : boundaries_(std::move(boundaries)), values_(std::move(values)) {
  require(values_.size() == boundaries_.size() + 1,
          "PiecewiseConstantDecay needs one more value than boundaries, got " +
              std::to_string(boundaries_.size()) + " boundaries and " +
              std::to_string(values_.size()) + " values");
  for (size_t i = 1; i < boundaries_.size(); ++i)
    require(boundaries_[i] > boundaries_[i - 1], "PiecewiseConstantDecay boundaries must increase");
  for (float v : values_) require(v > 0.f, "PiecewiseConstantDecay values must be > 0");
}
float PiecewiseConstantDecay::operator()(int64_t step) const {
  for (size_t i = 0; i < boundaries_.size(); ++i)
    if (step <= boundaries_[i]) return values_[i];
  return values_.back();
}
std::string PiecewiseConstantDecay::config() const {
  return "piecewise_constant boundaries=" + join(boundaries_) + " values=" + join(values_);
}

ExponentialDecay::ExponentialDecay(float initial, int64_t decay_steps, float rate, bool staircase)
    : initial_(initial), decay_steps_(decay_steps), rate_(rate), staircase_(staircase) {
  require(initial > 0.f, "ExponentialDecay initial_learning_rate must be > 0");
  require(decay_steps > 0, "ExponentialDecay decay_steps must be > 0");
  require(rate > 0.f, "ExponentialDecay decay_rate must be > 0");
}
float ExponentialDecay::operator()(int64_t step) const {
  double p = static_cast<double>(step) / static_cast<double>(decay_steps_);
  if (staircase_) p = std::floor(p);
  return static_cast<float>(initial_ * std::pow(static_cast<double>(rate_), p));
}
std::string ExponentialDecay::config() const {
  return "exponential" + kv("initial_learning_rate", initial_) +
         kv("decay_steps", static_cast<double>(decay_steps_)) + kv("decay_rate", rate_) +
         kv("staircase", staircase_ ? 1 : 0);
}

CosineDecay::CosineDecay(float initial, int64_t decay_steps, float alpha, float warmup_target,
                         int64_t warmup_steps)
    : initial_(initial),
      decay_steps_(decay_steps),
      alpha_(alpha),
      warmup_target_(warmup_target),
      warmup_steps_(warmup_steps) {
  require(initial >= 0.f, "CosineDecay initial_learning_rate must be >= 0");
  require(decay_steps > 0, "CosineDecay decay_steps must be > 0");
  require(alpha >= 0.f && alpha <= 1.f, "CosineDecay alpha must be in [0, 1]");
  require(warmup_steps >= 0, "CosineDecay warmup_steps must be >= 0");
  require(warmup_steps == 0 || warmup_target > 0.f,
          "CosineDecay with warmup_steps needs warmup_target > 0");
}
float CosineDecay::operator()(int64_t step) const {
  const bool warm = warmup_target_ > 0.f && warmup_steps_ > 0;
  if (warm && step < warmup_steps_)
    return static_cast<float>(initial_ + (static_cast<double>(warmup_target_) - initial_) *
                                             static_cast<double>(step) /
                                             static_cast<double>(warmup_steps_));
  const double target = warm ? warmup_target_ : initial_;
  const double s = static_cast<double>(std::min(step - (warm ? warmup_steps_ : 0), decay_steps_));
  const double cosine =
      0.5 * (1.0 + std::cos(std::numbers::pi * s / static_cast<double>(decay_steps_)));
  return static_cast<float>(target * ((1.0 - alpha_) * cosine + alpha_));
}
std::string CosineDecay::config() const {
  return "cosine" + kv("initial_learning_rate", initial_) +
         kv("decay_steps", static_cast<double>(decay_steps_)) + kv("alpha", alpha_) +
         kv("warmup_target", warmup_target_) +
         kv("warmup_steps", static_cast<double>(warmup_steps_));
}

PolynomialDecay::PolynomialDecay(float initial, int64_t decay_steps, float end, float power,
                                 bool cycle)
    : initial_(initial), decay_steps_(decay_steps), end_(end), power_(power), cycle_(cycle) {
  require(initial > 0.f, "PolynomialDecay initial_learning_rate must be > 0");
  require(decay_steps > 0, "PolynomialDecay decay_steps must be > 0");
  require(end >= 0.f, "PolynomialDecay end_learning_rate must be >= 0");
}
float PolynomialDecay::operator()(int64_t step) const {
  double steps = static_cast<double>(decay_steps_), s = static_cast<double>(step);
  if (cycle_)
    steps *= std::max(1.0, std::ceil(s / steps));
  else
    s = std::min(s, steps);
  return static_cast<float>(
      (initial_ - end_) * std::pow(1.0 - s / steps, static_cast<double>(power_)) + end_);
}
std::string PolynomialDecay::config() const {
  return "polynomial" + kv("initial_learning_rate", initial_) +
         kv("decay_steps", static_cast<double>(decay_steps_)) + kv("end_learning_rate", end_) +
         kv("power", power_) + kv("cycle", cycle_ ? 1 : 0);
}

std::shared_ptr<LearningRateSchedule> LearningRateSchedule::from_config(const std::string& config) {
  detail::ConfigLine c(config, "learning-rate schedule");
  auto integer = [&](const std::string& key, double fallback) {
    const double v = c.number(key, fallback);
    if (v != std::floor(v)) throw c.error("'" + key + "' must be a whole number");
    return static_cast<int64_t>(v);
  };
  auto positive = [&](const std::string& key) {
    const double v = c.number(key, -1);
    if (!(v > 0)) throw c.error("'" + key + "' is required and must be > 0");
    return v;
  };
  try {
    std::shared_ptr<LearningRateSchedule> s;
    const std::string& n = c.name();
    if (n == "constant") {
      s = std::make_shared<ConstantSchedule>(static_cast<float>(positive("learning_rate")));
      c.finish("learning_rate");
    } else if (n == "piecewise_constant") {
      std::vector<int64_t> b;
      for (double x : c.numbers("boundaries")) b.push_back(static_cast<int64_t>(x));
      std::vector<float> v;
      for (double x : c.numbers("values")) v.push_back(static_cast<float>(x));
      c.finish("boundaries, values");
      s = std::make_shared<PiecewiseConstantDecay>(b, v);
    } else if (n == "exponential") {
      const double lr = positive("initial_learning_rate");
      const int64_t steps = integer("decay_steps", 0);
      const double rate = positive("decay_rate");
      const bool stair = c.number("staircase", 0) != 0;
      c.finish("initial_learning_rate, decay_steps, decay_rate, staircase");
      s = std::make_shared<ExponentialDecay>(static_cast<float>(lr), steps,
                                             static_cast<float>(rate), stair);
    } else if (n == "cosine") {
      const double lr = c.number("initial_learning_rate", -1);
      const int64_t steps = integer("decay_steps", 0);
      const double alpha = c.number("alpha", 0), target = c.number("warmup_target", -1);
      const int64_t warm = integer("warmup_steps", 0);
      c.finish("initial_learning_rate, decay_steps, alpha, warmup_target, warmup_steps");
      s = std::make_shared<CosineDecay>(static_cast<float>(lr), steps, static_cast<float>(alpha),
                                        static_cast<float>(target), warm);
    } else if (n == "polynomial") {
      const double lr = positive("initial_learning_rate");
      const int64_t steps = integer("decay_steps", 0);
      const double end = c.number("end_learning_rate", 1e-4), power = c.number("power", 1);
      const bool cycle = c.number("cycle", 0) != 0;
      c.finish("initial_learning_rate, decay_steps, end_learning_rate, power, cycle");
      s = std::make_shared<PolynomialDecay>(static_cast<float>(lr), steps, static_cast<float>(end),
                                            static_cast<float>(power), cycle);
    } else {
      throw c.error("unknown schedule '" + n +
                    "' (constant, piecewise_constant, exponential, cosine, polynomial)");
    }
    return s;
  } catch (const InvalidArgument& e) {
    if (std::string(e.what()).rfind("malformed", 0) == 0) throw;
    throw c.error(e.what());
  }
}

}  // namespace dtrain
