// GradientTape semantics, including higher derivatives through nested tapes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/core/allocator.h"
#include "dtrain/core/precision.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/layers.h"
#include "model/op_util.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class Tape : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

TEST_F(Tape, UnwatchedTensorHasNoGradient) {
  Tensor x = Tensor::from_vector<float>({1, 2}, Shape{2});
  Tensor w = Tensor::from_vector<float>({3, 4}, Shape{2});
  GradientTape tape;
  tape.watch(x);
  Tensor y = ops::sum(ops::mul(x, w));
  auto g = tape.gradient(y, {x, w});
  EXPECT_EQ(g[0].to_vector<float>(), (std::vector<float>{3, 4}));
  EXPECT_FALSE(g[1].defined());  // TF returns None
}

TEST_F(Tape, BackwardFunctionsAreToldWhichInputsNeedAGradient) {
  // A recorded op sees, inside its backward pass, which of its inputs the tape wants: the data fed
  // in (unwatched) does not need one, a watched tensor and a variable's value do.
  Tensor data = Tensor::from_vector<float>({1, 2}, Shape{2});
  Tensor watched = Tensor::from_vector<float>({3, 4}, Shape{2});
  Tensor weight = Tensor::from_vector<float>({5, 6}, Shape{2});
  weight.set_trainable_variable(true);
  std::vector<bool> seen;
  GradientTape tape;
  tape.watch(watched);
  Tensor y = ops::add(ops::mul(data, weight), watched);
  Tensor out = Tensor::from_vector<float>({0, 0}, Shape{2});
  tape::record("probe", {data, watched, weight, y}, {out},
               [&](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                 for (size_t i = 0; i < 4; ++i) seen.push_back(tape::needs_gradient(i));
                 return {Tensor(), Tensor(), Tensor(), g[0]};
               });
  EXPECT_TRUE(tape::needs_gradient(0));  // outside a backward pass
  tape.gradient(ops::sum(out), {weight});
  EXPECT_EQ(seen, (std::vector<bool>{false, true, true, true}));
}

TEST_F(Tape, ConvolutionSkipsTheDataGradientButKeepsTheOthersExact) {
  // conv2d's backward computes dx only when the tape wants it; dw and db are the same either way.
  Tensor x = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6, 7, 8, 9}, Shape{1, 3, 3, 1});
  Tensor w = Tensor::from_vector<float>({1, -1, 2, 0.5f}, Shape{2, 2, 1, 1});
  Tensor b = Tensor::from_vector<float>({0.25f}, Shape{1});
  auto grads = [&](bool watch_x) {
    GradientTape tape;
    tape.watch(w);
    tape.watch(b);
    if (watch_x) tape.watch(x);
    Tensor y = ops::sum(ops::square(ops::conv2d(x, w, b, 1, 1, ops::Padding::kValid)));
    return tape.gradient(y, {x, w, b});
  };
  const auto with_dx = grads(true), without = grads(false);
  ASSERT_TRUE(with_dx[0].defined());
  EXPECT_FALSE(without[0].defined());
  EXPECT_EQ(with_dx[1].to_vector<float>(), without[1].to_vector<float>());
  EXPECT_EQ(with_dx[2].to_vector<float>(), without[2].to_vector<float>());
}

TEST_F(Tape, AccumulatesWhenATensorIsUsedTwice) {
  Tensor x = Tensor::from_vector<float>({2}, Shape{1});
  GradientTape tape;
  tape.watch(x);
  Tensor y = ops::add(ops::mul(x, x), ops::scale(x, 3.f));  // x^2 + 3x
  EXPECT_FLOAT_EQ(tape.gradient(y, {x})[0].item(), 7.f);
}

TEST_F(Tape, NonPersistentTapeRefusesSecondGradient) {
  Tensor x = Tensor::from_vector<float>({2}, Shape{1});
  GradientTape tape;
  tape.watch(x);
  Tensor y = ops::square(x);
  tape.gradient(y, {x});
  try {
    tape.gradient(y, {x});
    FAIL() << "expected FailedPrecondition";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("persistent"), std::string::npos);
  }
}

