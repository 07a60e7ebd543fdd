// Mirrored on logical CPU devices keeps one block of memory per variable for all replicas
// (MirroredOptions::share_host_variables): gradients are reduce-scattered and each replica updates
// its slice. These tests check that the copies are one block where they should be and only there,
// that every kind of write lands exactly once, and that training is bitwise what separate copies
// give, for every optimizer, replica count, pack size and the whole-variable fallbacks.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/core/timeline.h"
#include "dtrain/data/dataset.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/train/fit.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using V = std::vector<Tensor>;

class SharedVariables : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({4, 1}); }
  static MirroredOptions on(int n, bool shared = true) {
    MirroredOptions o;
    for (int i = 0; i < n; ++i) o.devices.push_back(DeviceSpec::cpu(i));
    o.share_host_variables = shared;
    return o;
  }
};

bool one_block(const Variable& v) {
  const auto copies = v.device_values();
  for (const auto& c : copies)
    if (c.raw_data() != copies[0].raw_data()) return false;
  return copies.size() > 1;
}

TEST_F(SharedVariables, OneBlockForWhatIsSynchronizedOnWriteOnly) {
  MirroredStrategy s(on(3));
  std::shared_ptr<Variable> w, r;
  {
    auto scope = s.scope();
    w = create_variable({"w", Shape{5, 3}, DType::kFloat32, initializers::glorot_uniform()});
    r = create_variable(
        testing::scalar_spec("r", 0, VariableAggregation::kSum, VariableSynchronization::kOnRead));
  }
  EXPECT_TRUE(one_block(*w));
  EXPECT_FALSE(one_block(*r)) << "a sync-on-read variable is written by each replica on its own";
  const auto copies = w->device_values();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(copies[static_cast<size_t>(i)].device(), DeviceSpec::cpu(i));
  // The optimizer's slots are variables of the strategy too: one block each.
  Adam adam(1e-3f);
  {
    auto scope = s.scope();
    adam.build({w});
  }
  ASSERT_EQ(adam.slot_variables().size(), 2u);
  for (const auto& slot : adam.slot_variables()) EXPECT_TRUE(one_block(*slot)) << slot->name();

  MirroredStrategy separate(on(3, false));
  std::shared_ptr<Variable> w2;
  {
    auto scope = separate.scope();
    w2 = create_variable({"w", Shape{5, 3}, DType::kFloat32, initializers::glorot_uniform()});
  }
  EXPECT_FALSE(one_block(*w2));
}

TEST_F(SharedVariables, EveryWriteLandsOnce) {
  MirroredStrategy s(on(3));
  std::shared_ptr<Variable> mean, sum, first, plain;
  {
    auto scope = s.scope();
    mean = create_variable(testing::scalar_spec("mean", 5, VariableAggregation::kMean));
    sum = create_variable(testing::scalar_spec("sum", 5, VariableAggregation::kSum));
    first =
        create_variable(testing::scalar_spec("first", 5, VariableAggregation::kOnlyFirstReplica));
    plain = create_variable(testing::scalar_spec("plain", 5, VariableAggregation::kNone));
  }
  ASSERT_TRUE(one_block(*sum));
  for (int step = 0; step < 3; ++step)  // repeated: a race between the replicas' writes would show
    s.run([&](ReplicaContext& ctx, const V&) -> V {
      const float x = 1.f + static_cast<float>(ctx.replica_id_in_sync_group());  // 1, 2, 3
      mean->assign_add(Tensor::full(Shape{1}, x, ctx.device()));   // + mean(1, 2, 3) = 2
      sum->assign_add(Tensor::full(Shape{1}, x, ctx.device()));    // + 6
      first->assign_sub(Tensor::full(Shape{1}, x, ctx.device()));  // - 1 (replica 0's)
      // update() outside an optimizer's sharded update: applied once, by one replica.
      plain->update([](Tensor& value, size_t) {
        value.copy_from(Tensor::full(Shape{1}, value.item() + 1.f, value.device()));
      });
      return {};
    });
  EXPECT_EQ(mean->value().item(), 11.f);
  EXPECT_EQ(sum->value().item(), 23.f);
  EXPECT_EQ(first->value().item(), 2.f);
  EXPECT_EQ(plain->value().item(), 8.f);
  // Cross-replica writes land once as well.
  sum->assign_add(Tensor::full(Shape{1}, 1.f));
  EXPECT_EQ(sum->value().item(), 24.f);
  plain->update([](Tensor& value, size_t) {
    value.copy_from(Tensor::full(Shape{1}, value.item() * 2.f, value.device()));
  });
  EXPECT_EQ(plain->value().item(), 16.f);
  for (const auto& t : sum->device_values()) EXPECT_EQ(t.item(), 24.f);
}

