// Learning-rate schedules (keras.optimizers.schedules). A schedule maps the optimizer's iteration
// count (the number of updates applied before this one, 0-based, as Keras passes
// optimizer.iterations) to a learning rate. config() gives one line that
// LearningRateSchedule::from_config() turns back into an equal schedule (--lr-schedule uses it).
//
// Thread-safety: schedules are immutable after construction; call them from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"

namespace dtrain {

class DTRAIN_API LearningRateSchedule {
 public:
  virtual ~LearningRateSchedule() = default;
  virtual float operator()(int64_t step) const = 0;
  // e.g. "cosine initial_learning_rate=0.001 decay_steps=1000 alpha=0 warmup_target=0.01
  // warmup_steps=100".
  virtual std::string config() const = 0;
  // Parses config() lines, also written by hand: "<name> key=value ...", keys left out take the
  // Keras defaults. Names: constant, piecewise_constant (boundaries=100;200 values=0.1;0.01;0.001),
  // exponential, cosine, polynomial. Throws InvalidArgument naming the line and what is wrong.
  static std::shared_ptr<LearningRateSchedule> from_config(const std::string& config);
};

// A fixed rate.
class DTRAIN_API ConstantSchedule : public LearningRateSchedule {
 public:
  explicit ConstantSchedule(float learning_rate);
  float operator()(int64_t) const override { return lr_; }
  std::string config() const override;

 private:
  float lr_;
};

// values[0] while step <= boundaries[0], values[1] while step <= boundaries[1], ..., values.back()
// after the last boundary (keras PiecewiseConstantDecay). Needs values.size() == boundaries.size()
// + 1 and increasing boundaries; InvalidArgument otherwise.
class DTRAIN_API PiecewiseConstantDecay : public LearningRateSchedule {
 public:
  PiecewiseConstantDecay(std::vector<int64_t> boundaries, std::vector<float> values);
  float operator()(int64_t step) const override;
  std::string config() const override;

 private:
  std::vector<int64_t> boundaries_;
  std::vector<float> values_;
};

// initial * rate^(step / decay_steps), the exponent floored when staircase.
class DTRAIN_API ExponentialDecay : public LearningRateSchedule {
 public:
  ExponentialDecay(float initial_learning_rate, int64_t decay_steps, float decay_rate,
                   bool staircase = false);
  float operator()(int64_t step) const override;
  std::string config() const override;

 private:
  float initial_;
  int64_t decay_steps_;
  float rate_;
  bool staircase_;
};

// Keras CosineDecay with its linear warm-up: for step < warmup_steps the rate rises linearly from
// initial_learning_rate to warmup_target; then it follows
// target * ((1 - alpha) * 0.5 * (1 + cos(pi * min(s, decay_steps) / decay_steps)) + alpha),
// s = step - warmup_steps, target = warmup_target (or initial_learning_rate without warm-up).
class DTRAIN_API CosineDecay : public LearningRateSchedule {
 public:
  CosineDecay(float initial_learning_rate, int64_t decay_steps, float alpha = 0.f,
              float warmup_target = -1.f, int64_t warmup_steps = 0);
  float operator()(int64_t step) const override;
  std::string config() const override;

 private:
  float initial_;
  int64_t decay_steps_;
  float alpha_;
  float warmup_target_;  // < 0: no warm-up target
  int64_t warmup_steps_;
};

// (initial - end) * (1 - min(step, decay_steps) / decay_steps)^power + end; with cycle, decay_steps
// is multiplied by ceil(step / decay_steps) (at least 1), as in Keras PolynomialDecay.
class DTRAIN_API PolynomialDecay : public LearningRateSchedule {
 public:
  PolynomialDecay(float initial_learning_rate, int64_t decay_steps, float end_learning_rate = 1e-4f,
                  float power = 1.f, bool cycle = false);
  float operator()(int64_t step) const override;
  std::string config() const override;

 private:
  float initial_;
  int64_t decay_steps_;
  float end_, power_;
  bool cycle_;
};

}  // namespace dtrain
