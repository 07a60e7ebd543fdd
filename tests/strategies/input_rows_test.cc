// The input pipeline of a multi-worker DATA-sharded job copies only the rows of each global batch
// that the worker's replicas take (RowWindowIterator, used by Strategy::distribute_dataset): the
// rows it yields, the whole batch's row count, and which pipelines cut inside batch() itself.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "data/row_window.h"
#include "dtrain/core/error.h"
#include "dtrain/data/dataset.h"

namespace dtrain {
namespace {

// Component 0: int32 [n] holding i; component 1: float32 [n, 3] holding 10 * i + k.
Dataset ids(int64_t n) {
  std::vector<int32_t> a(static_cast<size_t>(n));
  std::vector<float> b(static_cast<size_t>(n) * 3);
  for (int64_t i = 0; i < n; ++i) {
    a[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    for (int k = 0; k < 3; ++k) b[static_cast<size_t>(i * 3 + k)] = static_cast<float>(10 * i + k);
  }
  return Dataset::from_tensors(
      {Tensor::from_vector(a, Shape{n}), Tensor::from_vector(b, Shape{n, 3})});
}

struct Batch {
  std::vector<int32_t> ids;
  int64_t batch_rows;
};

// Every element of the windowed pipeline, after checking that both components hold the same rows.
std::vector<Batch> windowed(const Dataset& ds, int64_t begin, int64_t end,
                            bool expect_pushed_down) {
  detail::RowWindowIterator it(ds, begin, end);
  EXPECT_EQ(it.gathers_window_only(), expect_pushed_down) << ds.to_string();
  std::vector<Batch> out;
  std::vector<Tensor> e;
  int64_t rows = -1;
  while (it.next(&e, &rows)) {
    EXPECT_EQ(e.size(), 2u);
    const std::vector<int32_t> a = e[0].to_vector<int32_t>();
    const std::vector<float> b = e[1].to_vector<float>();
    EXPECT_EQ(e[1].shape(), (Shape{static_cast<int64_t>(a.size()), 3}));
    for (size_t r = 0; r < a.size(); ++r)
      for (int k = 0; k < 3; ++k)
        EXPECT_EQ(b[r * 3 + static_cast<size_t>(k)],
                  10.0f * static_cast<float>(a[r]) + static_cast<float>(k));
    out.push_back({a, rows});
  }
  return out;
}

// The same rows cut from the whole batches of the plain pipeline.
std::vector<Batch> cut(const Dataset& ds, int64_t begin, int64_t end) {
  std::vector<Batch> out;
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  while (it->next(&e)) {
    const std::vector<int32_t> a = e[0].to_vector<int32_t>();
    const int64_t n = static_cast<int64_t>(a.size());
    out.push_back(
        {std::vector<int32_t>(a.begin() + std::min(begin, n), a.begin() + std::min(end, n)), n});
  }
  return out;
}

void expect_same(const std::vector<Batch>& got, const std::vector<Batch>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].ids, want[i].ids) << "batch " << i;
    EXPECT_EQ(got[i].batch_rows, want[i].batch_rows) << "batch " << i;
  }
}

TEST(InputRows, BatchGathersOnlyTheWindowThroughPassThroughStages) {
  // 47 rows in batches of 10: the last batch has 7 rows. (Not reshuffled: the windowed pass and
  // the plain one it is compared with would otherwise be two passes of the shuffle.)
  const Dataset plain = ids(47).shuffle(5, false).batch(10);
  for (const Dataset& ds : {plain, plain.prefetch(2), plain.skip(1).take(4).prefetch(1),
                            plain.repeat(2).shard(2, 1), plain.prefetch(1).prefetch(2)}) {
    for (const auto& [b, e] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 8}, {8, 10}, {3, 3}, {6, 20}}) {
      SCOPED_TRACE(ds.to_string() + " rows " + std::to_string(b) + ":" + std::to_string(e));
      const std::vector<Batch> got = windowed(ds, b, e, true);
      expect_same(got, cut(ds, b, e));
    }
  }
  // The short last batch (7 rows): a window [8, 10) past its end yields no rows, but says 7.
  const std::vector<Batch> tail = windowed(plain, 8, 10, true);
  ASSERT_EQ(tail.size(), 5u);
  EXPECT_TRUE(tail.back().ids.empty());
  EXPECT_EQ(tail.back().batch_rows, 7);
  EXPECT_EQ(tail.front().ids.size(), 2u);
  EXPECT_EQ(tail.front().batch_rows, 10);
}

