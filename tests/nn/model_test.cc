// The Model API: layers as a tree (paths, unique names, recursive variables), functional models
// (skip connections, several inputs and outputs, merge layers), subclassed models, summary(), and
// fusion offered by layers.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <sstream>

#include "dtrain/core/allocator.h"
#include "dtrain/core/precision.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/layers.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using testing::random_tensor;

class ModelApi : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

// A residual block as a layer of its own, with sublayers.
class Block : public Layer {
 public:
  explicit Block(int64_t filters, std::string name = "block") : Layer(std::move(name)) {
    conv = register_layer(
        std::make_shared<Conv2D>(filters, 3, 3, Activation::kNone, ops::Padding::kSame), "conv");
    bn = register_layer(std::make_shared<BatchNormalization>(), "bn");
  }
  std::string class_name() const override { return "Block"; }
  std::shared_ptr<Conv2D> conv;
  std::shared_ptr<BatchNormalization> bn;

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override {
    return ops::relu(ops::add(x, (*bn)((*conv)(x), training)));
  }
};

class Net : public Model {
 public:
  Net() : Model("net") {
    stem = register_layer(std::make_shared<Conv2D>(4, 3, 3, Activation::kRelu));
    a = register_layer(std::make_shared<Block>(4));
    b = register_layer(std::make_shared<Block>(4));
    head = register_layer(std::make_shared<Dense>(3));
  }
  std::shared_ptr<Conv2D> stem;
  std::shared_ptr<Block> a, b;
  std::shared_ptr<Dense> head;

 protected:
  using Model::call;
  Tensor call(const Tensor& x, bool training) override {
    return (*head)(ops::flatten((*b)((*a)((*stem)(x), training), training)));
  }
};

std::vector<std::string> names(const VariableList& vs) {
  std::vector<std::string> out;
  for (const auto& v : vs) out.push_back(v->name());
  return out;
}

TEST_F(ModelApi, SubclassedModelIsATreeWithPathNamesUniqueAmongSiblings) {
  Net net;
  net.build(Shape{1, 6, 6, 1});
  const std::vector<std::string> want = {"conv2d/kernel",          "conv2d/bias",
                                         "block/conv/kernel",      "block/conv/bias",
                                         "block/bn/gamma",         "block/bn/beta",
                                         "block/bn/moving_mean",   "block/bn/moving_variance",
                                         "block_1/conv/kernel",    "block_1/conv/bias",
                                         "block_1/bn/gamma",       "block_1/bn/beta",
                                         "block_1/bn/moving_mean", "block_1/bn/moving_variance",
                                         "dense/kernel",           "dense/bias"};
  EXPECT_EQ(names(net.variables()), want);
  EXPECT_EQ(net.trainable_variables().size(), 12u);
  EXPECT_EQ(net.non_trainable_variables().size(), 4u);
  EXPECT_EQ(net.layers().size(), 4u);
  EXPECT_EQ(net.get_layer("block_1"), net.b);
  EXPECT_EQ(net.b->path(), "block_1");
  EXPECT_EQ(net.b->conv->path(), "block_1/conv");
  // 3*3*1*4+4, twice (3*3*4*4+4 + 4*4), 4*4*4*3+3 (6x6 -> 4x4 after the valid stem).
  EXPECT_EQ(net.count_params(), 40 + 2 * (148 + 16) + 195);
  const Tensor y = net(random_tensor({2, 6, 6, 1}, 1), false);
  EXPECT_EQ(y.shape(), (Shape{2, 3}));
}

TEST_F(ModelApi, ALayerRegisteredTwiceHasItsVariablesOnce) {
  class Tied : public Model {
   public:
    Tied() : Model("tied") {
      d = register_layer(std::make_shared<Dense>(4));
      register_layer(d);  // the same layer again: no-op
    }
    std::shared_ptr<Dense> d;

   protected:
    using Model::call;
    Tensor call(const Tensor& x, bool) override { return (*d)((*d)(x)); }
  };
  Tied t;
  t.build(Shape{1, 4});
  EXPECT_EQ(names(t.variables()), (std::vector<std::string>{"dense/kernel", "dense/bias"}));
}

