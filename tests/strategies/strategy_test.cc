// Scope semantics, the default strategy, OneDevice, and their equivalence.
#include <thread>

#include "dtrain/model/initializers.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/make_strategy.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/strategies/one_device_strategy.h"
#include "dtrain/train/fit.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class Strategies : public ::testing::Test {
 protected:
  void SetUp() override { testing::use_two_cpus(); }
};

VariableSpec spec(const std::string& name) {
  return {name, Shape{2}, DType::kFloat32, initializers::ones()};
}

TEST_F(Strategies, VariablesInsideAScopeBelongToItsDevice) {
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  auto outside = create_variable(spec("outside"));
  std::shared_ptr<Variable> inside;
  {
    auto scope = s.scope();
    EXPECT_EQ(&get_strategy(), &s);
    EXPECT_TRUE(has_strategy());
    inside = create_variable(spec("inside"));
  }
  EXPECT_FALSE(has_strategy());
  EXPECT_EQ(outside->value().device(), DeviceSpec::cpu(0));
  EXPECT_EQ(inside->value().device(), DeviceSpec::cpu(1));
}

TEST_F(Strategies, NestedScopesOfOneStrategyAreFine) {
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  auto a = s.scope();
  {
    auto b = s.scope();
    EXPECT_EQ(&get_strategy(), &s);
  }
  EXPECT_EQ(&get_strategy(), &s);
}

TEST_F(Strategies, MixingTwoStrategiesIsAnErrorThatSaysSo) {
  OneDeviceStrategy a(DeviceSpec::cpu(0)), b(DeviceSpec::cpu(1));
  auto scope = a.scope();
  try {
    auto inner = b.scope();
    FAIL() << "expected FailedPrecondition";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("mixing strategies"), std::string::npos) << e.what();
  }
  EXPECT_EQ(&get_strategy(), &a);  // the failed scope left no trace
}

TEST_F(Strategies, ReplicaContextDependsOnWhereYouAre) {
  ASSERT_NE(get_replica_context(), nullptr);  // default strategy: its single replica
  EXPECT_EQ(get_replica_context()->num_replicas_in_sync(), 1);
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  {
    auto scope = s.scope();
    EXPECT_EQ(get_replica_context(), nullptr);  // cross-replica context, as in TF
  }
  s.run([&](ReplicaContext& ctx, const std::vector<Tensor>&) -> std::vector<Tensor> {
    EXPECT_EQ(get_replica_context(), &ctx);
    EXPECT_EQ(ctx.replica_id_in_sync_group(), 0);
    EXPECT_EQ(ctx.device(), DeviceSpec::cpu(1));
    EXPECT_EQ(&get_strategy(), &s);
    return {};
  });
}

TEST_F(Strategies, RunExecutesOnTheDeviceThreadAndCopiesInputs) {
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  const auto caller = std::this_thread::get_id();
  PerReplica in{{{Tensor::from_vector<float>({1, 2}, Shape{2})}}};
  PerReplica out = s.run(
      [&](ReplicaContext&, const std::vector<Tensor>& x) -> std::vector<Tensor> {
        EXPECT_TRUE(std::this_thread::get_id() != caller);
        EXPECT_EQ(x[0].device(), DeviceSpec::cpu(1));
        return {ops::scale(x[0], 2.f)};
      },
      in);
  EXPECT_EQ(out.values[0][0].to_vector<float>(), (std::vector<float>{2, 4}));
  EXPECT_EQ(s.reduce(ReduceOp::kSum, out, 0)[0].item(), 6.f);
  EXPECT_EQ(s.reduce(ReduceOp::kMean, out, 0)[0].item(), 3.f);
}

TEST_F(Strategies, RunInsideRunIsAnError) {
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  EXPECT_THROW(s.run([&](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
    s.run([](ReplicaContext&, const std::vector<Tensor>&) { return std::vector<Tensor>{}; });
    return {};
  }),
               FailedPrecondition);
}

TEST_F(Strategies, ReplicaExceptionsReachTheCaller) {
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  EXPECT_THROW(s.run([](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
    throw InvalidArgument("boom");
  }),
               InvalidArgument);
}

TEST_F(Strategies, FactoryNamesTheValidValues) {
  try {
    make_strategy("mirroredd", {});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("one_device"), std::string::npos) << e.what();
  }
  StrategyOptions two, one;
  two.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  one.devices = {DeviceSpec::cpu(1)};
  EXPECT_THROW(make_strategy("one_device", two), InvalidArgument);
  EXPECT_EQ(make_strategy("one_device", one)->worker_devices()[0], DeviceSpec::cpu(1));
}

