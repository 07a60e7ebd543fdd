// How callbacks' states are kept in a backup (src/train/callback_states.h): values through JSON
// (non-finite ones too), tensors as "callbacks/<key>/<name>" entries, DataLoss for what is
// malformed, and the keys of repeated callbacks.
#include "train/callback_states.h"

#include <gtest/gtest.h>

#include <cmath>

#include "dtrain/dtrain.h"

namespace dtrain {
namespace {

TEST(CallbackStates, RoundTripAndRefuseWhatIsMalformed) {
  CallbackState es;
  es.values = {{"wait", 1}, {"best", -INFINITY}, {"best_epoch", -1}, {"stopped_epoch", NAN}};
  es.tensors["weights/dense/kernel"] = Tensor::from_vector<float>({1, 2, 3, 4}, Shape{2, 2});
  CallbackState lr;
  lr.values = {{"epoch", 3}, {"learning_rate", 0.1}};
  std::map<std::string, std::string> meta;
  std::vector<std::pair<std::string, Tensor>> entries;
  detail::put_callback_states({{"EarlyStopping(a/b)", es}, {"LearningRateScheduler", lr}}, meta,
                              entries);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].first, "callbacks/EarlyStopping(a/b)/weights/dense/kernel");
  const auto back = detail::take_callback_states(meta, entries, "test");
  ASSERT_EQ(back.size(), 2u);
  const CallbackState& e = back.at("EarlyStopping(a/b)");
  EXPECT_EQ(e.values.at("best"), -INFINITY);
  EXPECT_TRUE(std::isnan(e.values.at("stopped_epoch")));
  EXPECT_EQ(e.tensors.at("weights/dense/kernel").to_vector<float>(),
            (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(back.at("LearningRateScheduler").values.at("learning_rate"), 0.1);
  // A backup without the states (made before callbacks kept any): none.
  EXPECT_TRUE(detail::take_callback_states({}, {}, "test").empty());
  // Malformed: not JSON, a value that is no number, a tensor named and not there.
  auto bad = meta;
  bad[detail::kCallbackStates] = "{\"x\": ";
  EXPECT_THROW(detail::take_callback_states(bad, entries, "test"), DataLoss);
  bad[detail::kCallbackStates] = R"({"x": {"values": {"v": "many"}, "tensors": []}})";
  EXPECT_THROW(detail::take_callback_states(bad, entries, "test"), DataLoss);
  EXPECT_THROW(detail::take_callback_states(meta, {}, "test"), DataLoss);

  // Empty states are not written (nothing to give back).
  std::map<std::string, std::string> meta2;
  std::vector<std::pair<std::string, Tensor>> entries2;
  detail::put_callback_states({{"LearningRateScheduler", {}}}, meta2, entries2);
  EXPECT_TRUE(meta2.empty());
  EXPECT_TRUE(entries2.empty());

  // Layouts: keys, value names, tensor names, dtypes and shapes; not the values.
  const std::map<std::string, CallbackState> one{{"EarlyStopping(a/b)", es}};
  CallbackState other_values = es;
  other_values.values["wait"] = 7;
  EXPECT_EQ(detail::callback_states_layout(one),
            detail::callback_states_layout({{"EarlyStopping(a/b)", other_values}}));
  CallbackState other_shape = es;
  other_shape.tensors["weights/dense/kernel"] = Tensor::zeros(Shape{4});
  EXPECT_NE(detail::callback_states_layout(one),
            detail::callback_states_layout({{"EarlyStopping(a/b)", other_shape}}));
  CallbackState other_dtype = es;
  other_dtype.tensors["weights/dense/kernel"] = Tensor::zeros(Shape{2, 2}, DType::kInt32);
  EXPECT_NE(detail::callback_states_layout(one),
            detail::callback_states_layout({{"EarlyStopping(a/b)", other_dtype}}));
  EXPECT_NE(
      detail::callback_states_layout(one),
      detail::callback_states_layout({{"EarlyStopping(a/b)", es}, {"LearningRateScheduler", {}}}));
  // Keys only: a state still empty on a worker that has just joined has the same layout.
  EXPECT_EQ(detail::callback_states_layout(one, true),
            detail::callback_states_layout({{"EarlyStopping(a/b)", {}}}, true));
  EXPECT_NE(detail::callback_states_layout(one, true), detail::callback_states_layout({}, true));
  EXPECT_LT(detail::callback_states_layout(one), uint64_t{1} << 60);

  // Keys: repeats of a kind are told apart by their place in the list.
  EarlyStopping a("loss"), b("loss"), c("val_loss");
  ProgressBar bar;
  const std::vector<std::string> keys = detail::callback_state_keys({&a, &bar, &b, &c});
  EXPECT_EQ(keys, (std::vector<std::string>{"EarlyStopping(loss)", "", "EarlyStopping(loss)#2",
                                            "EarlyStopping(val_loss)"}));
}

}  // namespace
}  // namespace dtrain
