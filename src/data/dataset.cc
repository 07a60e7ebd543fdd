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

#include "core/usable_cores.h"
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
      : DatasetNode(
            s, s->n, false,
            str_cat(s->name, "(n=", s->n, ", components=", s->tensors.size(), ")", s->suffix)) {}
  bool is_source() const override { return true; }
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
    class It final : public DatasetNodeIterator {
     public:
      It(int64_t n, uint64_t epoch) : n_(n), epoch_(epoch) {}
      bool next(DatasetElement* out) override {
        if (i_ >= n_) return false;
        if (out) {
          out->row = i_;
          out->epoch = epoch_;
        }
        ++i_;
        return true;
      }

     private:
      int64_t n_, i_ = 0;
      uint64_t epoch_;
    };
    return std::make_unique<It>(source()->n, epoch);
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

  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
    const uint64_t pass =
        first_pass_ + (reshuffle_ ? passes_->fetch_add(1, std::memory_order_relaxed) : 0);
    return std::make_unique<It>(up_->make_iterator(epoch), Philox(seed_, pass));
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
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
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
    return std::make_unique<It>(up_->make_iterator(epoch), n_, index_);
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
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
    class It final : public DatasetNodeIterator {
     public:
      It(NodePtr node, int64_t count, uint64_t epoch)
          : node_(std::move(node)), count_(count), epoch_(epoch) {
        if (count_ != 0) up_ = node_->make_iterator(epoch_);
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
          up_ = node_->make_iterator(epoch_ + static_cast<uint64_t>(passes_));
        }
        return false;
      }

     private:
      NodePtr node_;
      int64_t count_;
      uint64_t epoch_;
      std::unique_ptr<DatasetNodeIterator> up_;
      int64_t passes_ = 0, produced_in_pass_ = 0;
    };
    return std::make_unique<It>(up_, count_, epoch);
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
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
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
    return std::make_unique<It>(up_->make_iterator(epoch), count_);
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
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const override {
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
    return std::make_unique<It>(up_->make_iterator(epoch), count_);
  }

  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<SkipNode>(std::move(up), count_) : nullptr;
  }

 private:
  NodePtr up_;
  int64_t count_;
};

// ---- with_epoch ----

class EpochNode final : public DatasetNode {
 public:
  EpochNode(NodePtr up, uint64_t epoch)
      : DatasetNode(up->source(), up->cardinality(), up->batched(),
                    str_cat(up->description(), ".with_epoch(", epoch, ")")),
        up_(std::move(up)),
        epoch_(epoch) {}
  std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t) const override {
    return up_->make_iterator(epoch_);
  }
  std::shared_ptr<const DatasetNode> with_row_window(int64_t begin, int64_t end) const override {
    auto up = up_->with_row_window(begin, end);
    return up ? std::make_shared<EpochNode>(std::move(up), epoch_) : nullptr;
  }

 private:
  NodePtr up_;
  uint64_t epoch_;
};

}  // namespace

int autotune_threads() { return detail::usable_cores(); }

bool read_row(const DatasetSource& src, int64_t row, uint64_t epoch, std::vector<Tensor>* out) {
  out->clear();
  std::vector<void*> dst;
  for (size_t c = 0; c < src.tensors.size(); ++c) {
    const Tensor& t = src.tensors[c];
    const std::vector<int64_t>& dims = t.shape().dims();
    out->push_back(
        Tensor::empty(Shape(std::vector<int64_t>(dims.begin() + 1, dims.end())), t.dtype()));
    dst.push_back(out->back().raw_data());
    if (!src.read)
      std::memcpy(
          dst.back(),
          static_cast<const char*>(t.raw_data()) + static_cast<size_t>(row) * src.row_bytes[c],
          src.row_bytes[c]);
  }
  if (!src.read || src.read(row, epoch, dst.data())) return true;
  src.skipped->fetch_add(1, std::memory_order_relaxed);
  out->clear();
  return false;
}

std::shared_ptr<const DatasetNode> make_source_node(std::shared_ptr<const DatasetSource> source) {
  return std::make_shared<SourceNode>(std::move(source));
}

