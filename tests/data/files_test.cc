// Input pipelines from files: image folders (labels, splits, errors, skipping), TFRecord files
// (TensorFlow-written files read back exactly, tf.data's interleave order, a corpus of corrupted
// files refused or skipped), parallel reading equal to serial, cache() in memory and in a file,
// and with_epoch() reaching the reader.
#include "dtrain/data/files.h"

#include <gtest/gtest.h>

#include <boost/crc.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "data/input_test_util.h"
#include "data/testdata_dir.h"
#include "dtrain/core/error.h"
#include "dtrain/data/image.h"

namespace dtrain::data {
namespace {

using namespace test_util;  // NOLINT(google-build-using-namespace): the test helpers
namespace fs = std::filesystem;

// ---- image folders ----

// root/<class>/<k>.png for classes "b_cats" (3 images), "a_dogs" (2), "c_owls" (1): gray 4 x 4,
// pixel value 10 * (row in sorted order) + 5.
fs::path make_folder(const std::string& name) {
  const fs::path root = temp_dir(name);
  const std::vector<std::pair<std::string, int>> classes = {
      {"b_cats", 3}, {"a_dogs", 2}, {"c_owls", 1}};
  std::map<std::string, int> first = {{"a_dogs", 0}, {"b_cats", 2}, {"c_owls", 5}};
  for (const auto& [cls, n] : classes)
    for (int k = 0; k < n; ++k)
      write(root / cls / (std::to_string(k) + ".png"),
            image::encode_png(marked(4, 4, 10 * (first[cls] + k) + 5)));
  write(root / "b_cats" / "notes.txt", "not an image");
  return root;
}

ImageFolderOptions gray4() {
  ImageFolderOptions o;
  o.transform.height = o.transform.width = 4;
  o.transform.channels = 1;
  return o;
}

TEST(ImageFolder, LabelsFromSortedFoldersAndExactPixels) {
  const fs::path root = make_folder("labels");
  const ImageFolder f = image_dataset_from_directory(root.string(), gray4());
  EXPECT_EQ(f.class_names, (std::vector<std::string>{"a_dogs", "b_cats", "c_owls"}));
  EXPECT_EQ(f.labels, (std::vector<int32_t>{0, 0, 1, 1, 1, 2}));
  ASSERT_EQ(f.dataset.cardinality(), 6);
  const auto batches = all_batches(f.dataset.batch(4));
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0][0].shape(), (Shape{4, 4, 4, 1}));
  EXPECT_EQ(batches[1][1].to_vector<int32_t>(), (std::vector<int32_t>{1, 2}));
  const std::vector<float> px = batches[0][0].to_vector<float>();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(px[static_cast<size_t>(r * 16)], static_cast<float>(10 * r + 6));  // the mark
    EXPECT_EQ(px[static_cast<size_t>(r * 16 + 5)], static_cast<float>(10 * r + 5));
  }
  EXPECT_NE(f.dataset.to_string().find("image_dataset_from_directory(n=6"), std::string::npos);
  // Named classes pick and order the folders.
  ImageFolderOptions o = gray4();
  o.class_names = {"c_owls", "a_dogs"};
  const ImageFolder g = image_dataset_from_directory(root.string(), o);
  EXPECT_EQ(g.labels, (std::vector<int32_t>{0, 1, 1}));
  fs::remove_all(root);
}

TEST(ImageFolder, ValidationSplitPartitionsTheFiles) {
  const fs::path root = make_folder("split");
  ImageFolderOptions o = gray4();
  o.validation_split = 0.34;
  o.seed = 11;
  o.subset = "training";
  const ImageFolder train = image_dataset_from_directory(root.string(), o);
  o.subset = "validation";
  const ImageFolder val = image_dataset_from_directory(root.string(), o);
  EXPECT_EQ(train.files.size(), 4u);
  EXPECT_EQ(val.files.size(), 2u);
  std::set<std::string> all(train.files.begin(), train.files.end());
  all.insert(val.files.begin(), val.files.end());
  EXPECT_EQ(all.size(), 6u);
  o.subset = "";
  EXPECT_THROW(image_dataset_from_directory(root.string(), o), InvalidArgument);
  fs::remove_all(root);
}

