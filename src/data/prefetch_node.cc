// The prefetch stage: a producer thread fills a bounded queue; errors are delivered in order and
// then rethrown on every later next(); destroying the iterator cancels and joins the producer.
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "data/dataset_node.h"
#include "dtrain/core/timeline.h"

namespace dtrain::detail {
namespace {

using NodePtr = std::shared_ptr<const DatasetNode>;

// ---- prefetch ----

class PrefetchNode final : public DatasetNode {
 public:
  PrefetchNode(NodePtr up, int buffer)
      : DatasetNode(up->source(), up->cardinality(), up->batched(),
                    str_cat(up->description(), ".prefetch(", buffer, ")")),
        up_(std::move(up)),
        buffer_(buffer) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
    return std::make_unique<It>(up_->make_iterator(epoch), static_cast<size_t>(buffer_));
  }
  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<PrefetchNode>(std::move(up), buffer_) : nullptr;
  }

 private:
  class It final : public DatasetNodeIterator {
   public:
    It(std::unique_ptr<DatasetNodeIterator> up, size_t capacity) : capacity_(capacity) {
      try {
        thread_ = std::thread([this, u = std::move(up)]() mutable {
          timeline::set_thread_name("input pipeline (prefetch)");
          produce(std::move(u));
        });
      } catch (const std::system_error& e) {
        throw Unavailable(str_cat("prefetch: cannot start the producer thread: ", e.what()));
      }
    }
    ~It() override {
      {
        std::lock_guard<std::mutex> lock(mu_);
        cancelled_ = true;
      }
      space_.notify_all();
      thread_.join();
    }
    bool next(DatasetElement* out) override {
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait(lock, [&] { return !queue_.empty() || finished_; });
      if (!queue_.empty()) {
        if (out) *out = std::move(queue_.front());
        queue_.pop_front();
        lock.unlock();
        space_.notify_one();
        return true;
      }
      if (error_) std::rethrow_exception(error_);
      return false;
    }

   private:
    void produce(std::unique_ptr<DatasetNodeIterator> up) {
      std::exception_ptr error;
      try {
        for (;;) {
          DatasetElement e;
          if (!up->next(&e)) break;
          std::unique_lock<std::mutex> lock(mu_);
          space_.wait(lock, [&] { return queue_.size() < capacity_ || cancelled_; });
          if (cancelled_) break;
          queue_.push_back(std::move(e));
          lock.unlock();
          ready_.notify_one();
        }
      } catch (...) {
        error = std::current_exception();
      }
      up.reset();  // joins any prefetch threads further upstream, on this thread
      {
        std::lock_guard<std::mutex> lock(mu_);
        error_ = error;
        finished_ = true;
      }
      ready_.notify_all();
    }

    const size_t capacity_;
    std::mutex mu_;
    std::condition_variable ready_, space_;
    std::deque<DatasetElement> queue_;
    bool finished_ = false, cancelled_ = false;
    std::exception_ptr error_;
    std::thread thread_;  // last: started after the members it uses exist
  };

  NodePtr up_;
  int buffer_;
};

}  // namespace

std::shared_ptr<const DatasetNode> make_prefetch_node(std::shared_ptr<const DatasetNode> up,
                                                      int buffer) {
  return std::make_shared<PrefetchNode>(std::move(up), buffer);
}

}  // namespace dtrain::detail
