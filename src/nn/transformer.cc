#include "dtrain/nn/transformer.h"

#include <cmath>

#include "dtrain/model/initializers.h"

namespace dtrain {

// --- Embedding ---
Embedding::Embedding(int64_t input_dim, int64_t output_dim, std::string name)
    : Layer(std::move(name)), input_dim_(input_dim), output_dim_(output_dim) {
  if (input_dim < 1 || output_dim < 1)
    throw InvalidArgument("Embedding needs input_dim and output_dim >= 1, got " +
                          std::to_string(input_dim) + " and " + std::to_string(output_dim));
}

void Embedding::build_weights(const Shape&) {
  embeddings = add_weight("embeddings", Shape{input_dim_, output_dim_},
                          embeddings_initializer ? embeddings_initializer
                                                 : initializers::random_uniform(-0.05f, 0.05f));
}

Tensor Embedding::call(const Tensor& ids, bool) {
  // Keras casts float ids (a model built on zeros, a float dataset) to int32.
  const Tensor i = ids.dtype() == DType::kInt32 ? ids : ops::cast(ids, DType::kInt32);
  return ops::embedding_lookup(embeddings->value(), i);
}

Tensor Embedding::attend(const Tensor& x) {
  if (!embeddings)
    throw FailedPrecondition("Embedding '" + name() +
                             "'.attend(): the layer is not built; call it on token ids first");
  if (x.rank() < 1 || x.shape()[-1] != output_dim_)
    throw InvalidArgument("Embedding '" + name() + "'.attend() expects [..., " +
                          std::to_string(output_dim_) + "], got " + x.shape().to_string());
  return ops::matmul(x, embeddings->value(), false, true);
}

// --- PositionEmbedding ---
PositionEmbedding::PositionEmbedding(int64_t sequence_length, std::string name)
    : Layer(std::move(name)), sequence_length_(sequence_length) {
  if (sequence_length < 1)
    throw InvalidArgument("PositionEmbedding needs sequence_length >= 1, got " +
                          std::to_string(sequence_length));
}

void PositionEmbedding::build_weights(const Shape& s) {
  if (s.rank() < 3)
    throw InvalidArgument("PositionEmbedding '" + name() + "' expects [batch, time, dim], got " +
                          s.to_string());
  embeddings = add_weight("embeddings", Shape{sequence_length_, s[-1]},
                          initializer ? initializer : initializers::glorot_uniform());
}

Tensor PositionEmbedding::call(const Tensor& x, bool) {
  const int64_t t = x.shape()[-2];
  if (t > sequence_length_)
    throw InvalidArgument("PositionEmbedding '" + name() + "': a sequence of " + std::to_string(t) +
                          " positions is longer than sequence_length " +
                          std::to_string(sequence_length_) + "; crop the input or raise it");
  return t == sequence_length_ ? embeddings->value() : ops::slice(embeddings->value(), 0, 0, t);
}

// --- LayerNormalization ---
LayerNormalization::LayerNormalization(float epsilon, std::string name)
    : Layer(std::move(name)), epsilon_(epsilon) {
  if (!(epsilon > 0.f))
    throw InvalidArgument("LayerNormalization needs epsilon > 0, got " + std::to_string(epsilon));
}

void LayerNormalization::build_weights(const Shape& s) {
  if (s.rank() < 1) throw InvalidArgument("LayerNormalization '" + name() + "' got a scalar");
  gamma = add_weight("gamma", Shape{s[-1]}, initializers::ones());
  beta = add_weight("beta", Shape{s[-1]}, initializers::zeros());
}

Tensor LayerNormalization::call(const Tensor& x, bool) {
  return ops::layer_norm(x, gamma->value(), beta->value(), epsilon_);
}

// --- MultiHeadAttention ---
class MultiHeadAttention::Projection : public Layer {
 public:
  Projection(int heads, int64_t key_dim, bool use_bias, Initializer* init, std::string name)
      : Layer(std::move(name)),
        heads_(heads),
        key_dim_(key_dim),
        use_bias_(use_bias),
        init_(init) {}
  std::string class_name() const override { return "EinsumDense"; }

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& s) override {
    kernel_ = add_weight("kernel", Shape{s[-1], heads_, key_dim_},
                         *init_ ? *init_ : initializers::glorot_uniform());
    if (use_bias_) bias_ = add_weight("bias", Shape{heads_, key_dim_}, initializers::zeros());
  }
  Tensor call(const Tensor& x, bool) override {  // [..., dim] -> [..., heads, key_dim]
    const int64_t dim = x.shape()[-1];
    Tensor y = ops::matmul(x, ops::reshape(kernel_->value(), Shape{dim, heads_ * key_dim_}));
    if (use_bias_) y = ops::add(y, ops::reshape(bias_->value(), Shape{heads_ * key_dim_}));
    std::vector<int64_t> d = x.shape().dims();
    d.back() = heads_;
    d.push_back(key_dim_);
    return ops::reshape(y, Shape(d));
  }

