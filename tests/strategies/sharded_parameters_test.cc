// Fully sharded parameters (Sharding::kParameters, ZeRO-3 / FSDP) inside one process: Mirrored over
// logical CPU devices with separate copies, unsharded, is the reference. The variables of layers
// marked shard_parameters are kept as one part per replica between calls and gathered for each
// call; training must be bitwise that of the unsharded strategy (the in-process collectives add in
// the same order), with and without recompute_grad on those layers, and checkpoints must not care.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dtrain/core/timeline.h"
#include "dtrain/data/dataset.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/fit.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class ShardedParameters : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({4, 1}); }
};

MirroredOptions on(int n, Sharding sharding) {
  MirroredOptions o;
  for (int i = 0; i < n; ++i) o.devices.push_back(DeviceSpec::cpu(i));
  o.share_host_variables = false;
  o.sharding = sharding;
  o.bytes_per_pack = 2048;  // several gradient packs in flight while blocks are gathered
  return o;
}

// A residual MLP block: x + W2 relu(W1 x + b1) + b2 (43 + 37 weights: parts cut them unevenly).
class Block : public Layer {
 public:
  Block() : Layer("block") {
    up = register_layer(std::make_shared<Dense>(7, Activation::kRelu), "up");
    down = register_layer(std::make_shared<Dense>(5), "down");
  }

 protected:
  Tensor call(const Tensor& x, bool training) override {
    return ops::add(x, (*down)((*up)(x, training), training));
  }
  std::shared_ptr<Dense> up, down;
};

struct Job {
  std::unique_ptr<MirroredStrategy> strategy;
  Sequential model;
  std::unique_ptr<Optimizer> opt;
  std::vector<std::shared_ptr<Block>> blocks;
  Tensor x;
};

Job make(const MirroredOptions& o, bool recompute, int steps,
         const std::string& optimizer = "adamw learning_rate=0.01 weight_decay=0.1") {
  Job r;
  r.strategy = std::make_unique<MirroredStrategy>(o);
  set_global_seed(9);
  {
    auto scope = r.strategy->scope();
    std::vector<std::shared_ptr<Layer>> layers{std::make_shared<Dense>(5)};
    for (int i = 0; i < 3; ++i) {
      auto b = std::make_shared<Block>();
      b->set_shard_parameters(true);
      b->set_recompute_grad(recompute);
      r.blocks.push_back(b);
      layers.push_back(b);
    }
    layers.push_back(std::make_shared<Dense>(3));
    r.model = Sequential(layers);
    r.opt = Optimizer::from_config(optimizer);
    r.model.build({Shape{1, 6}});
    r.opt->build(r.model.trainable_variables());
  }
  r.x = testing::random_tensor({72, 6}, 12, -1.f, 1.f);
  if (steps > 0) {
    std::vector<int32_t> y(72);
    for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>((i * 5) % 3);
    FitOptions f;
    f.steps = steps;
    f.global_batch_size = 24;
    fit(*r.strategy, r.model, *r.opt,
        Dataset::from_tensors({r.x, Tensor::from_vector(y, Shape{72})}), nullptr, f);
  }
  return r;
}

std::vector<std::vector<float>> weights(const Job& r) {
  std::vector<std::vector<float>> out;
  for (const auto& v : r.model.trainable_variables()) out.push_back(v->value().to_vector<float>());
  return out;
}

TEST_F(ShardedParameters, TrainingIsBitwiseThatOfUnshardedReplicas) {
  for (const std::string opt : {"adamw learning_rate=0.01 weight_decay=0.1",
                                "sgd learning_rate=0.1 momentum=0.9 nesterov=1",
                                "adam learning_rate=0.01 clipvalue=0.001"}) {
    for (int n : {2, 3}) {
      Job whole = make(on(n, Sharding::kNone), false, 6, opt);
      for (bool recompute : {true, false}) {
        const std::string what =
            opt + ", " + std::to_string(n) + " replicas" + (recompute ? ", recompute" : "");
        Job sharded = make(on(n, Sharding::kParameters), recompute, 6, opt);
        EXPECT_EQ(weights(sharded), weights(whole)) << what;
        EXPECT_EQ(sharded.opt->iterations(), 6) << what;
        EXPECT_EQ(predict(*sharded.strategy, sharded.model, Dataset::from_tensors({sharded.x}))
                      .to_vector<float>(),
                  predict(*whole.strategy, whole.model, Dataset::from_tensors({whole.x}))
                      .to_vector<float>())
            << what;
      }
    }
  }
}

