#include "dtrain/data/dataset.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>

#include "data/dataset_node.h"
#include "dtrain/core/random.h"

namespace dtrain {
namespace detail {

namespace {

using NodePtr = std::shared_ptr<const DatasetNode>;

// ---- source ----

class SourceNode final : public DatasetNode {
 public:
  explicit SourceNode(std::shared_ptr<const DatasetSource> s)
      : DatasetNode(s, s->n, false,
                    str_cat("from_tensors(n=", s->n, ", components=", s->tensors.size(), ")")) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    class It final : public DatasetNodeIterator {
     public:
      explicit It(int64_t n) : n_(n) {}
      bool next(DatasetElement* out) override {
        if (i_ >= n_) return false;
        if (out) out->row = i_;
        ++i_;
        return true;
      }

     private:
      int64_t n_, i_ = 0;
    };
    return std::make_unique<It>(source()->n);
  }
};

// ---- shuffle ----

// Uniform integers from a Philox stream, unbiased (rejection below 2^64 mod bound).
class PhiloxIntegers {
 public:
  explicit PhiloxIntegers(Philox p) : philox_(p) {}
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t r = uint64_t{word()} << 32 | word();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  uint32_t word() {
    if (pos_ == 4) {
      block_ = philox_.block(counter_++);
      pos_ = 0;
    }
    return block_[pos_++];
  }
  Philox philox_;
  uint64_t counter_ = 0;
  std::array<uint32_t, 4> block_{};
  int pos_ = 4;
};

class ShuffleNode final : public DatasetNode {
 public:
  ShuffleNode(NodePtr up, uint64_t seed, bool reshuffle, uint64_t first_pass)
      : DatasetNode(
            up->source(), up->cardinality(), up->batched(),
            str_cat(up->description(), ".shuffle(seed=", seed,
                    reshuffle ? "" : ", reshuffle_each_iteration=false",
                    first_pass ? str_cat(", first_pass=", first_pass) : std::string(), ")")),
        up_(std::move(up)),
        seed_(seed),
        reshuffle_(reshuffle),
        first_pass_(first_pass) {}

  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    const uint64_t pass =
        first_pass_ + (reshuffle_ ? passes_->fetch_add(1, std::memory_order_relaxed) : 0);
    return std::make_unique<It>(up_->make_iterator(), Philox(seed_, pass));
  }

 private:
  class It final : public DatasetNodeIterator {
   public:
    It(std::unique_ptr<DatasetNodeIterator> up, Philox philox) : up_(std::move(up)), rng_(philox) {}
    bool next(DatasetElement* out) override {
      if (up_) fill();
      if (pos_ >= buffer_.size()) return false;
      if (out) *out = std::move(buffer_[pos_]);
      buffer_[pos_] = DatasetElement{};
      ++pos_;
      return true;
    }

   private:
    // Drains one pass of the input on first use, then permutes it (Fisher-Yates).
    void fill() {
      for (DatasetElement e; up_->next(&e);) buffer_.push_back(std::move(e));
      up_.reset();
      for (size_t i = buffer_.size(); i > 1; --i) {
        const size_t j = static_cast<size_t>(rng_.below(i));
        std::swap(buffer_[i - 1], buffer_[j]);
      }
    }
    std::unique_ptr<DatasetNodeIterator> up_;
    PhiloxIntegers rng_;
    std::vector<DatasetElement> buffer_;
    size_t pos_ = 0;
  };

