// The layers of a transformer, with Keras' names, arguments and weight layouts (keras.layers
// Embedding, LayerNormalization, MultiHeadAttention; keras_nlp PositionEmbedding) and a GPT-2
// block. Inputs are [batch, time, features]; token ids are int32 [batch, time] (float ids are cast,
// as Keras' Embedding does).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/nn/layers.h"

namespace dtrain {

// Token ids [..] -> vectors [.., output_dim]: row `id` of the weight "embeddings"
// [input_dim, output_dim]. Its gradient is a scatter-add summed in id order (bitwise repeatable).
class DTRAIN_API Embedding : public Layer {
 public:
  Embedding(int64_t input_dim, int64_t output_dim, std::string name = "embedding");
  std::string class_name() const override { return "Embedding"; }
  std::shared_ptr<Variable> embeddings;
  // Keras' embeddings_initializer; set before the layer is built. Empty: uniform(-0.05, 0.05).
  Initializer embeddings_initializer;
  // x [..., output_dim] @ embeddings^T -> [..., input_dim]: the language-model head that shares
  // the token embedding's matrix (weight tying, as GPT-2; keras_nlp ReversibleEmbedding's
  // reverse call). The matrix stays one variable, so it is all-reduced, checkpointed and counted
  // once. Throws FailedPrecondition before the layer is built.
  Tensor attend(const Tensor& x);

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& ids, bool training) override;

 private:
  int64_t input_dim_, output_dim_;
};

// Learned position embeddings (keras_nlp PositionEmbedding): for x [batch, time, dim], the first
// `time` rows of "embeddings" [sequence_length, dim], shaped [time, dim] (it broadcasts when added
// to x). Throws InvalidArgument for a sequence longer than sequence_length.
class DTRAIN_API PositionEmbedding : public Layer {
 public:
  explicit PositionEmbedding(int64_t sequence_length, std::string name = "position_embedding");
  std::string class_name() const override { return "PositionEmbedding"; }
  std::shared_ptr<Variable> embeddings;
  Initializer initializer;  // empty: glorot_uniform, as keras_nlp

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  int64_t sequence_length_;
};

// keras.layers.LayerNormalization(axis=-1, epsilon): "gamma" (ones) and "beta" (zeros) [C].
class DTRAIN_API LayerNormalization : public Layer {
 public:
  explicit LayerNormalization(float epsilon = 1e-3f, std::string name = "layer_normalization");
  std::string class_name() const override { return "LayerNormalization"; }
  std::shared_ptr<Variable> gamma, beta;

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const Shape& input_shape) override;
  Tensor call(const Tensor& x, bool training) override;

 private:
  float epsilon_;
};

// keras.layers.MultiHeadAttention(num_heads, key_dim, value_dim = key_dim, dropout, use_bias,
// output_shape = the query's features) with use_causal_mask. Weights as Keras lays them out:
// query/key/value "kernel" [dim, heads, key_dim] and "bias" [heads, key_dim] (sublayers "query",
// "key", "value"), "attention_output" kernel [heads, key_dim, dim] and bias [dim].
// call(x): self-attention; call({query, value}) or call({query, value, key}): cross-attention.
// The query is scaled by 1/sqrt(key_dim) before Q K^T (as Keras does), the causal mask applied
// inside softmax (ops::causal_softmax); dropout applies to the attention probabilities.
class DTRAIN_API MultiHeadAttention : public Layer {
 public:
  MultiHeadAttention(int num_heads, int64_t key_dim, float dropout = 0.f,
                     bool use_causal_mask = false, bool use_bias = true,
                     std::string name = "multi_head_attention");
  std::string class_name() const override { return "MultiHeadAttention"; }
  // Set before the layer is built; empty: glorot_uniform (Keras').
  Initializer kernel_initializer;
  // Initializer of the output projection alone (GPT-2 scales it by 1/sqrt(2 layers)); empty:
  // kernel_initializer.
  Initializer output_initializer;

 protected:
  using Layer::build_weights;
  using Layer::call;
  void build_weights(const std::vector<Shape>& input_shapes) override;
  std::vector<Tensor> call(const std::vector<Tensor>& xs, bool training) override;

 private:
  class Projection;        // [.., dim] -> [.., heads, key_dim], kernel [dim, heads, key_dim]
  class OutputProjection;  // [.., heads, key_dim] -> [.., dim], kernel [heads, key_dim, dim]
  int num_heads_;
  int64_t key_dim_;
  bool causal_, use_bias_;
  std::shared_ptr<Projection> query_, key_, value_;
  std::shared_ptr<OutputProjection> output_;
  std::shared_ptr<Dropout> dropout_;
};

// A GPT-2 transformer block (Radford et al. 2019; pre-norm):
//   x = x + dropout(attention(ln_1(x)))       causal self-attention
//   x = x + dropout(mlp(ln_2(x)))             Dense(4 d, gelu tanh) then Dense(d)
// Sublayers "ln_1", "attn", "ln_2", "mlp_fc", "mlp_proj", "dropout".
struct DTRAIN_API TransformerBlockOptions {
  int64_t dim = 768;  // the model width (the residual stream's features)
  int num_heads = 12;
  int64_t mlp_dim = 0;  // 0: 4 times the model width
  float dropout = 0.f;
  float epsilon = 1e-5f;
  bool causal = true;
  // GPT-2's initialisation: normal(0, 0.02) kernels, zero biases, and the two projections back
  // into the residual stream normal(0, 0.02 / sqrt(2 num_layers)). num_layers 0: Keras' defaults.
  int num_layers = 0;
};
class DTRAIN_API TransformerBlock : public Layer {
 public:
  explicit TransformerBlock(TransformerBlockOptions options, std::string name = "block");
  std::string class_name() const override { return "TransformerBlock"; }

 protected:
  using Layer::call;
  Tensor call(const Tensor& x, bool training) override;

 private:
  TransformerBlockOptions o_;
  std::shared_ptr<LayerNormalization> ln_1_, ln_2_;
  std::shared_ptr<MultiHeadAttention> attn_;
  std::shared_ptr<Dense> fc_, proj_;
  std::shared_ptr<Dropout> drop_;
};

}  // namespace dtrain
