// Sharded optimizer state and gradients (MirroredOptions::sharding, ZeRO-1 and ZeRO-2) inside one
// process: Mirrored over logical CPU devices with separate copies is the reference. Every replica
// updates its fixed part of each variable, keeps slots for that part only, and the parts are
// all-gathered; training must be bitwise that of the unsharded strategy where the reductions add
// in the same order (the in-process collectives do), and close with clipping by norm (norms
// summed from parts).
#include <cmath>
#include <filesystem>

#include "dtrain/data/dataset.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/fit.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class ShardedUpdate : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({4, 1}); }
};

MirroredOptions on(int n, Sharding sharding, size_t bytes_per_pack = 0, bool overlap = true) {
  MirroredOptions o;
  for (int i = 0; i < n; ++i) o.devices.push_back(DeviceSpec::cpu(i));
  o.share_host_variables = false;
  o.sharding = sharding;
  if (bytes_per_pack) o.bytes_per_pack = bytes_per_pack;
  o.overlap_backward = overlap;
  return o;
}

struct Trained {
  std::vector<std::vector<float>> weights;
  // Every slot, whole: from slot variables, or assembled from the parts.
  std::map<std::string, std::vector<float>> slots;
  int64_t slot_elements_per_replica_max = 0;  // the most slot elements one replica holds
  int64_t iterations = 0;
};

// A conv net of 641 weights (not a multiple of 16 x replicas: parts cut variables unevenly), 6
// steps of 24 images.
Trained train(const MirroredOptions& o, const std::string& optimizer, int accumulate = 1) {
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
  f.accumulate = accumulate;
  fit(s, model, *opt, Dataset::from_tensors({x, Tensor::from_vector(y, Shape{144})}), nullptr, f);
  Trained r;
  for (const auto& v : model.trainable_variables()) {
    r.weights.push_back(v->value().to_vector<float>());
    for (const auto& c : v->device_values())
      EXPECT_EQ(c.to_vector<float>(), r.weights.back()) << v->name() << ": copies differ";
  }
  for (const auto& v : opt->slot_variables()) r.slots[v->name()] = v->value().to_vector<float>();
  std::map<int, int64_t> per_replica;
  for (const auto& p : opt->slot_shards()) {
    std::vector<float>& whole = r.slots[p.name];
    whole.resize(static_cast<size_t>(p.shape.numel()), NAN);
    const std::vector<float> part = p.value.to_vector<float>();
    std::copy(part.begin(), part.end(), whole.begin() + p.first);
    per_replica[p.part] += p.value.numel();
  }
  for (const auto& [part, n] : per_replica)
    r.slot_elements_per_replica_max = std::max(r.slot_elements_per_replica_max, n);
  r.iterations = opt->iterations();
  return r;
}

TEST_F(ShardedUpdate, TrainingIsBitwiseThatOfUnshardedReplicas) {
  const std::vector<std::string> optimizers = {
      "sgd learning_rate=0.1 momentum=0.9 nesterov=1", "adam learning_rate=0.01",
      "adamw learning_rate=0.01 weight_decay=0.1", "rmsprop learning_rate=0.01 centered=1",
      "adam learning_rate=0.01 clipvalue=0.001"};
  for (int n : {2, 3}) {
    for (const auto& opt : optimizers) {
      const Trained whole = train(on(n, Sharding::kNone), opt);
      ASSERT_EQ(whole.iterations, 6);
      for (Sharding sh : {Sharding::kOptimizerState, Sharding::kGradients}) {
        const std::string what = opt + ", " + sharding_name(sh) + ", " + std::to_string(n);
        const Trained sharded = train(on(n, sh), opt);
        EXPECT_EQ(sharded.weights, whole.weights) << what;
        EXPECT_EQ(sharded.slots, whole.slots) << what;
        EXPECT_EQ(sharded.iterations, whole.iterations) << what;
      }
    }
    // Several packs reduce-scattered while backward runs; none at all.
    const Trained whole = train(on(n, Sharding::kNone), optimizers[1]);
    EXPECT_EQ(train(on(n, Sharding::kGradients, 512), optimizers[1]).weights, whole.weights);
    EXPECT_EQ(train(on(n, Sharding::kGradients, 0, false), optimizers[1]).weights, whole.weights);
    EXPECT_EQ(train(on(n, Sharding::kOptimizerState, 512), optimizers[1]).weights, whole.weights);
  }
}

