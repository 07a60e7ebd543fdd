// RowWindowIterator (row_window.h): a worker's window of every global batch, gathered by batch()
// itself when the stages after it pass batches through whole, else cut from the whole batch.
#include "data/row_window.h"

#include <algorithm>

#include "data/dataset_node.h"
#include "dtrain/core/error.h"

namespace dtrain {
namespace detail {

RowWindowIterator::RowWindowIterator(const Dataset& dataset, int64_t begin, int64_t end)
    : begin_(begin), end_(std::max(begin, end)) {
  const auto& node = DatasetAccess::node(dataset);
  if (!node->batched())
    throw InvalidArgument("a row window needs a batched dataset: call .batch() first");
  if (begin < 0)
    throw InvalidArgument(str_cat("row window [", begin, ", ", end, "): begin must be >= 0"));
  source_rows_ = node->source()->n;
  source_name_ = node->source()->name;
  if (auto windowed = node->with_row_window(begin_, end_)) {
    pushed_down_ = true;
    it_ = windowed->make_iterator(0);
  } else {
    it_ = node->make_iterator(0);
  }
}

RowWindowIterator::~RowWindowIterator() = default;

bool RowWindowIterator::next(std::vector<Tensor>* out, int64_t* batch_rows) {
  if (!it_) return false;
  DatasetElement e;
  if (!it_->next(&e)) {
    it_.reset();
    return false;
  }
  const bool empty = e.tensors.empty() || e.tensors[0].shape()[0] == 0;
  skipped_in_a_row_ = empty ? skipped_in_a_row_ + e.skipped : 0;
  if (skipped_in_a_row_ > 2 * source_rows_)
    throw DataLoss(str_cat(source_name_, ": ", skipped_in_a_row_,
                           " rows skipped in a row (ignore_errors), more than twice its ",
                           source_rows_, ": a whole pass failed to read; check the files"));
  if (pushed_down_) {
    DTRAIN_CHECK(e.batch_rows >= 0, "a windowed batch() did not record its rows");
    *batch_rows = e.batch_rows;
    *out = std::move(e.tensors);
    return true;
  }
  const int64_t n = e.tensors.empty() ? 0 : e.tensors[0].shape()[0];
  *batch_rows = n;
  out->clear();
  for (const Tensor& t : e.tensors)
    out->push_back(t.slice_rows(std::min(begin_, n), std::min(end_, n)));
  return true;
}

}  // namespace detail
}  // namespace dtrain
