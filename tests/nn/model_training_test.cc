// Functional and subclassed models train under every in-process strategy exactly as under one
// device at the same global batch, with several outputs (a loss per output, loss weights, metrics
// per output), and their checkpoints move between strategies.
#include <cmath>
#include <filesystem>

#include "dtrain/nn/layers.h"
#include "dtrain/nn/losses.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/strategies/make_strategy.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/fit.h"
#include "testing/test_util.h"

namespace dtrain {
namespace {

using testing::random_tensor;

class ModelTraining : public ::testing::Test {
 protected:
  void SetUp() override { configure_devices({2, 1}); }
};

using testing::strategy_on_cpus;

// A residual CNN with two heads: 4 class logits and one value.
std::shared_ptr<Model> two_heads() {
  auto conv = std::make_shared<Conv2D>(6, 3, 3, Activation::kRelu, ops::Padding::kSame);
  auto conv2 = std::make_shared<Conv2D>(6, 3, 3, Activation::kNone, ops::Padding::kSame);
  KerasTensor in = Input({8, 8, 1}, "image");
  KerasTensor x = (*conv)(in);
  KerasTensor y = (*std::make_shared<Add>())({x, (*conv2)(x)});
  y = (*std::make_shared<ActivationLayer>(Activation::kRelu))(y);
  KerasTensor logits = (*std::make_shared<Dense>(4, Activation::kNone, true, "logits"))(
      (*std::make_shared<Flatten>())(y));
  KerasTensor value = (*std::make_shared<Dense>(1, Activation::kNone, true, "value"))(
      (*std::make_shared<GlobalAveragePooling2D>())(y));
  return std::make_shared<Model>(in, std::vector<KerasTensor>{logits, value}, "two_heads");
}

// A subclassed residual model with synchronized batch normalization.
class ResidualNet : public Model {
 public:
  ResidualNet() : Model("residual_net") {
    stem = register_layer(
        std::make_shared<Conv2D>(4, 3, 3, Activation::kNone, ops::Padding::kSame, 1, false));
    bn1 = register_layer(std::make_shared<BatchNormalization>(0.9f, 1e-3f, true));
    conv = register_layer(
        std::make_shared<Conv2D>(4, 3, 3, Activation::kNone, ops::Padding::kSame, 1, false));
    bn2 = register_layer(std::make_shared<BatchNormalization>(0.9f, 1e-3f, true));
    head = register_layer(std::make_shared<Dense>(4));
  }
  std::shared_ptr<Conv2D> stem, conv;
  std::shared_ptr<BatchNormalization> bn1, bn2;
  std::shared_ptr<Dense> head;

 protected:
  using Model::call;
  Tensor call(const Tensor& x, bool training) override {
    const Tensor h = ops::relu((*bn1)((*stem)(x), training));
    const Tensor r = ops::relu(ops::add(h, (*bn2)((*conv)(h), training)));
    return (*head)(ops::mean(r, {1, 2}));
  }
};

struct Data {
  Tensor x, labels, values;
};
Data data(int64_t n) {
  Data d;
  d.x = random_tensor({n, 8, 8, 1}, 100);
  std::vector<int32_t> l(static_cast<size_t>(n));
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    l[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % 4);
    v[static_cast<size_t>(i)] = static_cast<float>(i % 5) / 5.f;
  }
  d.labels = Tensor::from_vector<int32_t>(l, Shape{n});
  d.values = Tensor::from_vector<float>(v, Shape{n, 1});
  return d;
}

std::vector<std::vector<float>> weights(const Model& m) {
  std::vector<std::vector<float>> out;
  for (const auto& v : m.variables()) out.push_back(v->value().to_vector<float>());
  return out;
}

double max_rel_diff(const std::vector<std::vector<float>>& a,
                    const std::vector<std::vector<float>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[i].size(); ++j)
      worst = std::max(worst, std::abs(static_cast<double>(a[i][j]) - b[i][j]) /
                                  std::max(1e-3, std::abs(static_cast<double>(b[i][j]))));
  return worst;
}

