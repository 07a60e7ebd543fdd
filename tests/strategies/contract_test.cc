// The strategy contract: a variable belongs to the strategy that made it, the role of a process is
// resolved once and returned as a value, the training policy is reached through extended(), and the
// input API is on every Strategy. Each test checks the error type and what its message tells the
// user.
#include <omp.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "dtrain/data/dataset.h"
#include "dtrain/model/initializers.h"
#include "dtrain/nn/layers.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/make_strategy.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "dtrain/strategies/one_device_strategy.h"
#include "dtrain/train/fit.h"
#include "dtrain/train/run_task.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

class Contract : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({2, 1}); }
  static MirroredOptions two_cpus() {
    MirroredOptions o;
    o.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
    return o;
  }
};

// The message of the FailedPrecondition fn throws; fails the test for no exception or another type.
template <typename Fn>
std::string failed_precondition(Fn fn) {
  try {
    fn();
  } catch (const FailedPrecondition& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected FailedPrecondition, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected FailedPrecondition, nothing was thrown";
  return "";
}

std::shared_ptr<Variable> scalar_variable(const std::string& name, float value) {
  VariableSpec spec{name, Shape{1}, DType::kFloat32, initializers::constant(value)};
  return create_variable(spec);
}

// SGD(0.5) on loss 0.5 * sum(w) inside run(): one step moves w from 1 to 0.5 (mean of two replicas'
// equal gradients). Used with a variable of the wrong strategy it must not move at all.
PerReplica sgd_step(Strategy& s, SGD& sgd, const std::shared_ptr<Variable>& w) {
  return s.run([&](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
    GradientTape tape;
    Tensor loss = ops::scale(ops::sum(w->value()), 0.5f);
    std::vector<Tensor> grads = tape.gradient(loss, {w});
    sgd.apply_gradients(grads, {w});
    return {};
  });
}

TEST_F(Contract, AVariableMadeOutsideEveryScopeIsRefusedInsideRun) {
  std::shared_ptr<Variable> w = scalar_variable("w", 1.f);  // no scope: the default strategy's
  MirroredStrategy mirrored(two_cpus());
  SGD sgd(0.5f);
  const std::string what = failed_precondition([&] { sgd_step(mirrored, sgd, w); });
  EXPECT_NE(what.find("variable 'w'"), std::string::npos) << what;
  EXPECT_NE(what.find("outside every strategy.scope()"), std::string::npos) << what;
  EXPECT_NE(what.find("MirroredStrategy(CPU:0, CPU:1)"), std::string::npos) << what;
  EXPECT_NE(what.find("inside the training strategy's scope"), std::string::npos) << what;
  EXPECT_FLOAT_EQ(w->value().to_vector<float>()[0], 1.f);  // nothing was applied, by any replica
}

TEST_F(Contract, AVariableOfAnotherStrategyIsRefusedInsideRun) {
  OneDeviceStrategy one(DeviceSpec::cpu(0));
  std::shared_ptr<Variable> w;
  {
    auto scope = one.scope();
    w = scalar_variable("w", 1.f);
  }
  MirroredStrategy mirrored(two_cpus());
  SGD sgd(0.5f);
  const std::string what = failed_precondition([&] { sgd_step(mirrored, sgd, w); });
  EXPECT_NE(what.find("belongs to OneDeviceStrategy(CPU:0)"), std::string::npos) << what;
  EXPECT_NE(what.find("run() of MirroredStrategy"), std::string::npos) << what;
  EXPECT_FLOAT_EQ(w->value().to_vector<float>()[0], 1.f);
}

TEST_F(Contract, AWriteToAnotherStrategysVariableIsRefusedToo) {
  OneDeviceStrategy one(DeviceSpec::cpu(0));
  std::shared_ptr<Variable> w;
  {
    auto scope = one.scope();
    w = scalar_variable("w", 1.f);
  }
  MirroredStrategy mirrored(two_cpus());
  const std::string what = failed_precondition([&] {
    mirrored.run([&](ReplicaContext&, const std::vector<Tensor>&) -> std::vector<Tensor> {
      w->assign_add(Tensor::from_vector<float>({1.f}, Shape{1}));  // no read first
      return {};
    });
  });
  EXPECT_NE(what.find("is assigned inside the run() of MirroredStrategy"), std::string::npos)
      << what;
  EXPECT_FLOAT_EQ(w->value().to_vector<float>()[0], 1.f);
}

TEST_F(Contract, TheDefaultStrategyEvaluatesAModelOfAnyStrategy) {
  // As SidecarEvaluator and user code do: evaluate(get_strategy(), ...) outside every scope.
  MirroredStrategy mirrored(two_cpus());
  Sequential model;
  {
    auto scope = mirrored.scope();
    model.add(std::make_shared<Dense>(2));
    model.build(Shape{1, 3});
  }
  const Tensor x = testing::random_tensor(Shape{8, 3}, 2);
  const Tensor y = Tensor::from_vector<int32_t>(std::vector<int32_t>(8, 0), Shape{8});
  const EvalResult r = evaluate(get_strategy(), model, Dataset::from_tensors({x, y}), 4);
  EXPECT_EQ(r.examples, 8);
}

TEST_F(Contract, TheRightStrategyTrainsItsVariable) {
  MirroredStrategy mirrored(two_cpus());
  std::shared_ptr<Variable> w;
  SGD sgd(0.5f);
  {
    auto scope = mirrored.scope();
    w = scalar_variable("w", 1.f);
  }
  sgd_step(mirrored, sgd, w);
  // Each replica's gradient is 0.5; the all-reduce sums them to 1.0 (compute_average_loss is not
  // used here), so SGD(0.5) moves w from 1.0 to 0.5 on every copy.
  for (const Tensor& copy : w->device_values()) EXPECT_FLOAT_EQ(copy.to_vector<float>()[0], 0.5f);
}

TEST_F(Contract, FitWithAModelBuiltOutsideTheScopeNamesTheScope) {
  Sequential model;
  model.add(std::make_shared<Dense>(4, Activation::kRelu));
  model.add(std::make_shared<Dense>(2));
  model.build(Shape{1, 3});  // built outside any scope: the default strategy's variables
  MirroredStrategy mirrored(two_cpus());
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = mirrored.scope();
    opt = std::make_unique<Adam>(1e-3f);
  }
  const Tensor x = testing::random_tensor(Shape{16, 3}, 1);
  const Tensor y = Tensor::from_vector<int32_t>(std::vector<int32_t>(16, 1), Shape{16});
  FitOptions f;
  f.steps = 1;
  f.global_batch_size = 8;
  const std::string what = failed_precondition([&] {
    fit(mirrored, model, *opt, Dataset::from_tensors({x, y}), nullptr, f);
  });
  EXPECT_NE(what.find("strategy.scope()"), std::string::npos) << what;
  EXPECT_EQ(what.find("move one with .to(device)"), std::string::npos) << what;
}

