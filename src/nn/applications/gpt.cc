#include "dtrain/nn/gpt.h"

#include "dtrain/model/initializers.h"

namespace dtrain::applications {

GPTConfig GPTConfig::preset(const std::string& name) {
  GPTConfig c;
  const auto shape = [&](int layers, int heads, int64_t dim) {
    c.num_layers = layers;
    c.num_heads = heads;
    c.dim = dim;
  };
  if (name == "gpt2") return c;
  if (name == "gpt2-medium") {
    shape(24, 16, 1024);
    return c;
  }
  if (name == "gpt2-large") {
    shape(36, 20, 1280);
    return c;
  }
  if (name == "gpt2-xl") {
    shape(48, 25, 1600);
    return c;
  }
  c.vocab_size = 256;
  c.context_length = 256;
  if (name == "gpt-mini") {
    shape(6, 6, 192);
    return c;
  }
  if (name == "gpt-micro") {
    shape(4, 4, 128);
    return c;
  }
  if (name == "gpt-nano") {
    shape(3, 3, 48);
    return c;
  }
  throw InvalidArgument("unknown GPT preset '" + name +
                        "'; known: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-mini, gpt-micro, "
                        "gpt-nano");
}

int64_t GPTConfig::num_parameters() const {
  const int64_t d = dim;
  const int64_t block = 2 * 2 * d            // two layer norms
                        + 4 * d * d + 4 * d  // attention: q, k, v, output
                        + d * 4 * d + 4 * d  // mlp_fc
                        + 4 * d * d + d;     // mlp_proj
  return vocab_size * d + context_length * d + num_layers * block + 2 * d +
         (tie_weights ? 0 : d * vocab_size);
}

GPT::GPT(GPTConfig c, std::string name) : Model(std::move(name)), config_(c) {
  if (c.vocab_size < 1 || c.context_length < 1 || c.num_layers < 0 || c.num_heads < 1 ||
      c.dim < 1 || c.dim % c.num_heads != 0)
    throw InvalidArgument(
        "GPTConfig: vocab_size, context_length and num_heads must be >= 1 and "
        "dim a multiple of num_heads; got vocab " +
        std::to_string(c.vocab_size) + ", context " + std::to_string(c.context_length) + ", dim " +
        std::to_string(c.dim) + ", heads " + std::to_string(c.num_heads));
  wte = register_layer(std::make_shared<Embedding>(c.vocab_size, c.dim, "wte"));
  wte->embeddings_initializer = initializers::random_normal(0.f, 0.02f);
  wpe = register_layer(std::make_shared<PositionEmbedding>(c.context_length, "wpe"));
  wpe->initializer = initializers::random_normal(0.f, 0.02f);
  drop_ = register_layer(std::make_shared<Dropout>(c.dropout, "drop"));
  TransformerBlockOptions o;
  o.dim = c.dim;
  o.num_heads = c.num_heads;
  o.dropout = c.dropout;
  o.epsilon = 1e-5f;
  o.num_layers = c.num_layers;
  for (int i = 0; i < c.num_layers; ++i) {
    blocks_.push_back(
        register_layer(std::make_shared<TransformerBlock>(o, "h_" + std::to_string(i))));
    blocks_.back()->set_recompute_grad(c.recompute);
    blocks_.back()->set_shard_parameters(c.shard_parameters);
  }
  ln_f = register_layer(std::make_shared<LayerNormalization>(1e-5f, "ln_f"));
  if (!c.tie_weights) {
    lm_head =
        register_layer(std::make_shared<Dense>(c.vocab_size, Activation::kNone, false, "lm_head"));
    lm_head->kernel_initializer = initializers::random_normal(0.f, 0.02f);
  }
}

Tensor GPT::call(const Tensor& ids, bool training) {
  if (ids.rank() != 2)
    throw InvalidArgument("GPT '" + name() + "' takes token ids [batch, time], got " +
                          ids.shape().to_string());
  Tensor x = (*wte)(ids, training);
  x = (*drop_)(ops::add(x, (*wpe)(x, training)), training);
  for (auto& b : blocks_) x = (*b)(x, training);
  x = (*ln_f)(x, training);
  return config_.tie_weights ? wte->attend(x) : (*lm_head)(x, training);
}

}  // namespace dtrain::applications
