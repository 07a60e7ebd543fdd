// The transformer ops on the CPU: finite-difference gradient checks of every one, values against
// float64 references written here, the embedding gradient's determinism, and the errors bad input
// gets.
#include <cmath>
#include <cstring>

#include "dtrain/core/precision.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using testing::check_gradients;
using testing::random_tensor;
using V = std::vector<Tensor>;

class TransformerOps : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

TEST_F(TransformerOps, GradientsOfTransposeAndBatchedMatmul) {
  check_gradients(
      [](const V& x) {
        return ops::transpose(x[0], {0, 2, 1, 3});
      },
      {random_tensor({2, 3, 4, 2}, 1)}, {true});
  check_gradients(
      [](const V& x) {
        return ops::transpose(x[0], {2, 0, 1});
      },
      {random_tensor({3, 4, 2}, 2)}, {true});
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Shape a = ta ? Shape{2, 3, 4, 3} : Shape{2, 3, 3, 4};
      const Shape b = tb ? Shape{2, 3, 5, 4} : Shape{2, 3, 4, 5};
      check_gradients([ta, tb](const V& x) { return ops::matmul(x[0], x[1], ta, tb); },
                      {random_tensor(a, 3), random_tensor(b, 4)}, {true, true});
    }
  // [B, T, K] @ [K, N]: a Dense kernel applied at every position.
  check_gradients([](const V& x) { return ops::matmul(x[0], x[1]); },
                  {random_tensor({2, 3, 4}, 5), random_tensor({4, 5}, 6)}, {true, true});
}

TEST_F(TransformerOps, GradientsOfSoftmaxLayerNormGelu) {
  for (int axis : {-1, 1}) {
    check_gradients([axis](const V& x) { return ops::softmax(x[0], axis); },
                    {random_tensor({2, 3, 5}, 10, -2.f, 2.f)}, {true});
    check_gradients([axis](const V& x) { return ops::log_softmax(x[0], axis); },
                    {random_tensor({2, 3, 5}, 11, -2.f, 2.f)}, {true});
  }
  check_gradients([](const V& x) { return ops::layer_norm(x[0], x[1], x[2], 1e-5f); },
                  {random_tensor({2, 3, 6}, 12, -2.f, 3.f), random_tensor({6}, 13, 0.5f, 1.5f),
                   random_tensor({6}, 14)},
                  {true, true, true});
  for (bool approx : {false, true})
    check_gradients([approx](const V& x) { return ops::gelu(x[0], approx); },
                    {random_tensor({3, 7}, 15, -3.f, 3.f)}, {true});
}

TEST_F(TransformerOps, GradientsOfEmbeddingMaskAndSequenceLoss) {
  const Tensor ids = Tensor::from_vector<int32_t>({2, 0, 2, 4, 2, 1}, Shape{2, 3});
  check_gradients([&](const V& x) { return ops::embedding_lookup(x[0], ids); },
                  {random_tensor({5, 4}, 20)}, {true});
  check_gradients([](const V& x) { return ops::softmax(ops::causal_mask(x[0])); },
                  {random_tensor({2, 4, 4}, 21, -2.f, 2.f)}, {true});
  const Tensor labels = Tensor::from_vector<int32_t>({0, 3, 2, 1, 4, 4}, Shape{2, 3});
  check_gradients([&](const V& x) { return ops::sequence_cross_entropy(x[0], labels); },
                  {random_tensor({2, 3, 5}, 22, -2.f, 2.f)}, {true});
}