 private:
  int heads_;
  int64_t key_dim_;
  bool use_bias_;
  Initializer* init_;  // the owning attention layer's, read at build
  std::shared_ptr<Variable> kernel_, bias_;
};

class MultiHeadAttention::OutputProjection : public Layer {
 public:
  OutputProjection(bool use_bias, Initializer* init, Initializer* fallback, std::string name)
      : Layer(std::move(name)), use_bias_(use_bias), init_(init), fallback_(fallback) {}
  std::string class_name() const override { return "EinsumDense"; }
  int64_t units = 0;  // set by the attention layer before it is built

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& s) override {  // s: [..., heads, key_dim]
    kernel_ = add_weight("kernel", Shape{s[-2], s[-1], units},
                         *init_       ? *init_
                         : *fallback_ ? *fallback_
                                      : initializers::glorot_uniform());
    if (use_bias_) bias_ = add_weight("bias", Shape{units}, initializers::zeros());
  }
  Tensor call(const Tensor& x, bool) override {
    const int64_t hk = x.shape()[-2] * x.shape()[-1];
    std::vector<int64_t> d = x.shape().dims();
    d.pop_back();
    d.back() = hk;
    Tensor y =
        ops::matmul(ops::reshape(x, Shape(d)), ops::reshape(kernel_->value(), Shape{hk, units}));
    return use_bias_ ? ops::bias_add(y, bias_->value()) : y;
  }

 private:
  bool use_bias_;
  Initializer *init_, *fallback_;  // the attention layer's output / kernel initializers
  std::shared_ptr<Variable> kernel_, bias_;
};

MultiHeadAttention::MultiHeadAttention(int num_heads, int64_t key_dim, float dropout,
                                       bool use_causal_mask, bool use_bias, std::string name)
    : Layer(std::move(name)),
      num_heads_(num_heads),
      key_dim_(key_dim),
      causal_(use_causal_mask),
      use_bias_(use_bias) {
  if (num_heads < 1 || key_dim < 1)
    throw InvalidArgument("MultiHeadAttention needs num_heads and key_dim >= 1, got " +
                          std::to_string(num_heads) + " and " + std::to_string(key_dim));
  query_ = register_layer(
      std::make_shared<Projection>(num_heads, key_dim, use_bias, &kernel_initializer, "query"));
  key_ = register_layer(
      std::make_shared<Projection>(num_heads, key_dim, use_bias, &kernel_initializer, "key"));
  value_ = register_layer(
      std::make_shared<Projection>(num_heads, key_dim, use_bias, &kernel_initializer, "value"));
  output_ = register_layer(std::make_shared<OutputProjection>(
      use_bias, &output_initializer, &kernel_initializer, "attention_output"));
  dropout_ = register_layer(std::make_shared<Dropout>(dropout, "attention_dropout"));
}

void MultiHeadAttention::build_weights(const std::vector<Shape>& s) {
  if (s.empty() || s.size() > 3 || s[0].rank() < 3)
    throw InvalidArgument("MultiHeadAttention '" + name() +
                          "' takes query [batch, time, dim] (then value and key), got " +
                          std::to_string(s.size()) + " inputs" +
                          (s.empty() ? "" : ", query " + s[0].to_string()));
  output_->units = s[0][-1];
}