TEST(InputRows, WindowsOfOneBatchPartitionIt) {
  // Three workers' windows (4 + 4 + 2 rows of a batch of 10) put back together are the batch.
  const Dataset ds = ids(30).shuffle(3, false).batch(10).prefetch(2);
  const std::vector<Batch> a = windowed(ds, 0, 4, true), b = windowed(ds, 4, 8, true),
                           c = windowed(ds, 8, 10, true);
  const std::vector<Batch> whole = cut(ds, 0, 10);
  ASSERT_EQ(whole.size(), 3u);
  for (size_t i = 0; i < whole.size(); ++i) {
    std::vector<int32_t> joined = a[i].ids;
    joined.insert(joined.end(), b[i].ids.begin(), b[i].ids.end());
    joined.insert(joined.end(), c[i].ids.begin(), c[i].ids.end());
    EXPECT_EQ(joined, whole[i].ids);
  }
}

TEST(InputRows, AfterAMapTheWholeBatchIsMadeAndCut) {
  // map() sees whole batches (its function may depend on every row), so the window is cut after it.
  const Dataset ds = ids(25).batch(10).map([](std::vector<Tensor> e) {
    std::vector<int32_t> a = e[0].to_vector<int32_t>();
    const int32_t rows = static_cast<int32_t>(a.size());
    for (int32_t& x : a) x += 1000 * rows;  // depends on the whole batch
    e[0] = Tensor::from_vector(a, e[0].shape());
    std::vector<float> b = e[1].to_vector<float>();
    for (float& x : b) x += 10000.0f * static_cast<float>(rows);
    e[1] = Tensor::from_vector(b, e[1].shape());
    return e;
  });
  const std::vector<Batch> got = windowed(ds.prefetch(2), 5, 9, false);
  expect_same(got, cut(ds, 5, 9));
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].ids, (std::vector<int32_t>{10005, 10006, 10007, 10008}));
  EXPECT_TRUE(got[2].ids.empty());
  EXPECT_EQ(got[2].batch_rows, 5);
}

TEST(InputRows, RefusesAnUnbatchedDatasetAndANegativeRow) {
  EXPECT_THROW(detail::RowWindowIterator(ids(5), 0, 2), InvalidArgument);
  EXPECT_THROW(detail::RowWindowIterator(ids(5).batch(2), -1, 2), InvalidArgument);
}

// A repeat() of rows that all fail to read gave a worker empty windows for good (its job trained on
// nothing): DataLoss once more rows than twice the source's were skipped in a row, in the window
// batch() gathers and in one cut after a map(); an empty window of a short last batch counts none.
TEST(InputRows, ARepeatOfRowsThatAllFailEndsWithDataLoss) {
  const Dataset none = Dataset::from_reader(
      5, {{Shape{2}, DType::kFloat32}}, [](int64_t, uint64_t, void* const*) { return false; },
      Dataset::ReaderOptions{1, false, "unreadable", ""});
  for (const Dataset& d : {none.repeat().batch(4), none.repeat().batch(4).prefetch(2),
                           none.repeat().batch(4).map([](std::vector<Tensor> t) { return t; })}) {
    detail::RowWindowIterator it(d, 0, 2);
    std::vector<Tensor> e;
    int64_t rows = 0;
    try {
      for (int i = 0; i < 100 && it.next(&e, &rows);) ++i;
      ADD_FAILURE() << "no DataLoss from " << d.to_string();
    } catch (const DataLoss& err) {
      EXPECT_NE(std::string(err.what()).find("more than twice its 5"), std::string::npos)
          << err.what();
    }
  }
  // Windows past a short batch's end are empty with nothing skipped: no error, ever.
  detail::RowWindowIterator past(ids(3).repeat(50).batch(4), 3, 4);
  std::vector<Tensor> e;
  int64_t rows = 0, batches = 0;
  while (past.next(&e, &rows)) ++batches;
  EXPECT_EQ(batches, 38);
}

}  // namespace
}  // namespace dtrain
