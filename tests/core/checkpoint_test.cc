// Safetensors checkpoints: exact format, round trips, rejection of every kind of corrupt file,
// CheckpointManager retention and fallback, and crash safety under SIGKILL.
#include "dtrain/core/checkpoint.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace dtrain {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s;
}

// A safetensors file built by hand: length prefix, header text, data bytes.
std::string raw_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

std::string tensor_bytes(const Tensor& t) {
  return std::string(static_cast<const char*>(t.raw_data()), t.nbytes());
}

// A tensor whose bytes are a pattern derived from `seed` (any bit pattern is fine: compared as
// bytes).
Tensor patterned(const Shape& shape, DType dtype, int seed) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<unsigned char*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(i * 37 + seed * 11 + 5);
  return t;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dtrain_ckpt_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  // A small valid file: F32 [2,3] then I64 scalar, 32 data bytes.
  CheckpointData small() const {
    CheckpointData d;
    d.tensors.emplace_back("a", Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3}));
    d.tensors.emplace_back("b", Tensor::from_vector<int64_t>({-7}, Shape{}));
    d.metadata["format"] = "pt";
    return d;
  }
  void expect_data_loss(const std::string& bytes, const std::string& needle = "") {
    const std::string p = path("bad.safetensors");
    write_bytes(p, bytes);
    try {
      load_safetensors(p);
      ADD_FAILURE() << "loaded a corrupt file (" << bytes.size() << " bytes)";
    } catch (const DataLoss& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p), std::string::npos) << msg;
      if (!needle.empty()) {
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
      }
    }
  }
  std::string dir_;
};

TEST_F(CheckpointTest, RoundTripsEveryDTypeAndShape) {
  const DType dtypes[] = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                          DType::kBFloat16, DType::kInt32,   DType::kInt64};
  const Shape shapes[] = {Shape{}, Shape{0}, Shape{3, 0}, Shape{5}, Shape{2, 3, 4}};
  CheckpointData in;
  int seed = 0;
  for (DType dt : dtypes)
    for (const Shape& s : shapes)
      in.tensors.emplace_back(std::string(dtype_name(dt)) + s.to_string(),
                              patterned(s, dt, seed++));
  in.metadata = {
      {"format", "pt"}, {"note", "h\xc3\xa9llo \xe2\x9c\x93 \"quoted\"\n"}, {"empty", ""}};
  save_safetensors(path("all.safetensors"), in);

  const CheckpointData out = load_safetensors(path("all.safetensors"));
  EXPECT_EQ(out.metadata, in.metadata);
  ASSERT_EQ(out.tensors.size(), in.tensors.size());
  for (size_t i = 0; i < in.tensors.size(); ++i) {
    const auto& [name, t] = in.tensors[i];
    EXPECT_EQ(out.tensors[i].first, name) << "file order is save order";
    const Tensor* u = out.find(name);
    ASSERT_NE(u, nullptr) << name;
    EXPECT_EQ(u->dtype(), t.dtype()) << name;
    EXPECT_EQ(u->shape(), t.shape()) << name;
    EXPECT_EQ(u->device(), DeviceSpec::cpu());
    EXPECT_EQ(tensor_bytes(*u), tensor_bytes(t)) << name;
  }
  EXPECT_EQ(out.find("missing"), nullptr);
}

TEST_F(CheckpointTest, EmptyCheckpointRoundTrips) {
  save_safetensors(path("e.safetensors"), CheckpointData{});
  EXPECT_EQ(read_bytes(path("e.safetensors")), le64(8) + "{}      ");
  const CheckpointData out = load_safetensors(path("e.safetensors"));
  EXPECT_TRUE(out.tensors.empty());
  EXPECT_TRUE(out.metadata.empty());
}

TEST_F(CheckpointTest, WritesTheExactSafetensorsLayout) {
  save_safetensors(path("x.safetensors"), small());
  const std::string bytes = read_bytes(path("x.safetensors"));
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "data must start 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + 32);
  std::string json =
      R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"I64","shape":[],"data_offsets":[24,32]},"__metadata__":{"format":"pt"}})";
  json.append((8 - json.size() % 8) % 8, ' ');
  EXPECT_EQ(bytes.substr(8, n), json);
  const float a[] = {1, 2, 3, 4, 5, 6};
  const int64_t b = -7;
  EXPECT_EQ(bytes.substr(8 + n, 24), std::string(reinterpret_cast<const char*>(a), 24));
  EXPECT_EQ(bytes.substr(8 + n + 24, 8), std::string(reinterpret_cast<const char*>(&b), 8));
}