FitOptions two_head_options() {
  FitOptions f;
  f.steps = 3;
  f.global_batch_size = 16;
  f.shuffle = false;
  f.warmup_steps = 0;
  f.losses = {[](const Tensor& logits, const Tensor& labels) {
                return ops::sparse_softmax_cross_entropy(logits, labels);
              },
              [](const Tensor& pred, const Tensor& target) {
                return ops::mean_squared_error(pred, target);
              }};
  f.loss_weights = {1.f, 0.5f};
  f.output_metrics = {{"logits", {"accuracy"}}, {"value", {"mae"}}};
  return f;
}

struct Trained {
  std::vector<std::vector<float>> weights;
  History history;
};

Trained train_two_heads(const std::string& name) {
  auto s = strategy_on_cpus(name);
  set_global_seed(3);
  std::shared_ptr<Model> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = two_heads();
    opt = std::make_unique<SGD>(0.1f, 0.9f);
  }
  const Data d = data(48);
  const Dataset ds = Dataset::from_tensors({d.x, d.labels, d.values});
  Trained t;
  t.history = fit(*s, *m, *opt, ds, &ds, two_head_options());
  t.weights = weights(*m);
  return t;
}

TEST_F(ModelTraining, FunctionalModelWithTwoOutputsMatchesOneDeviceUnderEveryLocalStrategy) {
  const Trained one = train_two_heads("one_device");
  for (const char* k : {"loss", "logits_accuracy", "value_mae", "val_logits_accuracy"})
    EXPECT_EQ(one.history.history.count(k), 1u) << k;
  EXPECT_TRUE(std::isfinite(one.history.final_loss));
  for (const std::string name : {"mirrored", "central_storage"}) {
    const Trained other = train_two_heads(name);
    EXPECT_LT(max_rel_diff(other.weights, one.weights), 1e-4) << name;
    EXPECT_NEAR(other.history.final_loss, one.history.final_loss, 1e-5) << name;
  }
  // The loss weights matter: without them the weights end elsewhere.
  auto s = strategy_on_cpus("one_device");
  set_global_seed(3);
  auto m = two_heads();
  SGD sgd(0.1f, 0.9f);
  const Data d = data(48);
  FitOptions f = two_head_options();
  f.loss_weights = {};
  fit(*s, *m, sgd, Dataset::from_tensors({d.x, d.labels, d.values}), nullptr, f);
  EXPECT_GT(max_rel_diff(weights(*m), one.weights), 1e-4);
}

std::vector<std::vector<float>> train_residual(const std::string& name, int64_t steps) {
  auto s = strategy_on_cpus(name);
  set_global_seed(5);
  std::shared_ptr<ResidualNet> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = std::make_shared<ResidualNet>();
    opt = std::make_unique<SGD>(0.05f, 0.9f);
  }
  const Data d = data(64);
  FitOptions f;
  f.steps = steps;
  f.global_batch_size = 32;
  f.shuffle = false;
  fit(*s, *m, *opt, Dataset::from_tensors({d.x, d.labels}), nullptr, f);
  return weights(*m);
}

TEST_F(ModelTraining, SubclassedModelWithSyncBatchNormMatchesOneDevice) {
  const auto one = train_residual("one_device", 4);
  EXPECT_LT(max_rel_diff(train_residual("mirrored", 4), one), 1e-4);
  EXPECT_LT(max_rel_diff(train_residual("central_storage", 4), one), 1e-4);
}

TEST_F(ModelTraining, CheckpointOfAFunctionalModelRestoresUnderAnotherStrategy) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "dtrain_model_training_ckpt.safetensors").string();
  const Data d = data(32);
  const Dataset ds = Dataset::from_tensors({d.x, d.labels, d.values});
  Tensor before;
  {
    auto s = strategy_on_cpus("mirrored");
    set_global_seed(9);
    std::shared_ptr<Model> m;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s->scope();
      m = two_heads();
      opt = std::make_unique<Adam>(0.01f);
    }
    FitOptions f = two_head_options();
    fit(*s, *m, *opt, ds, nullptr, f);
    ASSERT_TRUE(Checkpoint(*m, opt.get(), s.get()).save(path));
    before = predict(*s, *m, ds, 8);
  }
  auto s = strategy_on_cpus("one_device");
  set_global_seed(123);  // other initial weights: the restore must replace them all
  std::shared_ptr<Model> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = two_heads();
    opt = std::make_unique<Adam>(0.01f);
    m->build();
  }
  EXPECT_NE(predict(*s, *m, ds, 8).to_vector<float>(), before.to_vector<float>());
  Checkpoint(*m, opt.get(), s.get()).restore(path);
  EXPECT_EQ(predict(*s, *m, ds, 8).to_vector<float>(), before.to_vector<float>());
  std::filesystem::remove(path);
}

