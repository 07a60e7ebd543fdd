// Private to the library: iterating a batched Dataset for a process that takes only some rows of
// every batch (multi-worker DATA sharding), so that the other rows are never copied.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/data/dataset.h"

namespace dtrain::detail {

class DatasetNodeIterator;
class SkipRun;

class RowWindowIterator {
 public:
  // Rows [begin, end) of every batch of `dataset` (which must be batched): batch() gathers only
  // those when every stage after it passes batches through whole (prefetch, take, skip, repeat,
  // shard); after a map() the whole batch is made and then cut (a view, no copy).
  RowWindowIterator(const Dataset& dataset, int64_t begin, int64_t end);
  ~RowWindowIterator();
  // The next batch's rows [begin, end) (fewer, or none, when the batch is shorter), and in
  // *batch_rows the rows of the whole batch; false at the end. DataLoss when more rows than twice
  // the source's were skipped in a row (ignore_errors: a whole pass failed to read), as
  // Dataset::Iterator does.
  bool next(std::vector<Tensor>* out, int64_t* batch_rows);
  // True when batch() copies only the window's rows.
  bool gathers_window_only() const { return pushed_down_; }

 private:
  std::unique_ptr<DatasetNodeIterator> it_;
  int64_t begin_, end_;
  bool pushed_down_ = false;
  std::unique_ptr<SkipRun> skips_;
};

}  // namespace dtrain::detail
