// Tests for Dataset: exact element order of every stage and of their compositions (checked
// against what tf.data yields for the same pipeline), shuffle determinism, cardinality, and the
// prefetch thread's error propagation and shutdown.
#include "dtrain/data/dataset.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

namespace dtrain {
namespace {

using Ids = std::vector<int>;

// Component 0: int32 [n] holding i. Component 1: float32 [n, 2, 3] holding 100 * i + k.
Dataset ids(int64_t n) {
  std::vector<int32_t> a(static_cast<size_t>(n));
  std::vector<float> b(static_cast<size_t>(n) * 6);
  for (int64_t i = 0; i < n; ++i) {
    a[i] = static_cast<int32_t>(i);
    for (int k = 0; k < 6; ++k) b[i * 6 + k] = static_cast<float>(100 * i + k);
  }
  return Dataset::from_tensors(
      {Tensor::from_vector(a, Shape{n}), Tensor::from_vector(b, Shape{n, 2, 3})});
}

// The ids in each element (one for unbatched pipelines), after checking that component 1 agrees
// with component 0 row by row, i.e. that both components were gathered with the same indices.
std::vector<Ids> collect(const Dataset& ds, size_t limit = 100000) {
  std::vector<Ids> out;
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  while (out.size() < limit && it->next(&e)) {
    EXPECT_EQ(e.size(), 2u);
    const int64_t rows = ds.is_batched() ? e[0].shape()[0] : 1;
    EXPECT_EQ(e[0].shape(), ds.is_batched() ? Shape{rows} : Shape{});
    EXPECT_EQ(e[1].shape(), ds.is_batched() ? (Shape{rows, 2, 3}) : (Shape{2, 3}));
    EXPECT_EQ(e[0].dtype(), DType::kInt32);
    EXPECT_EQ(e[1].dtype(), DType::kFloat32);
    const std::vector<int32_t> a = e[0].to_vector<int32_t>();
    const std::vector<float> b = e[1].to_vector<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int k = 0; k < 6; ++k) EXPECT_EQ(b[r * 6 + k], 100.0f * a[r] + k) << "row " << r;
    out.emplace_back(a.begin(), a.end());
  }
  return out;
}

Ids flat(const std::vector<Ids>& v) {
  Ids out;
  for (const Ids& x : v) out.insert(out.end(), x.begin(), x.end());
  return out;
}

Ids range(int begin, int end) {
  Ids v(static_cast<size_t>(end - begin));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

bool is_permutation_of_range(Ids v, int n) {
  std::sort(v.begin(), v.end());
  return v == range(0, n);
}

TEST(DatasetTest, FromTensorsValidates) {
  EXPECT_THROW(Dataset::from_tensors({}), InvalidArgument);
  EXPECT_THROW(Dataset::from_tensors({Tensor::zeros(Shape{3}), Tensor::zeros(Shape{4, 2})}),
               InvalidArgument);
  EXPECT_THROW(Dataset::from_tensors({Tensor::scalar(1.0f)}), InvalidArgument);
  EXPECT_THROW(Dataset::from_tensors({Tensor()}), InvalidArgument);
  Dataset empty = Dataset::from_tensors({Tensor::zeros(Shape{0, 5})});
  EXPECT_EQ(empty.cardinality(), 0);
  std::vector<Tensor> e;
  EXPECT_FALSE(empty.make_iterator()->next(&e));
  EXPECT_FALSE(empty.batch(4).make_iterator()->next(&e));
}

TEST(DatasetTest, UnbatchedElementsAreRowCopies) {
  Dataset ds = ids(5);
  EXPECT_EQ(ds.cardinality(), 5);
  EXPECT_EQ(ds.num_components(), 2u);
  EXPECT_FALSE(ds.is_batched());
  std::vector<Ids> got = collect(ds);
  EXPECT_EQ(flat(got), range(0, 5));
  EXPECT_EQ(got.size(), 5u);

  // Writing an element must not change the source.
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  ASSERT_TRUE(it->next(&e));
  e[0].data<int32_t>()[0] = 42;
  EXPECT_EQ(flat(collect(ds)), range(0, 5));
}

TEST(DatasetTest, BatchOrderAndRemainder) {
  Dataset ds = ids(10);
  EXPECT_EQ(collect(ds.batch(4)), (std::vector<Ids>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}));
  EXPECT_EQ(ds.batch(4).cardinality(), 3);
  EXPECT_TRUE(ds.batch(4).is_batched());
  EXPECT_EQ(collect(ds.batch(4, true)), (std::vector<Ids>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(ds.batch(4, true).cardinality(), 2);
  EXPECT_EQ(collect(ds.batch(5, true)).size(), 2u);
  EXPECT_EQ(collect(ds.batch(1)).size(), 10u);
  EXPECT_EQ(collect(ds.batch(64)), (std::vector<Ids>{range(0, 10)}));
  EXPECT_TRUE(collect(ds.batch(64, true)).empty());
  EXPECT_EQ(ds.batch(64, true).cardinality(), 0);
  EXPECT_THROW(ds.batch(0), InvalidArgument);
  EXPECT_THROW(ds.batch(2).batch(2), InvalidArgument);
}

TEST(DatasetTest, ShardKeepsEveryNthElement) {
  Dataset ds = ids(10);
  EXPECT_EQ(flat(collect(ds.shard(3, 1))), (Ids{1, 4, 7}));
  EXPECT_EQ(flat(collect(ds.shard(3, 0))), (Ids{0, 3, 6, 9}));
  EXPECT_EQ(flat(collect(ds.shard(3, 2))), (Ids{2, 5, 8}));
  EXPECT_EQ(ds.shard(3, 0).cardinality(), 4);
  EXPECT_EQ(ds.shard(3, 1).cardinality(), 3);
  EXPECT_EQ(ds.shard(1, 0).cardinality(), 10);
  EXPECT_EQ(ds.shard(20, 15).cardinality(), 0);
  EXPECT_TRUE(collect(ds.shard(20, 15)).empty());
  // After batch, shard keeps whole batches (the dropped ones are never gathered).
  EXPECT_EQ(collect(ds.batch(2).shard(2, 1)), (std::vector<Ids>{{2, 3}, {6, 7}}));
  EXPECT_EQ(ds.batch(2).shard(2, 1).cardinality(), 2);
  // shard then batch: each worker batches its own elements.
  EXPECT_EQ(collect(ds.shard(2, 1).batch(2)), (std::vector<Ids>{{1, 3}, {5, 7}, {9}}));
  EXPECT_THROW(ds.shard(0, 0), InvalidArgument);
  EXPECT_THROW(ds.shard(2, 2), InvalidArgument);
  EXPECT_THROW(ds.shard(2, -1), InvalidArgument);
}

TEST(DatasetTest, RepeatAndTake) {
  Dataset ds = ids(4);
  EXPECT_EQ(flat(collect(ds.repeat(2))), (Ids{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(ds.repeat(2).cardinality(), 8);
  EXPECT_EQ(ds.repeat().cardinality(), -1);
  EXPECT_EQ(ds.repeat(0).cardinality(), 0);
  EXPECT_TRUE(collect(ds.repeat(0)).empty());
  EXPECT_EQ(flat(collect(ds.repeat().take(10))), (Ids{0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(ds.repeat().take(10).cardinality(), 10);
  EXPECT_EQ(flat(collect(ds.take(3))), (Ids{0, 1, 2}));
  EXPECT_EQ(ds.take(3).cardinality(), 3);
  EXPECT_EQ(ds.take(100).cardinality(), 4);
  EXPECT_EQ(flat(collect(ds.take(100))), range(0, 4));
  EXPECT_EQ(ds.take(-1).cardinality(), 4);
  EXPECT_EQ(ds.repeat().take(-1).cardinality(), -1);
  EXPECT_TRUE(collect(ds.take(0)).empty());
  EXPECT_THROW(ds.repeat(-2), InvalidArgument);
  EXPECT_THROW(ds.take(-2), InvalidArgument);
  // repeat() of an empty dataset ends instead of spinning.
  Dataset empty = ids(8).take(0);
  EXPECT_EQ(empty.repeat().cardinality(), 0);
  EXPECT_TRUE(collect(empty.repeat()).empty());
}

TEST(DatasetTest, RepeatBatchOrderMatchesTfData) {
  Dataset ds = ids(10);
  // repeat -> batch: batches straddle the epoch boundary.
  EXPECT_EQ(
      collect(ds.repeat(2).batch(4)),
      (std::vector<Ids>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 0, 1}, {2, 3, 4, 5}, {6, 7, 8, 9}}));
  EXPECT_EQ(ds.repeat(2).batch(4).cardinality(), 5);
  // batch -> repeat: each epoch ends with its partial batch.
  EXPECT_EQ(
      collect(ds.batch(4).repeat(2)),
      (std::vector<Ids>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}, {0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}));
  EXPECT_EQ(ds.batch(4).repeat(2).cardinality(), 6);
  EXPECT_EQ(ds.batch(4).repeat().cardinality(), -1);
  EXPECT_EQ(collect(ds.batch(4).repeat(), 4).back(), (Ids{0, 1, 2, 3}));
  EXPECT_EQ(collect(ds.batch(4).take(2)), (std::vector<Ids>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(collect(ds.take(5).batch(2)), (std::vector<Ids>{{0, 1}, {2, 3}, {4}}));
}

TEST(DatasetTest, ShuffleIsADeterministicPermutation) {
  const Ids a = flat(collect(ids(100).shuffle(7)));
  const Ids b = flat(collect(ids(100).shuffle(7)));
  const Ids c = flat(collect(ids(100).shuffle(8)));
  EXPECT_TRUE(is_permutation_of_range(a, 100));
  EXPECT_TRUE(is_permutation_of_range(c, 100));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, range(0, 100));
  EXPECT_EQ(ids(100).shuffle(7).cardinality(), 100);
  // Seed 7's first pass is the same whether it comes from repeat or from make_iterator.
  EXPECT_EQ(flat(collect(ids(100).shuffle(7).repeat(2))).size(), 200u);
  const Ids r = flat(collect(ids(100).shuffle(7).repeat(2)));
  EXPECT_EQ(Ids(r.begin(), r.begin() + 100), a);
}

TEST(DatasetTest, ShuffleReshufflesEachPass) {
  // Each repeat epoch is a new permutation; the sequence of epochs is reproducible.
  const Ids r = flat(collect(ids(50).shuffle(3).repeat(3)));
  ASSERT_EQ(r.size(), 150u);
  Ids e0(r.begin(), r.begin() + 50), e1(r.begin() + 50, r.begin() + 100),
      e2(r.begin() + 100, r.end());
  EXPECT_TRUE(is_permutation_of_range(e0, 50));
  EXPECT_TRUE(is_permutation_of_range(e1, 50));
  EXPECT_TRUE(is_permutation_of_range(e2, 50));
  EXPECT_NE(e0, e1);
  EXPECT_NE(e1, e2);
  EXPECT_EQ(flat(collect(ids(50).shuffle(3).repeat(3))), r);

  // Iterating the same Dataset again (one make_iterator per epoch, as a fit loop does) also
  // reshuffles, continuing the same sequence of permutations.
  Dataset ds = ids(50).shuffle(3);
  EXPECT_EQ(flat(collect(ds)), e0);
  EXPECT_EQ(flat(collect(ds)), e1);
  EXPECT_EQ(flat(collect(ds.batch(7))), e2);  // derived datasets share the shuffle stage

  // Without reshuffling, every pass repeats permutation 0.
  Dataset fixed = ids(50).shuffle(3, false);
  EXPECT_EQ(flat(collect(fixed)), e0);
  EXPECT_EQ(flat(collect(fixed)), e0);
  const Ids fr = flat(collect(fixed.repeat(2)));
  EXPECT_EQ(Ids(fr.begin() + 50, fr.end()), e0);

  EXPECT_THROW(ids(5).repeat().shuffle(1), InvalidArgument);
}

TEST(DatasetTest, ShuffleBatchRepeatVersusRepeatBatch) {
  // shuffle -> batch -> repeat: per epoch a permutation, ending with a partial batch.
  std::vector<Ids> sbr = collect(ids(10).shuffle(1).batch(4).repeat(2));
  ASSERT_EQ(sbr.size(), 6u);
  std::vector<size_t> sizes;
  for (const Ids& b : sbr) sizes.push_back(b.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{4, 4, 2, 4, 4, 2}));
  const Ids f = flat(sbr);
  EXPECT_TRUE(is_permutation_of_range(Ids(f.begin(), f.begin() + 10), 10));
  EXPECT_TRUE(is_permutation_of_range(Ids(f.begin() + 10, f.end()), 10));

  // shuffle -> repeat -> batch: the same element stream, batched across the epoch boundary.
  std::vector<Ids> srb = collect(ids(10).shuffle(1).repeat(2).batch(4));
  sizes.clear();
  for (const Ids& b : srb) sizes.push_back(b.size());
  EXPECT_EQ(sizes, (std::vector<size_t>{4, 4, 4, 4, 4}));
  EXPECT_EQ(flat(srb), f);
}

TEST(DatasetTest, ShuffleAfterBatchPermutesWholeBatches) {
  std::vector<Ids> got = collect(ids(12).batch(3).shuffle(5));
  ASSERT_EQ(got.size(), 4u);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<Ids>{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9, 10, 11}}));
}

TEST(DatasetTest, ShuffleIsRoughlyUniform) {
  // All 6 orders of 3 elements over 6000 reshuffled passes: each expected 1000 times
  // (standard deviation ~29), so [850, 1150] fails only for a broken shuffle.
  Dataset ds = ids(3).shuffle(11);
  std::map<Ids, int> counts;
  for (int i = 0; i < 6000; ++i) ++counts[flat(collect(ds))];
  EXPECT_EQ(counts.size(), 6u);
  for (const auto& [order, n] : counts) {
    EXPECT_GT(n, 850);
    EXPECT_LT(n, 1150);
  }
}

TEST(DatasetTest, PrefetchYieldsTheSameSequence) {
  auto pipeline = [] { return ids(37).shuffle(9).batch(5).repeat(3); };
  const std::vector<Ids> plain = collect(pipeline());
  EXPECT_EQ(collect(pipeline().prefetch(2)), plain);
  EXPECT_EQ(collect(pipeline().prefetch(1).prefetch(3)), plain);
  EXPECT_EQ(pipeline().prefetch(2).cardinality(), pipeline().cardinality());
  EXPECT_EQ(flat(collect(ids(20).shuffle(4).prefetch(1))), flat(collect(ids(20).shuffle(4))));
  EXPECT_EQ(collect(ids(10).prefetch(2).batch(4)), collect(ids(10).batch(4)));
  EXPECT_THROW(ids(3).prefetch(0), InvalidArgument);
}

TEST(DatasetTest, MapTransformsBatches) {
  Dataset ds = ids(6).batch(4).map([](std::vector<Tensor> e) {
    std::vector<int32_t> a = e[0].to_vector<int32_t>();
    for (int32_t& x : a) x *= 2;
    e[0] = Tensor::from_vector(a, e[0].shape());
    return e;
  });
  EXPECT_EQ(ds.cardinality(), 2);
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  ASSERT_TRUE(it->next(&e));
  EXPECT_EQ(e[0].to_vector<int32_t>(), (std::vector<int32_t>{0, 2, 4, 6}));
  ASSERT_TRUE(it->next(&e));
  EXPECT_EQ(e[0].to_vector<int32_t>(), (std::vector<int32_t>{8, 10}));
  EXPECT_FALSE(it->next(&e));
  EXPECT_THROW(ids(3).map([](std::vector<Tensor> e) { return e; }), InvalidArgument);
  EXPECT_THROW(ids(3).batch(2).map(nullptr), InvalidArgument);
  auto bad = ids(3).batch(2).map([](std::vector<Tensor> e) { return std::vector<Tensor>{e[0]}; });
  EXPECT_THROW(bad.make_iterator()->next(&e), InvalidArgument);
}

// map(num_parallel_calls = N): the same batches in the same order as one call at a time, whatever
// the threads' timing (later batches are made to finish first), with each batch's index; N calls
// really run at once; errors come out in order, after the batches before them.
TEST(DatasetTest, ParallelMapKeepsOrderAndRunsConcurrently) {
  const auto tag = [](std::vector<Tensor> e, int64_t index) {
    // Early batches sleep longest, so a pool that returned results as they finish would reorder.
    std::this_thread::sleep_for(std::chrono::milliseconds(index < 4 ? 12 - 3 * index : 0));
    std::vector<int32_t> a = e[0].to_vector<int32_t>();
    std::vector<float> b = e[1].to_vector<float>();
    for (size_t r = 0; r < a.size(); ++r) {  // keeps component 1 = 100 * component 0 + k
      const int32_t t = a[r] * 10 + static_cast<int32_t>(index % 10);
      for (size_t k = 0; k < 6; ++k) b[r * 6 + k] += 100.f * static_cast<float>(t - a[r]);
      a[r] = t;
    }
    e[0] = Tensor::from_vector(a, e[0].shape());
    e[1] = Tensor::from_vector(b, e[1].shape());
    return e;
  };
  const Dataset base = ids(37).shuffle(5, false).batch(4);
  const std::vector<Ids> serial = collect(base.map_with_index(tag));
  ASSERT_EQ(serial.size(), 10u);
  EXPECT_EQ(serial[2][0], collect(base)[2][0] * 10 + 2);
  for (int n : {2, 3, 8, Dataset::kAutotune}) {
    EXPECT_EQ(collect(base.map_with_index(tag, n)), serial) << n;
    EXPECT_EQ(collect(base.map_with_index(tag, n).prefetch(2)), serial) << n;
  }
  EXPECT_EQ(base.map_with_index(tag, 3).cardinality(), 10);
  // Several calls at once: with 3 threads the peak of concurrent calls reaches 3.
  auto running = std::make_shared<std::atomic<int>>(0);
  auto peak = std::make_shared<std::atomic<int>>(0);
  const Dataset counted = ids(24).batch(2).map(
      [running, peak](std::vector<Tensor> e) {
        const int now = ++*running;
        int seen = peak->load();
        while (now > seen && !peak->compare_exchange_weak(seen, now)) {
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        --*running;
        return e;
      },
      3);
  EXPECT_EQ(collect(counted).size(), 12u);
  EXPECT_GE(peak->load(), 2);  // 3 unless the machine is loaded enough to stagger them
  EXPECT_LE(peak->load(), 3);
  // An error in batch 3 arrives after batches 0-2, in order.
  auto failing = ids(20).batch(4).map_with_index(
      [](std::vector<Tensor> e, int64_t i) {
        if (i == 3) throw DataLoss("injected failure in batch 3");
        return e;
      },
      4);
  auto it = failing.make_iterator();
  std::vector<Tensor> e;
  for (int b = 0; b < 3; ++b) ASSERT_TRUE(it->next(&e)) << b;
  EXPECT_EQ(e[0].to_vector<int32_t>(), (std::vector<int32_t>{8, 9, 10, 11}));
  EXPECT_THROW(it->next(&e), DataLoss);
  EXPECT_THROW(ids(8).batch(2).map([](std::vector<Tensor> x) { return x; }, 0), InvalidArgument);
  // An iterator destroyed with calls in flight joins its threads.
  auto slow = ids(40).batch(2).map(
      [](std::vector<Tensor> x) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return x;
      },
      4);
  auto it2 = slow.make_iterator();
  ASSERT_TRUE(it2->next(&e));
  it2.reset();
}

TEST(DatasetTest, PrefetchRethrowsProducerErrorsAfterEarlierElements) {
  auto failing =
      ids(20).batch(4).map([n = std::make_shared<std::atomic<int>>(0)](std::vector<Tensor> e) {
        if (++*n == 3) throw DataLoss("injected failure in batch 3");
        return e;
      });
  auto it = failing.prefetch(2).make_iterator();
  std::vector<Tensor> e;
  ASSERT_TRUE(it->next(&e));
  EXPECT_EQ(e[0].to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 2, 3}));
  ASSERT_TRUE(it->next(&e));
  EXPECT_EQ(e[0].to_vector<int32_t>(), (std::vector<int32_t>{4, 5, 6, 7}));
  try {
    it->next(&e);
    FAIL() << "expected DataLoss";
  } catch (const DataLoss& err) {
    EXPECT_NE(std::string(err.what()).find("injected failure in batch 3"), std::string::npos);
  }
  EXPECT_THROW(it->next(&e), DataLoss);  // the iterator stays failed
}

TEST(DatasetTest, PrefetchIteratorDestructionDoesNotHang) {
  const auto start = std::chrono::steady_clock::now();
  Dataset big = Dataset::from_tensors({Tensor::zeros(Shape{1000, 784})}).repeat().batch(64);
  for (int buffer : {1, 2, 8}) {
    { auto never_used = big.prefetch(buffer).make_iterator(); }
    {
      auto it = big.prefetch(buffer).prefetch(buffer).make_iterator();
      std::vector<Tensor> e;
      ASSERT_TRUE(it->next(&e));
      EXPECT_EQ(e[0].shape(), (Shape{64, 784}));
    }
    {
      // take() after prefetch releases the producer when it is done.
      auto it = big.prefetch(buffer).take(3).make_iterator();
      std::vector<Tensor> e;
      int n = 0;
      while (it->next(&e)) ++n;
      EXPECT_EQ(n, 3);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // A producer blocked inside a stage's full pass (shuffle drains its input first).
    { auto it = ids(200000).shuffle(1).batch(8).prefetch(buffer).make_iterator(); }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST(DatasetTest, IteratorsRunConcurrently) {
  Dataset ds = ids(500).shuffle(2, false).batch(16).prefetch(2);
  const std::vector<Ids> expected = collect(ds);
  std::vector<std::vector<Ids>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = collect(ds); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

TEST(DatasetTest, CardinalityOfCompositions) {
  Dataset ds = ids(60000);
  EXPECT_EQ(ds.shuffle(1).batch(64).cardinality(), 938);
  EXPECT_EQ(ds.shuffle(1).batch(64, true).cardinality(), 937);
  EXPECT_EQ(ds.shard(4, 3).batch(64).cardinality(), 235);
  EXPECT_EQ(ds.batch(64).repeat(3).cardinality(), 938 * 3);
  EXPECT_EQ(ds.repeat(3).batch(64).cardinality(), (180000 + 63) / 64);
  EXPECT_EQ(ds.repeat().batch(64).take(100).prefetch().cardinality(), 100);
  EXPECT_EQ(ds.repeat().batch(64).prefetch().cardinality(), -1);
  EXPECT_EQ(ds.batch(64).shard(3, 2).cardinality(), 312);
  EXPECT_EQ(ds.batch(64).map([](std::vector<Tensor> e) { return e; }).cardinality(), 938);
}

TEST(DatasetTest, LargeGatherMatchesSource) {
  const int64_t n = 60000;
  std::vector<float> px(static_cast<size_t>(n) * 784);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<float>(i % 1000003);
  std::vector<int32_t> labels(static_cast<size_t>(n));
  std::iota(labels.begin(), labels.end(), 0);
  Dataset ds = Dataset::from_tensors({Tensor::from_vector(px, Shape{n, 28, 28, 1}),
                                      Tensor::from_vector(labels, Shape{n})})
                   .shuffle(42)
                   .batch(64)
                   .prefetch(2);
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  int64_t batches = 0, rows = 0;
  std::vector<bool> seen(static_cast<size_t>(n), false);
  while (it->next(&e)) {
    ASSERT_EQ(e[0].shape()[1], 28);
    const float* img = e[0].data<float>();
    const int32_t* lab = e[1].data<int32_t>();
    for (int64_t r = 0; r < e[1].shape()[0]; ++r) {
      const int64_t src = lab[r];
      ASSERT_FALSE(seen[src]);
      seen[src] = true;
      for (int k : {0, 391, 783})
        ASSERT_EQ(img[r * 784 + k], px[static_cast<size_t>(src) * 784 + k]);
    }
    rows += e[1].shape()[0];
    ++batches;
  }
  EXPECT_EQ(batches, 938);
  EXPECT_EQ(rows, n);
}

TEST(DatasetTest, ToStringDescribesThePipeline) {
  EXPECT_EQ(
      ids(10).shuffle(1).batch(4, true).prefetch(2).to_string(),
      "from_tensors(n=10, components=2).shuffle(seed=1).batch(4, drop_remainder=true).prefetch(2)");
}

}  // namespace
}  // namespace dtrain