TEST_F(ModelApi, FunctionalResidualModelWithTwoOutputs) {
  auto conv = std::make_shared<Conv2D>(4, 3, 3, Activation::kRelu, ops::Padding::kSame);
  auto shortcut = std::make_shared<Conv2D>(4, 1, 1, Activation::kNone, ops::Padding::kValid, 1,
                                           false, "shortcut");
  auto add = std::make_shared<Add>();
  auto flatten = std::make_shared<Flatten>();
  auto logits = std::make_shared<Dense>(5, Activation::kNone, true, "logits");
  auto gap = std::make_shared<GlobalAveragePooling2D>();
  auto value = std::make_shared<Dense>(1, Activation::kNone, true, "value");

  KerasTensor in = Input({6, 6, 2}, "image");
  KerasTensor x = (*conv)(in);
  EXPECT_EQ(x.shape(), (Shape{6, 6, 4}));
  EXPECT_EQ(x.to_string(), "(None, 6, 6, 4)");
  KerasTensor y = (*add)({x, (*shortcut)(in)});
  KerasTensor out1 = (*logits)((*flatten)(y));
  KerasTensor out2 = (*value)((*gap)(y));
  EXPECT_FALSE(conv->built());  // weights are made when the model is built, not by the shape pass
  Model model({in}, {out1, out2}, "two_heads");
  EXPECT_EQ(model.num_inputs(), 1);
  EXPECT_EQ(model.num_outputs(), 2);
  EXPECT_EQ(model.output_names(), (std::vector<std::string>{"logits", "value"}));
  model.build();
  EXPECT_EQ(
      names(model.variables()),
      (std::vector<std::string>{"conv2d/kernel", "conv2d/bias", "shortcut/kernel", "logits/kernel",
                                "logits/bias", "value/kernel", "value/bias"}));
  const Tensor t = random_tensor({3, 6, 6, 2}, 2);
  const std::vector<Tensor> outs = model(std::vector<Tensor>{t}, false);
  ASSERT_EQ(outs.size(), 2u);
  // The same layers called by hand give the same numbers.
  const Tensor h = ops::add((*conv)(t), (*shortcut)(t));
  EXPECT_EQ(outs[0].to_vector<float>(), (*logits)(ops::flatten(h)).to_vector<float>());
  EXPECT_EQ(outs[1].to_vector<float>(), (*value)(ops::mean(h, {1, 2})).to_vector<float>());
  EXPECT_EQ(outs[1].shape(), (Shape{3, 1}));

  std::ostringstream s;
  model.summary(s);
  const std::string table = s.str();
  EXPECT_NE(table.find("Model: \"two_heads\""), std::string::npos) << table;
  EXPECT_NE(table.find(" image (InputLayer)"), std::string::npos) << table;
  EXPECT_NE(table.find(" add (Add)"), std::string::npos) << table;
  EXPECT_NE(table.find("conv2d[0], shortcut[0]"), std::string::npos) << table;
  EXPECT_NE(table.find("(None, 6, 6, 4)"), std::string::npos) << table;
  // 3*3*2*4+4 + 2*4 + 144*5+5 + 4*1+1
  EXPECT_EQ(model.count_params(), 76 + 8 + 725 + 5);
  EXPECT_NE(table.find("Total params: 814 (3.18 KB)"), std::string::npos) << table;
}

