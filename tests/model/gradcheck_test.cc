// Finite-difference checks of every op's backward pass on the CPU.
#include "testing/test_util.h"

namespace dtrain {
namespace {

using testing::check_gradients;
using testing::random_tensor;
using V = std::vector<Tensor>;

class GradCheck : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

TEST_F(GradCheck, AddSubMulDivWithBroadcasting) {
  const Shape a{3, 4}, b{4}, c{3, 1};
  check_gradients([](const V& x) { return ops::add(x[0], x[1]); },
                  {random_tensor(a, 1), random_tensor(b, 2)}, {true, true});
  check_gradients([](const V& x) { return ops::sub(x[0], x[1]); },
                  {random_tensor(a, 3), random_tensor(c, 4)}, {true, true});
  check_gradients([](const V& x) { return ops::sub(x[0], x[1]); },
                  {random_tensor(b, 3), random_tensor(a, 4)}, {true, true});
  check_gradients([](const V& x) { return ops::mul(x[0], x[1]); },
                  {random_tensor(a, 5), random_tensor(c, 6)}, {true, true});
  check_gradients([](const V& x) { return ops::div(x[0], x[1]); },
                  {random_tensor(c, 7), random_tensor(a, 8, 0.5f, 2.f)}, {true, true});
}

TEST_F(GradCheck, UnaryOps) {
  const Shape s{2, 5};
  check_gradients([](const V& x) { return ops::neg(x[0]); }, {random_tensor(s, 10)}, {true});
  check_gradients([](const V& x) { return ops::scale(x[0], -2.5f); }, {random_tensor(s, 11)},
                  {true});
  check_gradients([](const V& x) { return ops::add_scalar(x[0], 3.f); }, {random_tensor(s, 12)},
                  {true});
  check_gradients([](const V& x) { return ops::exp(x[0]); }, {random_tensor(s, 13)}, {true});
  check_gradients([](const V& x) { return ops::log(x[0]); }, {random_tensor(s, 14, 0.5f, 2.f)},
                  {true});
  check_gradients([](const V& x) { return ops::square(x[0]); }, {random_tensor(s, 15)}, {true});
  check_gradients([](const V& x) { return ops::sqrt(x[0]); }, {random_tensor(s, 16, 0.5f, 2.f)},
                  {true});
}

TEST_F(GradCheck, Activations) {
  const Shape s{3, 7};
  check_gradients([](const V& x) { return ops::relu(x[0]); }, {testing::away_from_zero(s, 20)},
                  {true});
  check_gradients([](const V& x) { return ops::tanh(x[0]); }, {random_tensor(s, 21, -2.f, 2.f)},
                  {true});
  check_gradients([](const V& x) { return ops::sigmoid(x[0]); }, {random_tensor(s, 22, -3.f, 3.f)},
                  {true});
}

// relu(a + b) as one op: the values and gradients of relu(add(a, b)), bitwise; operands of other
// shapes take the two ops. For the finite differences the sums stay 0.05 or more from ReLU's kink:
// |b| >= 0.1 and |a| <= 0.05.
TEST_F(GradCheck, AddRelu) {
  const Shape s{4, 33};  // 132 elements: oneDNN's vector body and its tail
  const Tensor a = ops::scale(random_tensor(s, 23), 0.05f), b = testing::away_from_zero(s, 24);
  check_gradients([&a](const V& x) { return ops::add_relu(a, x[0]); }, {b}, {true});
  check_gradients([](const V& x) { return ops::add_relu(x[0], x[1]); }, {a, b}, {true, true});
  for (const auto& [sa, sb] : {std::pair<Shape, Shape>{s, s}, {s, Shape{33}}, {Shape{33}, s}}) {
    const Tensor x = random_tensor(sa, 25), y = random_tensor(sb, 26);
    std::vector<Tensor> fused, apart;
    for (bool one_op : {true, false}) {
      GradientTape tape;
      tape.watch(x);
      tape.watch(y);
      const Tensor z = one_op ? ops::add_relu(x, y) : ops::relu(ops::add(x, y));
      (one_op ? fused : apart) = tape.gradient(ops::sum(ops::square(z)), {x, y});
      (one_op ? fused : apart).push_back(z);
    }
    for (size_t i = 0; i < fused.size(); ++i)
      EXPECT_EQ(fused[i].to_vector<float>(), apart[i].to_vector<float>())
          << sa.to_string() << " + " << sb.to_string() << ", tensor " << i;
  }
  EXPECT_THROW(kernels_for(a).add_relu(a, random_tensor({33}, 27)), InvalidArgument);
}

TEST_F(GradCheck, MatmulAllTransposes) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Shape a = ta ? Shape{4, 3} : Shape{3, 4};
      const Shape b = tb ? Shape{5, 4} : Shape{4, 5};
      check_gradients([ta, tb](const V& x) { return ops::matmul(x[0], x[1], ta, tb); },
                      {random_tensor(a, 30), random_tensor(b, 31)}, {true, true});
    }
}