TEST_F(Tape, PersistentTapeGivesSeveralGradients) {
  Tensor x = Tensor::from_vector<float>({3}, Shape{1});
  GradientTape tape(/*persistent=*/true);
  tape.watch(x);
  Tensor y = ops::square(x);
  Tensor z = ops::exp(x);
  EXPECT_FLOAT_EQ(tape.gradient(y, {x})[0].item(), 6.f);
  EXPECT_NEAR(tape.gradient(z, {x})[0].item(), std::exp(3.f), 1e-4);
}

TEST_F(Tape, StopRecordingHidesOps) {
  Tensor x = Tensor::from_vector<float>({3}, Shape{1});
  GradientTape tape;
  tape.watch(x);
  Tensor y;
  {
    auto pause = tape.stop_recording();
    y = ops::square(x);
  }
  EXPECT_FALSE(tape.gradient(y, {x})[0].defined());
}

TEST_F(Tape, TrainableVariablesAreWatchedAutomatically) {
  VariableSpec spec{"v", Shape{2}, DType::kFloat32, initializers::constant(2.f)};
  auto v = create_variable(spec);
  spec.trainable = false;
  spec.name = "frozen";
  auto frozen = create_variable(spec);
  GradientTape tape;
  Tensor y = ops::sum(ops::mul(v->value(), frozen->value()));
  auto g = tape.gradient(y, VariableList{v, frozen});
  EXPECT_EQ(g[0].to_vector<float>(), (std::vector<float>{2, 2}));
  EXPECT_FALSE(g[1].defined());
}

TEST_F(Tape, SecondDerivativeOfTanh) {
  Tensor x = Tensor::from_vector<float>({0.3f, -0.7f}, Shape{2});
  GradientTape outer;
  outer.watch(x);
  Tensor dy;
  {
    GradientTape inner;
    inner.watch(x);
    Tensor y = ops::tanh(x);
    dy = inner.gradient(ops::sum(y), {x})[0];
  }
  Tensor d2 = outer.gradient(ops::sum(dy), {x})[0];
  const auto v = d2.to_vector<float>();
  for (int i = 0; i < 2; ++i) {
    const double xi = i == 0 ? 0.3 : -0.7, t = std::tanh(xi);
    EXPECT_NEAR(v[static_cast<size_t>(i)], -2 * t * (1 - t * t), 1e-5);
  }
}

// u(x) = Dense(1)(tanh(Dense(8)(x))): u''(x) by nested tapes vs central differences of u.
TEST_F(Tape, SecondDerivativeOfAnMlpForPinns) {
  set_global_seed(5);
  Sequential net({std::make_shared<Dense>(8, Activation::kTanh), std::make_shared<Dense>(1)});
  net.build(Shape{3, 1});
  Tensor x = Tensor::from_vector<float>({-0.5f, 0.1f, 0.8f}, Shape{3, 1});
  Tensor uxx;
  {
    GradientTape outer;
    outer.watch(x);
    Tensor ux;
    {
      GradientTape inner;
      inner.watch(x);
      ux = inner.gradient(ops::sum(net(x)), {x})[0];
    }
    uxx = outer.gradient(ops::sum(ux), {x})[0];
  }
  const float h = 1e-2f;
  auto u = [&](float dx) {
    std::vector<float> xs = x.to_vector<float>();
    for (auto& e : xs) e += dx;
    return net(Tensor::from_vector(xs, Shape{3, 1})).to_vector<float>();
  };
  const auto up = u(h), u0 = u(0), um = u(-h);
  const auto a = uxx.to_vector<float>();
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(a[i], (up[i] - 2 * u0[i] + um[i]) / (h * h), 2e-2);
}

