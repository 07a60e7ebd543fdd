// Tests for the IDX reader and the Fashion-MNIST loader: small files written to a temp dir, and
// the real data set at /usr/share/datasets/fashion-mnist when it is installed.
#include "dtrain/data/fashion_mnist.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dtrain {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data,
                               uint8_t type_code = 0x08) {
  std::vector<uint8_t> out = {0, 0, type_code, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    out.push_back(static_cast<uint8_t>(d >> 24));
    out.push_back(static_cast<uint8_t>(d >> 16));
    out.push_back(static_cast<uint8_t>(d >> 8));
    out.push_back(static_cast<uint8_t>(d));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void write_raw(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << p;
}

void write_gz(const fs::path& p, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  ASSERT_NE(f, nullptr) << p;
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::vector<uint8_t> read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<uint8_t> iota_bytes(size_t n, size_t mod = 251) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i % mod);
  return v;
}

// Sets or clears an environment variable for the lifetime of the object.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class IdxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "dtrain_data_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A fake Fashion-MNIST split: n images (28x28) and m labels, gzip-compressed.
  void write_split(const std::string& prefix, uint32_t n, uint32_t m, uint8_t max_label = 9) {
    write_gz(dir_ / (prefix + "-images-idx3-ubyte.gz"),
             idx_bytes({n, 28, 28}, iota_bytes(n * 784, 256)));
    std::vector<uint8_t> labels(m);
    for (uint32_t i = 0; i < m; ++i) labels[i] = static_cast<uint8_t>(i % (max_label + 1));
    write_gz(dir_ / (prefix + "-labels-idx1-ubyte.gz"), idx_bytes({m}, labels));
  }

  template <typename E>
  std::string expect_throw(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const E& e) {
      return e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw the wrong type: " << e.what();
      return "";
    }
    ADD_FAILURE() << "did not throw";
    return "";
  }

  fs::path dir_;
};

TEST_F(IdxTest, ReadsRawFile) {
  write_raw(dir_ / "a", idx_bytes({2, 3}, {0, 1, 2, 3, 4, 255}));
  IdxArray a = read_idx((dir_ / "a").string());
  EXPECT_EQ(a.dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, (std::vector<uint8_t>{0, 1, 2, 3, 4, 255}));
}

TEST_F(IdxTest, ReadsGzipFileByNameAndByMagic) {
  const std::vector<uint8_t> data = iota_bytes(5 * 7 * 11);
  write_gz(dir_ / "a.gz", idx_bytes({5, 7, 11}, data));
  write_gz(dir_ / "no_suffix", idx_bytes({5, 7, 11}, data));
  for (const char* name : {"a.gz", "no_suffix"}) {
    IdxArray a = read_idx((dir_ / name).string());
    EXPECT_EQ(a.dims, (std::vector<int64_t>{5, 7, 11})) << name;
    EXPECT_EQ(a.data, data) << name;
  }
}

TEST_F(IdxTest, ReadsEmptyPayload) {
  write_raw(dir_ / "a", idx_bytes({0, 28, 28}, {}));
  IdxArray a = read_idx((dir_ / "a").string());
  EXPECT_EQ(a.dims, (std::vector<int64_t>{0, 28, 28}));
  EXPECT_TRUE(a.data.empty());
}