TEST_F(GradCheck, BiasAddSumMeanReshape) {
  check_gradients([](const V& x) { return ops::bias_add(x[0], x[1]); },
                  {random_tensor({2, 3, 4}, 40), random_tensor({4}, 41)}, {true, true});
  check_gradients([](const V& x) { return ops::sum(x[0], {1}); }, {random_tensor({2, 3, 4}, 42)},
                  {true});
  check_gradients(
      [](const V& x) {
        return ops::sum(x[0], {0, 2}, true);
      },
      {random_tensor({2, 3, 4}, 43)}, {true});
  check_gradients([](const V& x) { return ops::mean(x[0], {-1}); }, {random_tensor({2, 3, 4}, 44)},
                  {true});
  check_gradients([](const V& x) { return ops::mean(x[0]); }, {random_tensor({2, 3}, 45)}, {true});
  check_gradients(
      [](const V& x) {
        return ops::reshape(x[0], Shape{-1, 2});
      },
      {random_tensor({2, 3, 4}, 46)}, {true});
  check_gradients([](const V& x) { return ops::flatten(x[0]); }, {random_tensor({2, 3, 4, 2}, 47)},
                  {true});
}

TEST_F(GradCheck, Conv2dValidSameStrided) {
  struct Case {
    Shape x, w;
    int stride;
    ops::Padding pad;
  };
  for (const Case& c : {Case{{2, 6, 6, 2}, {3, 3, 2, 3}, 1, ops::Padding::kValid},
                        Case{{1, 5, 5, 3}, {3, 3, 3, 2}, 1, ops::Padding::kSame},
                        Case{{2, 7, 7, 1}, {3, 3, 1, 4}, 2, ops::Padding::kValid},
                        // non-square kernels, and an even one (2x4: 'same' pads one side more)
                        Case{{1, 6, 5, 2}, {3, 1, 2, 3}, 1, ops::Padding::kSame},
                        Case{{2, 7, 6, 3}, {5, 3, 3, 2}, 1, ops::Padding::kSame},
                        Case{{1, 5, 6, 2}, {2, 4, 2, 3}, 1, ops::Padding::kSame},
                        // 1x1, stride 1: the CPU's backward passes are matrix products
                        Case{{2, 3, 4, 5}, {1, 1, 5, 3}, 1, ops::Padding::kValid},
                        Case{{1, 4, 3, 2}, {1, 1, 2, 6}, 1, ops::Padding::kSame},
                        // 1x1, strided: the convolution primitives in float32 (matrix products
                        // on the rows it reads on bfloat16 kernels: cpu_bf16_test)
                        Case{{2, 5, 5, 3}, {1, 1, 3, 2}, 2, ops::Padding::kValid}}) {
    check_gradients(
        [&c](const V& x) { return ops::conv2d(x[0], x[1], x[2], c.stride, c.stride, c.pad); },
        {random_tensor(c.x, 50), random_tensor(c.w, 51), random_tensor({c.w[3]}, 52)},
        {true, true, true});
  }
  // Without bias.
  check_gradients([](const V& x) { return ops::conv2d(x[0], x[1], Tensor()); },
                  {random_tensor({1, 4, 4, 2}, 53), random_tensor({2, 2, 2, 2}, 54)}, {true, true});
}

// Explicit padding (torch.nn.Conv2d's padding=, Conv2D::set_explicit_padding): symmetric at stride
// 2 on an even input (torchvision's strided 3x3), and uneven pads; bad parameters refused.
TEST_F(GradCheck, Conv2dExplicitPadding) {
  for (const Conv2dParams& p : {Conv2dParams{2, 2, 1, 1, 1, 1}, Conv2dParams{1, 1, 0, 2, 2, 0},
                                Conv2dParams{2, 1, 2, 0, 1, 2}}) {
    check_gradients(
        [&p](const V& x) { return ops::conv2d(x[0], x[1], x[2], p); },
        {random_tensor({2, 6, 6, 3}, 55), random_tensor({3, 3, 3, 2}, 56), random_tensor({2}, 57)},
        {true, true, true});
  }
  // Symmetric pads equal the same convolution of the input padded with zeros by hand.
  const Tensor x = random_tensor({1, 6, 6, 2}, 58), w = random_tensor({3, 3, 2, 4}, 59);
  const std::vector<float> padded =
      ops::conv2d(ops::zero_pad2d(x, 1, 1, 1, 1), w, Tensor(), 2, 2, ops::Padding::kValid)
          .to_vector<float>();
  const std::vector<float> direct =
      ops::conv2d(x, w, Tensor(), Conv2dParams{2, 2, 1, 1, 1, 1}).to_vector<float>();
  ASSERT_EQ(direct.size(), padded.size());
  for (size_t i = 0; i < direct.size(); ++i) EXPECT_NEAR(direct[i], padded[i], 1e-5f) << i;
  EXPECT_THROW(ops::conv2d(x, w, Tensor(), Conv2dParams{0, 1, 0, 0, 0, 0}), InvalidArgument);
  EXPECT_THROW(ops::conv2d(x, w, Tensor(), Conv2dParams{1, 1, -1, 0, 0, 0}), InvalidArgument);
  EXPECT_THROW(ops::conv2d(random_tensor({1, 2, 2, 2}, 60), w, Tensor(), Conv2dParams{}),
               InvalidArgument);  // a 3x3 filter on a 2x2 input without padding
}

TEST_F(GradCheck, MaxPool) {
  // Distinct values so the arg-max is unique and stable under the perturbation.
  std::vector<float> v(2 * 6 * 6 * 3);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 37) % v.size()) * 0.01f;
  check_gradients([](const V& x) { return ops::max_pool2d(x[0]); },
                  {Tensor::from_vector(v, Shape{2, 6, 6, 3})}, {true});
  check_gradients([](const V& x) { return ops::max_pool2d(x[0], 3, 3, 2, 2, ops::Padding::kSame); },
                  {Tensor::from_vector(v, Shape{2, 6, 6, 3})}, {true});
}

TEST_F(GradCheck, Losses) {
  const Tensor labels = Tensor::from_vector<int32_t>({0, 3, 2, 1}, Shape{4});
  check_gradients([&](const V& x) { return ops::sparse_softmax_cross_entropy(x[0], labels); },
                  {random_tensor({4, 5}, 60, -2.f, 2.f)}, {true});
  check_gradients([](const V& x) { return ops::mean_squared_error(x[0], x[1]); },
                  {random_tensor({3, 4}, 61), random_tensor({3, 4}, 62)}, {true, true});
}

TEST_F(GradCheck, DropoutUsesItsMask) {
  check_gradients([](const V& x) { return ops::dropout(x[0], 0.4f, true, 7, 3); },
                  {random_tensor({4, 8}, 70)}, {true});
}

TEST_F(GradCheck, BatchNorm) {
  check_gradients(
      [](const V& x) {
        Tensor m, v;
        return ops::batch_norm_training(x[0], x[1], x[2], 1e-3f, &m, &v);
      },
      {random_tensor({4, 2, 2, 3}, 80), random_tensor({3}, 81, 0.5f, 1.5f), random_tensor({3}, 82)},
      {true, true, true}, 1e-3f, 1e-2f);
}

TEST_F(GradCheck, BatchNormRelu) {
  check_gradients(
      [](const V& x) {
        Tensor m, v;
        return ops::batch_norm_relu_training(x[0], x[1], x[2], 1e-3f, &m, &v);
      },
      {random_tensor({4, 2, 2, 3}, 83), random_tensor({3}, 84, 0.5f, 1.5f), random_tensor({3}, 85)},
      {true, true, true}, 1e-3f, 1e-2f);
}

// Inference (training=false): the moving statistics are constants; x, gamma and beta are
// differentiated (it threw Unimplemented, which ended every gradient through a model called in
// inference mode: fine-tuning with frozen statistics, saliency maps). On [N, C] and [N, H, W, C].
TEST_F(GradCheck, BatchNormInference) {
  for (const Shape& shape : {Shape{5, 3}, Shape{2, 2, 2, 3}}) {
    const Tensor mean = random_tensor({3}, 88), var = random_tensor({3}, 89, 0.5f, 2.f);
    check_gradients(
        [&](const V& x) { return ops::batch_norm_inference(x[0], x[1], x[2], mean, var, 1e-3f); },
        {random_tensor(shape, 86), random_tensor({3}, 87, 0.5f, 1.5f), random_tensor({3}, 90)},
        {true, true, true}, 1e-3f, 1e-2f);
  }
}

TEST_F(GradCheck, CastRoundTrip) {
  check_gradients(
      [](const V& x) { return ops::cast(ops::cast(x[0], DType::kFloat64), DType::kFloat32); },
      {random_tensor({5}, 90)}, {true});
}

}  // namespace
}  // namespace dtrain