  NodePtr up_;
  uint64_t seed_;
  bool reshuffle_;
  uint64_t first_pass_;
  // Shared by every Dataset handle built on this stage, like TF's seed generator resource.
  std::shared_ptr<std::atomic<uint64_t>> passes_ = std::make_shared<std::atomic<uint64_t>>(0);
};

// ---- shard ----

int64_t shard_cardinality(int64_t c, int n, int index) {
  if (c < 0) return c;
  return c / n + (index < c % n ? 1 : 0);
}

class ShardNode final : public DatasetNode {
 public:
  ShardNode(NodePtr up, int n, int index)
      : DatasetNode(up->source(), shard_cardinality(up->cardinality(), n, index), up->batched(),
                    str_cat(up->description(), ".shard(", n, ", ", index, ")")),
        up_(std::move(up)),
        n_(n),
        index_(index) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    class It final : public DatasetNodeIterator {
     public:
      It(std::unique_ptr<DatasetNodeIterator> up, int n, int index)
          : up_(std::move(up)), n_(n), index_(index) {}
      bool next(DatasetElement* out) override {
        if (!up_) return false;
        for (; pos_ % n_ != index_; ++pos_)
          if (!up_->next(nullptr)) return finish();
        if (!up_->next(out)) return finish();
        ++pos_;
        return true;
      }

     private:
      bool finish() {
        up_.reset();
        return false;
      }
      std::unique_ptr<DatasetNodeIterator> up_;
      int64_t n_, index_, pos_ = 0;
    };
    return std::make_unique<It>(up_->make_iterator(), n_, index_);
  }

  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<ShardNode>(std::move(up), n_, index_) : nullptr;
  }

 private:
  NodePtr up_;
  int n_, index_;
};

// ---- repeat ----

int64_t repeat_cardinality(int64_t c, int64_t count) {
  if (c == 0 || count == 0) return 0;
  if (c < 0 || count < 0) return -1;
  return c * count;
}

class RepeatNode final : public DatasetNode {
 public:
  RepeatNode(NodePtr up, int64_t count)
      : DatasetNode(up->source(), repeat_cardinality(up->cardinality(), count), up->batched(),
                    str_cat(up->description(), ".repeat(", count, ")")),
        up_(std::move(up)),
        count_(count) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    class It final : public DatasetNodeIterator {
     public:
      It(NodePtr node, int64_t count) : node_(std::move(node)), count_(count) {
        if (count_ != 0) up_ = node_->make_iterator();
      }
      bool next(DatasetElement* out) override {
        while (up_) {
          if (up_->next(out)) {
            ++produced_in_pass_;
            return true;
          }
          ++passes_;
          // An empty pass would repeat forever without yielding: stop, as tf.data does.
          if (produced_in_pass_ == 0 || (count_ >= 0 && passes_ >= count_)) {
            up_.reset();
            return false;
          }
          produced_in_pass_ = 0;
          up_.reset();  // release the previous pass (and any prefetch thread) first
          up_ = node_->make_iterator();
        }
        return false;
      }

     private:
      NodePtr node_;
      int64_t count_;
      std::unique_ptr<DatasetNodeIterator> up_;
      int64_t passes_ = 0, produced_in_pass_ = 0;
    };
    return std::make_unique<It>(up_, count_);
  }

  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<RepeatNode>(std::move(up), count_) : nullptr;
  }

 private:
  NodePtr up_;
  int64_t count_;
};

// ---- take ----

class TakeNode final : public DatasetNode {
 public:
  TakeNode(NodePtr up, int64_t count)
      : DatasetNode(up->source(),
                    count < 0               ? up->cardinality()
                    : up->cardinality() < 0 ? count
                                            : std::min(count, up->cardinality()),
                    up->batched(), str_cat(up->description(), ".take(", count, ")")),
        up_(std::move(up)),
        count_(count) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    class It final : public DatasetNodeIterator {
     public:
      It(std::unique_ptr<DatasetNodeIterator> up, int64_t count)
          : up_(std::move(up)), left_(count) {
        if (left_ == 0) up_.reset();
      }
      bool next(DatasetElement* out) override {
        if (!up_) return false;
        if (!up_->next(out)) {
          up_.reset();
          return false;
        }
        // Release the input as soon as the last element is out, so a prefetch thread upstream
        // stops now rather than when this iterator dies.
        if (left_ > 0 && --left_ == 0) up_.reset();
        return true;
      }

     private:
      std::unique_ptr<DatasetNodeIterator> up_;
      int64_t left_;  // -1 = unlimited
    };
    return std::make_unique<It>(up_->make_iterator(), count_);
  }

  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<TakeNode>(std::move(up), count_) : nullptr;
  }

 private:
  NodePtr up_;
  int64_t count_;
};

// ---- skip ----