TEST_F(ModelTraining, CheckpointOfASubclassedModelRestoresUnderAnotherStrategy) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "dtrain_subclassed_ckpt.safetensors").string();
  const Data d = data(32);
  const Dataset ds = Dataset::from_tensors({d.x, d.labels});
  Tensor before;
  {
    auto s = strategy_on_cpus("central_storage");
    set_global_seed(9);
    std::shared_ptr<ResidualNet> m;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s->scope();
      m = std::make_shared<ResidualNet>();
      opt = std::make_unique<Adam>(0.01f);
    }
    FitOptions f;
    f.steps = 3;
    f.global_batch_size = 16;
    fit(*s, *m, *opt, ds, nullptr, f);
    ASSERT_TRUE(Checkpoint(*m, opt.get(), s.get()).save(path));
    before = predict(*s, *m, ds, 8);
  }
  auto s = strategy_on_cpus("mirrored");
  set_global_seed(321);
  std::shared_ptr<ResidualNet> m;
  std::unique_ptr<Optimizer> opt;
  {
    auto scope = s->scope();
    m = std::make_shared<ResidualNet>();
    opt = std::make_unique<Adam>(0.01f);
    m->build(Shape{1, 8, 8, 1});
  }
  Checkpoint(*m, opt.get(), s.get()).restore(path);
  // The moving statistics came back too: inference (training = false) uses them.
  EXPECT_EQ(predict(*s, *m, ds, 8).to_vector<float>(), before.to_vector<float>());
  std::filesystem::remove(path);
}

// A subclassed model with two inputs and two outputs, as a Keras user writes one.
class TwoInTwoOut : public Model {
 public:
  TwoInTwoOut() : Model("two_in_two_out", /*num_inputs=*/2) {
    a_ = register_layer(std::make_shared<Dense>(8, Activation::kRelu));
    b_ = register_layer(std::make_shared<Dense>(8, Activation::kRelu));
    cls_ = register_layer(std::make_shared<Dense>(4));
    reg_ = register_layer(std::make_shared<Dense>(1));
  }

 protected:
  using Model::call;
  std::vector<Tensor> call(const std::vector<Tensor>& xs, bool) override {
    const Tensor h = ops::concat({(*a_)(xs.at(0)), (*b_)(xs.at(1))}, 1);
    return {(*cls_)(h), (*reg_)(h)};
  }

 private:
  std::shared_ptr<Dense> a_, b_, cls_, reg_;
};

TEST_F(ModelTraining, SubclassedModelWithTwoInputsAndTwoOutputsTrains) {
  const Data d = data(64);
  const Tensor flat = ops::reshape(d.x, Shape{64, 64});
  const Tensor other = ops::slice(flat, 1, 0, 10);
  for (const char* name : {"one_device", "mirrored"}) {
    auto s = strategy_on_cpus(name);
    std::shared_ptr<TwoInTwoOut> m;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s->scope();
      m = std::make_shared<TwoInTwoOut>();
      opt = std::make_unique<Adam>(0.01f);
    }
    FitOptions f = two_head_options();
    f.output_metrics = {{"output_1", {"accuracy"}}, {"output_2", {"mae"}}};
    f.steps = 20;
    const Dataset ds = Dataset::from_tensors({flat, other, d.labels, d.values});
    const History h = fit(*s, *m, *opt, ds, &ds, f);
    EXPECT_EQ(m->num_outputs(), 2) << name;
    EXPECT_EQ(m->output_names(), (std::vector<std::string>{"output_1", "output_2"}));
    EXPECT_LT(h.history.at("val_output_2_mae").back(), h.history.at("val_output_2_mae").front())
        << name;
    EXPECT_LT(h.epoch_loss.back(), h.epoch_loss.front()) << name;
  }
}

