// The smallest program a dtrain user writes: a model built in a strategy's scope and trained with
// fit() on two logical CPU devices, and a typed error caught across the library boundary; then a
// functional model with a skip connection and two outputs, and a subclassed model, the same way.
#include <cstdio>
#include <vector>

#include "dtrain/dtrain.h"

int main() {
  const std::vector<dtrain::DeviceSpec> devices = dtrain::parse_devices_flag("cpu:2");
  try {
    dtrain::make_strategy("no_such_strategy", {});
    std::puts("FAIL: an unknown strategy was accepted");
    return 1;
  } catch (const dtrain::InvalidArgument& e) {
    std::printf("typed error across the library boundary: %s\n", e.what());
  }

  // y = 1 when x0 + x1 > 0, else 0: separable, so a small MLP learns it in a few epochs.
  const int64_t n = 512;
  std::vector<float> x(static_cast<size_t>(n) * 2);
  std::vector<int32_t> y(static_cast<size_t>(n));
  dtrain::Philox rng(7, 0);
  for (int64_t i = 0; i < n; ++i) {
    const float a = rng.uniform(static_cast<uint64_t>(2 * i)) * 2 - 1;
    const float b = rng.uniform(static_cast<uint64_t>(2 * i + 1)) * 2 - 1;
    x[static_cast<size_t>(2 * i)] = a;
    x[static_cast<size_t>(2 * i + 1)] = b;
    y[static_cast<size_t>(i)] = a + b > 0 ? 1 : 0;
  }
  auto data = dtrain::Dataset::from_tensor_slices(
      {dtrain::Tensor::from_vector<float>(x, dtrain::Shape{n, 2}),
       dtrain::Tensor::from_vector<int32_t>(y, dtrain::Shape{n})});

  dtrain::StrategyOptions options;
  options.devices = devices;
  auto strategy = dtrain::make_strategy("mirrored", options);
  dtrain::Sequential model;
  std::unique_ptr<dtrain::Optimizer> optimizer;
  {
    auto scope = strategy->scope();
    model.add(std::make_unique<dtrain::Dense>(16, dtrain::Activation::kRelu));
    model.add(std::make_unique<dtrain::Dense>(2));
    optimizer = std::make_unique<dtrain::Adam>(0.05f);
  }
  dtrain::FitOptions fit;
  fit.epochs = 5;
  fit.global_batch_size = 64;
  const dtrain::History h = dtrain::fit(*strategy, model, *optimizer, data, &data, fit);
  std::printf("replicas %d, loss %.4f -> %.4f, accuracy %.3f\n", strategy->num_replicas_in_sync(),
              h.epoch_loss.front(), h.epoch_loss.back(), h.test_accuracy);
  if (strategy->num_replicas_in_sync() != 2 || !(h.epoch_loss.back() < h.epoch_loss.front()) ||
      h.test_accuracy < 0.9) {
    std::puts("FAIL: training did not converge");
    return 1;
  }
  // The Model API from outside: a functional model with a skip connection and two outputs (the
  // class, and a + b), and a subclassed model, each trained under Mirrored.
  std::vector<float> sums(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    sums[static_cast<size_t>(i)] =
        x[static_cast<size_t>(2 * i)] + x[static_cast<size_t>(2 * i + 1)];
  auto two = dtrain::Dataset::from_tensor_slices(
      {dtrain::Tensor::from_vector<float>(x, dtrain::Shape{n, 2}),
       dtrain::Tensor::from_vector<int32_t>(y, dtrain::Shape{n}),
       dtrain::Tensor::from_vector<float>(sums, dtrain::Shape{n, 1})});
  std::shared_ptr<dtrain::Model> functional;
  {
    auto scope = strategy->scope();
    auto hidden = std::make_shared<dtrain::Dense>(16, dtrain::Activation::kRelu);
    auto widen = std::make_shared<dtrain::Dense>(16);
    auto add = std::make_shared<dtrain::Add>();
    auto cls = std::make_shared<dtrain::Dense>(2, dtrain::Activation::kNone, true, "cls");
    auto sum = std::make_shared<dtrain::Dense>(1, dtrain::Activation::kNone, true, "sum");
    dtrain::KerasTensor in = dtrain::Input({2});
    dtrain::KerasTensor h = (*add)({(*hidden)(in), (*widen)(in)});
    functional =
        std::make_shared<dtrain::Model>(in, std::vector<dtrain::KerasTensor>{(*cls)(h), (*sum)(h)});
    optimizer = std::make_unique<dtrain::Adam>(0.05f);
  }
  dtrain::FitOptions two_fit = fit;
  two_fit.losses = {[](const dtrain::Tensor& l, const dtrain::Tensor& t) {
                      return dtrain::ops::sparse_softmax_cross_entropy(l, t);
                    },
                    [](const dtrain::Tensor& p, const dtrain::Tensor& t) {
                      return dtrain::ops::mean_squared_error(p, t);
                    }};
  two_fit.output_metrics = {{"cls", {"accuracy"}}, {"sum", {"mae"}}};
  const dtrain::History h2 = dtrain::fit(*strategy, *functional, *optimizer, two, &two, two_fit);
  functional->summary();
  std::printf("functional, two outputs: accuracy %.3f, mae %.4f\n",
              h2.history.at("val_cls_accuracy").back(), h2.history.at("val_sum_mae").back());
  if (h2.history.at("val_cls_accuracy").back() < 0.9 || h2.history.at("val_sum_mae").back() > 0.1) {
    std::puts("FAIL: the functional model did not learn");
    return 1;
  }

  class Mlp : public dtrain::Model {
   public:
    Mlp() : Model("mlp") {
      a_ = register_layer(std::make_shared<dtrain::Dense>(16, dtrain::Activation::kRelu));
      b_ = register_layer(std::make_shared<dtrain::Dense>(2));
    }

   protected:
    using Model::call;
    dtrain::Tensor call(const dtrain::Tensor& in, bool) override { return (*b_)((*a_)(in)); }

   private:
    std::shared_ptr<dtrain::Dense> a_, b_;
  };
  std::shared_ptr<Mlp> sub;
  {
    auto scope = strategy->scope();
    sub = std::make_shared<Mlp>();
    optimizer = std::make_unique<dtrain::Adam>(0.05f);
  }
  const dtrain::History h3 = dtrain::fit(*strategy, *sub, *optimizer, data, &data, fit);
  std::printf("subclassed: accuracy %.3f, variables %zu\n", h3.test_accuracy,
              sub->variables().size());
  if (h3.test_accuracy < 0.9 || sub->variables()[0]->name() != "dense/kernel") {
    std::puts("FAIL: the subclassed model did not learn, or its variables are misnamed");
    return 1;
  }
  // A user's own causal self-attention block from the public ops and layers, in a tiny language
  // model trained with fit() on a repeating token sequence (the next token follows from the
  // current).
  class MyAttention : public dtrain::Layer {
   public:
    MyAttention() : Layer("my_attention") {
      qkv_ = register_layer(
          std::make_shared<dtrain::Dense>(3 * 16, dtrain::Activation::kNone, true, "qkv"));
      out_ = register_layer(
          std::make_shared<dtrain::Dense>(16, dtrain::Activation::kNone, true, "out"));
    }

   protected:
    using Layer::call;
    dtrain::Tensor call(const dtrain::Tensor& x, bool) override {  // x [B, T, 16], 2 heads of 8
      const int64_t b = x.shape()[0], t = x.shape()[1];
      const dtrain::Tensor qkv = (*qkv_)(x);  // [B, T, 48]
      auto head = [&](int which) {
        return dtrain::ops::transpose(
            dtrain::ops::reshape(dtrain::ops::slice(qkv, 2, which * 16, 16),
                                 dtrain::Shape{b, t, 2, 8}),
            {0, 2, 1, 3});  // [B, 2, T, 8]
      };
      const dtrain::Tensor q = head(0), k = head(1), v = head(2);
      dtrain::Tensor scores =
          dtrain::ops::scale(dtrain::ops::matmul(q, k, false, true), 0.35355339f);
      const dtrain::Tensor p = dtrain::ops::softmax(dtrain::ops::causal_mask(scores), -1);
      const dtrain::Tensor o = dtrain::ops::transpose(dtrain::ops::matmul(p, v), {0, 2, 1, 3});
      return dtrain::ops::add(x, (*out_)(dtrain::ops::reshape(o, dtrain::Shape{b, t, 16})));
    }

   private:
    std::shared_ptr<dtrain::Dense> qkv_, out_;
  };
  class TinyLm : public dtrain::Model {
   public:
    TinyLm() : Model("tiny_lm") {
      emb_ = register_layer(std::make_shared<dtrain::Embedding>(7, 16));
      attn_ = register_layer(std::make_shared<MyAttention>());
      norm_ = register_layer(std::make_shared<dtrain::LayerNormalization>(1e-5f));
    }

   protected:
    using Model::call;
    dtrain::Tensor call(const dtrain::Tensor& ids, bool training) override {
      return emb_->attend((*norm_)((*attn_)((*emb_)(ids, training), training), training));
    }

   private:
    std::shared_ptr<dtrain::Embedding> emb_;
    std::shared_ptr<MyAttention> attn_;
    std::shared_ptr<dtrain::LayerNormalization> norm_;
  };
  std::vector<int32_t> xs, ys;
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 6; ++j) {
      xs.push_back((i + j) % 7);
      ys.push_back((i + j + 1) % 7);
    }
  const dtrain::Dataset tokens = dtrain::Dataset::from_tensors(
      {dtrain::Tensor::from_vector<int32_t>(xs, dtrain::Shape{64, 6}),
       dtrain::Tensor::from_vector<int32_t>(ys, dtrain::Shape{64, 6})});
  std::shared_ptr<TinyLm> lm;
  {
    auto scope = strategy->scope();
    lm = std::make_shared<TinyLm>();
    lm->build(dtrain::Shape{1, 6});
    optimizer = std::make_unique<dtrain::AdamW>(0.02f, 0.01f);
  }
  dtrain::FitOptions lm_fit;
  lm_fit.epochs = 15;
  lm_fit.global_batch_size = 16;
  lm_fit.loss = dtrain::get_loss("sparse_categorical_crossentropy");
  const dtrain::History h4 = dtrain::fit(*strategy, *lm, *optimizer, tokens, nullptr, lm_fit);
  std::printf("own attention block: loss %.3f -> %.3f\n", h4.epoch_loss.front(),
              h4.epoch_loss.back());
  if (!(h4.epoch_loss.back() < 0.3 * h4.epoch_loss.front())) {
    std::puts("FAIL: the language model with a user-written attention block did not learn");
    return 1;
  }
  std::puts("consumer OK");
  return 0;
}