TEST_F(IdxTest, TruncatedRawFileIsDataLoss) {
  std::vector<uint8_t> bytes = idx_bytes({4, 10}, iota_bytes(40));
  bytes.erase(bytes.end() - 7, bytes.end());
  write_raw(dir_ / "t", bytes);
  const std::string msg = expect_throw<DataLoss>([&] { read_idx((dir_ / "t").string()); });
  EXPECT_NE(msg.find((dir_ / "t").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("40 payload bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("only 33"), std::string::npos) << msg;
}

TEST_F(IdxTest, TruncatedHeaderIsDataLoss) {
  write_raw(dir_ / "h", {0, 0, 8, 3, 0, 0});
  expect_throw<DataLoss>([&] { read_idx((dir_ / "h").string()); });
  write_raw(dir_ / "h2", {0, 0});
  expect_throw<DataLoss>([&] { read_idx((dir_ / "h2").string()); });
}

TEST_F(IdxTest, TruncatedGzipStreamIsDataLoss) {
  write_gz(dir_ / "full.gz", idx_bytes({100, 100}, iota_bytes(10000)));
  std::vector<uint8_t> gz = read_all(dir_ / "full.gz");
  gz.resize(gz.size() / 2);
  write_raw(dir_ / "cut.gz", gz);
  const std::string msg = expect_throw<DataLoss>([&] { read_idx((dir_ / "cut.gz").string()); });
  EXPECT_NE(msg.find("cut.gz"), std::string::npos) << msg;
}

TEST_F(IdxTest, ExtraBytesAreDataLoss) {
  std::vector<uint8_t> bytes = idx_bytes({2, 2}, {1, 2, 3, 4});
  bytes.push_back(5);
  write_raw(dir_ / "x", bytes);
  const std::string msg = expect_throw<DataLoss>([&] { read_idx((dir_ / "x").string()); });
  EXPECT_NE(msg.find("holds 5 payload bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("= 4 bytes"), std::string::npos) << msg;
}

TEST_F(IdxTest, BadMagicIsDataLoss) {
  write_raw(dir_ / "m", {'P', 'K', 3, 4, 0, 0, 0, 1, 7});
  const std::string msg = expect_throw<DataLoss>([&] { read_idx((dir_ / "m").string()); });
  EXPECT_NE(msg.find("bad magic"), std::string::npos) << msg;
  EXPECT_NE(msg.find((dir_ / "m").string()), std::string::npos) << msg;
}

TEST_F(IdxTest, WrongTypeCodeIsDataLoss) {
  write_raw(dir_ / "f", idx_bytes({1}, {0, 0, 0, 0}, 0x0D));  // float32
  const std::string msg = expect_throw<DataLoss>([&] { read_idx((dir_ / "f").string()); });
  EXPECT_NE(msg.find("type code 0xd"), std::string::npos) << msg;
}

TEST_F(IdxTest, MissingFileIsNotFoundWithHint) {
  const std::string path = (dir_ / "nope-idx1-ubyte").string();
  const std::string msg = expect_throw<NotFound>([&] { read_idx(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("--data-dir"), std::string::npos) << msg;
  EXPECT_NE(msg.find("DTRAIN_DATA_DIR"), std::string::npos) << msg;
  EXPECT_NE(msg.find("apt-get install dataset-fashion-mnist"), std::string::npos) << msg;
}

TEST_F(IdxTest, LoadsFakeDataSetFromDirectory) {
  write_split("train", 5, 5);
  write_split("t10k", 3, 3);
  FashionMnist d = load_fashion_mnist(dir_.string());
  EXPECT_EQ(d.train_images.shape(), (Shape{5, 28, 28, 1}));
  EXPECT_EQ(d.train_images.dtype(), DType::kFloat32);
  EXPECT_EQ(d.train_labels.shape(), (Shape{5}));
  EXPECT_EQ(d.train_labels.dtype(), DType::kInt32);
  EXPECT_EQ(d.test_images.shape(), (Shape{3, 28, 28, 1}));
  EXPECT_EQ(d.test_labels.to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 2}));
  const float* px = d.train_images.data<float>();
  for (int i : {0, 1, 254, 255, 256, 1000})
    EXPECT_FLOAT_EQ(px[i], static_cast<float>(i % 256) / 255.0f) << i;
}

TEST_F(IdxTest, PrefersGzipWhenBothExistAndReadsRawOtherwise) {
  write_split("train", 2, 2);
  write_split("t10k", 1, 1);
  // A raw train-labels file that disagrees with the .gz one: the .gz one must win.
  write_raw(dir_ / "train-labels-idx1-ubyte", idx_bytes({2}, {7, 7}));
  EXPECT_EQ(load_fashion_mnist(dir_.string()).train_labels.to_vector<int32_t>(),
            (std::vector<int32_t>{0, 1}));
  fs::remove(dir_ / "train-labels-idx1-ubyte.gz");
  EXPECT_EQ(load_fashion_mnist(dir_.string()).train_labels.to_vector<int32_t>(),
            (std::vector<int32_t>{7, 7}));
}

TEST_F(IdxTest, ImageLabelCountMismatchIsDataLoss) {
  write_split("train", 3, 2);
  write_split("t10k", 1, 1);
  const std::string msg = expect_throw<DataLoss>([&] { load_fashion_mnist(dir_.string()); });
  EXPECT_NE(msg.find("mislabelled"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train-images-idx3-ubyte.gz"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train-labels-idx1-ubyte.gz"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3 images"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2 labels"), std::string::npos) << msg;
}

TEST_F(IdxTest, LabelOutOfRangeIsDataLoss) {
  write_split("train", 12, 12, 11);
  write_split("t10k", 1, 1);
  const std::string msg = expect_throw<DataLoss>([&] { load_fashion_mnist(dir_.string()); });
  EXPECT_NE(msg.find("label 10 at index 10"), std::string::npos) << msg;
}

TEST_F(IdxTest, WrongImageSizeIsDataLoss) {
  write_split("train", 1, 1);
  write_split("t10k", 1, 1);
  write_gz(dir_ / "t10k-images-idx3-ubyte.gz", idx_bytes({1, 27, 29}, iota_bytes(27 * 29)));
  const std::string msg = expect_throw<DataLoss>([&] { load_fashion_mnist(dir_.string()); });
  EXPECT_NE(msg.find("[1, 27, 29]"), std::string::npos) << msg;
}

TEST_F(IdxTest, MissingFileInDirectoryIsNotFound) {
  write_split("train", 1, 1);
  ScopedEnv env("DTRAIN_DATA_DIR", dir_.c_str());
  const std::string msg = expect_throw<NotFound>([&] { load_fashion_mnist(); });
  EXPECT_NE(msg.find("t10k-images-idx3-ubyte"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir_.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("from DTRAIN_DATA_DIR"), std::string::npos) << msg;
  EXPECT_NE(msg.find("apt-get install dataset-fashion-mnist"), std::string::npos) << msg;
}

TEST_F(IdxTest, DataDirResolution) {
  {
    ScopedEnv env("DTRAIN_DATA_DIR", nullptr);
    EXPECT_EQ(resolve_data_dir(""), kDefaultFashionMnistDir);
    EXPECT_EQ(resolve_data_dir("/x"), "/x");
  }
  {
    ScopedEnv env("DTRAIN_DATA_DIR", "");
    EXPECT_EQ(resolve_data_dir(""), kDefaultFashionMnistDir);
  }
  ScopedEnv env("DTRAIN_DATA_DIR", dir_.c_str());
  EXPECT_EQ(resolve_data_dir(""), dir_.string());
  EXPECT_EQ(resolve_data_dir("/explicit"), "/explicit");  // the flag beats the environment

  write_split("train", 4, 4);
  write_split("t10k", 2, 2);
  FashionMnist d = load_fashion_mnist();
  EXPECT_EQ(d.train_images.shape()[0], 4);
  EXPECT_EQ(d.test_labels.shape()[0], 2);
  EXPECT_EQ(load_fashion_mnist("", 3).train_images.shape()[0], 3);
}

TEST(FashionMnistRealData, LoadsInstalledDataSet) {
  const fs::path dir = kDefaultFashionMnistDir;
  if (!fs::exists(dir / "train-images-idx3-ubyte.gz") &&
      !fs::exists(dir / "train-images-idx3-ubyte"))
    FAIL() << "Fashion-MNIST is not installed at " << dir
           << " (apt-get install dataset-fashion-mnist; setup.sh installs it)";
  FashionMnist d = load_fashion_mnist(dir.string());
  EXPECT_EQ(d.train_images.shape(), (Shape{60000, 28, 28, 1}));
  EXPECT_EQ(d.train_labels.shape(), (Shape{60000}));
  EXPECT_EQ(d.test_images.shape(), (Shape{10000, 28, 28, 1}));
  EXPECT_EQ(d.test_labels.shape(), (Shape{10000}));

  const float* px = d.train_images.data<float>();
  float lo = 1, hi = 0;
  for (int64_t i = 0; i < d.train_images.numel(); ++i) {
    lo = std::min(lo, px[i]);
    hi = std::max(hi, px[i]);
  }
  EXPECT_EQ(lo, 0.0f);
  EXPECT_EQ(hi, 1.0f);
  double first_image_sum = 0;
  for (int i = 0; i < 784; ++i) first_image_sum += px[i];
  EXPECT_NEAR(first_image_sum, 76247.0 / 255.0, 1e-3);

  const std::vector<int32_t> train = d.train_labels.to_vector<int32_t>();
  const std::vector<int32_t> test = d.test_labels.to_vector<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(train.begin(), train.begin() + 10),
            (std::vector<int32_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
  EXPECT_EQ(std::vector<int32_t>(test.begin(), test.begin() + 10),
            (std::vector<int32_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7}));
  std::vector<int> counts(10, 0);
  for (int32_t l : train) ++counts[l];
  for (int c : counts) EXPECT_EQ(c, 6000);  // Fashion-MNIST is balanced

  // The first 1,000 training rows alone (--train-limit): the same bytes as the whole file's first
  // rows; the test set whole.
  const FashionMnist part = load_fashion_mnist(dir.string(), 1000);
  ASSERT_EQ(part.train_images.shape(), (Shape{1000, 28, 28, 1}));
  EXPECT_EQ(part.train_labels.to_vector<int32_t>(),
            std::vector<int32_t>(train.begin(), train.begin() + 1000));
  EXPECT_TRUE(std::equal(px, px + part.train_images.numel(), part.train_images.data<float>()));
  EXPECT_EQ(part.test_images.shape(), (Shape{10000, 28, 28, 1}));
  EXPECT_EQ(load_fashion_mnist(dir.string(), 70000).train_images.shape()[0], 60000);
}

}  // namespace
}  // namespace dtrain