TEST_F(ModelTraining, ADatasetWithoutALabelPerOutputIsRefused) {
  auto s = strategy_on_cpus("one_device");
  auto m = two_heads();
  SGD sgd(0.1f);
  const Data d = data(16);
  FitOptions f = two_head_options();
  try {
    fit(*s, *m, sgd, Dataset::from_tensors({d.x, d.labels}), nullptr, f);
    FAIL() << "two components accepted for one input and two outputs";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("one label per output"), std::string::npos) << e.what();
  }
  f.output_metrics = {{"no_such_output", {"mae"}}};
  EXPECT_THROW(fit(*s, *m, sgd, Dataset::from_tensors({d.x, d.labels, d.values}), nullptr, f),
               InvalidArgument);
  f = two_head_options();
  f.losses.pop_back();
  EXPECT_THROW(fit(*s, *m, sgd, Dataset::from_tensors({d.x, d.labels, d.values}), nullptr, f),
               InvalidArgument);
}

// Keras' compile(loss={"logits": ..., "value": "mse"}, loss_weights={"value": 0.5}): the same
// training as the list form, bitwise.
TEST_F(ModelTraining, LossesByOutputNameEqualTheListForm) {
  const Trained list = train_two_heads("one_device");
  auto s = strategy_on_cpus("one_device");
  set_global_seed(3);
  auto m = two_heads();
  SGD sgd(0.1f, 0.9f);
  const Data d = data(48);
  FitOptions f = two_head_options();
  f.losses.clear();
  f.loss_weights.clear();
  f.output_losses = {{"logits", get_loss("sparse_categorical_crossentropy")},
                     {"value", get_loss("mse")}};
  f.output_loss_weights = {{"value", 0.5f}};
  const Dataset ds = Dataset::from_tensors({d.x, d.labels, d.values});
  fit(*s, *m, sgd, ds, &ds, f);
  EXPECT_EQ(weights(*m), list.weights);
  // A name that is not an output, or both forms at once, is refused.
  f.output_losses["values"] = get_loss("mae");
  EXPECT_THROW(fit(*s, *m, sgd, ds, nullptr, f), InvalidArgument);
  f.output_losses.erase("values");
  f.loss_weights = {1.f, 1.f};
  EXPECT_THROW(fit(*s, *m, sgd, ds, nullptr, f), InvalidArgument);
  EXPECT_THROW(get_loss("categorical_hinge"), InvalidArgument);
}

// An output left out of output_losses is not trained on (Keras' dict semantics): its head keeps its
// initial weights under one device and under mirrored, while the other head trains.
TEST_F(ModelTraining, AnOutputWithoutALossIsNotTrained) {
  for (const char* name : {"one_device", "mirrored"}) {
    auto s = strategy_on_cpus(name);
    set_global_seed(3);
    std::shared_ptr<Model> m;
    std::unique_ptr<Optimizer> opt;
    {
      auto scope = s->scope();
      m = two_heads();
      opt = std::make_unique<SGD>(0.1f, 0.9f);
      m->build();
    }
    std::map<std::string, std::vector<float>> before;
    for (const auto& v : m->variables()) before[v->name()] = v->value().to_vector<float>();
    FitOptions f = two_head_options();
    f.losses.clear();
    f.loss_weights.clear();
    f.output_losses = {{"logits", get_loss("sparse_categorical_crossentropy")}};
    const Data d = data(48);
    const History h =
        fit(*s, *m, *opt, Dataset::from_tensors({d.x, d.labels, d.values}), nullptr, f);
    EXPECT_TRUE(std::isfinite(h.final_loss)) << name;
    for (const auto& v : m->variables()) {
      const bool value_head = v->name().rfind("value/", 0) == 0;
      EXPECT_EQ(v->value().to_vector<float>() == before.at(v->name()), value_head)
          << name << " " << v->name();
    }
  }
}

