// The batch stage: pulls batch_size row indices from upstream and gathers those rows into one
// [b, ...] tensor per component. In-memory sources are copied with one memcpy per run of
// consecutive rows; reader sources (files, token streams) are read row by row, on a pool of
// `source.parallel` threads of the iterator's own when that is above 1 (tf.data's
// map(num_parallel_calls) before batch), so decoding never runs on a training thread.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#include "data/dataset_node.h"
#include "dtrain/core/timeline.h"

namespace dtrain::detail {
namespace {

using NodePtr = std::shared_ptr<const DatasetNode>;

int64_t batch_cardinality(int64_t c, int64_t b, bool drop) {
  if (c < 0) return c;
  return drop ? c / b : (c + b - 1) / b;
}

// Threads that run one function over indices [0, n) together with the caller, then wait.
class ReaderPool {
 public:
  explicit ReaderPool(int threads) {
    try {
      for (int i = 0; i < threads - 1; ++i)  // the calling thread is the last one
        threads_.emplace_back([this, i] {
          timeline::set_thread_name("input reader " + std::to_string(i + 1));
          work();
        });
    } catch (const std::system_error& e) {  // out of threads (a pids cgroup, RLIMIT_NPROC)
      const size_t started = threads_.size();
      stop_and_join();
      throw Unavailable(str_cat("Dataset: cannot start reader thread ", started + 1, " of ",
                                threads - 1, " (", e.what(),
                                "); use fewer parallel reads or raise the process limit"));
    } catch (...) {  // (out of memory): the threads started must not be left joinable
      stop_and_join();
      throw;
    }
  }
  ~ReaderPool() { stop_and_join(); }
  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }
  ReaderPool(const ReaderPool&) = delete;
  ReaderPool& operator=(const ReaderPool&) = delete;