TEST_F(ModelApi, FunctionalModelWithTwoInputsAndConcatenate) {
  auto da = std::make_shared<Dense>(3, Activation::kRelu);
  auto db = std::make_shared<Dense>(2, Activation::kRelu);
  auto cat = std::make_shared<Concatenate>();
  auto mul = std::make_shared<Multiply>();
  auto out = std::make_shared<Dense>(1);
  KerasTensor a = Input({4}, "a"), b = Input({5}, "b");
  KerasTensor joined = (*cat)({(*da)(a), (*db)(b)});
  EXPECT_EQ(joined.shape(), (Shape{5}));
  Model m({a, b}, {(*out)((*mul)({joined, joined}))});
  m.build();
  const Tensor ta = random_tensor({2, 4}, 3), tb = random_tensor({2, 5}, 4);
  const Tensor y = m(std::vector<Tensor>{ta, tb}, false)[0];
  const Tensor j = ops::concat({(*da)(ta), (*db)(tb)}, 1);
  EXPECT_EQ(y.to_vector<float>(), (*out)(ops::mul(j, j)).to_vector<float>());
}

TEST_F(ModelApi, MistakesGetErrorsThatSayWhatIsWrong) {
  KerasTensor a = Input({4}, "a"), b = Input({4}, "b");
  auto add = std::make_shared<Add>();
  KerasTensor sum = (*add)({a, b});
  try {
    Model m({a}, {sum});
    FAIL() << "an output that needs an Input not given was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Input 'b'"), std::string::npos) << e.what();
  }
  Model ok({a, b}, {sum});
  try {
    ok(std::vector<Tensor>{random_tensor({2, 4}, 1), random_tensor({2, 3}, 2)}, false);
    FAIL() << "a wrong input shape was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expects (None, 4)"), std::string::npos) << e.what();
  }
  EXPECT_THROW((*std::make_shared<Add>())({a, Input({3})}), InvalidArgument);  // shapes differ
  Dense on_stack(3);
  EXPECT_THROW(on_stack(a), InvalidArgument);  // not owned by a shared_ptr
  EXPECT_THROW((*std::make_shared<Add>())(random_tensor({2, 4}, 3)), InvalidArgument);  // 1 input
  auto c = std::make_shared<Conv2D>(2, 3, 3);
  EXPECT_THROW((*c)(Input({3, 4})), InvalidArgument);  // Conv2D wants [batch, H, W, C]
  EXPECT_FALSE(c->built());
  // A built model called on the wrong features: the op's error names the innermost layer, once
  // (it named only the op: "matmul: inner dimensions differ").
  Sequential inner({std::make_shared<Dense>(8, Activation::kRelu, true, "hidden")});
  Sequential outer({std::make_shared<Dense>(6, Activation::kNone, true, "first"),
                    std::make_shared<Sequential>(std::move(inner))});
  outer.build(Shape{2, 5});
  outer(random_tensor({2, 5}, 4), false);
  for (const auto& [shape, layer] :
       {std::pair<Shape, std::string>{Shape{2, 7}, "layer 'first' (Dense): "}}) {
    try {
      outer(random_tensor(shape, 5), false);
      FAIL() << "a wrong feature count was accepted";
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind("InvalidArgument: " + layer, 0), 0u) << m;
      EXPECT_NE(m.find("[2, 7]"), std::string::npos) << m;
      EXPECT_EQ(m.find("layer '", m.find("layer '") + 1), std::string::npos)
          << "named twice: " << m;
    }
  }
}

// Conv2D(relu) followed by max pooling runs as one op in any container; the numbers and the
// gradients are those of the layers run apart.
TEST_F(ModelApi, ConvPoolFusionIsOfferedByTheLayersToAnyContainer) {
  auto conv = std::make_shared<Conv2D>(3, 3, 3, Activation::kRelu);
  auto pool = std::make_shared<MaxPool2D>();
  EXPECT_FALSE(conv->fuse_with_next(*pool));  // not built yet
  Sequential seq({conv, pool, std::make_shared<Flatten>()});
  seq.build(Shape{1, 8, 8, 2});
  EXPECT_TRUE(conv->fuse_with_next(*pool));
  EXPECT_FALSE(pool->fuse_with_next(*conv));
  const Tensor x = random_tensor({2, 8, 8, 2}, 5);
  const Tensor apart = ops::flatten((*pool)((*conv)(x)));
  std::vector<Tensor> g_seq, g_apart;
  {
    GradientTape tape;
    const Tensor y = seq(x, true);
    EXPECT_EQ(y.to_vector<float>(), apart.to_vector<float>());
    g_seq = tape.gradient(ops::sum(ops::square(y)), seq.trainable_variables());
  }
  {
    GradientTape tape;
    g_apart = tape.gradient(ops::sum(ops::square(ops::flatten((*pool)((*conv)(x))))),
                            seq.trainable_variables());
  }
  for (size_t i = 0; i < g_seq.size(); ++i)
    testing::expect_near(g_seq[i].to_vector<float>(), g_apart[i].to_vector<float>(), 1e-4f);
  // The same pair in a functional graph.
  KerasTensor in = Input({8, 8, 2});
  Model f(in, (*std::make_shared<Flatten>())((*pool)((*conv)(in))));
  f.build();
  EXPECT_EQ(f(x, false).to_vector<float>(), apart.to_vector<float>());
}

// Add followed by a ReLU activation runs as one op in a functional graph (the end of a residual
// block): the values and gradients of the layers run apart, and the sum is never stored, so the
// forward pass holds one tensor fewer at its peak.
TEST_F(ModelApi, AddReluFusionInAFunctionalGraph) {
  auto dense = std::make_shared<Dense>(64);
  auto add = std::make_shared<Add>();
  auto relu = std::make_shared<ActivationLayer>(Activation::kRelu);
  EXPECT_FALSE(add->fuse_with_next(*relu));  // not built yet
  KerasTensor in = Input({64});
  const KerasTensor h = (*dense)(in);
  Model f(in, {(*relu)((*add)({in, h})), h});  // h is kept to the end: it is an output
  f.build();
  EXPECT_TRUE(add->fuse_with_next(*relu));
  EXPECT_FALSE(relu->fuse_with_next(*add));
  auto tanh = std::make_shared<ActivationLayer>(Activation::kTanh);
  (*tanh)(random_tensor({2, 64}, 8));  // built
  EXPECT_FALSE(add->fuse_with_next(*tanh));

  const Tensor x = random_tensor({256, 64}, 9);  // 64 KB a tensor
  const size_t tensor_bytes = 256 * 64 * sizeof(float);
  Allocator& host = allocator_for(x.device());
  auto forward_peak = [&](const std::function<std::vector<Tensor>()>& forward,
                          std::vector<Tensor>* out) {
    const size_t before = host.get_memory_info().current;
    host.reset_memory_stats();
    *out = forward();
    return host.get_memory_info().peak - before;
  };
  std::vector<Tensor> fused, apart;
  const size_t fused_peak = forward_peak([&] { return f(std::vector<Tensor>{x}, false); }, &fused);
  const size_t apart_peak = forward_peak(
      [&] {
        const Tensor hx = (*dense)(x);
        return std::vector<Tensor>{(*relu)((*add)({x, hx}).at(0)), hx};
      },
      &apart);
  ASSERT_EQ(fused.size(), 2u);
  EXPECT_EQ(fused[0].to_vector<float>(), apart[0].to_vector<float>());
  EXPECT_EQ(fused[1].to_vector<float>(), apart[1].to_vector<float>());
  EXPECT_GE(apart_peak, fused_peak + tensor_bytes) << fused_peak << " against " << apart_peak;

  std::vector<std::vector<float>> g[2];
  for (int run = 0; run < 2; ++run) {
    GradientTape tape;
    tape.watch(x);
    std::vector<Tensor> ys;
    if (run == 0) {
      ys = f(std::vector<Tensor>{x}, true);
    } else {
      const Tensor hx = (*dense)(x, true);
      ys = {(*relu)((*add)({x, hx}).at(0)), hx};
    }
    VariableList vars = f.trainable_variables();
    std::vector<Tensor> sources{x};
    for (const auto& v : vars) sources.push_back(v->value());
    for (const Tensor& t :
         tape.gradient(ops::add(ops::sum(ops::square(ys[0])), ops::sum(ys[1])), sources))
      g[run].push_back(t.to_vector<float>());
  }
  EXPECT_EQ(g[0], g[1]);

  // With a second reader of the sum (another layer, or the model's output), the pair is not fused;
  // the values are the same.
  for (bool output : {false, true}) {
    KerasTensor in2 = Input({64});
    auto add2 = std::make_shared<Add>();
    const KerasTensor s2 = (*add2)({in2, (*dense)(in2)});
    const KerasTensor other =
        output ? s2 : (*std::make_shared<ActivationLayer>(Activation::kNone))(s2);
    Model g2(in2, {(*std::make_shared<ActivationLayer>(Activation::kRelu))(s2), other});
    g2.build();
    const std::vector<Tensor> both = g2(std::vector<Tensor>{x}, false);
    EXPECT_EQ(both[0].to_vector<float>(), fused[0].to_vector<float>());
    EXPECT_EQ(both[1].to_vector<float>(), ops::add(x, fused[1]).to_vector<float>());
  }
}

