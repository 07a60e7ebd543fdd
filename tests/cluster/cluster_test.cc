// Cluster resolution: TF_CONFIG (valid configs and every malformed case), ClusterSpec, host:port
// parsing, the explicit resolver and GPU pinning. SLURM/OpenMPI are in launcher_env_test.cc, the
// TF_CONFIG fuzz corpus in tf_config_fuzz_test.cc.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"

namespace dtrain {
namespace {

constexpr const char* kFull =
    R"({"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
        "ps": ["host3:2222", "host4:2222"], "evaluator": ["host5:2222"]},
        "task": {"type": "%TYPE%", "index": %INDEX%}})";

std::string full_config(const std::string& type, int index) {
  std::string s = kFull;
  s.replace(s.find("%TYPE%"), 6, type);
  s.replace(s.find("%INDEX%"), 7, std::to_string(index));
  return s;
}

// A TF_CONFIG whose cluster is `cluster` (a JSON fragment) and whose task is `task`.
std::string config(const std::string& cluster, const std::string& task) {
  return R"({"cluster": )" + cluster + R"(, "task": )" + task + "}";
}
const std::string kWorkers = R"({"worker": ["host1:2222", "host2:2222"]})";
const std::string kWorker0 = R"({"type": "worker", "index": 0})";

// Resolving `tf_config` throws InvalidArgument whose message has every needle and an example.
void expect_rejected(const std::string& tf_config, std::initializer_list<std::string> needles) {
  SCOPED_TRACE("TF_CONFIG: " + tf_config);
  try {
    resolve_tf_config(tf_config);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << n << " in " << msg;
    EXPECT_NE(msg.find(R"(A valid TF_CONFIG: TF_CONFIG='{"cluster": {"chief": ["host0:2222"])"),
              std::string::npos)
        << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something else: " << e.what();
  }
}

// --- valid TF_CONFIG --------------------------------------------------------------------------

TEST(TfConfig, ChiefWorkersPsAndEvaluator) {
  const auto chief = resolve_tf_config(full_config("chief", 0));
  EXPECT_EQ(chief.task_type(), TaskType::kChief);
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.worker_rank(), 0);
  EXPECT_EQ(chief.num_workers(), 3);
  EXPECT_EQ(chief.rendezvous_address(), "host0:2222");
  EXPECT_EQ(chief.task_address(), "host0:2222");
  EXPECT_EQ(chief.replica_ids(2), (std::vector<int>{0, 1}));
  EXPECT_EQ(chief.source(), "TF_CONFIG");

  const auto w1 = resolve_tf_config(full_config("worker", 1));
  EXPECT_FALSE(w1.is_chief());
  EXPECT_TRUE(w1.is_training_worker());
  EXPECT_EQ(w1.task_name(), "worker:1");
  EXPECT_EQ(w1.worker_rank(), 2);  // the chief is rank 0, then worker 0, worker 1
  EXPECT_EQ(w1.num_workers(), 3);
  EXPECT_EQ(w1.rendezvous_address(), "host0:2222");
  EXPECT_EQ(w1.task_address(), "host2:2222");
  EXPECT_EQ(w1.replica_ids(2), (std::vector<int>{4, 5}));
  EXPECT_EQ(w1.replica_ids(1), (std::vector<int>{2}));
  EXPECT_EQ(w1.num_replicas_in_sync(4), 12);
  EXPECT_EQ(w1.local_rank(), 0);
  EXPECT_EQ(w1.local_size(), 1);
  EXPECT_EQ(w1.cluster().num_tasks(TaskType::kPs), 2);

  const auto w0 = resolve_tf_config(full_config("worker", 0));
  EXPECT_FALSE(w0.is_chief());  // there is a chief job, so worker 0 is not chief
  EXPECT_EQ(w0.worker_rank(), 1);

  const auto ps = resolve_tf_config(full_config("ps", 1));
  EXPECT_FALSE(ps.is_chief());
  EXPECT_FALSE(ps.is_training_worker());
  EXPECT_EQ(ps.worker_rank(), -1);
  EXPECT_EQ(ps.num_workers(), 3);
  EXPECT_EQ(ps.rendezvous_address(), "host0:2222");
  EXPECT_EQ(ps.task_address(), "host4:2222");
  EXPECT_THROW(ps.replica_ids(1), FailedPrecondition);

  const auto ev = resolve_tf_config(full_config("evaluator", 0));
  EXPECT_FALSE(ev.is_chief());
  EXPECT_EQ(ev.worker_rank(), -1);
  EXPECT_EQ(ev.task_address(), "host5:2222");
  EXPECT_THROW(ev.replica_ids(1), FailedPrecondition);
  EXPECT_THROW(w1.replica_ids(0), InvalidArgument);
  EXPECT_THROW(w1.num_replicas_in_sync(0), InvalidArgument);
}

