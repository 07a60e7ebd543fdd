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
  skips_ = std::make_unique<SkipRun>(*node->source());
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
  skips_->add(e.tensors.empty() ? 0 : e.tensors[0].shape()[0], e.skipped);
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