// One training step's forward and backward pass in float32, under mixed_bfloat16, and under
// mixed_bfloat16 with an outer tape also watching x (which makes the ops keep their float32
// tensors): the gradients w.r.t. x and `vars`, the bytes the host allocator holds after the forward
// pass and the most it held during it.
struct PrecisionRun {
  std::vector<std::vector<float>> grads;
  size_t held = 0, peak = 0;
};
struct PrecisionRuns {
  PrecisionRun f32, b16, b16_outer;
};
PrecisionRuns run_in_both_precisions(const std::function<Tensor()>& loss_of_forward,
                                     const Tensor& x, const VariableList& vars) {
  auto step = [&](bool outer_tape) {
    PrecisionRun r;
    Allocator& host = allocator_for(x.device());
    const size_t before = host.get_memory_info().current;
    host.reset_memory_stats();
    std::optional<GradientTape> outer;
    if (outer_tape) {
      outer.emplace();
      outer->watch(x);
    }
    GradientTape tape;
    tape.watch(x);
    const Tensor loss = loss_of_forward();
    r.held = host.get_memory_info().current - before;
    r.peak = host.get_memory_info().peak - before;
    std::vector<Tensor> sources{x};
    for (const auto& v : vars) sources.push_back(v->value());
    for (const Tensor& g : tape.gradient(loss, sources)) r.grads.push_back(g.to_vector<float>());
    return r;
  };
  PrecisionRuns runs;
  runs.f32 = step(false);
  set_precision_policy(Precision::kMixedBFloat16);
  try {
    runs.b16 = step(false);
    runs.b16_outer = step(true);
  } catch (...) {
    set_precision_policy(Precision::kFloat32);
    throw;
  }
  set_precision_policy(Precision::kFloat32);
  return runs;
}