TEST(TfConfig, WorkersOnlyMakeWorkerZeroChief) {
  const std::string cluster = R"({"worker": ["a:1000", "b:1000", "c:1000"]})";
  for (int i = 0; i < 3; ++i) {
    const auto r = resolve_tf_config(
        config(cluster, R"({"type": "worker", "index": )" + std::to_string(i) + "}"));
    EXPECT_EQ(r.is_chief(), i == 0);
    EXPECT_EQ(r.worker_rank(), i);
    EXPECT_EQ(r.num_workers(), 3);
    EXPECT_EQ(r.rendezvous_address(), "a:1000");
    EXPECT_EQ(r.replica_ids(3), (std::vector<int>{3 * i, 3 * i + 1, 3 * i + 2}));
  }
}

TEST(TfConfig, EvaluatorMayBeAbsentFromTheCluster) {
  const auto r = resolve_tf_config(config(kWorkers, R"({"type": "evaluator", "index": 0})"));
  EXPECT_EQ(r.task_type(), TaskType::kEvaluator);
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.task_address(), "");
  EXPECT_EQ(r.num_workers(), 2);
  EXPECT_EQ(r.rendezvous_address(), "host1:2222");
}

TEST(TfConfig, ExtraKeysIpv6AndLocalPlacement) {
  // "environment" and "rpc_layer" are ignored as TF does; tasks on one host share a machine.
  const auto r = resolve_tf_config(
      R"({"cluster": {"worker": ["localhost:5000", "[::1]:5001", "localhost:5002", "h:1"]},
          "task": {"type": "worker", "index": 2}, "environment": "cloud", "rpc_layer": "grpc"})");
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_EQ(r.local_size(), 2);
  EXPECT_EQ(resolve_tf_config(config(R"({"worker": ["[::1]:5001", "[fe80::1%eth0]:2"]})", kWorker0))
                .task_address(),
            "[::1]:5001");
  EXPECT_NE(r.to_string().find("worker:2 (rank 2 of 4"), std::string::npos) << r.to_string();
}

TEST(TfConfig, MakeTfConfigRoundTrips) {
  const ClusterSpec spec({{TaskType::kChief, {"h0:1"}}, {TaskType::kWorker, {"h1:1", "h2:1"}}});
  const std::string text = make_tf_config(spec, TaskType::kWorker, 1);
  EXPECT_EQ(text, R"({"cluster":{"chief":["h0:1"],"worker":["h1:1","h2:1"]},)"
                  R"("task":{"type":"worker","index":1}})");
  const auto r = resolve_tf_config(text);
  EXPECT_EQ(r.cluster(), spec);
  EXPECT_EQ(r.worker_rank(), 2);
  EXPECT_THROW(make_tf_config(spec, TaskType::kWorker, 2), InvalidArgument);
  EXPECT_THROW(make_tf_config(spec, TaskType::kPs, 0), InvalidArgument);
}

// --- malformed TF_CONFIG: each case quotes the offending part ---------------------------------

TEST(TfConfigRejects, NotJson) {
  expect_rejected("", {"is empty", "unset it"});
  expect_rejected("worker:0", {"is not valid JSON", "byte 1", R"("worker:0")"});
  expect_rejected(R"({"cluster": {"worker": ["a:1"]}, "task": )",
                  {"is not valid JSON", "(the text ends there)"});
  expect_rejected(R"({"cluster": {"worker": ['a:1']}})", {"is not valid JSON", "'a:1'"});
}

TEST(TfConfigRejects, NotAnObject) {
  expect_rejected(R"(["a:1"])", {"must be a JSON object", R"(array ["a:1"])"});
  expect_rejected("42", {"must be a JSON object", "number 42"});
}