  // Calls fn(i) for every i in [0, n), each once, on the pool and the calling thread. Exceptions
  // are caught per index; the one of the lowest index is rethrown, so the error a batch reports
  // does not depend on the timing.
  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_ = 0;
      done_ = 0;
      error_index_ = -1;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_ == n_; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (generation_ != seen && fn_ != nullptr); });
        if (stop_) return;
        seen = generation_;
      }
      drain();
    }
  }
  void drain() {
    for (;;) {
      int64_t i;
      const std::function<void(int64_t)>* fn;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (fn_ == nullptr || next_ >= n_) return;
        i = next_++;
        fn = fn_;
      }
      std::exception_ptr error;
      try {
        (*fn)(i);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (error && (error_index_ < 0 || i < error_index_)) {
        error_index_ = i;
        error_ = error;
      }
      if (++done_ == n_) done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, next_ = 0, done_ = 0, error_index_ = -1;
  std::exception_ptr error_;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Gathers `rows` (with their epochs) into a new [rows.size(), ...] tensor per component. Rows a
// reader skips (ignore_errors) are left out: the batch is that much shorter.
std::vector<Tensor> gather_rows(const DatasetSource& src, const std::vector<int64_t>& rows,
                                const std::vector<uint64_t>& epochs, ReaderPool* pool) {
  std::vector<Tensor> out;
  out.reserve(src.tensors.size());
  const int64_t b = static_cast<int64_t>(rows.size());
  std::vector<char*> base;
  for (size_t c = 0; c < src.tensors.size(); ++c) {
    const Tensor& t = src.tensors[c];
    std::vector<int64_t> dims = t.shape().dims();
    dims[0] = b;
    out.push_back(Tensor::empty(Shape(std::move(dims)), t.dtype()));
    base.push_back(static_cast<char*>(out.back().raw_data()));
  }
  if (!src.read) {
    for (size_t c = 0; c < src.tensors.size(); ++c) {
      const size_t rb = src.row_bytes[c];
      const char* from = static_cast<const char*>(src.tensors[c].raw_data());
      for (int64_t i = 0; i < b;) {
        int64_t j = i + 1;
        while (j < b && rows[j] == rows[j - 1] + 1) ++j;
        std::memcpy(base[c] + static_cast<size_t>(i) * rb, from + static_cast<size_t>(rows[i]) * rb,
                    static_cast<size_t>(j - i) * rb);
        i = j;
      }
    }
    return out;
  }
  std::vector<char> kept(static_cast<size_t>(b), 1);
  const size_t k = src.tensors.size();
  const std::function<void(int64_t)> read_one = [&](int64_t i) {
    std::vector<void*> dst(k);
    for (size_t c = 0; c < k; ++c) dst[c] = base[c] + static_cast<size_t>(i) * src.row_bytes[c];
    const size_t at = static_cast<size_t>(i);
    if (!src.read(rows[at], epochs[at], dst.data())) kept[at] = 0;
  };
  if (pool != nullptr && b > 1) {
    pool->run(b, read_one);
  } else {
    for (int64_t i = 0; i < b; ++i) read_one(i);
  }
  const int64_t n_kept = std::count(kept.begin(), kept.end(), char{1});
  if (n_kept == b) return out;
  src.skipped->fetch_add(b - n_kept, std::memory_order_relaxed);
  std::vector<Tensor> compact;
  for (size_t c = 0; c < k; ++c) {
    std::vector<int64_t> dims = out[c].shape().dims();
    dims[0] = n_kept;
    compact.push_back(Tensor::empty(Shape(std::move(dims)), out[c].dtype()));
    char* to = static_cast<char*>(compact.back().raw_data());
    const size_t rb = src.row_bytes[c];
    for (int64_t i = 0; i < b; ++i)
      if (kept[static_cast<size_t>(i)]) {
        std::memcpy(to, base[c] + static_cast<size_t>(i) * rb, rb);
        to += rb;
      }
  }
  return compact;
}

class BatchNode final : public DatasetNode {
 public:
  BatchNode(NodePtr up, int64_t b, bool drop, int64_t window_begin, int64_t window_end)
      : DatasetNode(
            up->source(), batch_cardinality(up->cardinality(), b, drop), true,
            str_cat(up->description(), ".batch(", b, drop ? ", drop_remainder=true" : "", ")",
                    window_end >= 0 ? str_cat("[rows ", window_begin, ":", window_end, "]")
                                    : std::string())),
        up_(std::move(up)),
        batch_size_(b),
        drop_(drop),
        begin_(window_begin),
        end_(window_end) {}
  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    // A window of a window: rows [begin, end) of rows [begin_, end_).
    const int64_t b = begin_ + begin, e = end_ >= 0 ? std::min(end_, begin_ + end) : begin_ + end;
    return std::make_shared<BatchNode>(up_, batch_size_, drop_, b, std::max(b, e));
  }
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
    return std::make_unique<It>(up_->make_iterator(epoch), source(), batch_size_, drop_, begin_,
                                end_);
  }

 private:
  class It final : public DatasetNodeIterator {
   public:
    It(std::unique_ptr<DatasetNodeIterator> up, std::shared_ptr<const DatasetSource> src, int64_t b,
       bool drop, int64_t begin, int64_t end)
        : up_(std::move(up)), src_(std::move(src)), b_(b), drop_(drop), begin_(begin), end_(end) {
      rows_.reserve(static_cast<size_t>(std::min<int64_t>(b_, 1 << 20)));
    }
    bool next(DatasetElement* out) override {
      if (!up_) return false;
      rows_.clear();
      epochs_.clear();
      DatasetElement e;
      while (static_cast<int64_t>(rows_.size()) < b_) {
        if (!up_->next(&e)) {
          up_.reset();
          break;
        }
        rows_.push_back(e.row);
        epochs_.push_back(e.epoch);
      }
      if (rows_.empty() || (drop_ && static_cast<int64_t>(rows_.size()) < b_)) return false;
      if (out) {
        out->row = -1;
        if (src_->read && src_->parallel > 1 && !pool_)
          pool_ = std::make_unique<ReaderPool>(src_->parallel);
        if (end_ < 0) {
          out->tensors = gather_rows(*src_, rows_, epochs_, pool_.get());
          out->skipped = static_cast<int64_t>(rows_.size()) - out->tensors.at(0).shape()[0];
        } else {  // only this window's rows are read
          const int64_t n = static_cast<int64_t>(rows_.size());
          out->batch_rows = n;
          const auto from = static_cast<size_t>(std::min(begin_, n));
          const auto to = static_cast<size_t>(std::min(end_, n));
          window_.assign(rows_.begin() + from, rows_.begin() + to);
          window_epochs_.assign(epochs_.begin() + from, epochs_.begin() + to);
          out->tensors = gather_rows(*src_, window_, window_epochs_, pool_.get());
          out->skipped = static_cast<int64_t>(window_.size()) - out->tensors.at(0).shape()[0];
        }
      }
      return true;
    }

   private:
    std::unique_ptr<DatasetNodeIterator> up_;
    std::shared_ptr<const DatasetSource> src_;
    int64_t b_;
    bool drop_;
    int64_t begin_, end_;
    std::vector<int64_t> rows_, window_;
    std::vector<uint64_t> epochs_, window_epochs_;
    std::unique_ptr<ReaderPool> pool_;
  };

  NodePtr up_;
  int64_t batch_size_;
  bool drop_;
  int64_t begin_, end_;  // the row window (end_ < 0: whole batches)
};

}  // namespace

std::shared_ptr<const DatasetNode> make_batch_node(std::shared_ptr<const DatasetNode> up,
                                                   int64_t batch_size, bool drop, int64_t begin,
                                                   int64_t end) {
  return std::make_shared<BatchNode>(std::move(up), batch_size, drop, begin, end);
}

}  // namespace dtrain::detail