TEST_F(Contract, DistributeDatasetsFromFunctionIsOnEveryStrategy) {
  OneDeviceStrategy one(DeviceSpec::cpu(0));
  MirroredStrategy mirrored(two_cpus());
  for (Strategy* s : {static_cast<Strategy*>(&one), static_cast<Strategy*>(&mirrored)}) {
    Strategy& strategy = *s;  // code written against the base class
    const int n = strategy.num_replicas_in_sync();
    std::vector<InputContext> seen;
    auto next = strategy.distribute_datasets_from_function([&](const InputContext& ic) {
      seen.push_back(ic);
      std::vector<float> rows(8, static_cast<float>(ic.input_pipeline_id));
      return Dataset::from_tensors({Tensor::from_vector<float>(rows, Shape{8})})
          .batch(ic.get_per_replica_batch_size(4 * n));
    });
    ASSERT_EQ(static_cast<int>(seen.size()), n);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(seen[static_cast<size_t>(r)].input_pipeline_id, r);
      EXPECT_EQ(seen[static_cast<size_t>(r)].num_input_pipelines, n);
      EXPECT_EQ(seen[static_cast<size_t>(r)].num_replicas_in_sync, n);
    }
    PerReplica batch;
    ASSERT_TRUE(next(&batch));
    ASSERT_EQ(static_cast<int>(batch.num_replicas()), n);
    for (int r = 0; r < n; ++r) {
      const Tensor& t = batch.values[static_cast<size_t>(r)][0];
      EXPECT_EQ(t.device(), strategy.worker_devices()[static_cast<size_t>(r)]);
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, static_cast<float>(r)));
    }
  }
}

TEST_F(Contract, DistributeValuesFromFunctionPlacesEachReplicasValue) {
  MirroredStrategy mirrored(two_cpus());
  Strategy& strategy = mirrored;
  const PerReplica v =
      strategy.experimental_distribute_values_from_function([](const ValueContext& vc) {
        return std::vector<Tensor>{Tensor::scalar(
            static_cast<float>(10 * vc.replica_id_in_sync_group + vc.num_replicas_in_sync))};
      });
  ASSERT_EQ(v.num_replicas(), 2u);
  EXPECT_FLOAT_EQ(v.values[0][0].item(), 2.f);
  EXPECT_FLOAT_EQ(v.values[1][0].item(), 12.f);
  EXPECT_EQ(v.values[1][0].device(), DeviceSpec::cpu(1));
  // And the values feed run() directly.
  const PerReplica out = strategy.run(
      [](ReplicaContext& ctx, const std::vector<Tensor>& in) {
        return ctx.all_reduce(ReduceOp::kSum, {in[0]});
      },
      v);
  EXPECT_FLOAT_EQ(out.values[0][0].item(), 14.f);
}

TEST_F(Contract, ConfiguringDevicesTwiceSaysOncePerProcess) {
  configure_devices({2, 1});  // the same layout again is fine
  const std::string what = failed_precondition([] { configure_devices({3, 1}); });
  EXPECT_NE(what.find("already configured in this process"), std::string::npos) << what;
  EXPECT_NE(what.find("once per process"), std::string::npos) << what;
  EXPECT_EQ(what.find("before creating any tensor"), std::string::npos) << what;
}

