// The asynchronous face of every collective backend: a FIFO of collectives run by one communication
// thread, each completing the Work its caller holds (errors are stored there and rethrown by wait()).
//
// Help-first: a waiter whose collective is next in line and not started runs it itself, and the
// thread leaves a new collective to its waiter for kGrace before taking it, so the common
// issue-then-wait pattern costs no thread hand-off and no wake-up. Either way at most one collective
// runs at a time, in issue order. A collective is a plain record (no std::function), so issuing one
// costs a promise and a queue slot.
#include <array>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "collectives/sync_collectives.h"
#include "dtrain/core/error.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// How long the thread leaves a new collective to a caller that waits on it at once, and how often it
// looks while collectives are being issued: a collective nobody waits for yet starts within about
// kPoll + kGrace. After kIdle without one, the thread sleeps until the next is issued.
constexpr auto kGrace = std::chrono::microseconds(50);
constexpr auto kPoll = std::chrono::milliseconds(1);
constexpr auto kIdle = std::chrono::milliseconds(20);

enum class Op { kAllreduce, kAllgather, kBroadcast, kReduce, kReduceScatter, kBarrier };
constexpr std::array<const char*, 6> kOpNames = {"allreduce", "allgather", "broadcast", "reduce", "reduce_scatter",
                                                 "barrier"};

struct Task {
  uint64_t id = 0;
  Clock::time_point submitted;
  Op op = Op::kBarrier;
  Tensor* tensor = nullptr;        // allreduce, broadcast, reduce: in place; allgather, reduce_scatter: output
  const Tensor* input = nullptr;   // allgather, reduce_scatter
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::promise<void> done;
};

// Shared by the communicator, its thread and the Works it hands out (which may outlive it; once the
// communicator is gone its queue is empty, so a late helper finds nothing to run).
struct Queue {
  explicit Queue(std::unique_ptr<SyncCollectives> b, std::chrono::milliseconds bound)
      : backend(std::move(b)), collective_timeout(bound) {}
  std::unique_ptr<SyncCollectives> backend;
  const std::chrono::milliseconds collective_timeout;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> tasks;
  uint64_t next_id = 0;
  bool busy = false;    // a collective is running (on the thread or on a helping waiter)
  bool stop = false;
  bool parked = false;  // the thread sleeps until notified (no collective for kIdle)

  void execute(Task& t) {
    SyncCollectives& b = *backend;
    switch (t.op) {
      case Op::kAllreduce: b.allreduce(*t.tensor, t.reduce); break;
      case Op::kAllgather: b.allgather(*t.input, *t.tensor); break;
      case Op::kBroadcast: b.broadcast(*t.tensor, t.root); break;
      case Op::kReduce: b.reduce(*t.tensor, t.root, t.reduce); break;
      case Op::kReduceScatter: b.reduce_scatter(*t.input, *t.tensor, t.reduce); break;
      case Op::kBarrier: b.barrier(); break;
    }
  }

  // Runs `task` (claimed under the lock, busy set) outside the lock; marks the queue idle before
  // completing the Work, so a caller that waited may destroy the communicator right away.
  void run(Task& task) {
    std::exception_ptr error;
    try {
      execute(task);
    } catch (...) {
      error = std::current_exception();  // stored in the Work, never lost on this thread
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      busy = false;
    }
    if (error) {
      task.done.set_exception(error);
    } else {
      task.done.set_value();
    }
  }

  static void help(void* state, uint64_t id, std::chrono::milliseconds wait_timeout) {
    Queue& q = *static_cast<Queue*>(state);
    if (wait_timeout < q.collective_timeout) return;  // it may block that long: let the thread run it
    Task mine;
    {
      std::lock_guard<std::mutex> lock(q.mu);
      if (q.busy || q.tasks.empty() || q.tasks.front().id != id) return;  // running, done, or not next
      mine = std::move(q.tasks.front());
      q.tasks.pop_front();
      q.busy = true;
    }
    q.run(mine);
  }
};

class AsyncCommunicator final : public Communicator {
 public:
  AsyncCommunicator(std::unique_ptr<SyncCollectives> backend, std::chrono::milliseconds collective_timeout)
      : q_(std::make_shared<Queue>(std::move(backend), collective_timeout)) {
    for (size_t i = 0; i < kOpNames.size(); ++i)
      what_[i] = std::make_shared<const std::string>(std::string(kOpNames[i]) + " on rank " + std::to_string(rank()) +
                                                     " of " + std::to_string(size()));
    thread_ = std::thread([this] { loop(); });
  }
  ~AsyncCommunicator() override {
    bool pending;
    {
      std::lock_guard<std::mutex> lock(q_->mu);
      q_->stop = true;
      pending = q_->busy || !q_->tasks.empty();
    }
    // Collectives nobody waited for would block on peers that may be gone: fail them fast.
    if (pending) q_->backend->abort("the communicator of rank " + std::to_string(rank()) + " was destroyed with collectives pending");
    q_->cv.notify_all();  // the thread drains what is left (failed fast after an abort) and ends
    thread_.join();
  }

  int rank() const override { return q_->backend->rank(); }
  int size() const override { return q_->backend->size(); }

  Work allreduce(Tensor& t, ReduceOp op) override { return submit(Op::kAllreduce, &t, nullptr, op, 0); }
  Work allgather(const Tensor& in, Tensor& out) override { return submit(Op::kAllgather, &out, &in, ReduceOp::kSum, 0); }
  Work broadcast(Tensor& t, int root) override { return submit(Op::kBroadcast, &t, nullptr, ReduceOp::kSum, root); }
  Work reduce(Tensor& t, int root, ReduceOp op) override { return submit(Op::kReduce, &t, nullptr, op, root); }
  Work reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    return submit(Op::kReduceScatter, &out, &in, op, 0);
  }
  Work barrier() override { return submit(Op::kBarrier, nullptr, nullptr, ReduceOp::kSum, 0); }
  void abort(const std::string& reason) override { q_->backend->abort(reason); }

 private:
  // The caller keeps the tensors alive and untouched until wait() returns (Communicator's contract),
  // so the task holds pointers to them.
  Work submit(Op op, Tensor* tensor, const Tensor* input, ReduceOp reduce, int root) {
    Task task;
    task.op = op;
    task.tensor = tensor;
    task.input = input;
    task.reduce = reduce;
    task.root = root;
    std::shared_future<void> done = task.done.get_future().share();
    uint64_t id;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(q_->mu);
      if (q_->stop)
        throw FailedPrecondition(std::string(kOpNames[static_cast<size_t>(op)]) + " on a communicator that is being destroyed");
      id = task.id = q_->next_id++;
      task.submitted = Clock::now();
      q_->tasks.push_back(std::move(task));
      wake = q_->parked;
    }
    if (wake) q_->cv.notify_all();
    return Work(std::move(done), what_[static_cast<size_t>(op)], q_, &Queue::help, id);
  }

  void loop() {
    Queue& q = *q_;
    Clock::time_point last_activity = Clock::now();
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(q.mu);
        for (;;) {
          if (q.stop && !q.busy && q.tasks.empty()) return;
          const Clock::time_point now = Clock::now();
          if (!q.tasks.empty()) last_activity = now;
          if (!q.busy && !q.tasks.empty() && (q.stop || now >= q.tasks.front().submitted + kGrace)) break;  // ours
          if (q.tasks.empty() && !q.busy && now - last_activity > kIdle) {
            q.parked = true;  // nothing for a while: sleep until a collective is issued
            q.cv.wait(lock, [&] { return q.stop || !q.tasks.empty(); });
            q.parked = false;
            last_activity = Clock::now();
            continue;
          }
          q.cv.wait_for(lock, kPoll);  // a waiter may claim the fresh collective meanwhile
        }
        task = std::move(q.tasks.front());
        q.tasks.pop_front();
        q.busy = true;
      }
      q.run(task);
      last_activity = Clock::now();
    }
  }

  std::shared_ptr<Queue> q_;
  std::array<std::shared_ptr<const std::string>, kOpNames.size()> what_;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Communicator> make_async_communicator(std::unique_ptr<SyncCollectives> backend,
                                                      std::chrono::milliseconds collective_timeout) {
  return std::make_unique<AsyncCommunicator>(std::move(backend), collective_timeout);
}

}  // namespace dtrain
