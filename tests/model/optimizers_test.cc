// Optimizers, schedules, clipping, weight decay and layer naming, each against values computed by
// hand from the Keras formulas (in double).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "dtrain/dtrain.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class Optimizers : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

std::shared_ptr<Variable> var(const std::string& name, std::vector<float> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return create_variable(
      {name, Shape{n}, DType::kFloat32,
       [v](const Shape& s, DType, DeviceSpec d) { return Tensor::from_vector(v, s).to(d); }});
}
Tensor vec(std::vector<float> v) {
  return Tensor::from_vector(v, Shape{static_cast<int64_t>(v.size())});
}
float first(const std::shared_ptr<Variable>& v) { return v->value().to_vector<float>()[0]; }

TEST_F(Optimizers, RmspropPlainCenteredMomentumByHand) {
  struct Case {
    float momentum;
    bool centered;
  };
  for (const Case c : {Case{0.f, false}, Case{0.5f, false}, Case{0.f, true}, Case{0.5f, true}}) {
    auto w = var("w", {1.f});
    RMSprop opt(0.1f, 0.9f, c.momentum, 1e-7f, c.centered);
    double x = 1, vel = 0, mom = 0, avg = 0;
    for (double g : {0.5, -0.25, 1.0}) {
      opt.apply_gradients({vec({static_cast<float>(g)})}, {w});
      vel = 0.9 * vel + 0.1 * g * g;
      double denom = vel;
      if (c.centered) {
        avg = 0.9 * avg + 0.1 * g;
        denom = vel - avg * avg;
      }
      const double inc = 0.1 * g / std::sqrt(denom + 1e-7);
      if (c.momentum > 0) {
        mom = 0.5 * mom + inc;
        x -= mom;
      } else {
        x -= inc;
      }
      EXPECT_NEAR(first(w), x, 2e-5) << "momentum " << c.momentum << " centered " << c.centered;
    }
    EXPECT_EQ(opt.slots_per_variable(), 1 + (c.momentum > 0) + c.centered);
  }
}

TEST_F(Optimizers, AdagradByHand) {
  auto w = var("w", {1.f});
  Adagrad opt(0.1f);  // initial accumulator 0.1
  double x = 1, acc = 0.1;
  for (double g : {0.5, -0.25, 1.0}) {
    opt.apply_gradients({vec({static_cast<float>(g)})}, {w});
    acc += g * g;
    x -= 0.1 * g / std::sqrt(acc + 1e-7);
    EXPECT_NEAR(first(w), x, 1e-6);
  }
}

TEST_F(Optimizers, AdamWDecaysDecoupledThenAdam) {
  auto w = var("w", {1.f});
  AdamW opt(0.1f, /*weight_decay=*/0.1f);
  double x = 1, m = 0, v = 0;
  for (int t = 1; t <= 3; ++t) {
    const double g = 0.5 * t;
    opt.apply_gradients({vec({static_cast<float>(g)})}, {w});
    x -= 0.1 * 0.1 * x;  // var -= lr * wd * var, before the Adam step
    m = 0.9 * m + 0.1 * g;
    v = 0.999 * v + 0.001 * g * g;
    const double lr_t = 0.1 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    x -= lr_t * m / (std::sqrt(v) + 1e-7);
    EXPECT_NEAR(first(w), x, 1e-5) << "step " << t;
  }
}

TEST_F(Optimizers, WeightDecayAppliesToSgdToo) {
  auto w = var("w", {2.f});
  OptimizerOptions o;
  o.weight_decay = 0.5f;
  SGD opt(0.1f, 0.f, false, o);
  opt.apply_gradients({vec({1.f})}, {w});
  EXPECT_NEAR(first(w), 2.0 * (1 - 0.05) - 0.1, 1e-6);
}