// The intra-op thread count belongs to the device: the training loop's own thread, left at the
// process default (every core), runs CPU:0's kernels with CPU:0's one thread, so it starts no
// OpenMP team whose idle workers would spin on the replicas' cores.
TEST_F(Contract, KernelsRunWithTheirDevicesThreadCountOnAnyThread) {
  std::thread([] {
    omp_set_num_threads(8);  // a thread at some other default
    const Tensor a = testing::random_tensor(Shape{64, 64}, 3, -1.f, 1.f, DeviceSpec::cpu(0));
    ops::matmul(a, a);  // a oneDNN primitive of CPU:0, run on this thread
    EXPECT_EQ(omp_get_max_threads(), 1);
  }).join();
}

TEST_F(Contract, SingleProcessStrategiesHaveTheSingleProcessParts) {
  MirroredStrategy mirrored(two_cpus());
  StrategyExtended& ext = mirrored.extended();
  EXPECT_EQ(ext.cluster(), nullptr);
  EXPECT_EQ(ext.cross_worker(), nullptr);
  EXPECT_TRUE(ext.is_chief());
  EXPECT_TRUE(ext.synchronous());
  EXPECT_FALSE(ext.job_step().has_value());
  EXPECT_EQ(ext.input_shard().count, 1);
  EXPECT_EQ(ext.sum_across_workers({1.5, 2.5}), (std::vector<double>{1.5, 2.5}));
  EXPECT_THROW(ext.set_auto_shard_policy(AutoShardPolicy::kFile), InvalidArgument);
}

// Sets an environment variable for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

const char* kPsJob =
    R"({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]},
        "task": {"type": "%s", "index": 0}})";

std::string tf_config(const std::string& type) {
  std::string s = kPsJob;
  return s.replace(s.find("%s"), 2, type);
}

TEST_F(Contract, MakeStrategyOnAPsTaskThrowsInsteadOfExiting) {
  ScopedEnv tf("TF_CONFIG", tf_config("ps"));
  const std::string what = failed_precondition([] { make_strategy("parameter_server", {}); });
  EXPECT_NE(what.find("task ps:0"), std::string::npos) << what;
  EXPECT_NE(what.find("run_task()"), std::string::npos) << what;
}

TEST_F(Contract, RunTaskResolvesTheRoleOnceAndReturnsIt) {
  ScopedEnv tf("TF_CONFIG", tf_config("evaluator"));
  ScopedEnv dir("DTRAIN_CHECKPOINT_DIR", "/tmp/dtrain-contract-ckpt");
  TaskFunctions fns;
  bool trained = false;
  std::string evaluated_dir, evaluated_task;
  fns.train = [&](Strategy&) { trained = true; };
  fns.evaluate = [&](const TaskInfo& t) {
    evaluated_dir = t.checkpoint_dir;
    evaluated_task = t.cluster ? t.cluster->task_name() : "";
  };
  EXPECT_EQ(run_task("parameter_server", {}, fns), TaskRole::kEvaluator);
  EXPECT_FALSE(trained);
  EXPECT_EQ(evaluated_dir, "/tmp/dtrain-contract-ckpt");
  EXPECT_EQ(evaluated_task, "evaluator:0");

  fns.evaluate =
      nullptr;  // an evaluator task with nothing to evaluate is an error, not a silent exit
  const std::string what = failed_precondition([&] { run_task("parameter_server", {}, fns); });
  EXPECT_NE(what.find("evaluator:0"), std::string::npos) << what;
}

TEST_F(Contract, RunTaskRefusesAPsTaskUnderAStrategyWithoutParameterServers) {
  ScopedEnv tf("TF_CONFIG", tf_config("ps"));
  TaskFunctions fns;
  fns.train = [](Strategy&) {};
  const std::string what = failed_precondition([&] { run_task("multi_worker_mirrored", {}, fns); });
  EXPECT_NE(what.find("--strategy=multi_worker_mirrored has no parameter servers"),
            std::string::npos)
      << what;
}

TEST_F(Contract, RunTaskTrainsASingleProcess) {
  TaskFunctions fns;
  int replicas = 0;
  fns.train = [&](Strategy& s) { replicas = s.num_replicas_in_sync(); };
  StrategyOptions o;
  o.devices = {DeviceSpec::cpu(0), DeviceSpec::cpu(1)};
  EXPECT_EQ(run_task("mirrored", o, fns), TaskRole::kTrainer);
  EXPECT_EQ(replicas, 2);
}

TEST_F(Contract, MalformedEnvironmentSettingsAreTypedErrors) {
  {
    ScopedEnv c("DTRAIN_COLLECTIVE", "gloo");
    EXPECT_THROW(apply_environment({}), InvalidArgument);
  }
  ScopedEnv t("DTRAIN_RENDEZVOUS_TIMEOUT", "10s");
  EXPECT_THROW(apply_environment({}), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