class SkipNode final : public DatasetNode {
 public:
  SkipNode(NodePtr up, int64_t count)
      : DatasetNode(up->source(),
                    up->cardinality() < 0 ? -1 : std::max<int64_t>(0, up->cardinality() - count),
                    up->batched(), str_cat(up->description(), ".skip(", count, ")")),
        up_(std::move(up)),
        count_(count) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    class It final : public DatasetNodeIterator {
     public:
      It(std::unique_ptr<DatasetNodeIterator> up, int64_t count)
          : up_(std::move(up)), skip_(count) {}
      bool next(DatasetElement* out) override {
        for (; skip_ > 0; --skip_)  // advance without materialising the skipped elements
          if (!up_->next(nullptr)) return false;
        return up_->next(out);
      }

     private:
      std::unique_ptr<DatasetNodeIterator> up_;
      int64_t skip_;
    };
    return std::make_unique<It>(up_->make_iterator(), count_);
  }

  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<SkipNode>(std::move(up), count_) : nullptr;
  }

 private:
  NodePtr up_;
  int64_t count_;
};

// ---- batch ----

// Copies source rows into a new [rows.size(), ...] tensor per component, one memcpy per run of
// consecutive rows.
std::vector<Tensor> gather_rows(const DatasetSource& src, const std::vector<int64_t>& rows) {
  std::vector<Tensor> out;
  out.reserve(src.tensors.size());
  const int64_t b = static_cast<int64_t>(rows.size());
  for (size_t c = 0; c < src.tensors.size(); ++c) {
    const Tensor& t = src.tensors[c];
    std::vector<int64_t> dims = t.shape().dims();
    dims[0] = b;
    Tensor dst = Tensor::empty(Shape(std::move(dims)), t.dtype());
    const size_t rb = src.row_bytes[c];
    char* to = static_cast<char*>(dst.raw_data());
    if (src.read) {
      for (int64_t i = 0; i < b; ++i) src.read(c, rows[static_cast<size_t>(i)], to + i * rb);
      out.push_back(std::move(dst));
      continue;
    }
    const char* from = static_cast<const char*>(t.raw_data());
    for (int64_t i = 0; i < b;) {
      int64_t j = i + 1;
      while (j < b && rows[j] == rows[j - 1] + 1) ++j;
      std::memcpy(to + static_cast<size_t>(i) * rb, from + static_cast<size_t>(rows[i]) * rb,
                  static_cast<size_t>(j - i) * rb);
      i = j;
    }
    out.push_back(std::move(dst));
  }
  return out;
}

int64_t batch_cardinality(int64_t c, int64_t b, bool drop) {
  if (c < 0) return c;
  return drop ? c / b : (c + b - 1) / b;
}

