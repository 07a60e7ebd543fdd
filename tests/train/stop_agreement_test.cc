// Run as `dtrain-run -np 2 -- stop_agreement_test`: a stop asked by one worker's callback only (a
// wall-clock budget, say) stops every worker after the same step, without a hang or a mismatch.
#include <gtest/gtest.h>

#include "dtrain/dtrain.h"

namespace dtrain {
namespace {

Dataset data(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n * 4));
  std::vector<int32_t> y(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 13) / 13.f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(i % 3);
  return Dataset::from_tensors(
      {Tensor::from_vector(x, Shape{n, 4}), Tensor::from_vector(y, Shape{n})});
}

struct StopOn : Callback {
  int worker;
  int64_t at_step = -1;
  int at_epoch = -1;
  void on_train_batch_end(const TrainLogs& l) override {
    if (strategy().extended().worker_rank() == worker && l.global_step == at_step) stop_training();
  }
  void on_epoch_end(const TrainLogs& l) override {
    if (strategy().extended().worker_rank() == worker && l.epoch == at_epoch) stop_training();
  }
};

History train(Strategy& s, StopOn& cb) {
  Sequential m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s.scope();
    m.add(std::make_shared<Dense>(8, Activation::kRelu));
    m.add(std::make_shared<Dense>(3));
    opt = std::make_unique<SGD>(0.1f);
  }
  FitOptions o;
  o.epochs = 5;
  o.global_batch_size = 8;  // 64 rows: 8 steps per epoch
  o.callbacks = {&cb};
  return fit(s, m, *opt, data(64), nullptr, o);
}

TEST(StopAgreement, ABatchStopOnOneWorkerStopsBothAfterTheNextStep) {
  auto s = make_strategy("multi_worker_mirrored", {});
  ASSERT_EQ(s->extended().num_workers(), 2);
  StopOn cb;
  cb.worker = 1;
  cb.at_step = 3;
  const History h = train(*s, cb);
  EXPECT_EQ(h.steps, 4);  // asked after step 3 on worker 1; step 4 carried it to everyone
  EXPECT_EQ(h.epoch_loss.size(), 1u);
}

TEST(StopAgreement, AnEpochEndStopOnOneWorkerStopsBothBeforeTheNextEpoch) {
  auto s = make_strategy("multi_worker_mirrored", {});
  StopOn cb;
  cb.worker = 0;
  cb.at_epoch = 1;
  const History h = train(*s, cb);
  EXPECT_EQ(h.steps, 16);  // two epochs of 8
  EXPECT_EQ(h.epoch_loss.size(), 2u);
}

}  // namespace
}  // namespace dtrain