// exclude_from_weight_decay: names containing a listed string get no decay, alone and under
// Mirrored (whose replicas update slices of the variables).
TEST_F(Optimizers, ExcludedVariablesGetNoWeightDecay) {
  auto kernel = var("h_0/mlp_fc/kernel", {2.f}), bias = var("h_0/mlp_fc/bias", {2.f}),
       emb = var("wte/embeddings", {2.f});
  AdamW opt(0.1f, /*weight_decay=*/0.5f);
  opt.exclude_from_weight_decay({"bias", "gamma", "beta", "embeddings"});
  EXPECT_EQ(opt.weight_decay_for(*kernel), 0.5f);
  EXPECT_EQ(opt.weight_decay_for(*bias), 0.f);
  opt.apply_gradients({vec({0.f}), vec({0.f}), vec({0.f})}, {kernel, bias, emb});
  EXPECT_NEAR(first(kernel), 2.0 * (1 - 0.05), 1e-6);  // decayed; a zero gradient moves nothing
  EXPECT_EQ(first(bias), 2.f);
  EXPECT_EQ(first(emb), 2.f);
  MirroredOptions mo;
  mo.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  MirroredStrategy s(mo);
  std::shared_ptr<Variable> k2, b2;
  std::unique_ptr<AdamW> opt2;
  {
    auto scope = s.scope();
    k2 = var("dense/kernel", {2.f, 2.f, 2.f, 2.f});
    b2 = var("dense/bias", {2.f, 2.f, 2.f, 2.f});
    opt2 = std::make_unique<AdamW>(0.1f, 0.5f);
    opt2->exclude_from_weight_decay({"bias"});
  }
  s.run([&](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
    const DeviceSpec d = k2->value().device();
    opt2->apply_gradients({vec({0.f, 0.f, 0.f, 0.f}).to(d), vec({0.f, 0.f, 0.f, 0.f}).to(d)},
                          {k2, b2});
    return {};
  });
  for (float v : k2->value().to_vector<float>()) EXPECT_NEAR(v, 1.9f, 1e-6);
  for (float v : b2->value().to_vector<float>()) EXPECT_EQ(v, 2.f);
}

TEST_F(Optimizers, ClipValueNormAndGlobalNorm) {
  {
    OptimizerOptions o;
    o.clipvalue = 0.2f;
    auto w = var("w", {1.f, 1.f, 1.f});
    SGD(1.f, 0.f, false, o).apply_gradients({vec({0.5f, -0.5f, 0.1f})}, {w});
    const std::vector<float> got = w->value().to_vector<float>();
    EXPECT_NEAR(got[0], 0.8f, 1e-6);
    EXPECT_NEAR(got[1], 1.2f, 1e-6);
    EXPECT_NEAR(got[2], 0.9f, 1e-6);
  }
  {
    OptimizerOptions o;
    o.clipnorm = 1.f;  // each gradient on its own: [3,4] -> [0.6,0.8]; [0.3] is under the norm
    auto a = var("a", {0.f, 0.f}), b = var("b", {0.f});
    SGD(1.f, 0.f, false, o).apply_gradients({vec({3.f, 4.f}), vec({0.3f})}, {a, b});
    EXPECT_NEAR(a->value().to_vector<float>()[0], -0.6f, 1e-6);
    EXPECT_NEAR(a->value().to_vector<float>()[1], -0.8f, 1e-6);
    EXPECT_NEAR(first(b), -0.3f, 1e-6);
  }
  {
    OptimizerOptions o;
    o.global_clipnorm = 1.f;  // [3] and [4] together have norm 5
    auto a = var("a", {0.f}), b = var("b", {0.f});
    SGD(1.f, 0.f, false, o).apply_gradients({vec({3.f}), vec({4.f})}, {a, b});
    EXPECT_NEAR(first(a), -0.6f, 1e-6);
    EXPECT_NEAR(first(b), -0.8f, 1e-6);
  }
  OptimizerOptions both;
  both.clipnorm = both.global_clipnorm = 1.f;
  EXPECT_THROW(SGD(1.f, 0.f, false, both), InvalidArgument);
}

