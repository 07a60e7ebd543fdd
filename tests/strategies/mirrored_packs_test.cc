// A step that fails while the gradient packs its backward pass launched are still queued on the
// replicas' communication threads (MirroredOptions::overlap_backward): the failed step remakes the
// group, and no pack of the failed step may reach the new one. Found by the ResNet-50 fault test
// (synthetic_benchmark_faults): a pack that ran after the group was remade took the new group's
// communicator, or the old one while it was freed, and the surviving worker hung or crashed
// instead of reporting its dead peer.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/initializers.h"
#include "dtrain/strategies/mirrored_strategy.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using V = std::vector<Tensor>;

// Every communicator the strategy builds belongs to a generation: the group made at construction
// is 1, the one remade after a failed step 2. Each all-reduce is logged with its generation after
// a pause, so that the packs of a backward pass are still queued when a replica fails.
struct Log {
  std::mutex mu;
  std::vector<int> generations;  // of each all-reduce, in the order they were issued
  std::atomic<int> made{0};      // communicators made
  std::atomic<bool> open{true};  // false: all-reduces wait before they are logged
  std::vector<int> snapshot() {
    std::lock_guard<std::mutex> lock(mu);
    return generations;
  }
};

class Logged final : public Communicator {
 public:
  Logged(std::unique_ptr<Communicator> c, Log* log, int generation)
      : inner_(std::move(c)), log_(log), generation_(generation) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Work allreduce(Tensor& t, ReduceOp op) override {
    while (!log_->open) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    {
      std::lock_guard<std::mutex> lock(log_->mu);
      log_->generations.push_back(generation_);
    }
    return inner_->allreduce(t, op);
  }
  Work allgather(const Tensor& in, Tensor& out) override { return inner_->allgather(in, out); }
  Work broadcast(Tensor& t, int root) override { return inner_->broadcast(t, root); }
  Work reduce(Tensor& t, int root, ReduceOp op) override { return inner_->reduce(t, root, op); }
  Work reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    return inner_->reduce_scatter(in, out, op);
  }
  Work barrier() override { return inner_->barrier(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<Communicator> inner_;
  Log* log_;
  int generation_;
};

// Rank 0 of a job of two workers whose other worker is not there: the cross-worker steps are the
// identity, and the strategy's communicators are Logged.
class Generations final : public CrossWorkerOps {
 public:
  Generations(int local_replicas, Log* log) : local_(local_replicas), log_(log) {}
  int num_workers() const override { return 2; }
  int worker_rank() const override { return 0; }
  void all_reduce_sum(Tensor&) override {}
  void broadcast_from_chief(Tensor&) override {}
  std::unique_ptr<Communicator> span_workers(std::unique_ptr<Communicator> local, int) override {
    return std::make_unique<Logged>(std::move(local), log_, log_->made++ / local_ + 1);
  }

 private:
  int local_;
  Log* log_;
};

class Job final : public MirroredStrategy {
 public:
  Job(MirroredOptions o, StrategyExtended parts)
      : MirroredStrategy(std::move(o), std::move(parts)) {}
  using MirroredStrategy::reassemble;
};

constexpr int kReplicas = 2, kVariables = 24;

// Two replicas of rank 0 of a two-worker job, one gradient pack per gradient (24 all-reduces a
// replica, 5 ms each), and 24 variables.
struct TwoReplicas {
  explicit TwoReplicas(Log* log) {
    configure_devices({4, 1});  // as the other tests of this binary
    MirroredOptions o;
    for (int i = 0; i < kReplicas; ++i) o.devices.push_back(DeviceSpec::cpu(i));
    o.bytes_per_pack = 1;
    s = std::make_unique<Job>(o, parts(log));
    auto scope = s->scope();
    for (int i = 0; i < kVariables; ++i)
      vars.push_back(
          create_variable(VariableSpec{std::string(1, static_cast<char>('a' + i)), Shape{256},
                                       DType::kFloat32, initializers::constant(1.f)}));
  }
  static StrategyExtended parts(Log* log) {
    return StrategyExtended(resolve_tf_config(R"({"cluster":{"worker":["127.0.0.1:20000",)"
                                              R"("127.0.0.1:20001"]},"task":{"type":"worker",)"
                                              R"("index":0}})"),
                            std::make_shared<Generations>(kReplicas, log), nullptr);
  }
  // The backward pass of the sum of every variable: its packs are launched as the gradients come.
  void backward() const {
    GradientTape tape;
    Tensor loss = ops::sum(vars[0]->value());
    for (size_t i = 1; i < vars.size(); ++i) loss = ops::add(loss, ops::sum(vars[i]->value()));
    tape.gradient(loss, vars);
  }
  std::unique_ptr<Job> s;
  std::vector<std::shared_ptr<Variable>> vars;
};

TEST(MirroredPacks, AFailedStepsQueuedPacksNeverReachTheRemadeGroup) {
  Log log;
  TwoReplicas job(&log);
  Job& s = *job.s;
  ASSERT_EQ(log.made.load(), kReplicas);
  try {
    s.run([&](ReplicaContext&, const V&) -> V {
      job.backward();
      throw InvalidArgument("bad batch");  // before any pack was waited for
    });
    FAIL() << "the step's error was lost";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bad batch"), std::string::npos) << e.what();
  }
  EXPECT_EQ(log.made.load(), 2 * kReplicas) << "the failed step's group was not remade";
  // Every queued pack has run (against the aborted group) before run() returned: none runs later,
  // and none ran in the new group.
  const std::vector<int> at_return = log.snapshot();
  EXPECT_EQ(std::count(at_return.begin(), at_return.end(), 1), kReplicas * kVariables);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(log.snapshot(), at_return) << "packs of the failed step ran after run() returned";
  // The new group works, and carries only what this step issues.
  PerReplica out = s.run([](ReplicaContext& ctx, const V&) -> V {
    return ctx.all_reduce(ReduceOp::kSum, {Tensor::full(Shape{3}, 1.f, ctx.device())});
  });
  for (const auto& v : out.values) EXPECT_EQ(v[0].to_vector<float>(), std::vector<float>(3, 2.f));
  const std::vector<int> after = log.snapshot();
  ASSERT_EQ(after.size(), at_return.size() + kReplicas);
  for (size_t i = at_return.size(); i < after.size(); ++i) EXPECT_EQ(after[i], 2);
}

// A step that leaves its packs unconsumed (gradients computed, never applied), and the strategy
// destroyed at once: the packs still queued run first, while the replica contexts and
// communicators they use are alive (under tools/sanitize.sh address, a use after free otherwise).
TEST(MirroredPacks, DestroyingTheStrategyRunsThePacksStillQueuedFirst) {
  Log log;
  {
    TwoReplicas job(&log);
    log.open = false;  // every pack stays queued until the strategy is being destroyed
    job.s->run([&](ReplicaContext&, const V&) -> V {
      job.backward();
      return {};
    });
    EXPECT_TRUE(log.snapshot().empty());
    log.open = true;
  }
  EXPECT_EQ(log.snapshot(), std::vector<int>(kReplicas * kVariables, 1));
}

// A reassemble() whose connect fails leaves the strategy without communicators: a step then says
// so (it indexed an empty vector before), and a later reassemble() makes the strategy usable again.
TEST(MirroredPacks, AStepAfterAFailedReassembleSaysSoAndALaterOneRecovers) {
  Log log;
  TwoReplicas job(&log);
  EXPECT_THROW(
      job.s->reassemble([]() -> StrategyExtended { throw Unavailable("worker:1 is unreachable"); }),
      Unavailable);
  auto sum_of_ones = [](ReplicaContext& ctx, const V&) -> V {
    return ctx.all_reduce(ReduceOp::kSum, {Tensor::full(Shape{3}, 1.f, ctx.device())});
  };
  try {
    job.s->run(sum_of_ones);
    FAIL() << "a strategy without communicators ran a step";
  } catch (const FailedPrecondition& e) {
    EXPECT_NE(std::string(e.what()).find("reassemble() failed"), std::string::npos) << e.what();
  }
  job.s->reassemble([&] { return TwoReplicas::parts(&log); });
  PerReplica out = job.s->run(sum_of_ones);
  for (const auto& v : out.values) EXPECT_EQ(v[0].to_vector<float>(), std::vector<float>(3, 2.f));
}

}  // namespace
}  // namespace dtrain