namespace {

// ---- public iterator ----

class PublicIterator final : public Dataset::Iterator {
 public:
  PublicIterator(std::unique_ptr<DatasetNodeIterator> it, std::shared_ptr<const DatasetSource> src,
                 bool batched)
      : it_(std::move(it)), src_(std::move(src)), batched_(batched), skips_(*src_) {}
  bool next(std::vector<Tensor>* out) override {
    for (;;) {
      if (!it_) return false;
      DatasetElement e;
      if (!it_->next(&e)) {
        it_.reset();
        return false;
      }
      if (batched_) {
        skips_.add(e.tensors.empty() ? 0 : e.tensors[0].shape()[0], e.skipped);
        *out = std::move(e.tensors);
        return true;
      }
      const bool read = read_row(*src_, e.row, e.epoch, out);
      skips_.add(read ? 1 : 0, read ? 0 : 1);
      if (read) return true;  // else skipped: the next one
    }
  }

 private:
  std::unique_ptr<DatasetNodeIterator> it_;
  std::shared_ptr<const DatasetSource> src_;
  bool batched_;
  SkipRun skips_;
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
  return Dataset(detail::make_source_node(std::move(src)));
}

Dataset Dataset::from_reader(int64_t n, std::vector<RowSpec> components, RowReader read) {
  if (!read)
    throw InvalidArgument("Dataset::from_reader needs at least one component and a reader");
  const size_t k = components.size();
  return from_reader(
      n, std::move(components),
      [read = std::move(read), k](int64_t row, uint64_t, void* const* dst) {
        for (size_t c = 0; c < k; ++c) read(c, row, dst[c]);
        return true;
      },
      ReaderOptions{});
}

Dataset Dataset::from_reader(int64_t n, std::vector<RowSpec> components, ElementReader read,
                             const ReaderOptions& options) {
  if (n < 0) throw InvalidArgument(str_cat("Dataset::from_reader: n must be >= 0, got ", n));
  if (components.empty() || !read)
    throw InvalidArgument("Dataset::from_reader needs at least one component and a reader");
  int parallel = options.num_parallel_calls;
  if (parallel == kAutotune) parallel = detail::autotune_threads();
  if (parallel < 1)
    throw InvalidArgument(
        str_cat("Dataset::from_reader: num_parallel_calls must be >= 1 or "
                "kAutotune, got ",
                options.num_parallel_calls));
  auto src = std::make_shared<detail::DatasetSource>();
  src->parallel = parallel;
  src->epoch_dependent = options.epoch_dependent;
  src->name = options.name.empty() ? "from_reader" : options.name;
  src->fingerprint = options.fingerprint;
  for (const RowSpec& c : components) {
    std::vector<int64_t> dims = c.shape.dims();
    dims.insert(dims.begin(), 1);
    src->row_bytes.push_back(static_cast<size_t>(c.shape.numel()) * dtype_size(c.dtype));
    src->tensors.push_back(Tensor::zeros(Shape(dims), c.dtype));
  }
  src->n = n;
  src->read = std::move(read);
  return Dataset(detail::make_source_node(std::move(src)));
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
  return Dataset(detail::make_batch_node(node_, batch_size, drop_remainder));
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
  if (num_parallel_calls == kAutotune) num_parallel_calls = detail::autotune_threads();
  if (num_parallel_calls < 1)
    throw InvalidArgument(str_cat(
        "Dataset::map: num_parallel_calls must be >= 1 or kAutotune, got ", num_parallel_calls));
  return Dataset(detail::make_map_node(node_, std::move(fn), num_parallel_calls));
}

Dataset Dataset::with_epoch(uint64_t epoch) const {
  return Dataset(std::make_shared<detail::EpochNode>(node_, epoch));
}

int64_t Dataset::skipped_records() const {
  return node_->source()->skipped->load(std::memory_order_relaxed);
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
  return std::make_unique<detail::PublicIterator>(node_->make_iterator(0), node_->source(),
                                                  node_->batched());
}

}  // namespace dtrain
