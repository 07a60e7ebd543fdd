// Private to src/data: the stages a Dataset is made of.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/core/tensor.h"

namespace dtrain::detail {

// One element in flight between stages. Until batch() an element is a row index into the source
// (tensors empty); batch() turns rows into tensors, and later stages pass those along.
struct DatasetElement {
  int64_t row = -1;
  uint64_t epoch = 0;  // the pass's epoch the source was iterated with: the reader gets it
  std::vector<Tensor> tensors;
  int64_t batch_rows = -1;  // a batch cut to a row window: the rows of the whole batch
  int64_t skipped = 0;      // a batch: its rows the reader skipped (ignore_errors)
};

// Internal iterator: next(nullptr) advances without materialising (shard uses it to skip
// elements it drops, so skipped batches are never gathered).
class DatasetNodeIterator {
 public:
  virtual ~DatasetNodeIterator() = default;
  virtual bool next(DatasetElement* out) = 0;
};

struct DatasetSource {
  std::vector<Tensor> tensors;  // CPU, leading dim n; with `read`, one prototype row [1, ...]
  int64_t n = 0;
  std::vector<size_t> row_bytes;  // per component
  // Set for Dataset::from_reader: row `row` (every component, dst[c]) is written by this function
  // instead of copied out of tensors; false: the row is skipped (ignore_errors), and counted.
  std::function<bool(int64_t row, uint64_t epoch, void* const* dst)> read;
  int parallel = 1;              // threads batch() reads a batch's rows on
  bool epoch_dependent = false;  // read() depends on the epoch (random augmentation)
  std::string name = "from_tensors";
  std::string suffix;       // after the source in to_string(): ".cache()"
  std::string fingerprint;  // identifies the data (cache files check it)
  std::shared_ptr<std::atomic<int64_t>> skipped = std::make_shared<std::atomic<int64_t>>(0);
};

// The rows a reader skipped in a row (ignore_errors) over what an iterator yields: DataLoss once
// they are more than twice the source's rows, as such a run holds a whole pass whose every row
// failed (a repeat() of it would never yield anything). Not once the source's count: a pass's
// last bad rows and the next pass's first, in another order, can make a run that long with half
// the rows bad.
class SkipRun {
 public:
  explicit SkipRun(const DatasetSource& src) : name_(src.name), rows_(src.n) {}
  // An element that yielded `kept` rows, the reader having skipped `skipped`.
  void add(int64_t kept, int64_t skipped) {
    run_ = kept > 0 ? 0 : run_ + skipped;
    if (run_ > 2 * rows_)
      throw DataLoss(str_cat(name_, ": ", run_,
                             " rows skipped in a row (ignore_errors), more than twice its ", rows_,
                             ": a whole pass failed to read; check the files"));
  }

 private:
  std::string name_;
  int64_t rows_;
  int64_t run_ = 0;
};

// kAutotune's thread count: the cores this process may run on (its affinity: taskset, cgroups'
// cpusets), at least 1.
int autotune_threads();

// Reads one row of every component into freshly allocated row tensors (the unbatched element);
// false when the reader skipped it.
bool read_row(const DatasetSource& src, int64_t row, uint64_t epoch, std::vector<Tensor>* out);

class DatasetNode {
 public:
  DatasetNode(std::shared_ptr<const DatasetSource> source, int64_t cardinality, bool batched,
              std::string description)
      : source_(std::move(source)),
        cardinality_(cardinality),
        batched_(batched),
        description_(std::move(description)) {}
  virtual ~DatasetNode() = default;
  // A fresh pass; `epoch` reaches the source's reader (Dataset::with_epoch sets it; the k-th
  // repetition of repeat() adds k).
  virtual std::unique_ptr<DatasetNodeIterator> make_iterator(uint64_t epoch) const = 0;
  // True for the source node itself (cache() wraps only a source).
  virtual bool is_source() const { return false; }
  // The same pipeline, except that every batch keeps only its rows [begin, end) (fewer at the end
  // of a short batch), gathered by batch() itself so the other rows are never copied; each element
  // records the rows of the whole batch in batch_rows. nullptr when a stage between here and
  // batch() needs the whole batch (map()). Only called on batched nodes.
  virtual std::shared_ptr<const DatasetNode> with_row_window(int64_t /*begin*/,
                                                             int64_t /*end*/) const {
    return nullptr;
  }

  const std::shared_ptr<const DatasetSource>& source() const { return source_; }
  int64_t cardinality() const { return cardinality_; }
  bool batched() const { return batched_; }
  const std::string& description() const { return description_; }

 private:
  std::shared_ptr<const DatasetSource> source_;
  int64_t cardinality_;
  bool batched_;
  std::string description_;
};

}  // namespace dtrain::detail

#include "dtrain/data/dataset.h"

namespace dtrain::detail {

// The library's access to a Dataset's stages.
struct DatasetAccess {
  static const std::shared_ptr<const DatasetNode>& node(const Dataset& d) { return d.node_; }
  static Dataset make(std::shared_ptr<const DatasetNode> n) { return Dataset(std::move(n)); }
};

// The batch stage (batch_node.cc): gathers rows [begin, end) of every batch (end < 0: all).
std::shared_ptr<const DatasetNode> make_batch_node(std::shared_ptr<const DatasetNode> up,
                                                   int64_t batch_size, bool drop, int64_t begin = 0,
                                                   int64_t end = -1);
// A source node over `source` (from_tensors, from_reader, cache()).
std::shared_ptr<const DatasetNode> make_source_node(std::shared_ptr<const DatasetSource> source);
// The prefetch stage (prefetch_node.cc): produces elements of `up` on a background thread.
std::shared_ptr<const DatasetNode> make_prefetch_node(std::shared_ptr<const DatasetNode> up,
                                                      int buffer);
// The map stage (map_node.cc): fn(element, its index in the pass) on `parallel` threads (1: the
// consumer's), results in order.
std::shared_ptr<const DatasetNode> make_map_node(
    std::shared_ptr<const DatasetNode> up,
    std::function<std::vector<Tensor>(std::vector<Tensor>, int64_t)> fn, int parallel);

}  // namespace dtrain::detail
