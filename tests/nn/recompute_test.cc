// Activation recomputation (recompute_grad, Layer::set_recompute_grad, GPTConfig::recompute):
// gradients bitwise equal to the unrecomputed graph (inputs and variables, one and several
// outputs), Dropout's masks replayed, BatchNormalization's moving statistics updated once, no
// recording without a tape, the block's intermediate tensors not kept between forward and
// backward (counted through their storage), and a small GPT trained by fit() under one device and
// Mirrored with recomputation ending at bitwise the weights it ends at without.
#include "dtrain/model/recompute.h"

#include <gtest/gtest.h>

#include "dtrain/core/allocator.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "dtrain/nn/applications.h"
#include "dtrain/nn/gpt.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/make_strategy.h"
#include "dtrain/train/fit.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using applications::GPT;
using applications::GPTConfig;
using testing::random_tensor;

class Recompute : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({2, 1}); }
};

// A block of Dense(tanh) -> Dropout -> Dense, as one layer.
class Block : public Layer {
 public:
  explicit Block(float dropout) : Layer("block") {
    a = register_layer(std::make_shared<Dense>(6, Activation::kTanh, true, "a"));
    drop = register_layer(std::make_shared<Dropout>(dropout, "drop"));
    b = register_layer(std::make_shared<Dense>(4, Activation::kNone, true, "b"));
  }
  std::shared_ptr<Dense> a, b;
  std::shared_ptr<Dropout> drop;

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override {
    return (*b)((*drop)((*a)(x, training), training), training);
  }
};

std::vector<std::vector<float>> grads_of(Block& block, const Tensor& x, bool recompute) {
  block.set_recompute_grad(recompute);
  GradientTape tape;
  tape.watch(x);
  const Tensor y = block(ops::mul(x, x), true);
  const Tensor loss = ops::sum(ops::mul(y, y));
  std::vector<Tensor> sources = {x};
  for (const auto& v : block.trainable_variables()) sources.push_back(v->value());
  std::vector<std::vector<float>> out;
  for (const Tensor& g : tape.gradient(loss, sources)) out.push_back(g.to_vector<float>());
  out.push_back(y.to_vector<float>());
  return out;
}

TEST_F(Recompute, GradientsAreBitwiseTheUnrecomputedOnesDropoutIncluded) {
  set_global_seed(3);
  Block block(0.5f);
  const Tensor x = random_tensor(Shape{5, 3}, 11);
  block(x, false);  // build
  const int64_t calls = block.drop->rng_calls();
  const auto plain = grads_of(block, x, false);
  block.drop->set_rng_calls(calls);  // the same dropout draw for the recomputed run
  const auto again = grads_of(block, x, true);
  ASSERT_EQ(plain.size(), again.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(plain[i], again[i]) << "gradient " << i;
  // The replay did not draw again: one call for the recomputed forward pass.
  EXPECT_EQ(block.drop->rng_calls(), calls + 1);
}

TEST_F(Recompute, SeveralOutputsAndNoTape) {
  const Tensor x = random_tensor(Shape{4}, 2), w = random_tensor(Shape{4}, 3);
  const RecomputeFn f = [](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{ops::tanh(ops::mul(in[0], in[1])), ops::mul(in[0], in[0])};
  };
  auto grads = [&](bool recompute) {
    GradientTape tape;
    tape.watch(x);
    tape.watch(w);
    const std::vector<Tensor> y = recompute ? recompute_grad(f, {x, w}, {}) : f({x, w});
    const Tensor loss = ops::add(ops::sum(ops::mul(y[0], y[0])), ops::sum(ops::mul(y[1], w)));
    std::vector<std::vector<float>> out;
    for (const Tensor& g : tape.gradient(loss, {x, w})) out.push_back(g.to_vector<float>());
    return out;
  };
  const auto plain = grads(false), again = grads(true);
  for (size_t i = 0; i < plain.size(); ++i)
    for (size_t j = 0; j < plain[i].size(); ++j)
      EXPECT_NEAR(plain[i][j], again[i][j], 1e-6f) << i << "," << j;
  // Without a tape it is f itself.
  const std::vector<Tensor> y = recompute_grad(f, {x, w}, {});
  EXPECT_EQ(y[0].to_vector<float>(), f({x, w})[0].to_vector<float>());
  EXPECT_THROW(recompute_grad(RecomputeFn(), {x}, {}), InvalidArgument);
}

TEST_F(Recompute, BatchNormUpdatesItsMovingStatisticsOnce) {
  auto run = [](bool recompute) {
    set_global_seed(5);
    auto bn = std::make_shared<BatchNormalization>(0.9f, 1e-3f);
    const Tensor x = random_tensor(Shape{6, 3}, 4);
    bn->build(x.shape());
    bn->set_recompute_grad(recompute);
    GradientTape tape;
    const Tensor loss = ops::sum(ops::mul((*bn)(x, true), x));
    const auto g = tape.gradient(loss, bn->trainable_variables());
    std::vector<std::vector<float>> out;
    for (const auto& v : bn->variables()) out.push_back(v->value().to_vector<float>());
    for (const auto& t : g) out.push_back(t.to_vector<float>());
    return out;
  };
  EXPECT_EQ(run(false), run(true));
}

// The first pass of a recomputed layer keeps nothing of its intermediate tensors: the host
// allocator's live bytes after the forward pass of a 10-block stack, before backward, hold every
// block's activations without recomputation and only the blocks' inputs with it; the peak over
// forward and backward falls too.
TEST_F(Recompute, IntermediateTensorsAreNotKeptUntilBackward) {
  auto measure = [](bool recompute) {
    set_global_seed(1);
    std::vector<std::shared_ptr<Block>> blocks;
    const Tensor x0 = random_tensor(Shape{512, 4}, 1);
    for (int i = 0; i < 10; ++i) {
      blocks.push_back(std::make_shared<Block>(0.0f));
      (*blocks.back())(x0, false);  // built before measuring
      blocks.back()->set_recompute_grad(recompute);
    }
    Allocator& a = host_allocator();
    const size_t before = a.get_memory_info().current;
    a.reset_memory_stats();
    size_t after_forward = 0;
    {
      GradientTape tape;
      Tensor h = x0;
      for (auto& b : blocks) h = (*b)(h, true);
      const Tensor loss = ops::sum(ops::mul(h, h));
      after_forward = a.get_memory_info().current - before;
      (void)tape.gradient(loss, blocks[0]->trainable_variables());
    }
    return std::make_pair(after_forward, a.get_memory_info().peak - before);
  };
  const auto [plain_live, plain_peak] = measure(false);
  const auto [re_live, re_peak] = measure(true);
  EXPECT_LT(re_live * 2, plain_live) << plain_live << " vs " << re_live;
  EXPECT_LT(re_peak, plain_peak) << plain_peak << " vs " << re_peak;
  std::printf("live after forward: %zu -> %zu bytes; peak: %zu -> %zu bytes\n", plain_live, re_live,
              plain_peak, re_peak);
}

using testing::strategy_on_cpus;

std::vector<std::vector<float>> train_gpt(const std::string& name, bool recompute,
                                          float dropout = 0.1f) {
  auto s = strategy_on_cpus(name);
  set_global_seed(7);
  GPTConfig c;
  c.vocab_size = 11;
  c.context_length = 8;
  c.num_layers = 3;
  c.num_heads = 2;
  c.dim = 8;
  c.dropout = dropout;
  c.recompute = recompute;
  std::shared_ptr<GPT> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = std::make_shared<GPT>(c);
    m->build(Shape{1, 8});
    opt = std::make_unique<Adam>(1e-2f);
  }
  const Dataset ds = Dataset::from_tensors(testing::repeating_sequences(32, 8, 11));
  FitOptions f;
  f.steps = 12;
  f.global_batch_size = 16;
  f.warmup_steps = 0;
  f.loss = get_loss("sparse_categorical_crossentropy");
  fit(*s, *m, *opt, ds, nullptr, f);
  std::vector<std::vector<float>> w;
  for (const auto& v : m->variables()) w.push_back(v->value().to_vector<float>());
  return w;
}