TEST(TfConfigRejects, ClusterMissingOrNotAnObject) {
  expect_rejected(R"({"task": {"type": "worker", "index": 0}})",
                  {"has no \"cluster\"", R"(its keys are ["task"])"});
  expect_rejected(config(R"(["a:1"])", kWorker0),
                  {"\"cluster\" must be an object", R"(array ["a:1"])"});
  expect_rejected(config(R"("a:1")", kWorker0), {"\"cluster\" must be an object", R"("a:1")"});
}

TEST(TfConfigRejects, TaskMissingOrNotAnObject) {
  expect_rejected(R"({"cluster": {"worker": ["a:1"]}})", {"has no \"task\"", "[\"cluster\"]"});
  expect_rejected(config(kWorkers, R"("worker")"), {"\"task\" must be an object", "\"worker\""});
}

TEST(TfConfigRejects, TaskType) {
  expect_rejected(config(kWorkers, R"({"index": 0})"), {"has no \"type\"", R"({"index": 0})"});
  expect_rejected(config(kWorkers, R"({"type": "master", "index": 0})"),
                  {R"("master" is not a task type)", R"("chief", "worker", "ps" or "evaluator")"});
  expect_rejected(config(kWorkers, R"({"type": "Worker", "index": 0})"),
                  {R"("Worker" is not a task type)", "lower-case"});
  expect_rejected(config(kWorkers, R"({"type": 1, "index": 0})"), {"must be a string", "number 1"});
}

TEST(TfConfigRejects, TaskIndex) {
  expect_rejected(config(kWorkers, R"({"type": "worker"})"), {"has no \"index\""});
  expect_rejected(config(kWorkers, R"({"type": "worker", "index": -1})"), {"-1 is negative"});
  expect_rejected(config(kWorkers, R"({"type": "worker", "index": 1.5})"),
                  {"non-negative integer", "1.5"});
  expect_rejected(config(kWorkers, R"({"type": "worker", "index": "1"})"),
                  {R"(is the string "1")", "without quotes"});
  expect_rejected(config(kWorkers, R"({"type": "worker", "index": true})"),
                  {"non-negative integer", "boolean true"});
  expect_rejected(config(kWorkers, R"({"type": "worker", "index": 2})"),
                  {"2 is out of range", R"(job "worker" has 2 tasks)", "0..1"});
  expect_rejected(full_config("chief", 1), {"1 is out of range", "has 1 task,", "0..0"});
  expect_rejected(config(kWorkers, R"({"type": "evaluator", "index": 99999999999})"),
                  {"99999999999 is too large"});
  // An evaluator outside the cluster is evaluator:0, the only one a job has.
  expect_rejected(config(kWorkers, R"({"type": "evaluator", "index": 7})"),
                  {"7 is out of range", "evaluator:0", R"("index": 0)"});
}

TEST(TfConfigRejects, UnknownJob) {
  expect_rejected(config(R"({"worker": ["a:1"], "master": ["b:1"]})", kWorker0),
                  {R"(unknown job "master")"});
  expect_rejected(config(R"({"Chief": ["b:1"], "worker": ["a:1"]})", kWorker0),
                  {R"(unknown job "Chief")", "lower-case"});
}

TEST(TfConfigRejects, JobNotAListOfStrings) {
  expect_rejected(config(R"({"worker": "a:1"})", kWorker0),
                  {R"(job "worker" must be a list)", R"(string "a:1")"});
  expect_rejected(config(R"({"worker": {"0": "a:1"}})", kWorker0),
                  {R"(job "worker" must be a list)", R"(object {"0": "a:1"})"});
  expect_rejected(config(R"({"worker": ["a:1", 2222]})", kWorker0),
                  {R"(job "worker" task 1 is number 2222)", "not a \"host:port\" string"});
}

TEST(TfConfigRejects, BadHostPort) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {":2222", "has an empty host"},
      {"host1", "has no port"},
      {"host1:", "has no port after ':'"},
      {"host1:0", "port 0, outside 1-65535"},
      {"host1:65536", "port 65536, outside 1-65535"},
      {"host1:99999999999999999999", "outside 1-65535"},
      {"host1:22a", R"(port "22a" that is not a number)"},
      {"host1:-1", R"(port "-1" that is not a number)"},
      {"host1 :2222", "contains whitespace"},
      {" host1:2222", "contains whitespace"},
      {"grpc://host1:2222", "has a scheme"},
      {"::1:2222", "put the host in brackets"},
      {"[::1]", "has no port"},
      {"[::1:2222", "unclosed '['"},
      {"[host1]:2222", "not an IPv6 address"},
      {"[]:2222", "empty host"},
      {"host/1:2222", "in its host"},
      {"-host:2222", "starts with '-'"},
      {"", "\"\" is empty"},
  };
  for (const auto& [address, why] : cases)
    expect_rejected(config(R"({"worker": ["ok:1", ")" + address + R"("]})", kWorker0),
                    {"task worker:1", "\"" + address + "\"", why});
}