TEST_F(ShardedUpdate, GradientAccumulationIsBitwiseThatOfUnshardedReplicas) {
  // fit(accumulate = 3): the hook is off for the first micro-batches, the summed mean goes through
  // the sharded update without packs.
  const Trained whole = train(on(3, Sharding::kNone), "adam learning_rate=0.01", 3);
  EXPECT_EQ(whole.iterations, 2);
  for (Sharding sh : {Sharding::kOptimizerState, Sharding::kGradients}) {
    const Trained sharded = train(on(3, sh), "adam learning_rate=0.01", 3);
    EXPECT_EQ(sharded.weights, whole.weights) << sharding_name(sh);
    EXPECT_EQ(sharded.slots, whole.slots) << sharding_name(sh);
    EXPECT_EQ(sharded.iterations, 2);
  }
}

TEST_F(ShardedUpdate, ClippingByNormUsesTheWholeGradientsNorm) {
  for (const std::string opt : {"adamw learning_rate=0.01 weight_decay=0.1 global_clipnorm=0.01",
                                "sgd learning_rate=0.1 momentum=0.9 clipnorm=0.01"}) {
    const Trained whole = train(on(3, Sharding::kNone), opt);
    for (Sharding sh : {Sharding::kOptimizerState, Sharding::kGradients}) {
      const Trained sharded = train(on(3, sh), opt);
      ASSERT_EQ(sharded.weights.size(), whole.weights.size());
      double worst = 0;
      for (size_t i = 0; i < whole.weights.size(); ++i)
        for (size_t k = 0; k < whole.weights[i].size(); ++k)
          worst = std::max(worst, std::fabs(double(sharded.weights[i][k]) - whole.weights[i][k]));
      // Norms of parts summed in float64 differ from whole-tensor sums in the last bits only.
      EXPECT_LT(worst, 1e-6) << opt << ", " << sharding_name(sh);
      // Clipping took effect: without it the weights move much more.
      std::string unclipped = opt.substr(0, opt.find(" global_clipnorm"));
      unclipped = unclipped.substr(0, unclipped.find(" clipnorm"));
      const Trained free = train(on(3, sh), unclipped);
      double moved = 0;
      for (size_t i = 0; i < whole.weights.size(); ++i)
        for (size_t k = 0; k < whole.weights[i].size(); ++k)
          moved = std::max(moved, std::fabs(double(free.weights[i][k]) - whole.weights[i][k]));
      EXPECT_GT(moved, 1e-3) << opt;
    }
  }
}

TEST_F(ShardedUpdate, EachReplicaKeepsSlotsForItsPartOnly) {
  const Trained whole = train(on(4, Sharding::kNone), "adam learning_rate=0.01");
  int64_t all = 0;
  for (const auto& [name, v] : whole.slots) all += static_cast<int64_t>(v.size());
  const Trained sharded = train(on(4, Sharding::kGradients), "adam learning_rate=0.01");
  // 641 weights x 2 slots over 4 replicas: each holds at most a part per variable, rounded up.
  EXPECT_LE(sharded.slot_elements_per_replica_max, all / 4 + 8);
  EXPECT_GE(sharded.slot_elements_per_replica_max, all / 4);
  MirroredStrategy s(on(4, Sharding::kOptimizerState));
  Adam adam(1e-3f);
  std::shared_ptr<Variable> w;
  {
    auto scope = s.scope();
    w = create_variable({"w", Shape{10, 3}, DType::kFloat32, initializers::zeros()});
    adam.build({w});
  }
  EXPECT_TRUE(adam.slot_variables().empty()) << "sharded slots are parts, not whole variables";
  const auto parts = adam.slot_shards();
  ASSERT_EQ(parts.size(), 8u);  // 2 slots x 4 local parts
  int64_t covered = 0;
  for (const auto& p : parts) {
    EXPECT_EQ(p.shape, (Shape{10, 3}));
    EXPECT_EQ(p.parts, 4);
    const auto [b, e] = partition_range(30, p.part, 4);
    EXPECT_EQ(p.first, b);
    EXPECT_EQ(p.value.numel(), e - b);
    EXPECT_EQ(p.value.device(), DeviceSpec::cpu(p.part));
    covered += p.value.numel();
  }
  EXPECT_EQ(covered, 60);
}

// A model and optimizer under `o`, trained `steps` steps (0: built only).
struct Trainee {
  std::unique_ptr<MirroredStrategy> strategy;
  Sequential model;
  std::unique_ptr<Optimizer> opt;
  Tensor x;
};
Trainee make(const MirroredOptions& o, int steps) {
  Trainee r;
  r.strategy = std::make_unique<MirroredStrategy>(o);
  set_global_seed(5);
  {
    auto scope = r.strategy->scope();
    r.model =
        Sequential({std::make_shared<Dense>(9, Activation::kRelu), std::make_shared<Dense>(3)});
    r.opt = Optimizer::from_config("adam learning_rate=0.01");
    r.model.build({Shape{1, 5}});
    r.opt->build(r.model.trainable_variables());
  }
  r.x = testing::random_tensor({48, 5}, 11, -1.f, 1.f);
  if (steps > 0) {
    std::vector<int32_t> y(48);
    for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(i % 3);
    FitOptions f;
    f.steps = steps;
    f.global_batch_size = 12;
    fit(*r.strategy, r.model, *r.opt,
        Dataset::from_tensors({r.x, Tensor::from_vector(y, Shape{48})}), nullptr, f);
  }
  return r;
}

TEST_F(ShardedUpdate, CheckpointsDoNotCareAboutTheShardCount) {
  const auto dir = std::filesystem::temp_directory_path() / "dtrain_sharded_ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string sharded_file = (dir / "sharded.safetensors").string();
  const std::string whole_file = (dir / "whole.safetensors").string();
  Trainee a = make(on(4, Sharding::kGradients), 4);
  ASSERT_TRUE(Checkpoint(a.model, a.opt.get(), a.strategy.get()).save(sharded_file));
  Trainee w = make(on(4, Sharding::kNone), 4);
  ASSERT_TRUE(Checkpoint(w.model, w.opt.get(), w.strategy.get()).save(whole_file));
  // The sharded run's file is the unsharded run's, tensor for tensor (the slots written whole).
  const CheckpointData ds = load_safetensors(sharded_file), dw = load_safetensors(whole_file);
  ASSERT_EQ(ds.tensors.size(), dw.tensors.size());
  for (const auto& [name, t] : dw.tensors) {
    const Tensor* u = ds.find(name);
    ASSERT_NE(u, nullptr) << name;
    EXPECT_EQ(u->shape(), t.shape()) << name;
    if (t.dtype() == DType::kFloat32) {
      EXPECT_EQ(u->to_vector<float>(), t.to_vector<float>()) << name;
    }
  }
  const std::vector<float> expected =
      predict(*a.strategy, a.model, Dataset::from_tensors({a.x})).to_vector<float>();
  // Restored under 2 and 3 shards, unsharded, and one device: equal predictions, and training on
  // from there matches the unsharded run trained on from its own checkpoint.
  Trainee cont_whole = make(on(4, Sharding::kNone), 0);
  Checkpoint(cont_whole.model, cont_whole.opt.get(), cont_whole.strategy.get()).restore(whole_file);
  for (const MirroredOptions& o : {on(2, Sharding::kGradients), on(3, Sharding::kOptimizerState),
                                   on(4, Sharding::kNone), on(1, Sharding::kNone)}) {
    Trainee b = make(o, 0);
    const TrainingPosition p =
        Checkpoint(b.model, b.opt.get(), b.strategy.get()).restore(sharded_file);
    (void)p;
    EXPECT_EQ(predict(*b.strategy, b.model, Dataset::from_tensors({b.x})).to_vector<float>(),
              expected)
        << o.devices.size();
    EXPECT_EQ(b.opt->iterations(), 4);
    // The whole slots, assembled from whatever layout holds them, are the saved ones.
    for (const auto& sv : b.opt->slot_variables())
      EXPECT_EQ(sv->value().to_vector<float>(), dw.find(sv->name())->to_vector<float>());
    for (const auto& part : b.opt->slot_shards()) {
      const std::vector<float> all = dw.find(part.name)->to_vector<float>();
      EXPECT_EQ(part.value.to_vector<float>(),
                std::vector<float>(all.begin() + part.first,
                                   all.begin() + part.first + part.value.numel()))
          << part.name << " part " << part.part << " of " << part.parts;
    }
  }
  // A checkpoint of another model is refused before anything changes.
  Trainee c = make(on(2, Sharding::kGradients), 0);
  const std::vector<float> before =
      predict(*c.strategy, c.model, Dataset::from_tensors({c.x})).to_vector<float>();
  CheckpointData other = load_safetensors(sharded_file);
  for (auto& [name, t] : other.tensors)
    if (name.find("/m") != std::string::npos && name.rfind("optimizer/", 0) == 0)
      t = Tensor::zeros(Shape{t.numel() + 1});
  EXPECT_THROW(Checkpoint(c.model, c.opt.get(), c.strategy.get()).restore(other),
               FailedPrecondition);
  EXPECT_EQ(predict(*c.strategy, c.model, Dataset::from_tensors({c.x})).to_vector<float>(), before);
  for (const auto& part : c.opt->slot_shards())
    for (float v : part.value.to_vector<float>()) ASSERT_EQ(v, 0.f) << part.name;
  std::filesystem::remove_all(dir);
}