TEST_F(CheckpointTest, LoadsFilesWrittenByOtherWritersInOffsetOrder) {
  // As Python's safetensors writes it: __metadata__ first, JSON key order unrelated to offsets.
  const float a[] = {1.5f, -2.5f};
  const int32_t b = 42;
  const std::string data = std::string(reinterpret_cast<const char*>(&b), 4) +
                           std::string(reinterpret_cast<const char*>(a), 8);
  write_bytes(
      path("py.safetensors"),
      raw_file(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],)"
               R"("data_offsets":[4,12]},"z":{"shape":[0],"dtype":"BF16","data_offsets":[4,4]},)"
               R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
               data));
  const CheckpointData out = load_safetensors(path("py.safetensors"));
  ASSERT_EQ(out.tensors.size(), 3u);
  EXPECT_EQ(out.tensors[0].first, "b");
  EXPECT_EQ(out.tensors[1].first, "z");
  EXPECT_EQ(out.tensors[2].first, "a");
  EXPECT_EQ(out.find("a")->to_vector<float>(), (std::vector<float>{1.5f, -2.5f}));
  EXPECT_EQ(out.find("b")->to_vector<int32_t>(), std::vector<int32_t>{42});
  EXPECT_EQ(out.find("z")->dtype(), DType::kBFloat16);
  EXPECT_EQ(out.metadata.at("format"), "pt");
}

TEST_F(CheckpointTest, OverwritesAtomicallyAndLeavesNoTemporaries) {
  save_safetensors(path("x.safetensors"), small());
  CheckpointData d;
  d.tensors.emplace_back("c", Tensor::from_vector<double>({3.25}, Shape{1}));
  save_safetensors(path("x.safetensors"), d);
  EXPECT_EQ(listing(), std::vector<std::string>{"x.safetensors"});
  const CheckpointData out = load_safetensors(path("x.safetensors"));
  ASSERT_EQ(out.tensors.size(), 1u);
  EXPECT_EQ(out.find("c")->to_vector<double>(), std::vector<double>{3.25});
}

TEST_F(CheckpointTest, SaveRejectsBadNames) {
  auto with = [](std::vector<std::pair<std::string, Tensor>> ts) {
    CheckpointData d;
    d.tensors = std::move(ts);
    return d;
  };
  const Tensor t = Tensor::scalar(1.f);
  EXPECT_THROW(save_safetensors(path("x"), with({{"", t}})), InvalidArgument);
  EXPECT_THROW(save_safetensors(path("x"), with({{"__metadata__", t}})), InvalidArgument);
  EXPECT_THROW(save_safetensors(path("x"), with({{"__x", t}})), InvalidArgument);
  EXPECT_THROW(save_safetensors(path("x"), with({{"w", t}, {"w", t}})), InvalidArgument);
  EXPECT_THROW(save_safetensors(path("x"), with({{"bad\xff", t}})), InvalidArgument);
  EXPECT_THROW(save_safetensors(path("x"), with({{"u", Tensor()}})), InvalidArgument);
  CheckpointData bad_meta;
  bad_meta.metadata["k"] = "\xc3";
  EXPECT_THROW(save_safetensors(path("x"), bad_meta), InvalidArgument);
  EXPECT_TRUE(listing().empty()) << "a rejected save writes nothing";
}

