// Resolvers that read launcher variables: SLURM (srun), OpenMPI (mpirun) and TF_CONFIG through
// from_environment(). Each test starts from an environment with none of those variables (the test
// may itself run under SLURM) and restores the original one afterwards.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"

namespace dtrain {
namespace {

constexpr const char* kVars[] = {"TF_CONFIG",
                                 "SLURM_PROCID",
                                 "SLURM_STEP_NUM_TASKS",
                                 "SLURM_NTASKS",
                                 "SLURM_STEP_NODELIST",
                                 "SLURM_JOB_NODELIST",
                                 "SLURM_NODELIST",
                                 "SLURM_STEP_TASKS_PER_NODE",
                                 "SLURM_TASKS_PER_NODE",
                                 "SLURM_LOCALID",
                                 "SLURM_DISTRIBUTION",
                                 "OMPI_COMM_WORLD_RANK",
                                 "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK",
                                 "OMPI_COMM_WORLD_LOCAL_SIZE"};

class LauncherEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kVars) unsetenv(v);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  static void set(const std::map<std::string, std::string>& vars) {
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  // Runs `f`, expecting exception E whose message contains `needle`.
  template <typename E, typename F>
  static void expect_error(F f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no exception; expected " << needle;
    } catch (const E& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "wrong exception: " << e.what();
    }
  }

 private:
  std::map<std::string, std::string> saved_;
};

// --- SLURM node lists and tasks per node --------------------------------------------------------

TEST(SlurmNodelist, Expands) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07]"),
            (V{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_slurm_nodelist("a[1-2],b3"), (V{"a1", "a2", "b3"}));
  EXPECT_EQ(expand_slurm_nodelist("host"), (V{"host"}));
  EXPECT_EQ(expand_slurm_nodelist("x[8-10]"), (V{"x8", "x9", "x10"}));
  EXPECT_EQ(expand_slurm_nodelist("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_slurm_nodelist("r[1-2]n[1-2],login.x"),
            (V{"r1n1", "r1n2", "r2n1", "r2n2", "login.x"}));
  EXPECT_EQ(expand_slurm_nodelist("gpu[3]-ib"), (V{"gpu3-ib"}));
}

TEST(SlurmNodelist, RejectsMalformedLists) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"node[01-", "never closed"},
      {"node]", "has no '['"},
      {"a[[1]]", "nest"},
      {"a[3-1]", "goes down"},
      {"a[x]", "is not a number"},
      {"a,,b", "empty host name"},
      {"", "it is empty"},
      {"a b", "has the character"},
      {"a[]", "is not a number"},
      {"a[1,]", "is not a number"},
      {"a[1-2000000]", "more than 1048576 hosts"},
      {"a[-2]", "is not a number"}};
  for (const auto& [list, why] : cases) {
    SCOPED_TRACE(list);
    try {
      expand_slurm_nodelist(list);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
      EXPECT_NE(msg.find("\"" + list + "\""), std::string::npos) << msg;
      EXPECT_NE(msg.find("node[01-04,07]"), std::string::npos) << msg;
    }
  }
}

