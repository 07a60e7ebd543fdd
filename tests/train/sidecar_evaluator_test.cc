// SidecarEvaluator (TF's sidecar evaluation) in one process: which checkpoints it evaluates. The
// multi-process job (chief, workers, ps, evaluator) is in tests/ps/ps_test.py.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dtrain/dtrain.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

class SidecarEvaluatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("dtrain_sidecar_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    model_.add(std::make_shared<Dense>(3));
    model_.build(Shape{1, 4});
  }
  void TearDown() override { fs::remove_all(dir_); }
  // 20 examples of 4 features, 3 classes.
  static Dataset dataset() {
    std::vector<float> x(80);
    std::vector<int32_t> y(20);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) / 7.f - 0.5f;
    for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(i % 3);
    return Dataset::from_tensors(
        {Tensor::from_vector(x, Shape{20, 4}), Tensor::from_vector(y, Shape{20})});
  }
  // The model's variables as a checkpoint, marked final or not.
  CheckpointData checkpoint(bool final) const {
    CheckpointData d;
    for (const auto& v : model_.variables()) d.tensors.emplace_back(v->name(), v->value());
    d.metadata["final"] = std::string(1, final ? '1' : '0');
    return d;
  }

  // Runs the evaluator on dir_ on a thread (polling every 5 ms, giving up after 20 s without a
  // new checkpoint) until finish() sets `stop` and joins it.
  class Background {
   public:
    Background(SidecarEvaluatorTest& t, std::FILE* out) {
      SidecarEvaluatorOptions o;
      o.checkpoint_dir = t.dir_.string();
      o.poll = std::chrono::milliseconds(5);
      o.timeout = std::chrono::seconds(20);
      o.stop = &stop_;
      o.out = out;
      o.json = true;
      thread_ = std::thread([this, &t, o] {
        try {
          results_ = SidecarEvaluator(t.model_, dataset(), o).run();
        } catch (const std::exception& e) {
          error_ = e.what();
        }
      });
    }
    ~Background() {
      if (thread_.joinable()) finish();
    }
    // Stops the evaluator, joins it and returns what it evaluated; fails the test on an error.
    std::vector<SidecarResult> finish() {
      stop_ = true;
      thread_.join();
      EXPECT_EQ(error_, "");
      return results_;
    }

   private:
    std::atomic<bool> stop_{false};
    std::vector<SidecarResult> results_;
    std::string error_;
    std::thread thread_;
  };

  fs::path dir_;
  Sequential model_;
};

// The chief's final checkpoint replaces the file of its last step, at times within the file
// system's timestamp tick (or between the evaluator's load and its look at the file): the evaluator
// must still evaluate it. The modification time is set back here so that only the file's identity
// (its inode) tells the two apart.
TEST_F(SidecarEvaluatorTest, EvaluatesAFinalCheckpointThatReplacedTheLastOne) {
  CheckpointManager manager(dir_.string());
  const std::string path = manager.save(6, checkpoint(false));
  const fs::path out_path = dir_ / "evaluator.out";
  std::FILE* out = std::fopen(out_path.c_str(), "w");
  ASSERT_NE(out, nullptr);
  Background evaluator(*this, out);
  auto lines = [&] {
    std::ifstream in(out_path);
    int n = 0;
    for (std::string line; std::getline(in, line);) n += line.find("evaluator_step") != line.npos;
    return n;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (lines() < 1 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // As CheckpointManager::save writes it, but with the old file's modification time before it
  // replaces the old file.
  const fs::path staged = dir_ / "staged.safetensors";
  CheckpointData final_data = checkpoint(true);
  final_data.metadata["step"] = std::to_string(6);
  save_safetensors(staged.string(), final_data);
  fs::last_write_time(staged, fs::last_write_time(path));
  fs::rename(staged, path);
  const std::vector<SidecarResult> results = evaluator.finish();
  std::fclose(out);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_FALSE(results[0].final);
  EXPECT_TRUE(results[1].final);
  EXPECT_EQ(results[1].step, 6);
}

// The index names a checkpoint that does not load (truncated): the evaluator evaluates the older
// one restore_latest() falls back to once, then waits, rather than evaluating it again and again.
TEST_F(SidecarEvaluatorTest, EvaluatesTheFallbackOfADamagedCheckpointOnce) {
  CheckpointManager manager(dir_.string());
  manager.save(6, checkpoint(false));
  fs::resize_file(manager.save(9, checkpoint(false)), 20);
  Background evaluator(*this, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // 60 polls
  const std::vector<SidecarResult> results = evaluator.finish();
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].step, 6);
}

}  // namespace
}  // namespace dtrain