TEST_F(Tape, SecondDerivativeThroughConvIsRefusedNotZero) {
  Tensor x = testing::random_tensor({1, 4, 4, 1}, 1);
  Tensor w = testing::random_tensor({2, 2, 1, 1}, 2);
  GradientTape outer;
  outer.watch(x);
  Tensor gx;
  {
    GradientTape inner;
    inner.watch(x);
    gx = inner.gradient(ops::sum(ops::square(ops::conv2d(x, w, Tensor()))), {x})[0];
  }
  EXPECT_THROW(outer.gradient(ops::sum(gx), {x}), Unimplemented);
}

TEST_F(Tape, ReluAndBatchNormKeepOnlyWhatTheirBackwardNeeds) {
  // Between the forward and the backward pass each op keeps what its gradient reads: batch norm its
  // input and statistics, relu its output (y > 0 exactly where x > 0). So in h -> batch norm ->
  // relu the batch norm's output is freed once the caller drops it; only h and y stay.
  Allocator& host = host_allocator();
  const Shape shape{4, 32, 32, 16};
  Tensor x = Tensor::from_vector<float>(std::vector<float>(shape.numel(), 0.5f), shape);
  Tensor gamma = Tensor::from_vector<float>(std::vector<float>(16, 1.f), Shape{16});
  Tensor beta = Tensor::from_vector<float>(std::vector<float>(16, 0.f), Shape{16});
  for (int64_t i = 0; i < shape.numel(); ++i)
    x.data<float>()[i] = std::sin(0.37f * static_cast<float>(i));
  const size_t bytes = static_cast<size_t>(shape.numel()) * sizeof(float);
  GradientTape tape;
  tape.watch(x);
  const size_t before = host.get_memory_info().current;
  Tensor y, mean, var;
  {
    Tensor h = ops::mul(x, x);
    Tensor b = ops::batch_norm_training(h, gamma, beta, 1e-3f, &mean, &var);
    y = ops::relu(b);
  }
  const size_t held = host.get_memory_info().current - before;
  EXPECT_GE(held, 2 * bytes);  // h (batch norm's input) and y
  EXPECT_LT(held, 2 * bytes + bytes / 2) << "the batch norm's output is still held";
  // The gradient through relu's output is relu's: dy where the batch norm's output was > 0.
  const Tensor g = tape.gradient(ops::sum(y), {x})[0];
  ASSERT_TRUE(g.defined());
  EXPECT_EQ(g.shape(), shape);
}

// Bitwise equal, NaN or not.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> g = got.to_vector<float>(), w = want.to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i)
    if (std::memcmp(&g[i], &w[i], 4) != 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << g[i] << ", the sum first gives "
                    << w[i];
      return;
    }
}

// Gradients with the tape passing an output's gradient in two parts (tape::SumBackwardFn) and with
// the sum made first, as before; how many backward passes took two parts.
struct BothWays {
  std::vector<Tensor> parts, summed;
  uint64_t taken = 0;
};
BothWays both_ways(const std::function<std::vector<Tensor>()>& grads) {
  BothWays r;
  const uint64_t before = tape_testing::summed_in_backward();
  r.parts = grads();
  r.taken = tape_testing::summed_in_backward() - before;
  tape_testing::take_sums_in_backward(false);
  r.summed = grads();
  tape_testing::take_sums_in_backward(true);
  EXPECT_EQ(tape_testing::summed_in_backward() - before, r.taken) << "taken with the switch off";
  return r;
}