TEST_F(TransformerOps, ValuesAgainstFloat64) {
  // transpose: exact.
  const Tensor x = random_tensor({2, 3, 4}, 30);
  const std::vector<float> xv = x.to_vector<float>(),
                           tv = ops::transpose(x, {2, 0, 1}).to_vector<float>();
  EXPECT_EQ(ops::transpose(x, {2, 0, 1}).shape(), (Shape{4, 2, 3}));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) EXPECT_EQ(tv[k * 6 + i * 3 + j], xv[i * 12 + j * 4 + k]);
  EXPECT_EQ(ops::transpose(ops::transpose(x)).to_vector<float>(), xv);
  // batched matmul against loops.
  const Tensor a = random_tensor({3, 2, 5}, 31), b = random_tensor({3, 5, 4}, 32);
  const std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>(),
                           cv = ops::matmul(a, b).to_vector<float>();
  for (int n = 0; n < 3; ++n)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 4; ++j) {
        double s = 0;
        for (int k = 0; k < 5; ++k) s += double(av[n * 10 + i * 5 + k]) * bv[n * 20 + k * 4 + j];
        EXPECT_NEAR(cv[n * 8 + i * 4 + j], s, 1e-5) << n << i << j;
      }
  // softmax, log_softmax, layer norm, gelu against float64.
  const Tensor z = random_tensor({4, 9}, 33, -5.f, 5.f);
  const std::vector<float> zv = z.to_vector<float>(), sv = ops::softmax(z).to_vector<float>(),
                           lv = ops::log_softmax(z).to_vector<float>();
  const Tensor gamma = random_tensor({9}, 34), beta = random_tensor({9}, 35);
  const std::vector<float> nv = ops::layer_norm(z, gamma, beta, 1e-5f).to_vector<float>(),
                           gv = gamma.to_vector<float>(), bev = beta.to_vector<float>();
  for (int r = 0; r < 4; ++r) {
    double m = -1e30, sum = 0, mean = 0, var = 0;
    for (int j = 0; j < 9; ++j) m = std::max(m, double(zv[r * 9 + j]));
    for (int j = 0; j < 9; ++j) sum += std::exp(zv[r * 9 + j] - m);
    for (int j = 0; j < 9; ++j) mean += zv[r * 9 + j] / 9.0;
    for (int j = 0; j < 9; ++j) var += (zv[r * 9 + j] - mean) * (zv[r * 9 + j] - mean) / 9.0;
    for (int j = 0; j < 9; ++j) {
      const double e = std::exp(zv[r * 9 + j] - m) / sum;
      EXPECT_NEAR(sv[r * 9 + j], e, 1e-6);
      EXPECT_NEAR(lv[r * 9 + j], std::log(e), 1e-5);
      EXPECT_NEAR(nv[r * 9 + j], (zv[r * 9 + j] - mean) / std::sqrt(var + 1e-5) * gv[j] + bev[j],
                  1e-5);
    }
  }
  const std::vector<float> ge = ops::gelu(z).to_vector<float>(),
                           gt = ops::gelu(z, true).to_vector<float>();
  for (size_t i = 0; i < zv.size(); ++i) {
    const double v = zv[i];
    EXPECT_NEAR(ge[i], 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-5);
    EXPECT_NEAR(gt[i], 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))),
                1e-5);
  }
  // The causal mask: row i keeps keys 0..i; softmax puts exactly 0 on the rest.
  const std::vector<float> p =
      ops::softmax(ops::causal_mask(random_tensor({3, 3}, 36))).to_vector<float>();
  EXPECT_EQ(p[1], 0.f);
  EXPECT_EQ(p[2], 0.f);
  EXPECT_EQ(p[5], 0.f);
  EXPECT_NEAR(p[0], 1.f, 1e-7);
  EXPECT_GT(p[3], 0.f);
  // Masks are made once per shape and kept: another shape gets its own, and the first comes back
  // unchanged. With T != S, query i sees keys 0..i, as Keras' MultiHeadAttention makes the mask
  // (keras 3.x _compute_causal_mask, checked in TF 2.21: 4 queries over 2 keys [[1,0],[1,1],
  // [1,1],[1,1]]; 2 over 4 [[1,0,0,0],[1,1,0,0]]) and PyTorch's is_causal. It was aligned at the
  // last position: 4 over 2 left the first two queries no key (uniform attention over both).
  const auto visible = [](const std::vector<float>& p, int64_t t, int64_t s) {
    std::vector<std::vector<int>> v(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < s; ++j) v[i].push_back(p[static_cast<size_t>(i * s + j)] > 0.f);
    return v;
  };
  EXPECT_EQ(
      visible(ops::softmax(ops::causal_mask(random_tensor({3, 4}, 38))).to_vector<float>(), 3, 4),
      (std::vector<std::vector<int>>{{1, 0, 0, 0}, {1, 1, 0, 0}, {1, 1, 1, 0}}));
  EXPECT_EQ(
      visible(ops::softmax(ops::causal_mask(random_tensor({2, 4}, 39))).to_vector<float>(), 2, 4),
      (std::vector<std::vector<int>>{{1, 0, 0, 0}, {1, 1, 0, 0}}));
  const std::vector<float> u =
      ops::softmax(ops::causal_mask(random_tensor({4, 2}, 40))).to_vector<float>();
  EXPECT_EQ(visible(u, 4, 2), (std::vector<std::vector<int>>{{1, 0}, {1, 1}, {1, 1}, {1, 1}}));
  EXPECT_EQ(u[0], 1.f);
  EXPECT_EQ(u[1], 0.f);
  EXPECT_EQ(ops::softmax(ops::causal_mask(random_tensor({3, 3}, 36))).to_vector<float>(), p);
  // The sequence loss of each position equals the 2-D op's.
  const Tensor logits = random_tensor({2, 3, 5}, 37);
  const Tensor labels = Tensor::from_vector<int32_t>({0, 3, 2, 1, 4, 4}, Shape{2, 3});
  EXPECT_EQ(ops::sequence_cross_entropy(logits, labels).to_vector<float>(),
            ops::sparse_softmax_cross_entropy(ops::reshape(logits, Shape{6, 5}),
                                              ops::reshape(labels, Shape{6}))
                .to_vector<float>());
}