TEST_F(ShardedParameters, BlocksKeepOnlyTheirPartsBetweenCalls) {
  const Job r = make(on(3, Sharding::kParameters), true, 3);
  for (const auto& b : r.blocks)
    for (const auto& v : b->trainable_variables()) {
      const std::vector<ValuePart> parts = v->value_parts();
      ASSERT_EQ(parts.size(), 3u) << v->name();
      int64_t total = 0;
      for (size_t l = 0; l < parts.size(); ++l) {
        const auto [first, end] = partition_range(v->shape().numel(), static_cast<int>(l), 3);
        EXPECT_EQ(parts[l].part, static_cast<int>(l));
        EXPECT_EQ(parts[l].first, first);
        EXPECT_EQ(parts[l].value.numel(), end - first) << v->name();
        total += parts[l].value.numel();
      }
      EXPECT_EQ(total, v->shape().numel());
      // No copy holds the whole value: device_values() says so instead of handing out parts.
      EXPECT_THROW(v->device_values(), FailedPrecondition) << v->name();
    }
  // Variables of layers not marked stay whole, one copy per replica.
  const auto first = r.model.trainable_variables().front();
  EXPECT_TRUE(first->value_parts().empty());
  EXPECT_EQ(first->device_values().size(), 3u);
  // Under kGradients nothing is partial.
  const Job z2 = make(on(3, Sharding::kGradients), true, 2);
  for (const auto& v : z2.model.trainable_variables()) EXPECT_TRUE(v->value_parts().empty());
}

TEST_F(ShardedParameters, CheckpointsMoveBetweenShardLayouts) {
  const auto dir = std::filesystem::temp_directory_path() / "dtrain_sharded_params_ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string sharded = (dir / "sharded.safetensors").string();
  const std::string plain = (dir / "plain.safetensors").string();
  Job a = make(on(3, Sharding::kParameters), true, 4);
  ASSERT_TRUE(Checkpoint(a.model, a.opt.get(), a.strategy.get()).save(sharded));
  Job w = make(on(3, Sharding::kNone), false, 4);
  ASSERT_TRUE(Checkpoint(w.model, w.opt.get(), w.strategy.get()).save(plain));
  const CheckpointData ds = load_safetensors(sharded), dw = load_safetensors(plain);
  ASSERT_EQ(ds.tensors.size(), dw.tensors.size());
  for (const auto& [name, t] : dw.tensors) {
    const Tensor* u = ds.find(name);
    ASSERT_NE(u, nullptr) << name;
    if (t.dtype() == DType::kFloat32) {
      EXPECT_EQ(u->to_vector<float>(), t.to_vector<float>()) << name;
    }
  }
  const std::vector<float> expected =
      predict(*w.strategy, w.model, Dataset::from_tensors({w.x})).to_vector<float>();
  for (const MirroredOptions& o :
       {on(2, Sharding::kParameters), on(2, Sharding::kNone), on(1, Sharding::kParameters)}) {
    Job b = make(o, false, 0);
    // Trained once under this layout first, so that its blocks already hold parts.
    if (o.sharding == Sharding::kParameters) {
      Job warm = make(o, false, 1);
      b = std::move(warm);
    }
    Checkpoint(b.model, b.opt.get(), b.strategy.get()).restore(sharded);
    EXPECT_EQ(predict(*b.strategy, b.model, Dataset::from_tensors({b.x})).to_vector<float>(),
              expected)
        << o.devices.size() << " " << sharding_name(o.sharding);
    EXPECT_EQ(b.opt->iterations(), 4);
  }
  std::filesystem::remove_all(dir);
}

TEST_F(ShardedParameters, ReplicasWithNoRowsStillTakePartInTheGathers) {
  // One row among 3 replicas: two have nothing to compute but must join each block's all-gather
  // (a short collective timeout turns a missing participant into an error, not a hang).
  MirroredOptions o = on(3, Sharding::kParameters);
  o.timeout = std::chrono::seconds(20);
  Job z3 = make(o, true, 2);
  Job plain = make(on(3, Sharding::kGradients), true, 2);
  const Tensor one = z3.x.slice_rows(0, 1);
  EXPECT_EQ(predict(*z3.strategy, z3.model, Dataset::from_tensors({one})).to_vector<float>(),
            predict(*plain.strategy, plain.model, Dataset::from_tensors({one})).to_vector<float>());
  std::vector<int32_t> y{1};
  FitOptions f;
  f.eval_batch_size = 1;
  const EvalResult a = evaluate(*z3.strategy, z3.model,
                                Dataset::from_tensors({one, Tensor::from_vector(y, Shape{1})}), f);
  const EvalResult b = evaluate(*plain.strategy, plain.model,
                                Dataset::from_tensors({one, Tensor::from_vector(y, Shape{1})}), f);
  EXPECT_EQ(a.examples, 1);
  EXPECT_EQ(a.loss, b.loss);
}