TEST_F(Recompute, GptWithRecomputedBlocksTrainsBitwiseAlikeUnderOneDeviceAndMirrored) {
  for (const char* name : {"one_device", "mirrored"}) {
    const auto plain0 = train_gpt(name, false, 0.f);
    const auto recomputed0 = train_gpt(name, true, 0.f);
    ASSERT_EQ(plain0.size(), recomputed0.size());
    for (size_t i = 0; i < plain0.size(); ++i)
      EXPECT_EQ(plain0[i], recomputed0[i]) << name << " no dropout, variable " << i;
    const auto plain = train_gpt(name, false);
    const auto recomputed = train_gpt(name, true);
    ASSERT_EQ(plain.size(), recomputed.size());
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_EQ(plain[i], recomputed[i]) << name << " " << i;
  }
}

// ResNetOptions::recompute: resnet8 with (synchronized) batch norm, trained by fit() with and
// without recomputed blocks, under one device and Mirrored: bitwise the same weights and moving
// statistics.
std::vector<std::vector<float>> train_resnet(const std::string& name, bool recompute) {
  auto s = strategy_on_cpus(name);
  set_global_seed(9);
  applications::ResNetOptions o;
  o.input_shape = Shape{8, 8, 1};
  o.classes = 3;
  o.synchronized_batch_norm = name != "one_device";
  o.recompute = recompute;
  std::shared_ptr<Model> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = applications::CifarResNet(8, o);
    m->build(Shape{1, 8, 8, 1});
    opt = std::make_unique<SGD>(0.05f, 0.9f);
  }
  const Tensor x = random_tensor(Shape{24, 8, 8, 1}, 21);
  std::vector<int32_t> y;
  for (int i = 0; i < 24; ++i) y.push_back(i % 3);
  FitOptions f;
  f.steps = 4;
  f.global_batch_size = 12;
  f.warmup_steps = 0;
  fit(*s, *m, *opt, Dataset::from_tensors({x, Tensor::from_vector<int32_t>(y, Shape{24})}), nullptr,
      f);
  std::vector<std::vector<float>> w;
  for (const auto& v : m->variables()) w.push_back(v->value().to_vector<float>());
  return w;
}

TEST_F(Recompute, ResNetWithRecomputedBlocksTrainsBitwiseAlikeSyncBatchNormIncluded) {
  for (const char* name : {"one_device", "mirrored"}) {
    const auto plain = train_resnet(name, false);
    const auto recomputed = train_resnet(name, true);
    ASSERT_EQ(plain.size(), recomputed.size());
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_EQ(plain[i], recomputed[i]) << name << " " << i;
  }
}

}  // namespace
}  // namespace dtrain