// Adam scales the gradient (clipping by norm) and decays the variable (AdamW) in its own pass
// over memory: the Keras formulas step by step, in double, on vectors longer than one AVX-512
// register (tails included). epsilon = 0.1 makes the step depend on the gradient's scale.
TEST_F(Optimizers, AdamClipsAndDecaysInItsOwnPassAsKerasDoesInSteps) {
  for (const bool global : {true, false}) {
    std::vector<float> a0(37), b0(1000);
    for (size_t i = 0; i < a0.size(); ++i) a0[i] = 0.01f * static_cast<float>(i) - 0.2f;
    for (size_t i = 0; i < b0.size(); ++i) b0[i] = std::sin(0.37f * static_cast<float>(i));
    auto a = var("a", a0), b = var("b", b0);
    OptimizerOptions o;
    (global ? o.global_clipnorm : o.clipnorm) = 0.5f;
    AdamW opt(0.05f, /*weight_decay=*/0.2f, 0.9f, 0.999f, /*epsilon=*/0.1f, o);
    std::vector<double> xa(a0.begin(), a0.end()), xb(b0.begin(), b0.end());
    std::vector<double> ma(xa.size()), va(xa.size()), mb(xb.size()), vb(xb.size());
    for (int t = 1; t <= 3; ++t) {
      std::vector<float> ga(xa.size()), gb(xb.size());
      for (size_t i = 0; i < ga.size(); ++i) ga[i] = std::cos(static_cast<float>(i * t));
      for (size_t i = 0; i < gb.size(); ++i) gb[i] = 0.3f * t * std::cos(0.1f * i + t);
      opt.apply_gradients({vec(ga), vec(gb)}, {a, b});
      double na = 0, nb = 0;
      for (float g : ga) na += double{g} * g;
      for (float g : gb) nb += double{g} * g;
      const double sa =
          global ? std::min(1.0, 0.5 / std::sqrt(na + nb)) : std::min(1.0, 0.5 / std::sqrt(na));
      const double sb = global ? sa : std::min(1.0, 0.5 / std::sqrt(nb));
      const double lr_t = 0.05 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
      auto step = [&](std::vector<double>& x, std::vector<double>& m, std::vector<double>& v,
                      const std::vector<float>& g, double s) {
        for (size_t i = 0; i < x.size(); ++i) {
          const double gi = s * g[i];
          x[i] -= 0.05 * 0.2 * x[i];
          m[i] = 0.9 * m[i] + 0.1 * gi;
          v[i] = 0.999 * v[i] + 0.001 * gi * gi;
          x[i] -= lr_t * m[i] / (std::sqrt(v[i]) + 0.1);
        }
      };
      step(xa, ma, va, ga, sa);
      step(xb, mb, vb, gb, sb);
      const std::vector<float> got_a = a->value().to_vector<float>(),
                               got_b = b->value().to_vector<float>();
      for (size_t i = 0; i < xa.size(); ++i)
        ASSERT_NEAR(got_a[i], xa[i], 2e-6) << (global ? "global" : "clipnorm") << " step " << t;
      for (size_t i = 0; i < xb.size(); ++i)
        ASSERT_NEAR(got_b[i], xb[i], 2e-6) << (global ? "global" : "clipnorm") << " step " << t;
    }
  }
}

TEST_F(Optimizers, ClippingSeesTheAllReducedGradient) {
  // Two replicas each with gradient 0.5: the sum is 1.0, clipped to 0.4 by clipvalue.
  MirroredOptions mo;
  mo.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  MirroredStrategy s(mo);
  std::shared_ptr<Variable> w;
  std::unique_ptr<SGD> opt;
  OptimizerOptions o;
  o.clipvalue = 0.4f;
  {
    auto scope = s.scope();
    w = var("w", {1.f});
    opt = std::make_unique<SGD>(1.f, 0.f, false, o);
  }
  s.run([&](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
    opt->apply_gradients({vec({0.5f}).to(w->value().device())}, {w});
    return {};
  });
  EXPECT_NEAR(first(w), 0.6f, 1e-6);
}

