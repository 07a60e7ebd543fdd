// The asynchronous face of every collective backend: a FIFO of collectives run by one communication
// thread. Collectives complete strictly in issue order, so a Work is just (tracker, id) and "done"
// is "the completed count has passed id": nothing is allocated per collective but its queue slot,
// and an error is kept for the collective that raised it and rethrown by every wait() on it.
//
// Help-first: a waiter whose collective is next in line and not started runs it itself, and the
// thread leaves a new collective to its waiter for kGrace before taking it, so the common
// issue-then-wait pattern costs no thread hand-off. Either way at most one collective runs at a
// time, in issue order. The thread never polls: it sleeps until a collective is issued (or one
// completes with more queued), looks once, and sleeps again if a waiter has claimed it. A timer
// poll (it was 1 ms) woke it five times per training step on a core that a replica computes on.
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "collectives/sync_collectives.h"
#include "dtrain/core/error.h"
#include "dtrain/core/timeline.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// How long the thread leaves a new collective to a caller that waits on it at once: a collective
// nobody waits for yet starts kGrace after it was issued.
constexpr auto kGrace = std::chrono::microseconds(50);

enum class Op {
  kAllreduce,
  kAllgather,
  kBroadcast,
  kReduce,
  kReduceScatter,
  kBarrier,
  kAlltoall,
  kReduceScatterConcat,
  kReduceScatterInPlace
};
constexpr std::array<const char*, 9> kOpNames = {"allreduce",
                                                 "allgather",
                                                 "broadcast",
                                                 "reduce",
                                                 "reduce_scatter",
                                                 "barrier",
                                                 "alltoall",
                                                 "reduce_scatter_concat",
                                                 "reduce_scatter_in_place"};

struct Task {
  uint64_t id = 0;
  Clock::time_point submitted;
  Op op = Op::kBarrier;
  Tensor* tensor =
      nullptr;  // allreduce, broadcast, reduce: in place; allgather, reduce_scatter: output
  const Tensor* input = nullptr;                // allgather, reduce_scatter
  const std::vector<Tensor>* inputs = nullptr;  // reduce_scatter_concat
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  Tensor* scratch = nullptr;  // reduce_scatter_in_place: its input
};

// Shared by the communicator, its thread and the Works it hands out (which may outlive it; once the
// communicator is gone its queue is empty, so a late waiter finds nothing to run).
class Queue final : public Work::Tracker {
 public:
  Queue(std::unique_ptr<SyncCollectives> b, std::chrono::milliseconds bound)
      : backend(std::move(b)),
        collective_timeout(bound),
        rank_(backend->rank()),
        size_(backend->size()) {}

  bool done(uint64_t id) const override { return completed.load(std::memory_order_acquire) > id; }

  bool wait(uint64_t id, std::chrono::milliseconds timeout) override {
    if (done(id)) return true;
    if (timeout >= collective_timeout)
      help(id);  // a shorter wait leaves it to the thread: its timeout holds
    std::unique_lock<std::mutex> lock(mu);
    if (timeout == std::chrono::milliseconds::max()) {
      // No limit of our own: the backend's collective timeout ends it. (wait_for(max) would
      // overflow.)
      while (!done(id)) done_cv.wait_for(lock, std::chrono::seconds(1));
      return true;
    }
    return done_cv.wait_for(lock, timeout, [&] { return done(id); });
  }