// DTRAIN_BYTES_PER_PACK sets the gradient pack size where the options leave it unset; a value
// that is not a byte count is refused, naming the variable.
TEST_F(Strategies, BytesPerPackFromTheEnvironment) {
  struct Unset {
    ~Unset() { ::unsetenv("DTRAIN_BYTES_PER_PACK"); }
  } unset;
  ::setenv("DTRAIN_BYTES_PER_PACK", "1048576", 1);
  EXPECT_EQ(apply_environment({}).mirrored.bytes_per_pack, std::optional<size_t>(1048576));
  StrategyOptions set, set_comm;
  set.mirrored.bytes_per_pack = 77;
  EXPECT_EQ(apply_environment(set).mirrored.bytes_per_pack, std::optional<size_t>(77));
  set_comm.communication.bytes_per_pack = 88;  // an explicit option wins over the environment
  EXPECT_EQ(apply_environment(set_comm).mirrored.bytes_per_pack, std::nullopt);
  StrategyOptions two;
  two.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  const std::unique_ptr<Strategy> s = make_strategy("mirrored", two);
  auto* m = dynamic_cast<MirroredStrategy*>(s.get());
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->bytes_per_pack(), 1048576u);
  for (const char* bad : {"4MB", "-1", "+5", " 5", "99999999999999999999999", ""}) {
    ::setenv("DTRAIN_BYTES_PER_PACK", bad, 1);
    if (!*bad) {
      EXPECT_EQ(apply_environment({}).mirrored.bytes_per_pack, std::nullopt);  // empty: unset
      continue;
    }
    try {
      apply_environment({});
      ADD_FAILURE() << bad << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("DTRAIN_BYTES_PER_PACK='"), std::string::npos)
          << e.what();
    }
  }
  ::unsetenv("DTRAIN_BYTES_PER_PACK");
  EXPECT_EQ(apply_environment({}).mirrored.bytes_per_pack, std::nullopt);
}

TEST_F(Strategies, BadDevicesFlagsAreRejectedWithTheAcceptedForms) {
  EXPECT_THROW(parse_devices_flag("tpu:3"), InvalidArgument);
  EXPECT_THROW(parse_devices_flag("cpu:x"), InvalidArgument);
  EXPECT_THROW(OneDeviceStrategy(DeviceSpec::cpu(7)), NotFound);
  EXPECT_THROW(create_variable({"v", Shape{1}, DType::kFloat32, nullptr}), InvalidArgument);
}

TEST_F(Strategies, SplitBatchSizesFollowTfRebatching) {
  EXPECT_EQ(split_batch_sizes(8, 8, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(split_batch_sizes(6, 8, 2), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(split_batch_sizes(6, 8, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(split_batch_sizes(7, 9, 3), (std::vector<int64_t>{3, 3, 1}));
}

// The trainable weights as fit() starts (built, not yet trained).
struct InitialWeights : Callback {
  const Sequential* model = nullptr;
  std::vector<std::vector<float>> w;
  void on_train_begin(const TrainLogs&) override {
    for (const auto& v : model->trainable_variables()) w.push_back(v->value().to_vector<float>());
  }
};

// A small CNN with every layer kind of the reference model, trained for some steps with fit().
// `initial`, if given, receives the weights before the first step.
std::vector<std::vector<float>> train_small_cnn(
    Strategy* strategy, std::vector<std::vector<float>>* initial = nullptr) {
  set_global_seed(3);
  Sequential model;
  std::unique_ptr<Adam> opt;
  auto make = [&] {
    model =
        Sequential({std::make_shared<Conv2D>(4, 3, 3, Activation::kRelu),
                    std::make_shared<MaxPool2D>(2), std::make_shared<Flatten>(),
                    std::make_shared<Dense>(16, Activation::kRelu), std::make_shared<Dense>(3)});
    opt = std::make_unique<Adam>(1e-2f);
  };
  if (strategy) {
    auto scope = strategy->scope();
    make();
  } else {
    make();
  }
  Tensor x = testing::random_tensor({96, 8, 8, 1}, 5, 0.f, 1.f);
  std::vector<int32_t> y(96);
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(i % 3);
  const Dataset ds = Dataset::from_tensors({x, Tensor::from_vector(y, Shape{96})});
  FitOptions o;
  o.steps = 12;
  o.global_batch_size = 16;
  o.shuffle_seed = 9;
  InitialWeights start;
  start.model = &model;
  o.callbacks.push_back(&start);
  Strategy& s = strategy ? *strategy : get_strategy();
  const History h = fit(s, model, *opt, ds, nullptr, o);
  EXPECT_EQ(h.steps, 12);
  if (initial) *initial = start.w;
  std::vector<std::vector<float>> w;
  for (const auto& v : model.trainable_variables()) w.push_back(v->value().to_vector<float>());
  return w;
}

TEST_F(Strategies, DefaultAndOneDeviceGiveIdenticalWeights) {
  std::vector<std::vector<float>> initial;
  const auto a = train_small_cnn(nullptr, &initial);
  OneDeviceStrategy s(DeviceSpec::cpu(1));
  const auto b = train_small_cnn(&s);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "variable " << i;
  // And training moved them: every variable differs from its value before the first step
  // (identical untrained weights would also be "identical").
  ASSERT_EQ(initial.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(initial[i].size(), a[i].size()) << "variable " << i;
    EXPECT_NE(initial[i], a[i]) << "variable " << i << " did not change in 12 steps of training";
  }
  // And the run is repeatable.
  const auto again = train_small_cnn(nullptr);
  EXPECT_EQ(a, again);
}

}  // namespace
}  // namespace dtrain