// A residual block's input is read by the block's first layer and by its shortcut, so its
// gradient arrives in two parts; the ReLU that made it (ops::add_relu, ops::relu) takes them as
// they are, in one pass where the device fuses it (the CPU from 4 MB: both sizes here). The
// gradients are those of the sum made first, bit for bit, in float32 and under mixed_bfloat16 (the
// ReLU's kept bfloat16 copy); with more readers the parts before the last are summed in order
// first; a source read twice takes the sum, and an outer tape differentiating the backward pass the
// ops.
TEST_F(Tape, AGradientInTwoPartsIsTakenAsItIsByTheReluThatMadeIt) {
  for (const Precision precision : {Precision::kFloat32, Precision::kMixedBFloat16})
    for (const int64_t n : {int64_t{1000}, int64_t{1} << 20}) {
      SCOPED_TRACE(std::string(precision == Precision::kFloat32 ? "float32" : "mixed_bfloat16") +
                   ", " + std::to_string(n) + " elements");
      set_precision_policy(precision);
      const Shape shape{n};
      const Tensor x = testing::random_tensor(shape, 1), w = testing::random_tensor(shape, 2),
                   v = testing::random_tensor(shape, 3), r = testing::random_tensor(shape, 4);
      // Two residual blocks: h = add_relu(x w, x); z = add_relu(h v, h) (h read twice), and a
      // ReLU whose output is read twice.
      const auto two_blocks = [&] {
        GradientTape tape;
        tape.watch(x);
        tape.watch(w);
        tape.watch(v);
        const Tensor h = ops::add_relu(ops::mul(x, w), x);
        const Tensor q = ops::relu(ops::mul(h, r));
        const Tensor z = ops::add_relu(ops::mul(q, v), q);
        const Tensor loss = ops::sum(ops::mul(ops::add_relu(ops::mul(z, w), z), r));
        return tape.gradient(loss, {x, w, v});
      };
      BothWays b = both_ways(two_blocks);
      EXPECT_EQ(b.taken, 2u) << "q's ReLU and z's add_relu (h is read by mul(h, r) alone)";
      for (size_t i = 0; i < 3; ++i)
        expect_same_bits(b.parts[i], b.summed[i], "gradient " + std::to_string(i));

      // More readers (here four parts: mul(h, h) gives two): the first parts summed in the order
      // they come, as before, and the last taken as it is.
      const auto three_readers = [&] {
        GradientTape tape;
        tape.watch(x);
        const Tensor h = ops::relu(ops::mul(x, w));
        const Tensor loss =
            ops::sum(ops::add(ops::mul(ops::add(ops::mul(h, v), h), r), ops::mul(h, h)));
        return tape.gradient(loss, {x});
      };
      b = both_ways(three_readers);
      EXPECT_EQ(b.taken, 1u);
      expect_same_bits(b.parts[0], b.summed[0], "three readers");

      // The ReLU's output a source itself: its gradient is summed (the result returns it whole).
      const auto source = [&] {
        GradientTape tape;
        tape.watch(x);
        const Tensor h = ops::relu(ops::mul(x, w));
        const Tensor loss = ops::sum(ops::mul(ops::add(ops::mul(h, v), h), r));
        return tape.gradient(loss, {h, x});
      };
      b = both_ways(source);
      EXPECT_EQ(b.taken, 0u);
      expect_same_bits(b.parts[0], b.summed[0], "the source");
      expect_same_bits(b.parts[1], b.summed[1], "through the source");
      set_precision_policy(Precision::kFloat32);
    }
  // An outer tape differentiates the backward pass (a gradient penalty): the parts' sum and the
  // ReLU's gradient are recorded as ops, the same values.
  const Shape shape{1000};
  const Tensor x = testing::random_tensor(shape, 5), w = testing::random_tensor(shape, 6),
               r = testing::random_tensor(shape, 7);
  const auto penalty = [&] {
    GradientTape outer;
    outer.watch(w);
    Tensor gx;
    {
      GradientTape inner;
      inner.watch(x);
      const Tensor h = ops::relu(ops::mul(x, w));
      gx = inner.gradient(ops::sum(ops::mul(ops::add(ops::mul(h, w), h), r)), {x})[0];
    }
    return std::vector<Tensor>{gx, outer.gradient(ops::sum(ops::mul(gx, gx)), {w})[0]};
  };
  const BothWays b = both_ways(penalty);
  EXPECT_EQ(b.taken, 1u);
  expect_same_bits(b.parts[0], b.summed[0], "the inner gradient");
  expect_same_bits(b.parts[1], b.summed[1], "the penalty's gradient");
  EXPECT_GT(std::abs(b.parts[1].to_vector<float>()[0]) + std::abs(b.parts[1].to_vector<float>()[1]),
            0.f);
}