  void abort_and_drain(uint64_t id, const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (backend) backend->abort(reason);
    }
    std::unique_lock<std::mutex> lock(mu);
    while (!done(id)) done_cv.wait_for(lock, std::chrono::seconds(1));
  }

  void rethrow(uint64_t id) const override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = errors.find(id);
    if (it != errors.end()) std::rethrow_exception(it->second);
  }

  std::string describe(uint64_t id) const override {
    std::lock_guard<std::mutex> lock(mu);
    std::string op = "collective";
    if (running && running_id == id) op = kOpNames[static_cast<size_t>(running_op)];
    for (const Task& t : tasks)
      if (t.id == id) op = kOpNames[static_cast<size_t>(t.op)];
    return op + " #" + std::to_string(id) + " on rank " + std::to_string(rank_) + " of " +
           std::to_string(size_);
  }

  // Runs the task claimed under the lock (running set), outside the lock; then marks it complete.
  void run(const Task& task) {
    std::exception_ptr error;
    try {
      SyncCollectives& b = *backend;
      switch (task.op) {
        case Op::kAllreduce:
          b.allreduce(*task.tensor, task.reduce);
          break;
        case Op::kAllgather:
          b.allgather(*task.input, *task.tensor);
          break;
        case Op::kBroadcast:
          b.broadcast(*task.tensor, task.root);
          break;
        case Op::kReduce:
          b.reduce(*task.tensor, task.root, task.reduce);
          break;
        case Op::kReduceScatter:
          b.reduce_scatter(*task.input, *task.tensor, task.reduce);
          break;
        case Op::kBarrier:
          b.barrier();
          break;
        case Op::kAlltoall:
          b.alltoall(*task.input, *task.tensor);
          break;
        case Op::kReduceScatterConcat:
          b.reduce_scatter_concat(*task.inputs, *task.tensor, task.reduce);
          break;
        case Op::kReduceScatterInPlace:
          b.reduce_scatter_in_place(*task.scratch, *task.tensor, task.reduce);
          break;
      }
    } catch (...) {
      error = std::current_exception();  // kept for every wait(), never lost on this thread
    }
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (error) errors.emplace(task.id, error);
      running = false;
      completed.store(task.id + 1, std::memory_order_release);
      // A waiter ran it while the thread slept: wake the thread if more is queued, or if the
      // communicator is being destroyed (its destructor joins the thread).
      wake = parked && (!tasks.empty() || stop);
    }
    done_cv.notify_all();
    if (wake) cv.notify_all();
  }

  // Claims collective `id` if it is next and nothing runs, and runs it on this thread.
  void help(uint64_t id) {
    Task mine;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (running || tasks.empty() || tasks.front().id != id) return;  // running, done, or not next
      mine = claim_locked();
    }
    run(mine);
  }

  Task claim_locked() {
    Task t = tasks.front();
    tasks.pop_front();
    running = true;
    running_id = t.id;
    running_op = t.op;
    return t;
  }

  std::unique_ptr<SyncCollectives> backend;
  const std::chrono::milliseconds collective_timeout;
  mutable std::mutex mu;
  std::condition_variable cv;       // the thread: new work, stop
  std::condition_variable done_cv;  // waiters: a collective completed
  std::deque<Task> tasks;
  std::map<uint64_t, std::exception_ptr> errors;
  std::atomic<uint64_t> completed{0};  // collectives [0, completed) are done
  uint64_t next_id = 0;
  bool running = false;  // a collective is running (on the thread or on a helping waiter)
  uint64_t running_id = 0;
  Op running_op = Op::kBarrier;
  bool stop = false;
  bool parked =
      false;  // the thread sleeps until a collective is issued, or completes with more queued

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  const int rank_, size_;
};

class AsyncCommunicator final : public Communicator {
 public:
  AsyncCommunicator(std::unique_ptr<SyncCollectives> backend,
                    std::chrono::milliseconds collective_timeout)
      : q_(std::make_shared<Queue>(std::move(backend), collective_timeout)) {
    static std::atomic<int> groups{0};
    const std::string name = "collectives #" + std::to_string(groups++) + " (rank " +
                             std::to_string(q_->rank()) + " of " + std::to_string(q_->size()) + ")";
    thread_ = std::thread([this, name] {
      timeline::set_thread_name(name);  // distinct per communicator: rows of one name are merged
      loop();
    });
  }
  ~AsyncCommunicator() override {
    bool pending;
    {
      std::unique_lock<std::mutex> lock(q_->mu);
      q_->stop = true;
      q_->cv.notify_all();  // the thread runs what is queued, then ends
      // Collectives nobody waited for get their own timeout to finish with their peers...
      q_->done_cv.wait_for(lock, q_->collective_timeout,
                           [&] { return !q_->running && q_->tasks.empty(); });
      pending = q_->running || !q_->tasks.empty();
    }
    // ...then, if peers are gone, they fail fast rather than block shutdown.
    if (pending)
      q_->backend->abort("the communicator of rank " + std::to_string(rank()) +
                         " was destroyed with collectives pending");
    q_->cv.notify_all();
    thread_.join();
    // A Work may outlive us; the sockets, threads and streams of the backend must not.
    std::lock_guard<std::mutex> lock(q_->mu);
    q_->backend.reset();
  }