// Under mixed_bfloat16 what the backward pass keeps of a residual block (the convolutions' inputs,
// batch norm's inputs, the ReLU's output) is bfloat16 copies, and the functional model drops its
// float32 values after their last reader: the tape holds 0.6x float32's bytes. The
// gradients are those of keeping the float32 tensors (an outer tape makes the ops keep them),
// bit for bit: the convolutions read their inputs rounded anyway, and batch norm normalizes its
// input rounded in both passes.
TEST_F(ModelApi, MixedBfloat16KeepsHalfTheBytesForTheBackwardPassWithTheSameGradients) {
  KerasTensor in = Input({16, 16, 16}, "image");
  auto bn1 = std::make_shared<BatchNormalization>();
  bn1->activation = Activation::kRelu;
  KerasTensor y =
      (*bn1)((*std::make_shared<Conv2D>(32, 3, 3, Activation::kNone, ops::Padding::kSame))(in));
  y = (*std::make_shared<BatchNormalization>())((*std::make_shared<Conv2D>(32, 1, 1))(y));
  y = (*std::make_shared<Add>())({y, (*std::make_shared<Conv2D>(32, 1, 1))(in)});
  y = (*std::make_shared<ActivationLayer>(Activation::kRelu))(y);
  y = (*std::make_shared<Conv2D>(8, 3, 3, Activation::kNone, ops::Padding::kSame))(y);
  Model model({in},
              {(*std::make_shared<Dense>(3))((*std::make_shared<GlobalAveragePooling2D>())(y))});
  model.build();
  const Tensor x = random_tensor({16, 16, 16, 16}, 21);
  const PrecisionRuns r = run_in_both_precisions(
      [&] { return ops::sum(ops::square(model(std::vector<Tensor>{x}, true)[0])); }, x,
      model.trainable_variables());
  const auto &f32 = r.f32.grads, &b16 = r.b16.grads, &b16_full = r.b16_outer.grads;
  std::printf(
      "after the forward pass: float32 %zu bytes, mixed_bfloat16 %zu; at its peak %zu and %zu\n",
      r.f32.held, r.b16.held, r.f32.peak, r.b16.peak);
  EXPECT_LT(r.b16.held, r.f32.held * 65 / 100);
  // Also during the forward pass: each float32 value is dropped after its last reader (kept to the
  // end of the pass, they made mixed_bfloat16's peak 1.4x float32's).
  EXPECT_LT(r.b16.peak, r.f32.peak * 9 / 10);
  ASSERT_EQ(b16.size(), b16_full.size());
  for (size_t i = 0; i < b16.size(); ++i) EXPECT_EQ(b16[i], b16_full[i]) << "gradient " << i;
  // And they are bfloat16's approximations of float32's: each points the same way, except where
  // float32's is a sum that nearly cancels (the biases of the convolutions before batch norm, 0 in
  // exact arithmetic: norms of 1e-6 and 1e-4 against up to 300 for the others).
  std::vector<double> norm(f32.size()), cosine(f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    double d = 0, a = 0, b = 0;
    for (size_t j = 0; j < f32[i].size(); ++j) {
      d += static_cast<double>(f32[i][j]) * b16[i][j];
      a += static_cast<double>(f32[i][j]) * f32[i][j];
      b += static_cast<double>(b16[i][j]) * b16[i][j];
    }
    norm[i] = std::sqrt(a);
    cosine[i] = d / std::sqrt(a * b + 1e-300);
  }
  const double largest = *std::max_element(norm.begin(), norm.end());
  for (size_t i = 0; i < f32.size(); ++i) {
    if (norm[i] > 1e-3 * largest) {
      EXPECT_GT(cosine[i], 0.99) << "gradient " << i;
    }
  }
  EXPECT_NE(f32, b16);  // bfloat16 did run
}

// The same for dense layers: a matmul reading a ReLU's output keeps the ReLU's bfloat16 copy.
// What the tape holds after the forward pass is bfloat16 copies only: of the input, of each ReLU's
// output (one copy for the ReLU and the matmul reading it), and of each kernel (the copies the
// products read, kept for the backward pass as PyTorch's autocast and Keras' AutoCastVariable keep
// theirs); a second copy of each ReLU output would add 128 KiB.
TEST_F(ModelApi, MixedBfloat16DenseLayersShareTheReluCopies) {
  Sequential model({std::make_shared<Dense>(512, Activation::kRelu),
                    std::make_shared<Dense>(512, Activation::kRelu), std::make_shared<Dense>(4)});
  model.build(Shape{1, 256});
  const Tensor x = random_tensor({64, 256}, 22);
  const PrecisionRuns r = run_in_both_precisions(
      [&] { return ops::sum(ops::square(model(x, true))); }, x, model.trainable_variables());
  const auto &f32 = r.f32.grads, &b16 = r.b16.grads, &b16_full = r.b16_outer.grads;
  std::printf("after the forward pass: float32 %zu bytes, mixed_bfloat16 %zu\n", r.f32.held,
              r.b16.held);
  const size_t kernels = 256 * 512 + 512 * 512 + 512 * 4, relu_outputs = 2 * 64 * 512;
  const size_t copies = 2 * (x.numel() + relu_outputs + kernels);
  EXPECT_LE(r.b16.held, copies + 16 * 1024);  // + the float32 output and loss
  EXPECT_EQ(b16, b16_full);
  EXPECT_NE(f32, b16);
}

