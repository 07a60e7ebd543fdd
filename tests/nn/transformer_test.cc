// The transformer layers and the GPT application: GPT-2 small's parameter count (Hugging Face's
// 124,439,808), Keras' weight layouts and names, multi-head attention against a float64 reference
// written here, causality, weight tying (one variable, gradients from both uses), and a small GPT
// trained under one device, Mirrored and CentralStorage to the same weights.
#include <cmath>

#include "dtrain/nn/gpt.h"
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

class Transformer : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({2, 1}); }
};

using testing::strategy_on_cpus;

GPTConfig tiny() {
  GPTConfig c;
  c.vocab_size = 11;
  c.context_length = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.dim = 8;
  return c;
}

TEST_F(Transformer, Gpt2SmallHasHuggingFacesParameterCount) {
  const GPTConfig c = GPTConfig::preset("gpt2");
  EXPECT_EQ(c.num_parameters(), 124439808);
  auto s = strategy_on_cpus("one_device");
  auto scope = s->scope();
  GPT m(c);
  m.build(Shape{1, 4});
  EXPECT_EQ(m.count_params(), 124439808);
  EXPECT_EQ(m.variables().size(), 2u + 12u * 16u + 2u);  // wte, wpe, 16 a block, ln_f
  EXPECT_EQ(m.variables()[0]->name(), "wte/embeddings");
  EXPECT_EQ(m.variables()[0]->shape(), (Shape{50257, 768}));
  EXPECT_EQ(m.variables()[2]->name(), "h_0/ln_1/gamma");
  EXPECT_EQ(m.variables()[4]->name(), "h_0/attn/query/kernel");
  EXPECT_EQ(m.variables()[4]->shape(), (Shape{768, 12, 64}));
  EXPECT_EQ(m.variables()[10]->name(), "h_0/attn/attention_output/kernel");
  EXPECT_EQ(m.variables()[10]->shape(), (Shape{12, 64, 768}));
  // GPT-2's initialisation: the residual projections are narrower than the other kernels.
  auto stddev = [](const Tensor& t) {
    double s2 = 0;
    for (float v : t.to_vector<float>()) s2 += double(v) * v;
    return std::sqrt(s2 / static_cast<double>(t.numel()));
  };
  EXPECT_NEAR(stddev(m.variables()[4]->value()), 0.02, 0.001);
  EXPECT_NEAR(stddev(m.variables()[10]->value()), 0.02 / std::sqrt(24.0), 0.0005);
  for (const char* p :
       {"gpt2-medium", "gpt2-large", "gpt2-xl", "gpt-mini", "gpt-micro", "gpt-nano"})
    EXPECT_GT(GPTConfig::preset(p).num_parameters(), 0) << p;
  EXPECT_EQ(GPTConfig::preset("gpt2-medium").num_parameters(), 354823168);  // Hugging Face's
  EXPECT_THROW(GPTConfig::preset("gpt3"), InvalidArgument);
}

// Multi-head attention with a causal mask against loops in float64 over the layer's own weights.
TEST_F(Transformer, MultiHeadAttentionMatchesAFloat64Reference) {
  const int64_t B = 2, T = 5, D = 6, H = 2, K = 3;
  MultiHeadAttention mha(H, K, 0.f, /*use_causal_mask=*/true);
  const Tensor x = random_tensor({B, T, D}, 1);
  const std::vector<float> y = mha(x).to_vector<float>();
  const auto vars = mha.variables();  // query k,b; key k,b; value k,b; output k,b
  ASSERT_EQ(vars.size(), 8u);
  EXPECT_EQ(vars[0]->name(), "multi_head_attention/query/kernel");
  EXPECT_EQ(vars[6]->name(), "multi_head_attention/attention_output/kernel");
  std::vector<std::vector<float>> w;
  for (const auto& v : vars) w.push_back(v->value().to_vector<float>());
  const std::vector<float> xv = x.to_vector<float>();
  // proj[p][b][t][h][k]
  auto project = [&](int p, int64_t b, int64_t t, int64_t h, int64_t k) {
    double s = w[2 * p + 1][h * K + k];
    for (int64_t d = 0; d < D; ++d)
      s += double(xv[(b * T + t) * D + d]) * w[2 * p][(d * H + h) * K + k];
    return s;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> out(D, 0.0);
      for (int64_t d = 0; d < D; ++d) out[d] = w[7][d];
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> score(t + 1);
        double m = -1e300, z = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t k = 0; k < K; ++k) dot += project(0, b, t, h, k) * project(1, b, s, h, k);
          score[s] = dot / std::sqrt(double(K));
          m = std::max(m, score[s]);
        }
        for (auto& v : score) z += (v = std::exp(v - m));
        for (int64_t k = 0; k < K; ++k) {
          double o = 0;
          for (int64_t s = 0; s <= t; ++s) o += score[s] / z * project(2, b, s, h, k);
          for (int64_t d = 0; d < D; ++d) out[d] += o * w[6][(h * K + k) * D + d];
        }
      }
      for (int64_t d = 0; d < D; ++d)
        EXPECT_NEAR(y[(b * T + t) * D + d], out[d], 1e-5) << b << "," << t << "," << d;
    }
}

// A GPT's logits at position t depend on tokens 0..t only.
TEST_F(Transformer, GptIsCausal) {
  GPT m(tiny());
  const Tensor a = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6}, Shape{1, 6});
  const Tensor b = Tensor::from_vector<int32_t>({1, 2, 3, 9, 0, 7}, Shape{1, 6});
  const std::vector<float> ya = m(a).to_vector<float>(), yb = m(b).to_vector<float>();
  ASSERT_EQ(ya.size(), 6u * 11u);
  for (size_t i = 0; i < 3 * 11; ++i) EXPECT_EQ(ya[i], yb[i]) << i;  // positions 0-2: same
  bool later_differ = false;
  for (size_t i = 3 * 11; i < ya.size(); ++i) later_differ = later_differ || ya[i] != yb[i];
  EXPECT_TRUE(later_differ);
  EXPECT_THROW(m(Tensor::from_vector<int32_t>(std::vector<int32_t>(9, 1), Shape{1, 9})),
               InvalidArgument);  // longer than the context
  EXPECT_THROW(m(Tensor::from_vector<int32_t>({1, 11}, Shape{1, 2})), InvalidArgument);
}

// Weight tying: the head is the token embedding; its gradient is the sum of both uses' (checked
// against finite differences of the loss).
TEST_F(Transformer, TiedHeadIsOneVariableWithBothGradients) {
  GPTConfig c = tiny();
  GPT tied(c);
  const Tensor ids = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6, 7, 8}, Shape{2, 4});
  const Tensor labels = Tensor::from_vector<int32_t>({2, 3, 4, 5, 6, 7, 8, 9}, Shape{2, 4});
  tied.build(Shape{2, 4});
  c.tie_weights = false;
  GPT untied(c);
  untied.build(Shape{2, 4});
  EXPECT_EQ(untied.count_params() - tied.count_params(), 11 * 8);
  EXPECT_EQ(tied.count_params(), tiny().num_parameters());
  EXPECT_EQ(untied.count_params(), c.num_parameters());
  for (const auto& v : tied.variables()) EXPECT_EQ(v->name().find("lm_head"), std::string::npos);
  auto& table = *tied.wte->embeddings;
  auto loss = [&] { return ops::mean(ops::sequence_cross_entropy(tied(ids), labels)); };
  std::vector<float> g;
  {
    GradientTape tape;
    g = tape.gradient(loss(), {table.value()})[0].to_vector<float>();
  }
  const Tensor base = table.value().clone();
  std::vector<float> w = base.to_vector<float>();
  for (size_t i : {size_t{2 * 8 + 1}, size_t{9 * 8 + 3}, size_t{0}}) {  // row 2: input; 9: head
    const float e = 1e-3f;
    std::vector<float> p = w, q = w;
    p[i] += e;
    q[i] -= e;
    table.assign(Tensor::from_vector(p, base.shape()));
    const double lp = loss().item();
    table.assign(Tensor::from_vector(q, base.shape()));
    const double lq = loss().item();
    EXPECT_NEAR(g[i], (lp - lq) / (2 * e), 2e-3) << i << " " << g[i];
  }
  table.assign(base);
  EXPECT_NE(g[9 * 8 + 3], 0.f);  // only the head reads row 9
}

TEST_F(Transformer, DenseAppliesToTheLastAxisOfASequence) {
  Dense d(4);
  const Tensor x = random_tensor({2, 3, 5}, 9);
  const Tensor y = d(x);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(d.kernel->shape(), (Shape{5, 4}));
  const Tensor flat = d(ops::reshape(x, Shape{6, 5}));
  EXPECT_EQ(y.to_vector<float>(), flat.to_vector<float>());
}

std::vector<std::vector<float>> train_tiny(const std::string& name) {
  auto s = strategy_on_cpus(name);
  set_global_seed(7);
  std::shared_ptr<GPT> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = std::make_shared<GPT>(tiny());
    m->build(Shape{1, 8});
    opt = std::make_unique<Adam>(1e-2f);
  }
  // A repeating sequence: each window's next token is determined by the current one.
  const Dataset ds = Dataset::from_tensors(testing::repeating_sequences(32, 8, 11));
  FitOptions f;
  f.steps = 80;
  f.global_batch_size = 16;
  f.shuffle = false;
  f.warmup_steps = 0;
  f.loss = get_loss("sparse_categorical_crossentropy");
  const History h = fit(*s, *m, *opt, ds, nullptr, f);
  EXPECT_LT(h.epoch_loss.back(), 0.5 * h.epoch_loss.front()) << name;
  std::vector<std::vector<float>> w;
  for (const auto& v : m->variables()) w.push_back(v->value().to_vector<float>());
  return w;
}

TEST_F(Transformer, SmallGptTrainsAlikeUnderOneDeviceMirroredAndCentralStorage) {
  const auto one = train_tiny("one_device");
  for (const char* name : {"mirrored", "central_storage"}) {
    const auto other = train_tiny(name);
    double worst = 0, largest = 0;
    for (size_t i = 0; i < one.size(); ++i)
      for (size_t j = 0; j < one[i].size(); ++j) {
        worst = std::max(worst, std::abs(double(other[i][j]) - one[i][j]));
        largest = std::max(largest, std::abs(double(one[i][j])));
      }
    EXPECT_LT(worst / largest, 1e-4) << name << ": " << worst << " of " << largest;
  }
}

}  // namespace
}  // namespace dtrain
