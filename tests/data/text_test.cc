// The byte tokenizer, token files (1- and 2-byte, memory-mapped; truncated and missing files
// refused) and token_windows: exact windows, targets shifted by one, determinism per seed, ranges,
// and shards that split the windows without overlap.
#include "dtrain/data/text.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

namespace dtrain::text {
namespace {

std::string temp(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("dtrain_text_test_" + name)).string();
}

std::vector<std::vector<int32_t>> rows_of(const Dataset& ds, size_t component) {
  std::vector<std::vector<int32_t>> out;
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  while (it->next(&e)) out.push_back(e[component].to_vector<int32_t>());
  return out;
}

TEST(Text, ByteTokenizerRoundTrips) {
  ByteTokenizer tok;
  const std::string s = "Hello, \xc3\xa9t\xc3\xa9!\n";
  const std::vector<int32_t> ids = tok.encode(s);
  EXPECT_EQ(ids.size(), s.size());
  EXPECT_EQ(ids[0], 72);
  EXPECT_EQ(ids[7], 0xc3);
  EXPECT_EQ(tok.decode(ids), s);
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_THROW(tok.decode({65, 256}), InvalidArgument);
}

TEST(Text, TokenFilesOfOneAndTwoBytes) {
  const std::string p1 = temp("one.bin"), p2 = temp("two.bin");
  write_token_file(p1, {0, 7, 255, 3}, 1);
  write_token_file(p2, {0, 50256, 300, 65535}, 2);
  TokenFile f1(p1), f2(p2, 2);
  EXPECT_EQ(f1.size(), 4);
  EXPECT_EQ(f1[2], 255);
  EXPECT_EQ(f2.size(), 4);
  EXPECT_EQ(f2[1], 50256);
  std::vector<int32_t> out(3);
  f2.read(1, 3, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{50256, 300, 65535}));
  EXPECT_THROW(f2.read(2, 3, out.data()), InvalidArgument);
  EXPECT_THROW(write_token_file(p1, {256}, 1), InvalidArgument);
  // A 2-byte file cut mid-token is refused; so is a missing one.
  std::filesystem::resize_file(p2, 7);
  EXPECT_THROW(TokenFile(p2, 2), DataLoss);
  EXPECT_THROW(TokenFile(temp("missing.bin")), NotFound);
  std::filesystem::remove(p1);
  std::filesystem::remove(p2);
}

// A file cache of token windows holds what identifies them: another seed's (or range's) windows
// with the same count took the cached rows before.
TEST(Text, AFileCacheOfOtherWindowsIsRefused) {
  const std::string p = temp("cache_tokens.bin"), cache = temp("windows.cache");
  std::vector<int32_t> tokens(101);
  for (int i = 0; i < 101; ++i) tokens[static_cast<size_t>(i)] = i;
  write_token_file(p, tokens, 1);
  std::filesystem::remove(cache);
  auto file = std::make_shared<const TokenFile>(p);
  TokenWindowOptions o;
  o.sequence_length = 10;
  o.windows = 20;
  o.seed = 3;
  const auto first = rows_of(token_windows(file, o).cache(cache), 0);
  EXPECT_EQ(rows_of(token_windows(file, o).cache(cache), 0), first);  // the same windows: reused
  o.seed = 4;
  EXPECT_THROW(token_windows(file, o).cache(cache), InvalidArgument);
  o.seed = 3;
  o.begin = 1;
  EXPECT_THROW(token_windows(file, o).cache(cache), InvalidArgument);
  // A reader that says nothing of its data cannot have a file cache (it could be anyone's).
  const Dataset plain =
      Dataset::from_reader(4, {{Shape{1}, DType::kInt32}}, [](size_t, int64_t row, void* dst) {
        *static_cast<int32_t*>(dst) = static_cast<int32_t>(row);
      });
  try {
    plain.cache(cache + "2");
    ADD_FAILURE() << "a file cache of a reader without a fingerprint";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no fingerprint"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rows_of(plain.cache(), 0).size(), 4u);  // in memory: fine
  std::filesystem::remove(cache);
  std::filesystem::remove(p);
}

TEST(Text, WindowsAreExactShiftedAndDeterministic) {
  const std::string p = temp("windows.bin");
  std::vector<int32_t> tokens(101);
  for (int i = 0; i < 101; ++i) tokens[static_cast<size_t>(i)] = i;  // token i at position i
  write_token_file(p, tokens, 1);
  auto file = std::make_shared<const TokenFile>(p);
  TokenWindowOptions o;
  o.sequence_length = 10;
  o.random = false;
  const Dataset consecutive = token_windows(file, o);
  EXPECT_EQ(consecutive.cardinality(), 10);
  const auto x = rows_of(consecutive, 0), y = rows_of(consecutive, 1);
  for (int r = 0; r < 10; ++r)
    for (int j = 0; j < 10; ++j) {
      EXPECT_EQ(x[r][j], r * 10 + j);
      EXPECT_EQ(y[r][j], r * 10 + j + 1);
    }
  o.random = true;
  o.seed = 3;
  o.windows = 50;
  o.begin = 20;
  o.end = 80;
  const auto a = rows_of(token_windows(file, o), 0), b = rows_of(token_windows(file, o), 0);
  EXPECT_EQ(a, b);  // the seed decides
  std::set<int32_t> starts;
  for (const auto& w : a) {
    EXPECT_GE(w.front(), 20);
    EXPECT_LE(w.back() + 1, 79);  // the target of the last input is inside [begin, end)
    for (int j = 1; j < 10; ++j) EXPECT_EQ(w[j], w[0] + j);
    starts.insert(w.front());
  }
  EXPECT_GT(starts.size(), 20u);  // 50 draws over 50 possible starts
  o.seed = 4;
  EXPECT_NE(rows_of(token_windows(file, o), 0), a);
  // Batched, the rows come as [batch, T] int32.
  auto it = token_windows(file, o).batch(8).prefetch(2).make_iterator();
  std::vector<Tensor> e;
  ASSERT_TRUE(it->next(&e));
  EXPECT_EQ(e[0].shape(), (Shape{8, 10}));
  EXPECT_EQ(e[1].dtype(), DType::kInt32);
  // Shards split the windows: together every row once, none in both.
  o.random = false;
  o.begin = 0;
  o.end = -1;
  o.windows = 0;
  std::multiset<int32_t> seen;
  for (int s = 0; s < 3; ++s)
    for (const auto& w : rows_of(token_windows(file, o).shard(3, s), 0)) seen.insert(w.front());
  EXPECT_EQ(seen.size(), 10u);
  EXPECT_EQ(std::set<int32_t>(seen.begin(), seen.end()).size(), 10u);
  o.sequence_length = 200;
  EXPECT_THROW(token_windows(file, o), InvalidArgument);
  std::filesystem::remove(p);
}

}  // namespace
}  // namespace dtrain::text