std::vector<Tensor> MultiHeadAttention::call(const std::vector<Tensor>& xs, bool training) {
  if (xs.empty() || xs.size() > 3)
    throw InvalidArgument("MultiHeadAttention '" + name() + "' takes 1 to 3 inputs, got " +
                          std::to_string(xs.size()));
  const Tensor& q_in = xs[0];
  const Tensor& v_in = xs.size() > 1 ? xs[1] : xs[0];
  const Tensor& k_in = xs.size() > 2 ? xs[2] : v_in;
  if (q_in.rank() != 3 || v_in.rank() != 3 || k_in.rank() != 3 ||
      q_in.shape()[0] != v_in.shape()[0] || k_in.shape()[1] != v_in.shape()[1])
    throw InvalidArgument("MultiHeadAttention '" + name() +
                          "': query [B, T, dim], value and key [B, S, dim'] with equal B and S, "
                          "got " +
                          q_in.shape().to_string() + ", " + v_in.shape().to_string() + ", " +
                          k_in.shape().to_string());
  // The query scaled by 1 / sqrt(key_dim) before its product with the keys, as Keras'
  // MultiHeadAttention does: the same scores and gradients (bit for bit where key_dim is a power of
  // 4, as GPT-2's 64, the scale then a power of two, while values stay normal floats, above
  // 2^-126), from B T H dk values scaled instead of B H T S (a sixteenth of them at GPT-2's 1,024
  // tokens), in the forward pass and the backward one.
  const float scale = 1.f / std::sqrt(static_cast<float>(key_dim_));
  // [B, T, H, dk] -> [B, H, T, dk]
  const Tensor q = ops::transpose(ops::scale((*query_)(q_in, training), scale), {0, 2, 1, 3});
  const Tensor k = ops::transpose((*key_)(k_in, training), {0, 2, 1, 3});
  const Tensor v = ops::transpose((*value_)(v_in, training), {0, 2, 1, 3});
  const Tensor scores = ops::matmul(q, k, false, true);  // [B, H, T, S]
  const Tensor p =
      (*dropout_)(causal_ ? ops::causal_softmax(scores) : ops::softmax(scores, -1), training);
  const Tensor o = ops::transpose(ops::matmul(p, v), {0, 2, 1, 3});  // [B, T, H, dk]
  return {(*output_)(o, training)};
}

// --- TransformerBlock ---
TransformerBlock::TransformerBlock(TransformerBlockOptions o, std::string name)
    : Layer(std::move(name)), o_(o) {
  if (o.dim < 1 || o.num_heads < 1 || o.dim % o.num_heads != 0)
    throw InvalidArgument("TransformerBlock: dim " + std::to_string(o.dim) +
                          " must be a positive multiple of num_heads " +
                          std::to_string(o.num_heads));
  const int64_t mlp = o.mlp_dim > 0 ? o.mlp_dim : 4 * o.dim;
  ln_1_ = register_layer(std::make_shared<LayerNormalization>(o.epsilon, "ln_1"));
  attn_ = register_layer(std::make_shared<MultiHeadAttention>(o.num_heads, o.dim / o.num_heads,
                                                              o.dropout, o.causal, true, "attn"));
  ln_2_ = register_layer(std::make_shared<LayerNormalization>(o.epsilon, "ln_2"));
  fc_ = register_layer(std::make_shared<Dense>(mlp, Activation::kGeluTanh, true, "mlp_fc"));
  proj_ = register_layer(std::make_shared<Dense>(o.dim, Activation::kNone, true, "mlp_proj"));
  drop_ = register_layer(std::make_shared<Dropout>(o.dropout, "dropout"));
  if (o.num_layers > 0) {  // GPT-2's initialisation
    const float residual = 0.02f / std::sqrt(2.f * static_cast<float>(o.num_layers));
    attn_->kernel_initializer = initializers::random_normal(0.f, 0.02f);
    attn_->output_initializer = initializers::random_normal(0.f, residual);
    fc_->kernel_initializer = initializers::random_normal(0.f, 0.02f);
    proj_->kernel_initializer = initializers::random_normal(0.f, residual);
  }
}

Tensor TransformerBlock::call(const Tensor& x, bool training) {
  if (x.rank() != 3 || x.shape()[-1] != o_.dim)
    throw InvalidArgument("TransformerBlock '" + name() + "' expects [batch, time, " +
                          std::to_string(o_.dim) + "], got " + x.shape().to_string());
  Tensor h = ops::add(x, (*drop_)((*attn_)((*ln_1_)(x, training), training), training));
  return ops::add(h,
                  (*drop_)((*proj_)((*fc_)((*ln_2_)(h, training), training), training), training));
}

}  // namespace dtrain