TEST(SlurmTasksPerNode, Parses) {
  EXPECT_EQ(parse_slurm_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(parse_slurm_tasks_per_node("4"), (std::vector<int>{4}));
  EXPECT_EQ(parse_slurm_tasks_per_node("1(x2),3,2(x1)"), (std::vector<int>{1, 1, 3, 2}));
  for (const char* bad :
       {"", "0", "2(x0)", "2(3)", "a", "2(x3", "2,", "-1", "+2", "2(x+1)", "2(x3)(x2)", "(x2)"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(parse_slurm_tasks_per_node(bad), InvalidArgument);
  }
}

// --- SLURM environment --------------------------------------------------------------------------

TEST_F(LauncherEnv, SlurmBlockDistribution) {
  set({{"SLURM_PROCID", "3"},
       {"SLURM_STEP_NUM_TASKS", "4"},
       {"SLURM_STEP_NODELIST", "node[01-02]"},
       {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
       {"SLURM_LOCALID", "1"}});
  const auto r = resolve_slurm();
  EXPECT_EQ(r.task_name(), "worker:3");
  EXPECT_EQ(r.task_address(), "node02:23457");
  EXPECT_EQ(r.rendezvous_address(), "node01:23456");
  EXPECT_EQ(r.num_workers(), 4);
  EXPECT_EQ(r.worker_rank(), 3);
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_EQ(r.local_size(), 2);
  EXPECT_EQ(r.replica_ids(2), (std::vector<int>{6, 7}));
  EXPECT_EQ(r.source(), "SLURM");
  EXPECT_EQ(
      r.cluster().job_tasks(TaskType::kWorker),
      (std::vector<std::string>{"node01:23456", "node01:23457", "node02:23456", "node02:23457"}));
  set({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
  const auto chief = resolve_slurm(3000);
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.task_address(), "node01:3000");
}

TEST_F(LauncherEnv, SlurmUnevenNodesAndJobFallbacks) {
  // Job-level variables when the step ones are absent; "2,1" places tasks 0,1 | 2.
  set({{"SLURM_PROCID", "2"},
       {"SLURM_NTASKS", "3"},
       {"SLURM_JOB_NODELIST", "a[1-2]"},
       {"SLURM_TASKS_PER_NODE", "2,1"}});
  const auto r = resolve_slurm();
  EXPECT_EQ(r.task_address(), "a2:23456");
  EXPECT_EQ(r.local_rank(), 0);
  EXPECT_EQ(r.local_size(), 1);
  // No tasks-per-node at all: an even split.
  unsetenv("SLURM_TASKS_PER_NODE");
  set({{"SLURM_NTASKS", "4"}, {"SLURM_PROCID", "1"}});
  EXPECT_EQ(resolve_slurm().task_address(), "a1:23457");
  set({{"SLURM_NTASKS", "3"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, "do not split evenly");
}

TEST_F(LauncherEnv, SlurmCyclicDistribution) {
  set({{"SLURM_PROCID", "1"},
       {"SLURM_STEP_NUM_TASKS", "3"},
       {"SLURM_STEP_NODELIST", "n[1-2]"},
       {"SLURM_STEP_TASKS_PER_NODE", "2,1"},
       {"SLURM_DISTRIBUTION", "cyclic:block"},
       {"SLURM_LOCALID", "0"}});
  const auto r = resolve_slurm();
  EXPECT_EQ(r.task_address(), "n2:23456");
  EXPECT_EQ(r.cluster().job_tasks(TaskType::kWorker),
            (std::vector<std::string>{"n1:23456", "n2:23456", "n1:23457"}));
  set({{"SLURM_DISTRIBUTION", "plane=2"}});
  expect_error<Unimplemented>([] { resolve_slurm(); }, R"("plane=2")");
}

TEST_F(LauncherEnv, SlurmErrors) {
  expect_error<FailedPrecondition>([] { resolve_slurm(); }, "SLURM_PROCID is unset");
  set({{"SLURM_PROCID", "x1"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, R"(SLURM_PROCID="x1")");
  set({{"SLURM_PROCID", "4"}});
  expect_error<FailedPrecondition>([] { resolve_slurm(); }, "SLURM_NTASKS");
  set({{"SLURM_STEP_NUM_TASKS", "4"}});
  expect_error<FailedPrecondition>([] { resolve_slurm(); }, "SLURM_STEP_NODELIST");
  set({{"SLURM_STEP_NODELIST", "node[01-"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, R"(SLURM_STEP_NODELIST="node[01-")");
  set({{"SLURM_STEP_NODELIST", "node[01-02]"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x3)"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, "gives 3 node(s)");
  set({{"SLURM_STEP_TASKS_PER_NODE", "2,1"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, "adds up to 3");
  set({{"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, "SLURM_PROCID=4 is not below");
  set({{"SLURM_PROCID", "1"}, {"SLURM_LOCALID", "0"}});
  expect_error<FailedPrecondition>([] { resolve_slurm(); }, "SLURM_LOCALID=0 but task 1");
  set({{"SLURM_LOCALID", "1"}});
  expect_error<InvalidArgument>([] { resolve_slurm(65535); }, "port base 65535");
  EXPECT_EQ(resolve_slurm(65534).task_address(), "node01:65535");
  set({{"SLURM_STEP_NODELIST", "a,a"}});
  expect_error<InvalidArgument>([] { resolve_slurm(); }, "also used by task");
}

// --- OpenMPI ------------------------------------------------------------------------------------

TEST_F(LauncherEnv, OpenMpi) {
  expect_error<FailedPrecondition>([] { resolve_openmpi("n0:5000"); },
                                   "OMPI_COMM_WORLD_RANK is unset");
  set({{"OMPI_COMM_WORLD_RANK", "1"},
       {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  const auto r = resolve_openmpi("n0:5000");
  EXPECT_EQ(r.task_name(), "worker:1");
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.num_workers(), 4);
  EXPECT_EQ(r.worker_rank(), 1);
  EXPECT_EQ(r.rendezvous_address(), "n0:5000");
  EXPECT_FALSE(r.has_addresses());
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_EQ(r.local_size(), 2);
  EXPECT_EQ(r.replica_ids(2), (std::vector<int>{2, 3}));
  EXPECT_EQ(r.source(), "OpenMPI");
  expect_error<InvalidArgument>([] { resolve_openmpi(""); }, "no rendezvous address");
  expect_error<InvalidArgument>([] { resolve_openmpi("n0"); }, R"("n0" has no port)");
  set({{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}});
  expect_error<InvalidArgument>([] { resolve_openmpi("n0:5000"); }, "inconsistent");
  set({{"OMPI_COMM_WORLD_RANK", "one"}});
  expect_error<InvalidArgument>([] { resolve_openmpi("n0:5000"); }, R"("one")");
  set({{"OMPI_COMM_WORLD_RANK", "4"}});
  expect_error<InvalidArgument>([] { resolve_openmpi("n0:5000"); }, "is not below");
  set({{"OMPI_COMM_WORLD_RANK", "0"}});
  unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const auto chief = resolve_openmpi("[::1]:5000");  // local placement unset: 0 of 1, logged
  EXPECT_TRUE(chief.is_chief());
  EXPECT_EQ(chief.task_address(), "[::1]:5000");
  EXPECT_EQ(chief.local_size(), 1);
}

// --- TF_CONFIG from the environment -------------------------------------------------------------

TEST_F(LauncherEnv, TfConfigFromEnvironment) {
  EXPECT_FALSE(from_environment().has_value());
  set({{"TF_CONFIG", "  "}});
  EXPECT_FALSE(from_environment().has_value());
  set({{"TF_CONFIG",
        R"({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})"}});
  const auto r = from_environment();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->worker_rank(), 1);
  set({{"TF_CONFIG", "{not json"}});
  expect_error<InvalidArgument>([] { from_environment(); }, "is not valid JSON");
}

}  // namespace
}  // namespace dtrain