// A strategy's GradientReadyHook may release a source's gradient it is told is exclusive
// (ZeRO-2/3). add(h, s) hands one tensor to both inputs: the variable s's gradient and one of h's
// two parts, which the tape holds apart until h's ReLU reads it. So s's gradient is not exclusive
// then (it was with the sum made first, a new tensor), and the gradients are the same either way.
TEST_F(Tape, AGradientHeldAsAPartIsNotReportedExclusive) {
  struct Recorder : tape::GradientReadyHook {
    std::vector<int> exclusive;
    void on_ready(size_t i, const Tensor&, bool ex) override {
      if (exclusive.size() <= i) exclusive.resize(i + 1, -1);
      exclusive[i] = ex ? 1 : 0;
    }
    void on_done() override {}
  };
  const Shape shape{64};
  auto s = create_variable({"s", shape, DType::kFloat32, initializers::constant(0.5f)});
  auto w = create_variable({"w", shape, DType::kFloat32, initializers::constant(-0.25f)});
  const Tensor x = testing::random_tensor(shape, 8), v = testing::random_tensor(shape, 9),
               r = testing::random_tensor(shape, 10);
  const auto run = [&](Recorder* rec) {
    tape::GradientReadyHook* prev = tape::set_gradient_ready_hook(rec);
    GradientTape tape;
    const Tensor h = ops::relu(ops::add(x, w->value()));
    // (one op a statement: the order they are recorded in decides which part comes second)
    const Tensor hs = ops::add(h, s->value());
    const Tensor hv = ops::mul(h, v);
    const Tensor loss = ops::sum(ops::mul(ops::add(hs, hv), r));
    std::vector<Tensor> g = tape.gradient(loss, VariableList{s, w});
    tape::set_gradient_ready_hook(prev);
    return g;
  };
  Recorder parts, summed;
  const uint64_t before = tape_testing::summed_in_backward();
  const std::vector<Tensor> a = run(&parts);
  EXPECT_EQ(tape_testing::summed_in_backward() - before, 1u) << "h's ReLU took two parts";
  tape_testing::take_sums_in_backward(false);
  const std::vector<Tensor> b = run(&summed);
  tape_testing::take_sums_in_backward(true);
  ASSERT_EQ(parts.exclusive.size(), 2u);
  ASSERT_EQ(summed.exclusive.size(), 2u);
  EXPECT_EQ(parts.exclusive[0], 0) << "s's gradient is also h's part held apart";
  EXPECT_EQ(summed.exclusive[0], 1) << "(the sum first: a tensor of its own)";
  expect_same_bits(a[0], b[0], "s");
  expect_same_bits(a[1], b[1], "w");
}

// ZeroPadding2D's gradient is a crop, itself recorded (its gradient the padding again): through two
// tapes, d/dr of sum(d/dx[sum(pad(x) r)] s) = d/dr sum(crop(r) s) = pad(s), exactly.
TEST_F(Tape, ZeroPaddingDifferentiatesTwice) {
  const Tensor x = testing::random_tensor(Shape{2, 3, 4, 5}, 11),
               r = testing::random_tensor(Shape{2, 6, 5, 5}, 12),
               s = testing::random_tensor(Shape{2, 3, 4, 5}, 13);
  GradientTape outer;
  outer.watch(r);
  Tensor gx;
  {
    GradientTape inner;
    inner.watch(x);
    gx = inner.gradient(ops::sum(ops::mul(ops::zero_pad2d(x, 1, 2, 0, 1), r)), {x})[0];
  }
  expect_same_bits(gx, ops::slice(ops::slice(r, 1, 1, 3), 2, 0, 4), "the crop");
  const Tensor gr = outer.gradient(ops::sum(ops::mul(gx, s)), {r})[0];
  expect_same_bits(gr, ops::zero_pad2d(s, 1, 2, 0, 1), "the crop's gradient");
}

}  // namespace
}  // namespace dtrain