  int rank() const override { return q_->rank(); }
  int size() const override { return q_->size(); }

  Work allreduce(Tensor& t, ReduceOp op) override {
    return submit(Op::kAllreduce, &t, nullptr, op, 0);
  }
  Work allgather(const Tensor& in, Tensor& out) override {
    return submit(Op::kAllgather, &out, &in, ReduceOp::kSum, 0);
  }
  Work broadcast(Tensor& t, int root) override {
    return submit(Op::kBroadcast, &t, nullptr, ReduceOp::kSum, root);
  }
  Work reduce(Tensor& t, int root, ReduceOp op) override {
    return submit(Op::kReduce, &t, nullptr, op, root);
  }
  Work reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    return submit(Op::kReduceScatter, &out, &in, op, 0);
  }
  Work barrier() override { return submit(Op::kBarrier, nullptr, nullptr, ReduceOp::kSum, 0); }
  Work alltoall(const Tensor& in, Tensor& out) override {
    return submit(Op::kAlltoall, &out, &in, ReduceOp::kSum, 0);
  }
  Work reduce_scatter_in_place(Tensor& in, Tensor& out, ReduceOp op) override {
    return submit(Op::kReduceScatterInPlace, &out, &in, op, 0, nullptr, &in);
  }
  Work reduce_scatter_concat(const std::vector<Tensor>& in, Tensor& out, ReduceOp op) override {
    return submit(Op::kReduceScatterConcat, &out, nullptr, op, 0, &in);
  }
  void abort(const std::string& reason) override { q_->backend->abort(reason); }
  void set_progress_marker(int64_t marker) override {
    std::lock_guard<std::mutex> lock(q_->mu);
    if (q_->backend) q_->backend->set_progress_marker(marker);
  }
  std::vector<int64_t> peer_markers() const override {
    std::lock_guard<std::mutex> lock(q_->mu);
    return q_->backend ? q_->backend->peer_markers() : std::vector<int64_t>{};
  }

 private:
  // The caller keeps the tensors alive and untouched until wait() returns (Communicator's
  // contract), so the task holds pointers to them.
  Work submit(Op op, Tensor* tensor, const Tensor* input, ReduceOp reduce, int root,
              const std::vector<Tensor>* inputs = nullptr, Tensor* scratch = nullptr) {
    uint64_t id;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(q_->mu);
      if (q_->stop)
        throw FailedPrecondition(std::string(kOpNames[static_cast<size_t>(op)]) +
                                 " on a communicator that is being destroyed");
      id = q_->next_id++;
      q_->tasks.push_back(Task{id, Clock::now(), op, tensor, input, inputs, reduce, root, scratch});
      wake = q_->parked;
    }
    if (wake) q_->cv.notify_all();
    return Work(q_, id);
  }

  void loop() {
    Queue& q = *q_;
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(q.mu);
        for (;;) {
          if (q.stop && !q.running && q.tasks.empty()) return;
          if (!q.running && !q.tasks.empty()) {
            const Clock::time_point due = q.tasks.front().submitted + kGrace;
            if (q.stop || Clock::now() >= due) break;  // nobody has claimed it: ours
            q.cv.wait_until(lock, due);                // its waiter may claim it meanwhile
            continue;
          }
          // Nothing to start (none queued, or a waiter runs the next one): sleep until told.
          q.parked = true;
          q.cv.wait(lock);
          q.parked = false;
        }
        task = q.claim_locked();
      }
      q.run(task);
    }
  }

  std::shared_ptr<Queue> q_;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Communicator> make_async_communicator(
    std::unique_ptr<SyncCollectives> backend, std::chrono::milliseconds collective_timeout) {
  return std::make_unique<AsyncCommunicator>(std::move(backend), collective_timeout);
}

}  // namespace dtrain