TEST_F(Optimizers, SchedulesByHand) {
  PiecewiseConstantDecay pc({10, 20}, {1.f, 0.5f, 0.1f});
  EXPECT_EQ(pc(0), 1.f);
  EXPECT_EQ(pc(10), 1.f);
  EXPECT_EQ(pc(11), 0.5f);
  EXPECT_EQ(pc(21), 0.1f);
  ExponentialDecay ex(1.f, 10, 0.5f), stair(1.f, 10, 0.5f, true);
  EXPECT_NEAR(ex(10), 0.5, 1e-7);
  EXPECT_NEAR(ex(5), std::sqrt(0.5), 1e-7);
  EXPECT_EQ(stair(5), 1.f);
  EXPECT_NEAR(stair(25), 0.25, 1e-7);
  CosineDecay cos(1.f, 100, 0.1f);
  EXPECT_NEAR(cos(0), 1.0, 1e-7);
  EXPECT_NEAR(cos(50), 0.1 + 0.9 * 0.5, 1e-6);
  EXPECT_NEAR(cos(100), 0.1, 1e-7);
  EXPECT_NEAR(cos(500), 0.1, 1e-7);
  CosineDecay warm(0.f, 100, 0.f, 2.f, 10);  // linear warm-up 0 -> 2 over 10 steps, then decay
  EXPECT_NEAR(warm(0), 0.0, 1e-7);
  EXPECT_NEAR(warm(5), 1.0, 1e-6);
  EXPECT_NEAR(warm(10), 2.0, 1e-6);
  EXPECT_NEAR(warm(60), 1.0, 1e-6);
  EXPECT_NEAR(warm(110), 0.0, 1e-6);
  PolynomialDecay poly(1.f, 10, 0.1f, 2.f), cyc(1.f, 10, 0.1f, 2.f, true);
  EXPECT_NEAR(poly(5), 0.9 * 0.25 + 0.1, 1e-6);
  EXPECT_NEAR(poly(20), 0.1, 1e-7);
  EXPECT_NEAR(cyc(15), 0.9 * 0.25 * 0.25 + 0.1, 1e-6);  // decay_steps becomes 20
  EXPECT_THROW(PiecewiseConstantDecay({10}, {1.f}), InvalidArgument);
  EXPECT_THROW(CosineDecay(1.f, 0), InvalidArgument);
}

TEST_F(Optimizers, ScheduleConfigsRoundTrip) {
  for (const auto& s : std::vector<std::shared_ptr<LearningRateSchedule>>{
           std::make_shared<ConstantSchedule>(0.5f),
           std::make_shared<PiecewiseConstantDecay>(std::vector<int64_t>{10, 20},
                                                    std::vector<float>{1.f, 0.5f, 0.1f}),
           std::make_shared<ExponentialDecay>(0.1f, 100, 0.96f, true),
           std::make_shared<CosineDecay>(0.f, 900, 0.f, 1e-3f, 100),
           std::make_shared<PolynomialDecay>(0.1f, 50, 1e-3f, 2.f, true)}) {
    const auto back = LearningRateSchedule::from_config(s->config());
    EXPECT_EQ(back->config(), s->config());
    for (int64_t step : {0, 7, 99, 1000}) EXPECT_EQ((*back)(step), (*s)(step)) << s->config();
  }
  EXPECT_NEAR(
      (*LearningRateSchedule::from_config("cosine initial_learning_rate=1 decay_steps=100"))(50),
      0.5, 1e-6);
  for (const char* bad :
       {"", "linear", "cosine decay_steps=100",
        "exponential initial_learning_rate=1 decay_steps=1.5 decay_rate=0.9",
        "piecewise_constant boundaries=1;2 values=1", "constant learning_rate=1 extra=2"})
    EXPECT_THROW(LearningRateSchedule::from_config(bad), InvalidArgument) << bad;
  // A rate of 0 is a rate (a warm-up from 0, a cosine decay's end, a parameter server handed that
  // step's rate); a negative one is not.
  EXPECT_EQ(Optimizer::from_config("adamw learning_rate=0 weight_decay=0")->learning_rate(), 0.f);
  EXPECT_THROW(Optimizer::from_config("sgd learning_rate=-0.1"), InvalidArgument);
  EXPECT_THROW(SGD(-1.f), InvalidArgument);
}