struct Trained {
  std::vector<std::vector<float>> weights, slots;
  int64_t iterations = 0;
};

// A small conv net, 6 steps of 24 images. Its 641 gradient elements are not a multiple of 16 x
// replicas, so the packed buffer's padding is exercised, and replicas' slices cut variables.
Trained train(MirroredOptions o, const std::string& optimizer, size_t bytes_per_pack = 0,
              bool overlap = true) {
  if (bytes_per_pack) o.bytes_per_pack = bytes_per_pack;
  o.overlap_backward = overlap;
  MirroredStrategy s(o);
  set_global_seed(3);
  Sequential model;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s.scope();
    model = Sequential({std::make_shared<Conv2D>(5, 3, 3, Activation::kRelu),
                        std::make_shared<Flatten>(), std::make_shared<Dense>(7, Activation::kRelu),
                        std::make_shared<Dense>(3)});
    opt = Optimizer::from_config(optimizer);
  }
  Tensor x = testing::random_tensor({144, 6, 6, 1}, 8, 0.f, 1.f);
  std::vector<int32_t> y(144);
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>((i * 7) % 3);
  FitOptions f;
  f.steps = 6;
  f.global_batch_size = 24;
  fit(s, model, *opt, Dataset::from_tensors({x, Tensor::from_vector(y, Shape{144})}), nullptr, f);
  Trained r;
  for (const auto& v : model.trainable_variables()) {
    r.weights.push_back(v->value().to_vector<float>());
    for (const auto& c : v->device_values())
      EXPECT_EQ(c.to_vector<float>(), r.weights.back()) << v->name();
  }
  for (const auto& v : opt->slot_variables()) r.slots.push_back(v->value().to_vector<float>());
  r.iterations = opt->iterations();
  return r;
}

void expect_same(const Trained& a, const Trained& b, const std::string& what) {
  EXPECT_EQ(a.weights, b.weights) << what;
  EXPECT_EQ(a.slots, b.slots) << what;
  EXPECT_EQ(a.iterations, b.iterations) << what;
}

TEST_F(SharedVariables, TrainingIsBitwiseThatOfSeparateCopies) {
  const std::vector<std::string> optimizers = {
      "adam learning_rate=0.01",
      "sgd learning_rate=0.1 momentum=0.9 nesterov=1",
      "adamw learning_rate=0.01 weight_decay=0.1",
      "rmsprop learning_rate=0.01 centered=1 momentum=0.5",
      "adagrad learning_rate=0.1",
      "adam learning_rate=0.01 clipvalue=0.001",  // elementwise: clipped slice by slice
      "adam learning_rate=0.01 clipnorm=0.01",    // needs whole gradients: whole-variable update
      "sgd learning_rate=0.1 global_clipnorm=0.01"};  // likewise
  for (int n : {2, 3}) {
    for (const auto& opt : optimizers) {
      const Trained separate = train(on(n, false), opt);
      EXPECT_GT(separate.iterations, 0);
      expect_same(train(on(n), opt), separate, opt + " on " + std::to_string(n) + " replicas");
    }
    // Several packs (some reduce-scattered on the communication thread while backward runs), and
    // no packs at all.
    const Trained separate = train(on(n, false), optimizers[0]);
    expect_same(train(on(n), optimizers[0], 512), separate, "512-byte packs");
    expect_same(train(on(n), optimizers[0], 0, false), separate, "no overlap with backward");
    // Small packs gathered back whole for clipping by norm.
    expect_same(train(on(n), optimizers[6], 512), train(on(n, false), optimizers[6], 512),
                "512-byte packs, clipnorm");
  }
}

// The update really is divided: with the timeline on, a step of shared replicas reduce-scatters
// and ends with the barrier; separate copies, or clipping by norm, all-reduce.
TEST_F(SharedVariables, TheTimelineShowsTheReduceScatterAndTheBarrier) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "dtrain_shared_variables_timeline.json").string();
  timeline::enable(path);
  auto count = [&](const std::string& name) {
    timeline::flush_timeline();
    std::ifstream in(path);
    const nlohmann::json j = nlohmann::json::parse(in);
    int k = 0;
    for (const auto& e : j.is_object() ? j.at("traceEvents") : j)
      if (e.value("name", "") == name) ++k;
    return k;
  };
  const int rs0 = count("barrier: every slice updated");
  train(on(2), "adam learning_rate=0.01");
  const int rs1 = count("barrier: every slice updated");
  EXPECT_EQ(rs1 - rs0, 2 * 6) << "2 replicas x 6 steps";
  train(on(2, false), "adam learning_rate=0.01");
  train(on(2), "adam learning_rate=0.01 clipnorm=1");
  EXPECT_EQ(count("barrier: every slice updated"), rs1);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace dtrain