TEST_F(ModelApi, NewOpsHaveGradients) {
  using V = std::vector<Tensor>;
  testing::check_gradients(
      [](const V& x) {
        return ops::concat({x[0], x[1]}, 1);
      },
      {random_tensor({2, 3, 2}, 10), random_tensor({2, 1, 2}, 11)}, {true, true});
  testing::check_gradients([](const V& x) { return ops::slice(x[0], -1, 1, 2); },
                           {random_tensor({3, 4}, 12)}, {true});
  testing::check_gradients(
      [](const V& x) {
        return ops::split(x[0], 0, {1, 2})[1];
      },
      {random_tensor({3, 2}, 13)}, {true});
  testing::check_gradients([](const V& x) { return ops::zero_pad2d(x[0], 1, 0, 2, 1); },
                           {random_tensor({1, 2, 3, 2}, 14)}, {true});
  testing::check_gradients([](const V& x) { return ops::avg_pool2d(x[0], 2, 2, 2, 2); },
                           {random_tensor({1, 4, 4, 2}, 15)}, {true});
  testing::check_gradients(
      [](const V& x) { return ops::avg_pool2d(x[0], 3, 3, 2, 2, ops::Padding::kSame); },
      {random_tensor({1, 5, 5, 2}, 16)}, {true});
  // Values: a 2x2 valid window is the mean; TF pads "same" 3x3/2 on 4x4 only after (0 before, 1
  // after), so the first window covers 9 elements and the last the 4 that are not padding, each
  // divided by its own count.
  std::vector<float> v(16);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const Tensor img = Tensor::from_vector<float>(v, Shape{1, 4, 4, 1});
  EXPECT_EQ(ops::avg_pool2d(img).to_vector<float>(),
            (std::vector<float>{2.5f, 4.5f, 10.5f, 12.5f}));
  const std::vector<float> same =
      ops::avg_pool2d(img, 3, 3, 2, 2, ops::Padding::kSame).to_vector<float>();
  EXPECT_FLOAT_EQ(same[0], 45.f / 9.f);
  EXPECT_FLOAT_EQ(same[3], (10.f + 11.f + 14.f + 15.f) / 4.f);
  // Two images of three channels (pooled one plane at a time): each channel its own means.
  std::vector<float> v3(2 * 16 * 3);
  for (size_t i = 0; i < v3.size(); ++i)
    v3[i] = static_cast<float>(i / 3 % 16) + 100.f * static_cast<float>(i % 3) +
            1000.f * static_cast<float>(i / 48);
  const std::vector<float> got =
      ops::avg_pool2d(Tensor::from_vector<float>(v3, Shape{2, 4, 4, 3})).to_vector<float>();
  ASSERT_EQ(got.size(), 2u * 2 * 2 * 3);
  const float means[4] = {2.5f, 4.5f, 10.5f, 12.5f};
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(got[i], means[i / 3 % 4] + 100.f * static_cast<float>(i % 3) +
                          1000.f * static_cast<float>(i / 12))
        << i;
  EXPECT_EQ((*std::make_shared<AveragePooling2D>(2))(Input({4, 4, 3})).shape(), (Shape{2, 2, 3}));
  const Tensor p = ops::zero_pad2d(Tensor::full(Shape{1, 1, 1, 1}, 7.f), 1, 0, 0, 1);
  EXPECT_EQ(p.shape(), (Shape{1, 2, 2, 1}));
  EXPECT_EQ(p.to_vector<float>(), (std::vector<float>{0, 0, 7, 0}));
  EXPECT_THROW(ops::concat({random_tensor({2, 3}, 1), random_tensor({3, 3}, 2)}, 1),
               InvalidArgument);
  EXPECT_THROW(ops::slice(random_tensor({2, 3}, 1), 1, 2, 2), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