TEST_F(ShardedUpdate, MisuseIsRefused) {
  MirroredOptions o = on(2, Sharding::kGradients);
  EXPECT_THROW(CentralStorageStrategy(o, DeviceSpec::cpu(0)), InvalidArgument);
  EXPECT_THROW(parse_sharding("4"), InvalidArgument);
  EXPECT_EQ(parse_sharding("2"), Sharding::kGradients);
  EXPECT_EQ(parse_sharding("optimizer_state"), Sharding::kOptimizerState);
  // A gradient aggregator sees whole gradients: refused under sharding, naming both.
  MirroredStrategy s(o);
  SGD sgd(0.1f);
  sgd.set_gradient_aggregator([](std::vector<Tensor> g) { return std::optional(std::move(g)); });
  std::shared_ptr<Variable> w;
  {
    auto scope = s.scope();
    w = create_variable({"w", Shape{4}, DType::kFloat32, initializers::zeros()});
  }
  try {
    s.run([&](ReplicaContext& ctx, const std::vector<Tensor>&) {
      sgd.apply_gradients({Tensor::full(Shape{4}, 1.f, ctx.device())}, {w});
      return std::vector<Tensor>{};
    });
    FAIL() << "expected FailedPrecondition";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("aggregator"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sharding"), std::string::npos) << e.what();
  }
  // Whole slots made outside the scope, then a sharded update: refused, saying where to build.
  Adam adam(0.1f);
  adam.build({w});
  try {
    s.run([&](ReplicaContext& ctx, const std::vector<Tensor>&) {
      adam.apply_gradients({Tensor::full(Shape{4}, 1.f, ctx.device())}, {w});
      return std::vector<Tensor>{};
    });
    FAIL() << "expected FailedPrecondition";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("inside strategy.scope()"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain
