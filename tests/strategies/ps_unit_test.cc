// Unit tests of the pieces of ParameterServerStrategy that need no processes: partitioners, shard
// rows, optimizer configs (how a server rebuilds the job's optimizer), and refused configurations.
// The strategy itself is tested with real processes in tests/ps/ps_test.py.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/multi_worker_mirrored_strategy.h"
#include "dtrain/strategies/parameter_server_strategy.h"

namespace dtrain {
namespace {

TEST(Partitioners, FollowTensorFlowsRules) {
  const Shape big{1000, 256};  // 1,024,000 bytes of float32
  EXPECT_EQ(fixed_shards_partitioner(3)(big, DType::kFloat32, 2), 3);
  EXPECT_EQ(min_size_partitioner(256 << 10, 1)(big, DType::kFloat32, 2),
            1);  // TF's default: no split
  EXPECT_EQ(min_size_partitioner(256 << 10, 8)(big, DType::kFloat32, 2),
            3);  // 3 shards of >= 256 KiB
  EXPECT_EQ(min_size_partitioner(1 << 20, 8)(big, DType::kFloat32, 2),
            1);  // smaller than one shard
  EXPECT_EQ(max_size_partitioner(256 << 10)(big, DType::kFloat32, 2),
            4);  // 250 rows = 256,000 B each
  EXPECT_EQ(max_size_partitioner(256 << 10, 2)(big, DType::kFloat32, 2), 2);  // capped
  EXPECT_EQ(max_size_partitioner(1)(big, DType::kFloat32, 2), 1000);          // never below one row
  EXPECT_EQ(max_size_partitioner(10 << 20)(big, DType::kFloat64, 2), 1);
  EXPECT_THROW(fixed_shards_partitioner(0), InvalidArgument);
  EXPECT_THROW(min_size_partitioner(0, 1), InvalidArgument);
  EXPECT_THROW(max_size_partitioner(0), InvalidArgument);
}

TEST(Partitioners, ShardRowsSplitLikeTensorFlow) {
  EXPECT_EQ(shard_rows(10, 3), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(shard_rows(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(shard_rows(2, 2), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(shard_rows(7, 1), (std::vector<int64_t>{7}));
  EXPECT_THROW(shard_rows(7, 0), InvalidArgument);
}

TEST(OptimizerConfig, RoundTripsExactly) {
  OptimizerOptions clip;
  clip.clipnorm = 1.5f;
  clip.clipvalue = 0.25f;
  OptimizerOptions global;
  global.global_clipnorm = 2.f;
  global.weight_decay = 0.01f;
  for (const std::string& c :
       {SGD(0.1f).config(), SGD(0.01f, 0.9f, true, clip).config(), Adam(1e-3f).config(),
        Adam(3e-4f, 0.8f, 0.99f, 1e-8f, global).config(), AdamW(2e-3f, 0.05f).config(),
        RMSprop(1e-3f, 0.8f, 0.5f, 1e-6f, true, clip).config(), RMSprop(0.01f).config(),
        Adagrad(0.05f, 0.2f, 1e-6f, global).config()}) {
    EXPECT_EQ(Optimizer::from_config(c)->config(), c);
  }
  // Keys left out take Keras' defaults; a hand-written line works.
  EXPECT_EQ(Optimizer::from_config("adamw")->config(), AdamW().config());
  EXPECT_EQ(Optimizer::from_config("sgd learning_rate=0.1 momentum=0.9")->config(),
            SGD(0.1f, 0.9f).config());
  // And the rebuilt optimizer updates exactly as the original.
  Adam a(1e-3f);
  auto b = Optimizer::from_config(a.config());
  Tensor v1 = Tensor::full(Shape{5}, 1.f), v2 = v1.clone(), g = Tensor::full(Shape{5}, 0.5f);
  std::vector<Tensor> s1{Tensor::zeros(Shape{5}), Tensor::zeros(Shape{5})},
      s2{Tensor::zeros(Shape{5}), Tensor::zeros(Shape{5})};
  for (int step = 1; step <= 3; ++step) {
    a.apply_dense(v1, g, s1, step);
    b->apply_dense(v2, g, s2, step);
  }
  EXPECT_EQ(v1.to_vector<float>(), v2.to_vector<float>());
  EXPECT_EQ(b->slots_per_variable(), 2);
}

TEST(OptimizerConfig, MalformedConfigsAreRefused) {
  for (const char* bad :
       {"", "nadam", "sgd 0.1", "sgd learning_rate=", "sgd learning_rate=x", "sgd lr=0.1",
        "sgd learning_rate=0.1 learning_rate=0.2", "sgd learning_rate=-1", "sgd momentum=1.5",
        "adam beta_1=1", "adam clipnorm=1 global_clipnorm=1", "adagrad epsilon=0",
        "rmsprop rho=2"}) {
    EXPECT_THROW(Optimizer::from_config(bad), InvalidArgument) << bad;
  }
  try {
    Optimizer::from_config("adam learning_rate=0.1 beta1=0.9");
    ADD_FAILURE() << "an unknown key was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown key 'beta1'"), std::string::npos) << e.what();
  }
}

ClusterResolution cluster_of(const std::string& json) { return resolve_tf_config(json); }

TEST(ParameterServerStrategy, RefusesClustersItCannotServe) {
  try {
    ParameterServerStrategy s(
        {}, DeviceSpec::cpu(),
        cluster_of(
            R"({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}})"),
        "a-token-of-sixteen-chars");
    FAIL() << "a cluster without ps tasks was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("at least one ps task"), std::string::npos) << e.what();
  }
  try {
    ParameterServerStrategy s(
        {}, DeviceSpec::cpu(),
        cluster_of(
            R"({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "ps", "index": 0}})"),
        "a-token-of-sixteen-chars");
    FAIL() << "a ps task was accepted as a worker";
  } catch (const FailedPrecondition&
               e) {  // the task's role, not an argument, is wrong: run_task() serves it
    EXPECT_NE(std::string(e.what()).find("run_task()"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("serve_parameter_server"), std::string::npos) << e.what();
  }
  ParameterServerOptions o;
  o.checkpoint_every = 0;
  EXPECT_THROW(
      ParameterServerStrategy(
          o, DeviceSpec::cpu(),
          cluster_of(
              R"({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}})"),
          "a-token-of-sixteen-chars"),
      InvalidArgument);
}

TEST(ParameterServerStrategy, UnreachableServerIsNamed) {
  ParameterServerOptions o;
  o.connect_timeout = std::chrono::milliseconds(300);
  try {
    ParameterServerStrategy s(
        o, DeviceSpec::cpu(),
        cluster_of(
            R"({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:9"]}, "task": {"type": "worker", "index": 0}})"),
        "a-token-of-sixteen-chars");
    FAIL() << "connected to nobody";
  } catch (const DeadlineExceeded& e) {
    EXPECT_NE(std::string(e.what()).find("ps:0 (127.0.0.1:9)"), std::string::npos) << e.what();
  }
}

// serve_parameter_server() blocks SIGTERM and SIGINT to wait for them; however it returns (here:
// its port is taken, so it throws), the caller gets its own signal mask back.
TEST(ParameterServerStrategy, ServingGivesTheSignalMaskBackWhenItThrows) {
  const int taken = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(taken, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(taken, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(taken, 1), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::getsockname(taken, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string port = std::to_string(ntohs(a.sin_port));
  sigset_t before, after;
  pthread_sigmask(SIG_SETMASK, nullptr, &before);
  ASSERT_FALSE(sigismember(&before, SIGTERM));
  try {
    serve_parameter_server(
        cluster_of(R"({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:)" + port +
                   R"("]}, "task": {"type": "ps", "index": 0}})"),
        "a-token-of-sixteen-chars");
    FAIL() << "served on a port that is taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(port), std::string::npos) << e.what();
  }
  pthread_sigmask(SIG_SETMASK, nullptr, &after);
  EXPECT_FALSE(sigismember(&after, SIGTERM));
  EXPECT_FALSE(sigismember(&after, SIGINT));
  ::close(taken);
}

TEST(MultiWorkerMirrored, NcclOnCpuDevicesIsRefused) {
  CommunicationOptions c;
  c.implementation = CommunicationOptions::Implementation::kNccl;
  MirroredOptions m;
  m.devices = {DeviceSpec::cpu(0)};
  try {
    MultiWorkerMirroredStrategy s(
        m, c,
        cluster_of(
            R"({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}})"),
        "a-token-of-sixteen-chars");
    FAIL() << "NCCL on CPU devices was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("needs GPU devices"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain
