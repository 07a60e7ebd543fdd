// The map stage: applies a function to every batch in order, on the calling thread or on a pool of
// `parallel` threads that work up to `parallel` batches ahead (tf.data's map(num_parallel_calls)).
// Results come back in the input's order whatever the pool does, and each call gets the element's
// index in this pass, so the output never depends on the number of threads or their timing.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <future>
#include <mutex>
#include <system_error>
#include <thread>

#include "data/dataset_node.h"
#include "dtrain/core/timeline.h"

namespace dtrain::detail {
namespace {

using NodePtr = std::shared_ptr<const DatasetNode>;
using Fn = std::function<std::vector<Tensor>(std::vector<Tensor>, int64_t)>;

std::vector<Tensor> checked(const Fn& fn, std::vector<Tensor> in, int64_t index, size_t k) {
  std::vector<Tensor> out = fn(std::move(in), index);
  if (out.size() != k)
    throw InvalidArgument(str_cat("Dataset::map: the function returned ", out.size(),
                                  " tensors for an element of ", k,
                                  "; it must keep the number of components"));
  return out;
}

// Calls on the consumer's thread.
class SerialIt final : public DatasetNodeIterator {
 public:
  SerialIt(std::unique_ptr<DatasetNodeIterator> up, std::shared_ptr<const Fn> fn, size_t k)
      : up_(std::move(up)), fn_(std::move(fn)), k_(k) {}
  bool next(DatasetElement* out) override {
    if (!out) {  // dropped elements are not mapped, but they take their index
      if (!up_->next(nullptr)) return false;
      ++index_;
      return true;
    }
    if (!up_->next(out)) return false;
    out->tensors = checked(*fn_, std::move(out->tensors), index_++, k_);
    return true;
  }

 private:
  std::unique_ptr<DatasetNodeIterator> up_;
  std::shared_ptr<const Fn> fn_;
  size_t k_;
  int64_t index_ = 0;
};

// A pool of threads mapping the next `parallel` elements while the consumer uses earlier ones.
// The upstream is read only on the consumer's thread; the pool only runs the function.
class ParallelIt final : public DatasetNodeIterator {
 public:
  ParallelIt(std::unique_ptr<DatasetNodeIterator> up, std::shared_ptr<const Fn> fn, size_t k,
             int parallel)
      : up_(std::move(up)), fn_(std::move(fn)), k_(k), window_(static_cast<size_t>(parallel)) {
    try {
      for (int t = 0; t < parallel; ++t)
        threads_.emplace_back([this, t] {
          timeline::set_thread_name(str_cat("input pipeline (map ", t, ")"));
          work();
        });
    } catch (const std::system_error& e) {  // out of threads (a pids cgroup, RLIMIT_NPROC)
      const size_t started = threads_.size();
      stop_and_join();
      throw Unavailable(str_cat("Dataset::map: cannot start thread ", started + 1, " of ", parallel,
                                " (", e.what(),
                                "); use fewer parallel calls or raise the process limit"));
    } catch (...) {  // (out of memory): the threads started must not be left joinable
      stop_and_join();
      throw;
    }
  }
  ~ParallelIt() override { stop_and_join(); }
  ParallelIt(const ParallelIt&) = delete;
  ParallelIt& operator=(const ParallelIt&) = delete;
  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  bool next(DatasetElement* out) override {
    fill();
    if (inflight_.empty()) {
      if (error_) std::rethrow_exception(error_);
      return false;
    }
    InFlight front = std::move(inflight_.front());
    inflight_.pop_front();
    fill();                 // keep the pool busy while the caller waits for this one
    if (!out) return true;  // mapped for nothing: a later stage drops it
    out->row = front.row;
    out->batch_rows = front.batch_rows;
    out->skipped = front.skipped;
    out->tensors = front.result.get();  // rethrows what the function threw, in order
    return true;
  }

 private:
  struct InFlight {
    std::future<std::vector<Tensor>> result;
    int64_t row, batch_rows, skipped;
  };

  void fill() {
    while (!done_ && inflight_.size() < window_) {
      DatasetElement e;
      bool more = false;
      try {
        more = up_->next(&e);
      } catch (...) {  // delivered after the elements before it, as prefetch() does
        error_ = std::current_exception();
      }
      if (!more) {
        done_ = true;
        break;
      }
      std::packaged_task<std::vector<Tensor>()> task(
          [fn = fn_, k = k_, t = std::move(e.tensors), i = index_++]() mutable {
            return checked(*fn, std::move(t), i, k);
          });
      inflight_.push_back({task.get_future(), e.row, e.batch_rows, e.skipped});
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(task));
      }
      cv_.notify_one();
    }
  }

  void work() {
    for (;;) {
      std::packaged_task<std::vector<Tensor>()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;  // unstarted tasks are abandoned with the iterator
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::unique_ptr<DatasetNodeIterator> up_;
  std::shared_ptr<const Fn> fn_;
  size_t k_;
  size_t window_;
  int64_t index_ = 0;
  bool done_ = false;
  std::exception_ptr error_;       // the upstream's, rethrown once the elements before it are out
  std::deque<InFlight> inflight_;  // consumer thread only

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<std::vector<Tensor>()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

class MapNode final : public DatasetNode {
 public:
  MapNode(NodePtr up, std::shared_ptr<const Fn> fn, int parallel)
      : DatasetNode(up->source(), up->cardinality(), true,
                    parallel > 1
                        ? str_cat(up->description(), ".map(num_parallel_calls=", parallel, ")")
                        : str_cat(up->description(), ".map()")),
        up_(std::move(up)),
        fn_(std::move(fn)),
        parallel_(parallel) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
    const size_t k = source()->tensors.size();
    if (parallel_ > 1)
      return std::make_unique<ParallelIt>(up_->make_iterator(epoch), fn_, k, parallel_);
    return std::make_unique<SerialIt>(up_->make_iterator(epoch), fn_, k);
  }

 private:
  NodePtr up_;
  std::shared_ptr<const Fn> fn_;
  int parallel_;
};

}  // namespace

std::shared_ptr<const DatasetNode> make_map_node(
    std::shared_ptr<const DatasetNode> up,
    std::function<std::vector<Tensor>(std::vector<Tensor>, int64_t)> fn, int parallel) {
  return std::make_shared<MapNode>(std::move(up), std::make_shared<const Fn>(std::move(fn)),
                                   parallel);
}

}  // namespace dtrain::detail