TEST(TfConfigRejects, DuplicateAddress) {
  expect_rejected(config(R"({"worker": ["a:1", "b:1", "a:1"]})", kWorker0),
                  {R"(address "a:1" of task worker:2 is also used by task worker:0)"});
  expect_rejected(config(R"({"chief": ["A:1"], "ps": ["a:01"], "worker": ["b:1"]})", kWorker0),
                  {R"(address "a:01" of task ps:0 is also used by task chief:0)"});
}

TEST(TfConfigRejects, MoreThanOneChiefOrEvaluator) {
  expect_rejected(config(R"({"chief": ["a:1", "b:1"], "worker": ["c:1"]})", kWorker0),
                  {R"(job "chief" has 2 tasks ["a:1", "b:1"])", "at most one chief"});
  expect_rejected(config(R"({"worker": ["c:1"], "evaluator": ["a:1", "b:1"]})", kWorker0),
                  {R"(job "evaluator" has 2 tasks)", "at most one evaluator"});
}

TEST(TfConfigRejects, TaskTypeNotInCluster) {
  expect_rejected(config(kWorkers, R"({"type": "ps", "index": 0})"),
                  {R"("ps" is not a job of "cluster")", R"({"worker": ["host1:2222")"});
  expect_rejected(config(kWorkers, R"({"type": "chief", "index": 0})"),
                  {R"("chief" is not a job of "cluster")"});
}

TEST(TfConfigRejects, EmptyClusterOrNoWorkers) {
  expect_rejected(config("{}", kWorker0), {"the cluster is empty"});
  expect_rejected(config(R"({"worker": []})", kWorker0), {"the cluster is empty"});
  expect_rejected(config(R"({"ps": ["a:1"]})", R"({"type": "ps", "index": 0})"),
                  {R"(no "chief" or "worker" job)"});
}

TEST(TfConfigRejects, HostileInputsStayShort) {
  // Deep nesting and huge strings: rejected, and the message stays readable.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_rejected(config(deep, kWorker0), {"\"cluster\" must be an object", "..."});
  const std::string big(200000, 'x');
  try {
    resolve_tf_config(config(R"({"worker": [")" + big + R"("]})", kWorker0));
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_LT(std::string(e.what()).size(), 1000u);
    EXPECT_NE(std::string(e.what()).find("(200000 bytes)"), std::string::npos);
  }
}

// --- ClusterSpec and addresses -----------------------------------------------------------------

TEST(ClusterSpec, AccessorsAndJson) {
  const ClusterSpec spec({{TaskType::kPs, {"p:1"}},
                          {TaskType::kWorker, {"w0:1", "w1:1"}},
                          {TaskType::kEvaluator, {}},
                          {TaskType::kChief, {"c:1"}}});
  EXPECT_EQ(spec.jobs(),
            (std::vector<TaskType>{TaskType::kChief, TaskType::kWorker, TaskType::kPs}));
  EXPECT_FALSE(spec.has_job(TaskType::kEvaluator));  // empty jobs are dropped
  EXPECT_EQ(spec.num_tasks(TaskType::kWorker), 2);
  EXPECT_EQ(spec.num_tasks(TaskType::kEvaluator), 0);
  EXPECT_EQ(spec.task_address(TaskType::kWorker, 1), "w1:1");
  EXPECT_EQ(spec.num_training_workers(), 3);
  EXPECT_EQ(spec.all_addresses(), (std::vector<std::string>{"c:1", "w0:1", "w1:1", "p:1"}));
  EXPECT_EQ(spec.to_json(), R"({"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]})");
  EXPECT_THROW(spec.task_address(TaskType::kWorker, 2), InvalidArgument);
  EXPECT_THROW(spec.task_address(TaskType::kEvaluator, 0), InvalidArgument);
  EXPECT_TRUE(ClusterSpec().empty());
  EXPECT_EQ(ClusterSpec().to_json(), "{}");
  EXPECT_THROW(ClusterSpec({{TaskType::kWorker, {"a:1", "a:1"}}}), InvalidArgument);
  EXPECT_THROW(ClusterSpec(ClusterSpec::JobMap{{TaskType::kWorker, {}}}), InvalidArgument);
  EXPECT_EQ(task_type_from_name("evaluator"), TaskType::kEvaluator);
  EXPECT_EQ(task_type_from_name("Worker"), std::nullopt);
  EXPECT_STREQ(task_type_name(TaskType::kPs), "ps");
}