// The embedding gradient sums repeated ids in id order: the same bits on every run, on one thread
// or two, and equal to a float64 sum to float32 rounding.
TEST_F(TransformerOps, EmbeddingGradientIsDeterministic) {
  std::vector<int32_t> idv(600);
  for (size_t i = 0; i < idv.size(); ++i) idv[i] = static_cast<int32_t>((i * 7919) % 13);
  const Tensor ids = Tensor::from_vector<int32_t>(idv, Shape{20, 30});
  Tensor table = random_tensor({13, 16}, 40);
  const Tensor w = random_tensor({20, 30, 16}, 41);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    GradientTape tape;
    tape.watch(table);
    const Tensor loss = ops::sum(ops::mul(ops::embedding_lookup(table, ids), w));
    const std::vector<float> g = tape.gradient(loss, {table})[0].to_vector<float>();
    if (run == 0) first = g;
    EXPECT_EQ(g, first) << run;
  }
  const std::vector<float> wv = w.to_vector<float>();
  for (int r = 0; r < 13; ++r)
    for (int j = 0; j < 16; ++j) {
      double s = 0;
      for (size_t i = 0; i < idv.size(); ++i)
        if (idv[i] == r) s += wv[i * 16 + j];
      EXPECT_NEAR(first[r * 16 + j], s, 1e-4) << r << "," << j;
    }
}

// MultiHeadAttention scales the query instead of the scores: with a power-of-two scale (key_dim a
// power of 4) the scores and both gradients are the same bits as scaling the scores.
TEST_F(TransformerOps, ScalingTheQueryIsScalingTheScores) {
  uint64_t seed = 70;
  for (int64_t key_dim : {16, 64}) {
    const float s = 1.f / std::sqrt(static_cast<float>(key_dim));
    const Tensor q = random_tensor({2, 3, 5, key_dim}, seed++, -2.f, 2.f);
    const Tensor k = random_tensor({2, 3, 7, key_dim}, seed++, -2.f, 2.f);
    const Tensor w = random_tensor({2, 3, 5, 7}, seed++);  // a loss's weights on the scores
    std::vector<float> scores[2];
    std::vector<Tensor> grads[2];
    for (int query_first = 0; query_first < 2; ++query_first) {
      GradientTape tape;
      tape.watch(q);
      tape.watch(k);
      const Tensor x = query_first ? ops::matmul(ops::scale(q, s), k, false, true)
                                   : ops::scale(ops::matmul(q, k, false, true), s);
      scores[query_first] = x.to_vector<float>();
      grads[query_first] = tape.gradient(ops::sum(ops::mul(x, w)), {q, k});
    }
    EXPECT_EQ(scores[0], scores[1]) << "key_dim " << key_dim;
    EXPECT_EQ(grads[0][0].to_vector<float>(), grads[1][0].to_vector<float>()) << "dq " << key_dim;
    EXPECT_EQ(grads[0][1].to_vector<float>(), grads[1][1].to_vector<float>()) << "dk " << key_dim;
  }
}

// causal_softmax is softmax(causal_mask(x)) as one op: the same values bit for bit, by the op (the
// CPU adds its kept mask) and by the kernels' default (which makes one), with more keys than
// queries, as many, and fewer (the first queries see no key: uniform over the masked ones); and
// the same gradient.
TEST_F(TransformerOps, CausalSoftmaxIsTheMaskThenSoftmax) {
  uint64_t seed = 60;
  for (const Shape& shape : {Shape{2, 3, 5, 5}, Shape{4, 7}, Shape{6, 3}, Shape{1, 1}}) {
    const Tensor x = random_tensor(shape, seed++, -3.f, 3.f);
    const Tensor composed = ops::softmax(ops::causal_mask(x), -1);
    const std::string at = shape.to_string();
    EXPECT_EQ(ops::causal_softmax(x).to_vector<float>(), composed.to_vector<float>()) << at;
    EXPECT_EQ(kernels_for(x).causal_softmax(x, ops::kMaskValue).to_vector<float>(),
              composed.to_vector<float>())
        << at;
  }
  check_gradients([](const V& x) { return ops::causal_softmax(x[0]); },
                  {random_tensor({2, 4, 5}, 65, -2.f, 2.f)}, {true});
  try {
    ops::causal_softmax(random_tensor({4}, 66));
    FAIL() << "a rank-1 input was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("causal_softmax"), std::string::npos) << e.what();
  }
}

TEST_F(TransformerOps, BadInputIsRefusedWithItsName) {
  const Tensor x = random_tensor({2, 3, 4}, 50);
  EXPECT_THROW(ops::transpose(x, {0, 0, 1}), InvalidArgument);
  EXPECT_THROW(ops::transpose(x, {0, 1}), InvalidArgument);
  EXPECT_THROW(ops::matmul(x, random_tensor({3, 3, 4}, 51)), InvalidArgument);  // batch 2 vs 3
  EXPECT_THROW(ops::matmul(x, random_tensor({2, 5, 4}, 52)), InvalidArgument);  // inner 4 vs 5
  EXPECT_THROW(ops::softmax(x, 3), InvalidArgument);
  EXPECT_THROW(ops::layer_norm(x, random_tensor({3}, 53), random_tensor({3}, 54)), InvalidArgument);
  const Tensor table = random_tensor({5, 4}, 55);
  try {
    ops::embedding_lookup(table, Tensor::from_vector<int32_t>({1, 5}, Shape{2}));
    FAIL() << "id 5 of a 5-row table accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("index 5 at position 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::embedding_lookup(table, random_tensor({2}, 56)), InvalidArgument);  // float ids
  EXPECT_THROW(ops::sequence_cross_entropy(x, Tensor::from_vector<int32_t>({0, 1}, Shape{2})),
               InvalidArgument);
}

// Under mixed_bfloat16 the batched matmul rounds its operands to bfloat16 and accumulates in
// float32, as matmul does: equal to float32 on rounded operands, and visibly not the float32
// product.
TEST_F(TransformerOps, BatchedMatmulFollowsMixedBfloat16) {
  auto rounded = [](const Tensor& t) {
    std::vector<float> v = t.to_vector<float>();
    for (float& f : v) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      std::memcpy(&f, &u, 4);
    }
    return Tensor::from_vector(v, t.shape());
  };
  const Tensor a = random_tensor({3, 8, 40}, 60), b = random_tensor({3, 40, 6}, 61);
  const std::vector<float> raw = ops::matmul(a, b).to_vector<float>(),
                           on_rounded = ops::matmul(rounded(a), rounded(b)).to_vector<float>();
  set_precision_policy(Precision::kMixedBFloat16);
  std::vector<float> mixed;
  try {
    mixed = ops::matmul(a, b).to_vector<float>();
  } catch (...) {
    set_precision_policy(Precision::kFloat32);
    throw;
  }
  set_precision_policy(Precision::kFloat32);
  double to_rounded = 0, to_raw = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    to_rounded = std::max(to_rounded, std::abs(double(mixed[i]) - on_rounded[i]));
    to_raw = std::max(to_raw, std::abs(double(mixed[i]) - raw[i]));
  }
  EXPECT_LT(to_rounded, 1e-5);
  EXPECT_GT(to_raw, 1e-3);
}

}  // namespace
}  // namespace dtrain