TEST_F(ModelTraining, MeanAbsoluteErrorByName) {
  const Tensor p = Tensor::from_vector<float>({1.f, -2.f, 3.f, 0.5f}, Shape{2, 2});
  const Tensor t = Tensor::from_vector<float>({0.f, 0.f, 1.f, 1.f}, Shape{2, 2});
  EXPECT_EQ(get_loss("mae")(p, t).to_vector<float>(), (std::vector<float>{1.5f, 1.25f}));
  EXPECT_EQ(get_loss("mse")(p, t).to_vector<float>(), (std::vector<float>{2.5f, 2.125f}));
  // Per example over every other axis, like mse and Keras ([N, T, K]: the last axis alone left
  // the loss T times Keras's), and [N] predictions per element (it returned a scalar).
  const Tensor p3 = Tensor::from_vector<float>({1.f, -2.f, 3.f, 0.5f, 0.f, 4.f}, Shape{1, 3, 2});
  const Tensor t3 = Tensor::zeros(Shape{1, 3, 2});
  EXPECT_EQ(get_loss("mae")(p3, t3).to_vector<float>(), (std::vector<float>{10.5f / 6}));
  EXPECT_EQ(get_loss("mse")(p3, t3).to_vector<float>(), (std::vector<float>{30.25f / 6}));
  const Tensor p1 = Tensor::from_vector<float>({1.f, -2.f}, Shape{2});
  EXPECT_EQ(get_loss("mae")(p1, Tensor::zeros(Shape{2})).to_vector<float>(),
            (std::vector<float>{1.f, 2.f}));
}

// predict_outputs(): every output of a two-headed model, each [N, ...], equal under mirrored and
// one device; predict() is the first.
TEST_F(ModelTraining, PredictGivesEveryOutput) {
  const Data d = data(20);
  const Dataset ds = Dataset::from_tensors({d.x, d.labels, d.values});
  std::vector<std::vector<float>> first;
  for (const char* name : {"one_device", "mirrored", "ensemble"}) {
    auto s = strategy_on_cpus(name);
    set_global_seed(4);
    std::shared_ptr<Model> m;
    {
      auto scope = s->scope();
      m = two_heads();
      m->build();
    }
    const std::vector<Tensor> outs = predict_outputs(*s, *m, ds, 8);
    ASSERT_EQ(outs.size(), 2u) << name;
    EXPECT_EQ(outs[0].shape(), (Shape{20, 4})) << name;
    EXPECT_EQ(outs[1].shape(), (Shape{20, 1})) << name;
    EXPECT_EQ(predict(*s, *m, ds, 8).to_vector<float>(), outs[0].to_vector<float>()) << name;
    if (first.empty()) {
      for (const Tensor& o : outs) first.push_back(o.to_vector<float>());
    } else if (std::string(name) == "mirrored") {
      for (size_t i = 0; i < 2; ++i)
        EXPECT_EQ(outs[i].to_vector<float>(), first[i]) << name << " output " << i;
    }
  }
}

// Keras' steps_per_epoch: six epochs of a third of a pass each train exactly as two whole passes
// (the same batches in the same order, a new shuffle after each pass), under one device and
// mirrored; one that does not divide a pass is refused.
TEST_F(ModelTraining, StepsPerEpochContinuesThroughThePasses) {
  const Data d = data(48);  // 3 batches of 16 a pass
  const Dataset ds = Dataset::from_tensors({d.x, d.labels, d.values});
  for (const char* name : {"one_device", "mirrored"}) {
    auto run = [&](int epochs, int64_t steps_per_epoch) {
      auto s = strategy_on_cpus(name);
      set_global_seed(3);
      std::shared_ptr<Model> m;
      std::unique_ptr<Optimizer> opt;
      {
        auto scope = s->scope();
        m = two_heads();
        opt = std::make_unique<SGD>(0.1f, 0.9f);
      }
      FitOptions f = two_head_options();
      f.steps = 0;
      f.epochs = epochs;
      f.shuffle = true;
      f.steps_per_epoch = steps_per_epoch;
      const History h = fit(*s, *m, *opt, ds, nullptr, f);
      EXPECT_EQ(h.epoch_loss.size(), static_cast<size_t>(epochs)) << name;
      EXPECT_EQ(h.steps, 6) << name;
      return weights(*m);
    };
    EXPECT_EQ(run(6, 1), run(2, 0)) << name;
    auto s = strategy_on_cpus(name);
    auto m = two_heads();
    SGD sgd(0.1f);
    FitOptions f = two_head_options();
    f.steps_per_epoch = 2;  // does not divide 3
    EXPECT_THROW(fit(*s, *m, sgd, ds, nullptr, f), InvalidArgument) << name;
    f.steps_per_epoch = 3;
    f.shuffle = false;
    EXPECT_THROW(fit(*s, *m, sgd, ds.repeat(), nullptr, f), InvalidArgument) << name;  // infinite
  }
}

}  // namespace
}  // namespace dtrain