class BatchNode final : public DatasetNode {
 public:
  BatchNode(NodePtr up, int64_t b, bool drop, int64_t window_begin = 0, int64_t window_end = -1)
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
  std::unique_ptr<DatasetNodeIterator> make_iterator() const override {
    class It final : public DatasetNodeIterator {
     public:
      It(std::unique_ptr<DatasetNodeIterator> up, std::shared_ptr<const DatasetSource> src,
         int64_t b, bool drop, int64_t begin, int64_t end)
          : up_(std::move(up)), src_(std::move(src)), b_(b), drop_(drop), begin_(begin), end_(end) {
        rows_.reserve(static_cast<size_t>(std::min<int64_t>(b_, 1 << 20)));
      }
      bool next(DatasetElement* out) override {
        if (!up_) return false;
        rows_.clear();
        DatasetElement e;
        while (static_cast<int64_t>(rows_.size()) < b_) {
          if (!up_->next(&e)) {
            up_.reset();
            break;
          }
          rows_.push_back(e.row);
        }
        if (rows_.empty() || (drop_ && static_cast<int64_t>(rows_.size()) < b_)) return false;
        if (out) {
          out->row = -1;
          if (end_ < 0) {
            out->tensors = gather_rows(*src_, rows_);
          } else {  // only this window's rows are copied
            const int64_t n = static_cast<int64_t>(rows_.size());
            out->batch_rows = n;
            window_.assign(rows_.begin() + std::min(begin_, n), rows_.begin() + std::min(end_, n));
            out->tensors = gather_rows(*src_, window_);
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
    };
    return std::make_unique<It>(up_->make_iterator(), source(), batch_size_, drop_, begin_, end_);
  }

 private:
  NodePtr up_;
  int64_t batch_size_;
  bool drop_;
  int64_t begin_, end_;  // the row window (end_ < 0: whole batches)
};

// ---- public iterator ----

class PublicIterator final : public Dataset::Iterator {
 public:
  PublicIterator(std::unique_ptr<DatasetNodeIterator> it, std::shared_ptr<const DatasetSource> src,
                 bool batched)
      : it_(std::move(it)), src_(std::move(src)), batched_(batched) {}
  bool next(std::vector<Tensor>* out) override {
    if (!it_) return false;
    DatasetElement e;
    if (!it_->next(&e)) {
      it_.reset();
      return false;
    }
    if (batched_) {
      *out = std::move(e.tensors);
      return true;
    }
    out->clear();
    for (size_t c = 0; c < src_->tensors.size(); ++c) {
      const Tensor& t = src_->tensors[c];
      const std::vector<int64_t>& dims = t.shape().dims();
      Tensor row =
          Tensor::empty(Shape(std::vector<int64_t>(dims.begin() + 1, dims.end())), t.dtype());
      const size_t rb = src_->row_bytes[c];
      if (src_->read)
        src_->read(c, e.row, row.raw_data());
      else
        std::memcpy(row.raw_data(),
                    static_cast<const char*>(t.raw_data()) + static_cast<size_t>(e.row) * rb, rb);
      out->push_back(std::move(row));
    }
    return true;
  }

 private:
  std::unique_ptr<DatasetNodeIterator> it_;
  std::shared_ptr<const DatasetSource> src_;
  bool batched_;
};

}  // namespace
}  // namespace detail

using detail::str_cat;

Dataset Dataset::from_tensors(std::vector<Tensor> components) {
  if (components.empty()) throw InvalidArgument("Dataset::from_tensors needs at least one tensor");
  auto src = std::make_shared<detail::DatasetSource>();
  for (size_t c = 0; c < components.size(); ++c) {
    const Tensor& t = components[c];
    if (!t.defined())
      throw InvalidArgument(
          str_cat("Dataset::from_tensors: component ", c, " is an undefined Tensor"));
    if (t.rank() == 0)
      throw InvalidArgument(str_cat("Dataset::from_tensors: component ", c,
                                    " is a scalar; every component needs a leading dimension "
                                    "that indexes the elements"));
    if (t.shape()[0] != components[0].shape()[0])
      throw InvalidArgument(
          str_cat("Dataset::from_tensors: components must share the leading "
                  "dimension, but component 0 is ",
                  components[0].to_string(), " and component ", c, " is ", t.to_string()));
    // Logical CPU devices share host RAM, so only device memory needs a copy.
    Tensor host = t.device().host_accessible() ? t : t.to(DeviceSpec::cpu());
    const std::vector<int64_t>& dims = host.shape().dims();
    src->row_bytes.push_back(
        static_cast<size_t>(Shape(std::vector<int64_t>(dims.begin() + 1, dims.end())).numel()) *
        dtype_size(host.dtype()));
    src->tensors.push_back(std::move(host));
  }
  src->n = components[0].shape()[0];
  return Dataset(std::make_shared<detail::SourceNode>(std::move(src)));
}

Dataset Dataset::from_reader(int64_t n, std::vector<RowSpec> components, RowReader read) {
  if (n < 0) throw InvalidArgument(str_cat("Dataset::from_reader: n must be >= 0, got ", n));
  if (components.empty() || !read)
    throw InvalidArgument("Dataset::from_reader needs at least one component and a reader");
  auto src = std::make_shared<detail::DatasetSource>();
  for (const RowSpec& c : components) {
    std::vector<int64_t> dims = c.shape.dims();
    dims.insert(dims.begin(), 1);
    src->row_bytes.push_back(static_cast<size_t>(c.shape.numel()) * dtype_size(c.dtype));
    src->tensors.push_back(Tensor::zeros(Shape(dims), c.dtype));
  }
  src->n = n;
  src->read = std::move(read);
  return Dataset(std::make_shared<detail::SourceNode>(std::move(src)));
}

Dataset Dataset::shuffle(uint64_t seed, bool reshuffle_each_iteration, uint64_t first_pass) const {
  if (node_->cardinality() < 0)
    throw InvalidArgument(str_cat("shuffle() over an infinite dataset (", node_->description(),
                                  ") would never yield: dtrain shuffles a whole pass; put "
                                  "shuffle() before repeat()"));
  return Dataset(
      std::make_shared<detail::ShuffleNode>(node_, seed, reshuffle_each_iteration, first_pass));
}

Dataset Dataset::shard(int num_shards, int index) const {
  if (num_shards < 1 || index < 0 || index >= num_shards)
    throw InvalidArgument(str_cat("shard(num_shards=", num_shards, ", index=", index,
                                  "): need num_shards >= 1 and 0 <= index < num_shards"));
  return Dataset(std::make_shared<detail::ShardNode>(node_, num_shards, index));
}

Dataset Dataset::repeat(int64_t count) const {
  if (count < -1)
    throw InvalidArgument(str_cat("repeat(", count, "): count must be >= 0, or -1 for forever"));
  return Dataset(std::make_shared<detail::RepeatNode>(node_, count));
}

Dataset Dataset::take(int64_t count) const {
  if (count < -1)
    throw InvalidArgument(str_cat("take(", count, "): count must be >= 0, or -1 for all"));
  return Dataset(std::make_shared<detail::TakeNode>(node_, count));
}

Dataset Dataset::skip(int64_t count) const {
  if (count < 0) throw InvalidArgument(str_cat("skip(", count, "): count must be >= 0"));
  if (count == 0) return *this;
  return Dataset(std::make_shared<detail::SkipNode>(node_, count));
}

Dataset Dataset::batch(int64_t batch_size, bool drop_remainder) const {
  if (batch_size < 1)
    throw InvalidArgument(str_cat("batch(", batch_size, "): batch_size must be >= 1"));
  if (node_->batched())
    throw InvalidArgument(str_cat("batch() on an already batched dataset (", node_->description(),
                                  ") is not supported; batch once with the combined size"));
  return Dataset(std::make_shared<detail::BatchNode>(node_, batch_size, drop_remainder));
}

Dataset Dataset::map(MapFn fn, int num_parallel_calls) const {
  if (!fn) throw InvalidArgument("Dataset::map: the function is empty");
  return map_with_index(
      [f = std::move(fn)](std::vector<Tensor> e, int64_t) { return f(std::move(e)); },
      num_parallel_calls);
}

Dataset Dataset::map_with_index(IndexedMapFn fn, int num_parallel_calls) const {
  if (!fn) throw InvalidArgument("Dataset::map: the function is empty");
  if (!node_->batched())
    throw InvalidArgument(str_cat("Dataset::map on an unbatched dataset (", node_->description(),
                                  ") is not supported: map() runs on batches; call batch() first"));
  if (num_parallel_calls == kAutotune)
    num_parallel_calls = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (num_parallel_calls < 1)
    throw InvalidArgument(str_cat(
        "Dataset::map: num_parallel_calls must be >= 1 or kAutotune, got ", num_parallel_calls));
  return Dataset(detail::make_map_node(node_, std::move(fn), num_parallel_calls));
}

Dataset Dataset::prefetch(int buffer_size) const {
  if (buffer_size < 1)
    throw InvalidArgument(str_cat("prefetch(", buffer_size, "): buffer_size must be >= 1"));
  return Dataset(detail::make_prefetch_node(node_, buffer_size));
}

int64_t Dataset::cardinality() const { return node_->cardinality(); }
size_t Dataset::num_components() const { return node_->source()->tensors.size(); }
bool Dataset::is_batched() const { return node_->batched(); }
std::string Dataset::to_string() const { return node_->description(); }

std::unique_ptr<Dataset::Iterator> Dataset::make_iterator() const {
  return std::make_unique<detail::PublicIterator>(node_->make_iterator(), node_->source(),
                                                  node_->batched());
}

}  // namespace dtrain