TEST(ImageFolder, MissingEmptyAndBadFoldersAreTypedErrors) {
  EXPECT_THROW(image_dataset_from_directory("/nonexistent/dtrain/images", gray4()), NotFound);
  const fs::path root = temp_dir("empty");
  EXPECT_THROW(image_dataset_from_directory(root.string(), gray4()), InvalidArgument);
  fs::create_directories(root / "only_text");
  write(root / "only_text" / "a.txt", "x");
  try {
    image_dataset_from_directory(root.string(), gray4());
    ADD_FAILURE() << "an empty class was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("only_text"), std::string::npos) << e.what();
  }
  ImageFolderOptions o = gray4();
  o.class_names = {"missing"};
  EXPECT_THROW(image_dataset_from_directory(root.string(), o), InvalidArgument);
  // A symlink loop followed (follow_links): a typed error naming where, not the standard
  // library's filesystem_error.
  fs::create_directories(root / "cats");
  write(root / "cats" / "0.png", image::encode_png(marked(4, 4, 0)));
  fs::create_directory_symlink("..", root / "cats" / "loop");
  o = gray4();
  o.follow_links = true;
  try {
    image_dataset_from_directory(root.string(), o);
    ADD_FAILURE() << "a symlink loop was walked";
  } catch (const DataLoss& e) {
    EXPECT_NE(std::string(e.what()).find("cannot list"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

TEST(ImageFolder, UndecodableFileFailsNamingItOrIsSkippedAndCounted) {
  const fs::path root = make_folder("corrupt");
  const std::string bad = (root / "b_cats" / "1.png").string();
  std::string bytes = image::encode_png(marked(4, 4, 0));
  write(bad, bytes.substr(0, bytes.size() - 20));  // truncated
  ImageFolderOptions o = gray4();
  o.num_parallel_calls = 3;
  const ImageFolder f = image_dataset_from_directory(root.string(), o);
  try {
    all_batches(f.dataset.batch(6));
    ADD_FAILURE() << "a truncated PNG was decoded";
  } catch (const DataLoss& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  o.ignore_errors = true;
  const ImageFolder g = image_dataset_from_directory(root.string(), o);
  const auto batches = all_batches(g.dataset.batch(4));
  ASSERT_EQ(batches.size(), 2u);
  // Row 3 is skipped: its batch is one row shorter; the other batch keeps its rows.
  EXPECT_EQ(batches[0][1].to_vector<int32_t>(), (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(batches[0][0].to_vector<float>()[2 * 16 + 1], 25.0f);  // row 2 (no row 3)
  EXPECT_EQ(batches[1][1].to_vector<int32_t>(), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(g.dataset.skipped_records(), 1);
  // Unbatched iteration skips it too.
  EXPECT_EQ(all_batches(g.dataset).size(), 5u);
  EXPECT_EQ(g.dataset.skipped_records(), 2);
  fs::remove_all(root);
}

// A repeated source whose every row fails to read yields nothing, ever: unbatched iteration looped
// for good, batched yielded empty batches for good. More skips in a row than the source's rows end
// it with DataLoss.
TEST(ImageFolder, ARepeatOfRowsThatAllFailEndsWithDataLoss) {
  const Dataset none = Dataset::from_reader(
      5, {{Shape{2}, DType::kFloat32}}, [](int64_t, uint64_t, void* const*) { return false; },
      Dataset::ReaderOptions{1, false, "unreadable", ""});
  EXPECT_EQ(all_batches(none).size(), 0u);  // one pass: ends, nothing read
  for (const Dataset& d :
       {none.repeat(), none.repeat().batch(2), none.repeat().batch(2).prefetch(2),
        none.repeat().batch(2).map([](std::vector<Tensor> t) { return t; }, 2)}) {
    try {
      auto it = d.make_iterator();
      std::vector<Tensor> out;
      for (int i = 0; i < 100 && it->next(&out);) ++i;
      ADD_FAILURE() << "no DataLoss from " << d.to_string();
    } catch (const DataLoss& e) {
      EXPECT_NE(std::string(e.what()).find("more than twice its 5"), std::string::npos) << e.what();
    }
  }
  // A repeat of a source with one good row goes on.
  const Dataset one = Dataset::from_reader(
      5, {{Shape{2}, DType::kFloat32}},
      [](int64_t row, uint64_t, void* const* dst) {
        static_cast<float*>(dst[0])[0] = static_cast<float*>(dst[0])[1] = 1;
        return row == 4;
      },
      Dataset::ReaderOptions{1, false, "mostly unreadable", ""});
  auto it = one.repeat().make_iterator();
  std::vector<Tensor> out;
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(it->next(&out));
}

TEST(ImageFolder, ParallelReadingEqualsSerialAndEpochReachesTheReader) {
  const fs::path root = temp_dir("parallel");
  for (int k = 0; k < 40; ++k)
    write(root / (k % 2 ? "x" : "y") / (std::to_string(k) + ".jpg"),
          image::encode_jpeg(noise(30, 40, 3, static_cast<uint32_t>(k)), 85));
  ImageFolderOptions o;
  o.transform.height = o.transform.width = 12;
  o.transform.resize = image::ImageTransform::Resize::kRandomResizedCrop;
  o.transform.random_flip = true;
  o.seed = 3;
  o.num_parallel_calls = 1;
  const Dataset serial = image_dataset_from_directory(root.string(), o).dataset;
  o.num_parallel_calls = 4;
  const Dataset parallel = image_dataset_from_directory(root.string(), o).dataset;
  const auto a = all_batches(serial.shuffle(1).with_epoch(2).batch(7));
  const auto b = all_batches(parallel.shuffle(1).with_epoch(2).batch(7));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i][0].to_vector<float>(), b[i][0].to_vector<float>()) << i;
    EXPECT_EQ(a[i][1].to_vector<int32_t>(), b[i][1].to_vector<int32_t>()) << i;
  }
  // Another epoch: other crops of the same rows.
  const auto c = all_batches(parallel.shuffle(1).with_epoch(3).batch(7));
  EXPECT_NE(a[0][0].to_vector<float>(), c[0][0].to_vector<float>());
  // repeat(): the k-th pass is epoch + k.
  const auto r = all_batches(parallel.repeat(2).with_epoch(2).batch(40));
  const auto e3 = all_batches(parallel.with_epoch(3).batch(40));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[1][0].to_vector<float>(), e3[0][0].to_vector<float>());
  // A random reader cannot be cached.
  EXPECT_THROW(parallel.cache(), InvalidArgument);
  fs::remove_all(root);
}

// ---- cache ----

TEST(Cache, MemoryAndFileCachesServeTheSameRowsWithoutReadingAgain) {
  std::atomic<int> reads{0};
  Dataset::ReaderOptions ro;
  ro.name = "counted";
  ro.fingerprint = "v1";
  auto make = [&](const std::string& fp) {
    Dataset::ReaderOptions r = ro;
    r.fingerprint = fp;
    return Dataset::from_reader(
        10, {{Shape{2}, DType::kFloat32}},
        [&reads](int64_t row, uint64_t, void* const* dst) {
          ++reads;
          static_cast<float*>(dst[0])[0] = static_cast<float>(row);
          static_cast<float*>(dst[0])[1] = static_cast<float>(row * row);
          return row != 4;  // row 4 is skipped, and stays skipped
        },
        r);
  };
  const Dataset plain = make("v1");
  const auto expected = all_batches(plain.batch(3));
  reads = 0;
  const Dataset mem = plain.cache();
  EXPECT_NE(mem.to_string().find(".cache()"), std::string::npos);
  for (int pass = 0; pass < 3; ++pass) {
    const auto got = all_batches(mem.shuffle(5, false).batch(3));
    const auto ordered = all_batches(mem.batch(3));
    ASSERT_EQ(ordered.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i)
      EXPECT_EQ(ordered[i][0].to_vector<float>(), expected[i][0].to_vector<float>());
  }
  EXPECT_EQ(reads.load(), 10);  // each row read once over six passes

  const fs::path dir = temp_dir("cache");
  const std::string file = (dir / "rows.cache").string();
  reads = 0;
  {
    const auto got = all_batches(plain.cache(file).take(6).batch(3));  // a partial pass
    EXPECT_EQ(got.size(), 2u);
  }
  EXPECT_EQ(reads.load(), 6);
  reads = 0;  // a new pipeline (a later run) over the same file reads only the rest
  const auto whole = all_batches(make("v1").cache(file).batch(3));
  EXPECT_EQ(reads.load(), 4);
  ASSERT_EQ(whole.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_EQ(whole[i][0].to_vector<float>(), expected[i][0].to_vector<float>());
  reads = 0;
  all_batches(make("v1").cache(file).batch(3));
  EXPECT_EQ(reads.load(), 0);
  // Another pipeline's data, a damaged header, a truncated file: refused, the file unchanged.
  EXPECT_THROW(make("v2").cache(file), InvalidArgument);
  const auto size = fs::file_size(file);
  fs::resize_file(file, size - 3);
  EXPECT_THROW(make("v1").cache(file), DataLoss);
  EXPECT_EQ(fs::file_size(file), size - 3);
  write(file, "garbage");
  EXPECT_THROW(make("v1").cache(file), DataLoss);
  EXPECT_THROW(plain.shuffle(1).cache(), InvalidArgument);  // not on a source
  fs::remove_all(dir);
}

// ---- TFRecord ----

std::string testdata(const std::string& name) {
  return dtrain::testing::testdata_dir() + "/" + name;
}

std::vector<FeatureSpec> tf_specs(int h = 6, int w = 8) {
  image::ImageTransform t;
  t.height = h;
  t.width = w;
  return {FeatureSpec::image("image/encoded", t), FeatureSpec::int64("image/class/label"),
          FeatureSpec::float32("values", Shape{3}),
          FeatureSpec::int64("ids", Shape{2}, DType::kInt64)};
}

TEST(TFRecord, FilesWrittenByTensorFlowReadBackExactly) {
  std::ifstream in(testdata("tf_examples.json"));
  ASSERT_TRUE(in) << testdata("tf_examples.json");
  const nlohmann::json expected = nlohmann::json::parse(in);
  const std::vector<std::string> files = {testdata("tf_examples_0.tfrecord"),
                                          testdata("tf_examples_1.tfrecord")};
  EXPECT_EQ(read_tfrecord_file(files[0]).size(), 5u);
  const Dataset ds = TFRecordDataset(files, tf_specs());
  ASSERT_EQ(ds.cardinality(), 8);
  const auto b = all_batches(ds.batch(8));
  ASSERT_EQ(b.size(), 1u);
  const std::vector<float> px = b[0][0].to_vector<float>();
  const std::vector<int32_t> labels = b[0][1].to_vector<int32_t>();
  const std::vector<float> values = b[0][2].to_vector<float>();
  const std::vector<int64_t> ids = b[0][3].to_vector<int64_t>();
  size_t row = 0;
  for (const auto& file : expected["files"])
    for (const auto& rec : file["records"]) {
      EXPECT_EQ(labels[row], rec["label"].get<int32_t>());
      for (size_t k = 0; k < 3; ++k) EXPECT_EQ(values[row * 3 + k], rec["values"][k].get<float>());
      for (size_t k = 0; k < 2; ++k) EXPECT_EQ(ids[row * 2 + k], rec["ids"][k].get<int64_t>());
      const auto& want = rec["pixels"];
      for (size_t i = 0; i < 6 * 8 * 3; ++i)
        ASSERT_EQ(px[row * 144 + i], want[i].get<float>()) << "record " << row << " byte " << i;
      ++row;
    }
  EXPECT_EQ(row, 8u);
  // tf.data's interleave(cycle_length=2, block_length=2) order.
  TFRecordOptions o;
  o.cycle_length = 2;
  o.block_length = 2;
  const auto il =
      all_batches(TFRecordDataset(files, {FeatureSpec::int64("image/class/label")}, o).batch(8));
  EXPECT_EQ(il[0][0].to_vector<int32_t>(),
            expected["interleave_2_2_labels"].get<std::vector<int32_t>>());
  // A cycle longer than the files: all open at once, the same order as a cycle of 2.
  o.cycle_length = 1 << 30;
  EXPECT_EQ(all_batches(
                TFRecordDataset(files, {FeatureSpec::int64("image/class/label")}, o).batch(8))[0][0]
                .to_vector<int32_t>(),
            expected["interleave_2_2_labels"].get<std::vector<int32_t>>());
}

// A TFRecord file cache holds how the records were read: another rescale of the same files (or
// other features, or another interleave) took the cached rows before.
TEST(TFRecord, AFileCacheOfOtherDecodingIsRefused) {
  const std::vector<std::string> files = {testdata("tf_examples_0.tfrecord"),
                                          testdata("tf_examples_1.tfrecord")};
  const fs::path dir = temp_dir("tfrecord_cache");
  const std::string cache = (dir / "records.cache").string();
  std::vector<FeatureSpec> specs = tf_specs();
  const auto first = all_batches(TFRecordDataset(files, specs).cache(cache).batch(8));
  EXPECT_EQ(
      all_batches(TFRecordDataset(files, specs).cache(cache).batch(8))[0][0].to_vector<float>(),
      first[0][0].to_vector<float>());
  specs[0].transform.rescale = 1.0f / 255;
  EXPECT_THROW(TFRecordDataset(files, specs).cache(cache), InvalidArgument);
  TFRecordOptions o;
  o.cycle_length = 2;
  EXPECT_THROW(TFRecordDataset(files, tf_specs(), o).cache(cache), InvalidArgument);
  fs::remove_all(dir);
}

TEST(TFRecord, WrittenByDtrainParsesAndMissingFeaturesUseDefaults) {
  const fs::path dir = temp_dir("tfrecord");
  const std::string path = (dir / "a.tfrecord").string();
  {
    TFRecordWriter w(path);
    for (int i = 0; i < 4; ++i) {
      Example ex{{"x", Feature::of_floats({static_cast<float>(i), 0.5f})},
                 {"y", Feature::of_ints({i * 3})}};
      if (i == 2) ex.erase("y");
      w.write(serialize_example(ex));
    }
    EXPECT_FALSE(fs::exists(path));  // only after close()
    w.close();
  }
  const std::vector<std::string> recs = read_tfrecord_file(path);
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(parse_example(recs[1]).at("y").ints, (std::vector<int64_t>{3}));
  FeatureSpec y = FeatureSpec::int64("y");
  y.default_value = {-1};
  const auto b =
      all_batches(TFRecordDataset({path}, {FeatureSpec::float32("x", Shape{2}), y}).batch(4));
  EXPECT_EQ(b[0][1].to_vector<int32_t>(), (std::vector<int32_t>{0, 3, -1, 9}));
  EXPECT_EQ(b[0][0].to_vector<float>()[6], 3.0f);
  // Without a default the missing feature is named.
  try {
    all_batches(TFRecordDataset({path}, {FeatureSpec::int64("y")}).batch(4));
    ADD_FAILURE();
  } catch (const DataLoss& e) {
    EXPECT_NE(std::string(e.what()).find("record 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'y'"), std::string::npos) << e.what();
  }
  // Wrong kind, wrong count.
  EXPECT_THROW(all_batches(TFRecordDataset({path}, {FeatureSpec::int64("x", Shape{2})}).batch(4)),
               DataLoss);
  EXPECT_THROW(all_batches(TFRecordDataset({path}, {FeatureSpec::float32("x", Shape{3})}).batch(4)),
               DataLoss);
  EXPECT_THROW(TFRecordDataset({path}, {}), InvalidArgument);
  // An image with a default: refused (a record without it left the row's memory unwritten).
  FeatureSpec img = FeatureSpec::image("img", image::ImageTransform{});
  img.default_value = {0};
  try {
    TFRecordDataset({path}, {img});
    ADD_FAILURE() << "an image feature with a default was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("takes no default_value"), std::string::npos) << e.what();
  }
  write(dir / "z.tfrecord.gz", std::string("\x1f\x8b\x08\x00rest", 8));  // GZIP: named
  EXPECT_THROW(TFRecordDataset({(dir / "z.tfrecord.gz").string()}, {y}), InvalidArgument);
  EXPECT_THROW(TFRecordDataset({(dir / "none.tfrecord").string()}, {y}), NotFound);
  fs::remove_all(dir);
}

// A TFRecord header (length and its masked CRC-32C) for any length.
std::string detail_header_for_test(uint64_t len) {
  std::string h(12, '\0');
  for (int i = 0; i < 8; ++i) h[static_cast<size_t>(i)] = static_cast<char>(len >> (8 * i));
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(h.data(), 8);
  const uint32_t c = crc.checksum();
  const uint32_t masked = ((c >> 15) | (c << 17)) + 0xa282ead8u;
  for (int i = 0; i < 4; ++i) h[static_cast<size_t>(8 + i)] = static_cast<char>(masked >> (8 * i));
  return h;
}

// Every way of damaging the TensorFlow-written file: each is refused with DataLoss naming the file
// or, with ignore_errors, skipped; never a crash or a wrong value.
TEST(TFRecord, CorruptedFilesAreRefusedOrSkippedNeverMisread) {
  const std::string good = image::read_file(testdata("tf_examples_0.tfrecord"));
  const fs::path dir = temp_dir("corrupt");
  const std::vector<std::string> records = read_tfrecord_file(testdata("tf_examples_0.tfrecord"));
  int refused = 0, skipped_ok = 0;
  auto check = [&](const std::string& bytes, const std::string& what) {
    const std::string path = (dir / "bad.tfrecord").string();
    write(path, bytes);
    bool threw = false;
    try {
      all_batches(TFRecordDataset({path}, tf_specs()).batch(5));
    } catch (const DataLoss& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << what << ": " << e.what();
    }
    if (threw) ++refused;
    // With ignore_errors: whatever is read is one of the original records, in order.
    TFRecordOptions o;
    o.ignore_errors = true;
    const Dataset ds = TFRecordDataset({path}, tf_specs(), o);
    const auto b = all_batches(ds.batch(5));
    std::vector<int32_t> labels;
    for (const auto& batch : b)
      for (int32_t l : batch[1].to_vector<int32_t>()) labels.push_back(l);
    for (size_t i = 1; i < labels.size(); ++i) EXPECT_LT(labels[i - 1], labels[i]) << what;
    for (int32_t l : labels) EXPECT_TRUE(l >= 0 && l < 5) << what;
    if (threw && labels.size() < 5) ++skipped_ok;
    return threw;
  };
  // Truncations at every 97th byte (but not between records: that is a valid shorter file), and
  // just before the end.
  std::set<size_t> boundaries;
  size_t end = 0;
  for (const std::string& r : records) boundaries.insert(end += 16 + r.size());
  EXPECT_EQ(end, good.size());
  for (size_t cut = 1; cut < good.size(); cut += 97)
    if (boundaries.count(cut) == 0) {
      EXPECT_TRUE(check(good.substr(0, cut), "cut at " + std::to_string(cut))) << cut;
    }
  EXPECT_TRUE(check(good.substr(0, good.size() - 1), "last byte cut"));
  // A flipped byte anywhere: a header, data or checksum byte. Every one is caught by a CRC.
  for (size_t at = 0; at < good.size(); at += 31) {
    std::string bad = good;
    bad[at] = static_cast<char>(bad[at] ^ 0x24);
    EXPECT_TRUE(check(bad, "flip at " + std::to_string(at))) << at;
  }
  // A length that claims more than the file holds (with its checksum fixed up).
  {
    std::string bad = good;
    const std::string header = detail_header_for_test(1u << 30);
    bad.replace(0, 12, header);
    EXPECT_TRUE(check(bad, "huge length"));
  }
  EXPECT_GT(refused, 50);
  EXPECT_GT(skipped_ok, 50);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtrain::data