TEST_F(Optimizers, ScheduleDrivesEachStepFromIterations) {
  auto w = var("w", {1.f});
  SGD opt(std::make_shared<PiecewiseConstantDecay>(std::vector<int64_t>{0},
                                                   std::vector<float>{1.f, 0.1f}));
  EXPECT_EQ(opt.learning_rate(), 1.f);
  opt.apply_gradients({vec({0.5f})}, {w});  // iteration 0: lr 1
  EXPECT_NEAR(first(w), 0.5f, 1e-7);
  EXPECT_NEAR(opt.learning_rate(), 0.1f, 1e-9);
  opt.apply_gradients({vec({0.5f})}, {w});  // iteration 1: lr 0.1
  EXPECT_NEAR(first(w), 0.45f, 1e-7);
  EXPECT_NE(opt.config().find("learning_rate=0.1"), std::string::npos) << opt.config();
}

TEST_F(Optimizers, RestoredIterationCountContinuesAdamExactly) {
  // Run 4 Adam steps; separately run 2, copy the weights and slots into a fresh optimizer with
  // set_iterations(2), run 2 more: bitwise equal (the bias correction needs the count).
  const std::vector<float> grads{0.5f, -0.25f, 1.f, 0.125f};
  auto a = var("w", {1.f});
  Adam full(0.01f);
  for (float g : grads) full.apply_gradients({vec({g})}, {a});

  auto b = var("w", {1.f});
  Adam first_half(0.01f);
  for (int i = 0; i < 2; ++i) first_half.apply_gradients({vec({grads[i]})}, {b});
  auto c = var("w", {0.f});
  c->assign(b->value());
  Adam resumed(0.01f);
  resumed.build({c});
  const auto from = first_half.slot_variables(), to = resumed.slot_variables();
  ASSERT_EQ(from.size(), 2u);
  for (size_t i = 0; i < from.size(); ++i) to[i]->assign(from[i]->value());
  resumed.set_iterations(2);
  EXPECT_EQ(resumed.iterations(), 2);
  for (int i = 2; i < 4; ++i) resumed.apply_gradients({vec({grads[i]})}, {c});
  EXPECT_EQ(first(c), first(a));
  EXPECT_EQ(resumed.iterations(), 4);
}

TEST_F(Optimizers, SlotsComeInVariableOrderWithNames) {
  auto z = var("z", {1.f}), a = var("a", {1.f}), m = var("m", {1.f});
  Adam opt;
  opt.build({z, a, m});
  std::vector<std::string> names;
  for (const auto& s : opt.slot_variables()) names.push_back(s->name());
  EXPECT_EQ(names, (std::vector<std::string>{"optimizer/z/m", "optimizer/z/v", "optimizer/a/m",
                                             "optimizer/a/v", "optimizer/m/m", "optimizer/m/v"}));
  Adagrad ada(0.1f, 0.25f);
  ada.build({z});
  EXPECT_EQ(first(ada.slot_variables()[0]), 0.25f);
}

TEST_F(Optimizers, HorovodLearningRateScaling) {
  EXPECT_EQ(scale_learning_rate(0.001f, 4), 0.004f);
  EXPECT_THROW(scale_learning_rate(0.1f, 0), InvalidArgument);
}

TEST_F(Optimizers, SequentialMakesLayerNamesUniqueAsKeras) {
  Sequential m;
  m.add(std::make_shared<Dense>(4));
  m.add(std::make_shared<Dense>(4));
  m.add(std::make_shared<Dense>(2));
  m.add(
      std::make_shared<Dense>(2, Activation::kNone, true, "dense_1"));  // taken: becomes dense_1_1
  m.build(Shape{1, 3});
  std::vector<std::string> names;
  for (const auto& v : m.variables()) names.push_back(v->name());
  EXPECT_EQ(names, (std::vector<std::string>{"dense/kernel", "dense/bias", "dense_1/kernel",
                                             "dense_1/bias", "dense_2/kernel", "dense_2/bias",
                                             "dense_1_1/kernel", "dense_1_1/bias"}));
}

}  // namespace
}  // namespace dtrain