TEST_F(ShardedParameters, AModelOutlivingItsStrategyIsWholeAgainAndTrains) {
  // A function that trains and returns only the model: the strategy that held the blocks' parts
  // and gathered them is gone. Its variables held its gatherer by a raw pointer before (the first
  // call after was a use after free); now the gatherer's destructor makes them whole again.
  Job whole = make(on(3, Sharding::kNone), false, 3);
  Job z3 = make(on(3, Sharding::kParameters), true, 3);
  const std::vector<float> want =
      predict(*whole.strategy, whole.model, Dataset::from_tensors({whole.x})).to_vector<float>();
  const auto v = z3.blocks[0]->trainable_variables()[0];
  ASSERT_EQ(v->value_parts().size(), 3u);
  z3.strategy.reset();
  EXPECT_TRUE(v->value_parts().empty());
  EXPECT_EQ(v->device_values().size(), 3u);
  EXPECT_EQ(v->parameter_gatherer(), nullptr);
  EXPECT_EQ(z3.model(z3.x, false).to_vector<float>(), want);
  EXPECT_EQ(weights(z3), weights(whole));
  // Trained on by the default strategy: every block's gradient is there (a fresh tensor assembled
  // on each read would have none, and the optimizer would skip it silently), recompute included.
  const std::vector<std::shared_ptr<Variable>> vars = z3.model.trainable_variables();
  std::vector<Tensor> grads;
  {
    GradientTape tape;
    const Tensor loss = ops::sum(z3.model(z3.x, true));
    grads = tape.gradient(loss, vars);
  }
  for (size_t i = 0; i < vars.size(); ++i) EXPECT_TRUE(grads[i].defined()) << vars[i]->name();
  const std::vector<float> before = v->value().to_vector<float>();
  auto sgd = Optimizer::from_config("sgd learning_rate=0.1");
  sgd->apply_gradients(grads, vars);
  EXPECT_NE(v->value().to_vector<float>(), before);
}

// Last in this file: it turns the timeline on for the rest of the process.
TEST_F(ShardedParameters, EachBlockPrefetchesTheNextOnesParameters) {
  const auto path = std::filesystem::temp_directory_path() / "dtrain_sharded_params_trace.json";
  timeline::enable(path.string());
  const int steps = 5;
  make(on(2, Sharding::kParameters), true, steps);
  ASSERT_EQ(timeline::flush_timeline(), path.string());
  nlohmann::json trace;
  std::ifstream(path) >> trace;
  int waited = 0, gathered = 0;
  for (const auto& e : trace["traceEvents"]) {
    const std::string name = e.value("name", "");
    waited += name == "wait for prefetched parameters";
    gathered +=
        name.rfind("all-gather of ", 0) == 0 && name.find("parameter(s)") != std::string::npos;
  }
  // Per replica and step after the first: forward gathers block 0 itself and prefetches blocks 1
  // and 2; the backward pass gathers block 2 itself and prefetches blocks 1 and 0. The first step
  // gathers in the backward pass only (the blocks are whole until their first release).
  EXPECT_EQ(waited, 2 * (steps - 1) * 4);
  EXPECT_EQ(gathered, 2 * (3 + (steps - 1) * 6));
  std::filesystem::remove(path);
}

// EarlyStopping(restore_best_weights) keeps the best epoch's parameters whole (gathered from the
// replicas' parts) and gives each replica its part back when training ends; a BackupAndRestore
// restart (a process killed at epoch 2's start) carries them and ends with the same weights.
TEST_F(ShardedParameters, EarlyStoppingRestoresTheBestWeights) {
  const std::string backup =
      ::testing::TempDir() + "/dtrain_zero3_es_" + std::to_string(::getpid());
  std::filesystem::remove_all(backup);
  auto run = [&](const MirroredOptions& o, bool crash) {
    Job r = make(o, true, 0);
    std::vector<int32_t> y(72);
    for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>((i * 5) % 3);
    // "max" of a falling loss: epoch 0 stays the best; patience 2 stops after epoch 2.
    EarlyStopping es("loss", 0, 2, MonitorMode::kMax, /*restore_best_weights=*/true);
    BackupAndRestore bar(backup);
    struct Snap : Callback {
      bool crash = false;
      std::vector<std::vector<float>> first;
      void on_epoch_begin(const TrainLogs& l) override {
        if (crash && l.epoch == 2) throw Unavailable("simulated crash");
      }
      void on_epoch_end(const TrainLogs& l) override {
        if (l.epoch != 0) return;
        for (const auto& v : model().trainable_variables())
          first.push_back(v->value().to_vector<float>());
      }
    } snap;
    snap.crash = crash;
    FitOptions f;
    f.epochs = 10;
    f.global_batch_size = 24;
    f.callbacks = {&snap, &es, &bar};
    fit(*r.strategy, r.model, *r.opt,
        Dataset::from_tensors({r.x, Tensor::from_vector(y, Shape{72})}), nullptr, f);
    EXPECT_EQ(es.stopped_epoch(), 2);
    if (!snap.first.empty()) {
      EXPECT_EQ(weights(r), snap.first);
    }
    return weights(r);
  };
  const auto whole = run(on(3, Sharding::kNone), false);
  EXPECT_EQ(run(on(3, Sharding::kParameters), false), whole);
  EXPECT_THROW(run(on(3, Sharding::kParameters), true), Unavailable);
  EXPECT_EQ(run(on(3, Sharding::kParameters), false), whole);  // from the backup of epoch 1's end
  std::filesystem::remove_all(backup);
}

TEST_F(ShardedParameters, ParsedAndNamed) {
  EXPECT_EQ(parse_sharding("parameters"), Sharding::kParameters);
  EXPECT_EQ(parse_sharding("3"), Sharding::kParameters);
  EXPECT_STREQ(sharding_name(Sharding::kParameters), "parameters (ZeRO-3)");
  EXPECT_THROW(parse_sharding("params"), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
