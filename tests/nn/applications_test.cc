// dtrain::applications: the ResNets have Keras' (and torchvision's) parameter counts, path names,
// and run.
#include "dtrain/nn/applications.h"

#include <sstream>

#include "dtrain/nn/layers.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using applications::ResNetOptions;

int64_t trainable(const Model& m) {
  int64_t n = 0;
  for (const auto& v : m.trainable_variables()) n += v->shape().numel();
  return n;
}

TEST(Applications, ResNet50HasKerasParameterCountAndPathNames) {
  auto m = applications::ResNet50();
  m->build();
  // keras.applications.ResNet50(weights=None).summary(): 25,636,712 total, 25,583,592 trainable.
  EXPECT_EQ(m->count_params(), 25636712);
  EXPECT_EQ(trainable(*m), 25583592);
  EXPECT_EQ(m->layers().size(), 6u + 16u + 2u);  // stem, 16 blocks, head
  const VariableList vs = m->variables();
  EXPECT_EQ(vs.front()->name(), "conv1_conv/kernel");
  bool found = false;
  for (const auto& v : vs) found = found || v->name() == "conv2_block1/1_conv/kernel";
  EXPECT_TRUE(found);
  EXPECT_EQ(vs.back()->name(), "predictions/bias");
  std::ostringstream s;
  m->summary(s);
  EXPECT_NE(s.str().find("Total params: 25,636,712 (97.80 MB)"), std::string::npos) << s.str();
  EXPECT_NE(s.str().find("conv5_block3 (BottleneckBlock)     (None, 7, 7, 2048)"),
            std::string::npos)
      << s.str();
}

TEST(Applications, CifarAndBasicResNetsHaveTheirReferenceCounts) {
  ResNetOptions cifar;
  cifar.input_shape = Shape{32, 32, 3};
  cifar.classes = 10;
  auto r20 = applications::ResNet20(cifar);
  r20->build();
  // Keras' cifar10_resnet example, resnet_v1(depth=20): 274,442 total, 273,066 trainable.
  EXPECT_EQ(r20->count_params(), 274442);
  EXPECT_EQ(trainable(*r20), 273066);
  const Tensor y = (*r20)(testing::random_tensor({2, 32, 32, 3}, 1), false);
  EXPECT_EQ(y.shape(), (Shape{2, 10}));
  // torchvision.models.resnet18(): 11,689,512 parameters (its BN statistics are buffers).
  ResNetOptions small;
  auto r18 = applications::ResNet18(small);
  r18->build();
  EXPECT_EQ(trainable(*r18), 11689512);
  EXPECT_THROW(applications::CifarResNet(21, cifar), InvalidArgument);
  ResNetOptions tiny;
  tiny.input_shape = Shape{16, 16, 3};
  EXPECT_THROW(applications::ResNet50(tiny), InvalidArgument);
  EXPECT_THROW(applications::resnet_by_name("resnet51", cifar), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