TEST(ClusterSpec, ParseHostPort) {
  auto hp = parse_host_port("[::1]:2222");
  EXPECT_EQ(hp.host, "::1");
  EXPECT_EQ(hp.port, 2222);
  EXPECT_EQ(hp.to_string(), "[::1]:2222");
  hp = parse_host_port("10.0.0.1:65535");
  EXPECT_EQ(hp.host, "10.0.0.1");
  EXPECT_EQ(hp.port, 65535);
  EXPECT_EQ(parse_host_port("node-01.cluster_a:1").to_string(), "node-01.cluster_a:1");
  try {
    parse_host_port("host:x");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(R"("host:x")"), std::string::npos);
  }
}

// --- explicit resolver and GPU pinning ---------------------------------------------------------

TEST(ExplicitCluster, RanksAndErrors) {
  const auto r = explicit_cluster({"a:1", "b:1", "c:1"}, 2);
  EXPECT_EQ(r.worker_rank(), 2);
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.num_workers(), 3);
  EXPECT_EQ(r.rendezvous_address(), "a:1");
  EXPECT_EQ(r.task_address(), "c:1");
  EXPECT_EQ(r.source(), "explicit");
  EXPECT_TRUE(explicit_cluster({"a:1"}, 0).is_chief());
  EXPECT_THROW(explicit_cluster({"a:1", "b:1"}, 2), InvalidArgument);
  EXPECT_THROW(explicit_cluster({"a:1", "b:1"}, -1), InvalidArgument);
  EXPECT_THROW(explicit_cluster({}, 0), InvalidArgument);
  EXPECT_THROW(explicit_cluster({"a:1", "a:1"}, 0), InvalidArgument);
  EXPECT_THROW(explicit_cluster({"a"}, 0), InvalidArgument);
}

TEST(ClusterResolution, FromRanksAndLocalPlacement) {
  auto r = ClusterResolution::from_ranks(1, 4, "n0:5000", "test");
  EXPECT_FALSE(r.has_addresses());
  EXPECT_EQ(r.task_address(), "");
  EXPECT_EQ(r.replica_ids(2), (std::vector<int>{2, 3}));
  r.set_local_placement(1, 2);
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_EQ(r.local_size(), 2);
  EXPECT_THROW(r.set_local_placement(2, 2), InvalidArgument);
  EXPECT_THROW(ClusterResolution::from_ranks(4, 4, "n0:5000"), InvalidArgument);
  EXPECT_THROW(ClusterResolution::from_ranks(0, 1, "n0"), InvalidArgument);
  EXPECT_THROW(ClusterResolution(ClusterSpec(), TaskType::kWorker, 0), InvalidArgument);
}

TEST(GpusForLocalRank, RoundRobin) {
  EXPECT_EQ(gpus_for_local_rank(0, 2, 2), (std::vector<int>{0}));
  EXPECT_EQ(gpus_for_local_rank(1, 2, 2), (std::vector<int>{1}));
  EXPECT_EQ(gpus_for_local_rank(1, 2, 4), (std::vector<int>{1, 3}));
  EXPECT_EQ(gpus_for_local_rank(0, 1, 3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(gpus_for_local_rank(1, 2, 3), (std::vector<int>{1}));  // GPU 2 idle, logged
  try {
    gpus_for_local_rank(2, 3, 2);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("3 tasks on this machine share 2 GPU(s)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--ntasks-per-node=2"), std::string::npos) << msg;
  }
  EXPECT_THROW(gpus_for_local_rank(0, 1, 0), InvalidArgument);
  EXPECT_THROW(gpus_for_local_rank(2, 2, 4), InvalidArgument);
  EXPECT_THROW(gpus_for_local_rank(-1, 2, 4), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