TEST_F(CheckpointTest, IoErrorsNameThePathAndTheCause) {
  const std::string p = dir_ + "/no/such/dir/x.safetensors";
  try {
    save_safetensors(p, small());
    ADD_FAILURE() << "saved into a missing directory";
  } catch (const Unavailable& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(load_safetensors(path("missing.safetensors")), NotFound);
  EXPECT_THROW(load_safetensors(dir_), Unavailable);
}

TEST_F(CheckpointTest, EveryTruncationIsDataLoss) {
  save_safetensors(path("x.safetensors"), small());
  const std::string bytes = read_bytes(path("x.safetensors"));
  for (size_t len = 0; len < bytes.size(); ++len) {
    SCOPED_TRACE("truncated to " + std::to_string(len) + " bytes");
    expect_data_loss(bytes.substr(0, len));
  }
  expect_data_loss(bytes.substr(0, bytes.size() - 4),
                   "truncated: header says 32 bytes of data, file has 28");
  expect_data_loss(bytes.substr(0, 5), "truncated");
}

TEST_F(CheckpointTest, CorruptHeaderLengthIsDataLoss) {
  save_safetensors(path("x.safetensors"), small());
  const std::string bytes = read_bytes(path("x.safetensors"));
  const std::string rest = bytes.substr(8);
  expect_data_loss(le64(uint64_t{1} << 40) + rest, "exceeds");
  expect_data_loss(le64(~uint64_t{0}) + rest, "exceeds");
  expect_data_loss(le64(rest.size() + 1) + rest, "truncated: header length says");
  expect_data_loss(le64(0) + rest);
  expect_data_loss(le64(1) + rest);
  expect_data_loss(le64(20) + rest, "not valid JSON");  // cuts the JSON short
}

TEST_F(CheckpointTest, MalformedHeadersAreDataLoss) {
  const std::string f32_2 = R"("dtype":"F32","shape":[2])";
  const std::string eight(8, '\x01');
  expect_data_loss(raw_file("{not json}", ""), "not valid JSON");
  expect_data_loss(raw_file("{\"a\":", ""), "not valid JSON");
  expect_data_loss(raw_file("[1,2]", ""), "start with '{'");
  expect_data_loss(raw_file("{} garbage", ""), "not valid JSON");
  expect_data_loss(raw_file(std::string("{\"a\":1}\0\0", 9), ""), "NUL byte");
  expect_data_loss(raw_file("{\"a\":" + std::string(100, '[') + std::string(100, ']') + "}", ""),
                   "nested too deeply");
  expect_data_loss(raw_file(R"({"a":[1]})", eight), "not a JSON object");
  expect_data_loss(raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight), "no \"dtype\"");
  expect_data_loss(raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", eight),
                   "no \"shape\"");
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + "}}", eight), "no \"data_offsets\"");
  expect_data_loss(raw_file(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", eight),
                   "unknown dtype 'F33'");
  expect_data_loss(raw_file(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", eight));
  expect_data_loss(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight));
  expect_data_loss(raw_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight));
  expect_data_loss(raw_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", eight));
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0]}}", eight));
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0,8,9]}}", eight));
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0,-8]}}", eight));
  expect_data_loss(raw_file(R"({"__metadata__":{"k":1}})", ""), "not a string");
  expect_data_loss(raw_file(R"({"__metadata__":["k"]})", ""), "__metadata__");
}

TEST_F(CheckpointTest, BadOffsetsAreDataLoss) {
  const std::string f32_2 = R"("dtype":"F32","shape":[2])";
  const std::string eight(8, '\x01'), sixteen(16, '\x02');
  // Shape disagrees with the byte span.
  expect_data_loss(
      raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0,12]}}", std::string(12, 'x')),
      "needs 8 bytes but data_offsets [0, 12] span 12");
  expect_data_loss(
      raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})",
               eight),
      "over 2^64");
  // Outside the file.
  expect_data_loss(
      raw_file(R"({"a":{"dtype":"F32","shape":[250],"data_offsets":[0,1000]}})", eight),
      "truncated: header says 1000 bytes of data, file has 8");
  expect_data_loss(
      raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[99999999999,100000000007]}}", eight),
      "belong to no tensor");
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[8,0]}}", eight),
                   "end before begin");
  // Overlapping, with a gap, not covering all the data.
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0,8]},\"b\":{" + f32_2 +
                                ",\"data_offsets\":[4,12]}}",
                            std::string(12, 'x')),
                   "overlap tensor 'a'");
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0,8]},\"b\":{" + f32_2 +
                                ",\"data_offsets\":[0,8]}}",
                            sixteen),
                   "overlap");
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[8,16]}}", sixteen),
                   "data bytes [0, 8) belong to no tensor");
  expect_data_loss(raw_file("{\"a\":{" + f32_2 + ",\"data_offsets\":[0,8]}}", sixteen),
                   "8 trailing bytes belong to no tensor");
}

TEST_F(CheckpointTest, SpecDTypesDtrainCannotHoldAreUnimplemented) {
  write_bytes(path("u8.safetensors"),
              raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "abcd"));
  EXPECT_THROW(load_safetensors(path("u8.safetensors")), Unimplemented);
}

TEST_F(CheckpointTest, RandomByteFlipsLoadOrThrowDtrainErrors) {
  save_safetensors(path("x.safetensors"), small());
  const std::string good = read_bytes(path("x.safetensors"));
  std::mt19937 rng(20240601);
  int loaded = 0, rejected = 0;
  for (int iter = 0; iter < 500; ++iter) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f)
      bytes[rng() % bytes.size()] ^= static_cast<char>(1 + rng() % 255);
    write_bytes(path("flip.safetensors"), bytes);
    try {
      const CheckpointData d = load_safetensors(path("flip.safetensors"));
      size_t total = 0;
      for (const auto& [name, t] : d.tensors) total += t.nbytes();
      EXPECT_LE(total, bytes.size());
      ++loaded;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << " threw a non-dtrain exception: " << e.what();
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(loaded, 0);  // flips in the data section are not detectable by the format
}

// ---------------------------------------------------------------------------------------------
// CheckpointManager

CheckpointData step_data(int64_t step, int64_t n = 64) {
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) w[i] = static_cast<float>((step * 7919 + i) % 1000003);
  CheckpointData d;
  d.tensors.emplace_back("w", Tensor::from_vector(w, Shape{n}));
  d.tensors.emplace_back("step", Tensor::from_vector<int64_t>({step}, Shape{}));
  return d;
}

// Checks that `d` is exactly what step_data(step, n) wrote.
void expect_step_data(const CheckpointData& d, int64_t step, int64_t n = 64) {
  ASSERT_EQ(d.metadata.count("step"), 1u);
  EXPECT_EQ(d.metadata.at("step"), std::to_string(step));
  const Tensor* s = d.find("step");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->to_vector<int64_t>(), std::vector<int64_t>{step});
  const Tensor* w = d.find("w");
  ASSERT_NE(w, nullptr);
  ASSERT_EQ(w->shape(), Shape{n});
  const float* p = w->data<float>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += p[i] != static_cast<float>((step * 7919 + i) % 1000003);
  EXPECT_EQ(wrong, 0) << "elements differing from step " << step;
}

using CheckpointManagerTest = CheckpointTest;

TEST_F(CheckpointManagerTest, KeepsTheNewestMaxToKeep) {
  CheckpointManager mgr(dir_ + "/sub/ckpts", 2);
  EXPECT_EQ(mgr.directory(), dir_ + "/sub/ckpts");
  int64_t step = -1;
  EXPECT_FALSE(mgr.restore_latest(&step).has_value());
  EXPECT_FALSE(mgr.latest_path().has_value());
  for (int64_t s : {10, 20, 30, 40, 50})
    EXPECT_EQ(mgr.save(s, step_data(s)),
              dir_ + "/sub/ckpts/ckpt-" + std::to_string(s) + ".safetensors");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(mgr.directory()))
    names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"checkpoint", "ckpt-40.safetensors", "ckpt-50.safetensors"}));
  EXPECT_EQ(read_bytes(mgr.directory() + "/checkpoint"),
            "{\"latest\":\"ckpt-50.safetensors\",\"step\":50,\"all\":[\"ckpt-40.safetensors\","
            "\"ckpt-50.safetensors\"]}\n");
  EXPECT_EQ(mgr.latest_path(), mgr.directory() + "/ckpt-50.safetensors");
  auto d = mgr.restore_latest(&step);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(step, 50);
  expect_step_data(*d, 50);
}

// A rerun in the same directory that starts again at a lower step (another learning rate, say):
// the newest are the newest saved, as in TF's CheckpointManager. By step, the rerun's first
// checkpoint was deleted at its second save while the last run's higher steps stayed, and a damaged
// newest file fell back to the last run's.
TEST_F(CheckpointManagerTest, KeepsTheNewestSavedNotTheHighestSteps) {
  {
    CheckpointManager run1(dir_, 3);
    for (int64_t s : {10, 20, 30, 40}) run1.save(s, step_data(s));
  }
  CheckpointManager run2(dir_, 3);
  const auto files = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  };
  run2.save(5, step_data(5));
  EXPECT_EQ(files(), (std::vector<std::string>{"checkpoint", "ckpt-30.safetensors",
                                               "ckpt-40.safetensors", "ckpt-5.safetensors"}));
  run2.save(10, step_data(10));
  run2.save(15, step_data(15));
  EXPECT_EQ(files(), (std::vector<std::string>{"checkpoint", "ckpt-10.safetensors",
                                               "ckpt-15.safetensors", "ckpt-5.safetensors"}));
  EXPECT_EQ(run2.latest_path(), path("ckpt-15.safetensors"));
  // A damaged newest: the one saved before it, not the highest step.
  run2.save(2, step_data(2));  // ckpt-5 goes
  fs::resize_file(path("ckpt-2.safetensors"), 20);
  ::testing::internal::CaptureStderr();
  int64_t step = -1;
  std::string restored;
  auto d = run2.restore_latest(&step, &restored);
  ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(step, 15);
  EXPECT_EQ(restored, path("ckpt-15.safetensors"));
  expect_step_data(*d, 15);
  // Without its index: the files by step.
  fs::remove(path("checkpoint"));
  EXPECT_EQ(run2.latest_path(), path("ckpt-15.safetensors"));
}

// A file that cannot be read for a reason that may pass (here EACCES) is not fallen back past: on
// one worker of several, that restored other weights than the rest's.
TEST_F(CheckpointManagerTest, AnUnreadableNewestFileIsAnErrorNotAFallback) {
  if (::geteuid() == 0) {
    // root reads a file whatever its mode: a directory where the file should be is unreadable
    // even to root (Unavailable: not a regular file).
    CheckpointManager mgr(dir_);
    for (int64_t s : {1, 2}) mgr.save(s, step_data(s));
    fs::remove(path("ckpt-2.safetensors"));
    fs::create_directory(path("ckpt-2.safetensors"));
    EXPECT_THROW(mgr.restore_latest(), Unavailable);
    return;
  }
  CheckpointManager mgr(dir_);
  for (int64_t s : {1, 2}) mgr.save(s, step_data(s));
  fs::permissions(path("ckpt-2.safetensors"), fs::perms::none);
  EXPECT_THROW(mgr.restore_latest(), Unavailable);
  fs::permissions(path("ckpt-2.safetensors"), fs::perms::owner_read | fs::perms::owner_write);
}

TEST_F(CheckpointManagerTest, RejectsBadArguments) {
  EXPECT_THROW(CheckpointManager(dir_, 0), InvalidArgument);
  EXPECT_THROW(CheckpointManager("", 3), InvalidArgument);
  write_bytes(path("file"), "x");
  EXPECT_THROW(CheckpointManager(path("file"), 3), Unavailable);
  CheckpointManager mgr(dir_);
  EXPECT_THROW(mgr.save(-1, step_data(1)), InvalidArgument);
  CheckpointData dup = step_data(1);
  dup.tensors.push_back(dup.tensors[0]);
  EXPECT_THROW(mgr.save(1, dup), InvalidArgument);
  EXPECT_FALSE(mgr.latest_path().has_value()) << "a failed save leaves no index";
}

TEST_F(CheckpointManagerTest, RestoresHighestAfterIndexDeletion) {
  CheckpointManager mgr(dir_);
  for (int64_t s : {1, 2, 3}) mgr.save(s, step_data(s));
  fs::remove(path("checkpoint"));
  EXPECT_EQ(mgr.latest_path(), path("ckpt-3.safetensors"));
  ::testing::internal::CaptureStderr();
  int64_t step = -1;
  auto d = mgr.restore_latest(&step);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(step, 3);
  expect_step_data(*d, 3);
  EXPECT_NE(log.find("index file 'checkpoint' is missing"), std::string::npos) << log;
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
}

TEST_F(CheckpointManagerTest, FallsBackWhenTheIndexedFileIsTruncated) {
  CheckpointManager mgr(dir_);
  for (int64_t s : {1, 2, 3}) mgr.save(s, step_data(s));
  fs::resize_file(path("ckpt-3.safetensors"), fs::file_size(path("ckpt-3.safetensors")) / 2);
  ::testing::internal::CaptureStderr();
  int64_t step = -1;
  auto d = mgr.restore_latest(&step);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(step, 2);
  expect_step_data(*d, 2);
  EXPECT_EQ(log.rfind("W ", 0), 0u) << "one WARNING line: " << log;
  EXPECT_NE(log.find("ckpt-3.safetensors"), std::string::npos) << log;
  EXPECT_NE(log.find("truncated"), std::string::npos) << log;
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
}

TEST_F(CheckpointManagerTest, FallsBackOnCorruptIndexAndFailsLoudlyWhenNothingLoads) {
  CheckpointManager mgr(dir_);
  for (int64_t s : {1, 2}) mgr.save(s, step_data(s));
  write_bytes(path("checkpoint"), "{\"latest\":\"../../etc/passwd\",\"step\":2}");
  int64_t step = -1;
  ::testing::internal::CaptureStderr();
  auto d = mgr.restore_latest(&step);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("corrupt"), std::string::npos);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(step, 2);
  // A file whose metadata step disagrees with its name is not trusted.
  CheckpointData lying = step_data(7);
  lying.metadata["step"] = "6";
  save_safetensors(path("ckpt-2.safetensors"), lying);
  write_bytes(path("ckpt-1.safetensors"), "garbage");
  ::testing::internal::CaptureStderr();
  try {
    mgr.restore_latest();
    ADD_FAILURE() << "restored from corrupt files";
  } catch (const DataLoss& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("ckpt-1.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("metadata says step 6"), std::string::npos) << msg;
  }
  ::testing::internal::GetCapturedStderr();
}

TEST_F(CheckpointManagerTest, IgnoresAndCleansUpTemporaryLeftovers) {
  CheckpointManager mgr(dir_);
  mgr.save(1, step_data(1));
  write_bytes(path("ckpt-2.safetensors.tmp.99999.0"), "partial");
  write_bytes(path("checkpoint.tmp.99999.1"), "{\"latest\":\"ckpt-2.safetensors\",\"step\":2}");
  write_bytes(path("unrelated.tmp.1"), "user file");
  EXPECT_EQ(mgr.latest_path(), path("ckpt-1.safetensors"));
  int64_t step = -1;
  auto d = mgr.restore_latest(&step);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(step, 1);
  mgr.save(3, step_data(3));
  EXPECT_EQ(listing(), (std::vector<std::string>{"checkpoint", "ckpt-1.safetensors",
                                                 "ckpt-3.safetensors", "unrelated.tmp.1"}));
}

// A writer SIGKILLed at random moments while saving ~8 MB checkpoints never leaves the directory
// without a complete, correct checkpoint, and never loses a save that had returned. The writer
// reports each finished save through a pipe; on even rounds the kill comes after the first report
// (so it lands in a later save whatever the disk speed), on odd rounds at a random time.
TEST_F(CheckpointManagerTest, SigkillDuringSaveAlwaysLeavesARestorableCheckpoint) {
  constexpr int64_t kN = int64_t{2} << 20;  // 2M floats = 8 MB
  CheckpointManager mgr(dir_, 3);
  mgr.save(0, step_data(0, kN));
  std::mt19937 rng(7);
  int64_t last = 0;
  for (int round = 0; round < 20; ++round) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      try {
        CheckpointManager child(dir_, 3);
        for (int64_t s = (round + 1) * 1000;; ++s) {
          child.save(s, step_data(s, kN));
          if (::write(fds[1], &s, sizeof s) != sizeof s) break;
        }
      } catch (...) {
      }
      ::_exit(1);  // a save failed: the parent sees an exit instead of SIGKILL
    }
    ::close(fds[1]);
    if (round % 2 == 0) {
      pollfd pfd{fds[0], POLLIN, 0};
      EXPECT_EQ(::poll(&pfd, 1, 60000), 1) << "the writer finished no save in 60 s";
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 30000));
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(500 + rng() % 60000));
    }
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the writer failed itself";
    int64_t reported = last, s = 0;
    while (::read(fds[0], &s, sizeof s) == sizeof s) reported = std::max(reported, s);
    ::close(fds[0]);

    int64_t step = -1;
    auto d = mgr.restore_latest(&step);
    ASSERT_TRUE(d.has_value()) << "round " << round;
    ASSERT_GE(step, reported) << "round " << round << ": a finished save was lost";
    if (round % 2 == 0) {
      EXPECT_GT(step, last) << "round " << round;
    }
    last = step;
    expect_step_data(*d, step, kN);
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace dtrain
