// dtrain::applications::GPT: a GPT-2-shaped decoder-only language model (Radford et al. 2019, as
// nanoGPT writes it): token embedding + learned position embedding, dropout, num_layers pre-norm
// TransformerBlocks (causal self-attention, gelu-tanh MLP), a final LayerNormalization, and the
// language-model head tied to the token embedding (one matrix; GPT-2's choice). Input: int32 token
// ids [batch, time] (time <= context_length); output: logits [batch, time, vocab_size]. GPT-2's
// initialisation: normal(0, 0.02) weights, the residual projections scaled by 1/sqrt(2 layers).
//
//   GPTConfig::preset("gpt2")  vocabulary 50,257, context 1,024, 12 layers, 768 wide, 12 heads:
//                              124,439,808 parameters, as Hugging Face's GPT-2 counts them.
//   "gpt2-medium", "gpt2-large", "gpt2-xl": the larger GPT-2s (350M, 774M, 1.5B).
//   "gpt-mini", "gpt-micro", "gpt-nano": minGPT's small shapes (6/4/3 layers, 192/128/48 wide)
//                              with a byte vocabulary (256) and context 256, for CPUs.
#pragma once

#include <memory>
#include <string>

#include "dtrain/nn/model.h"
#include "dtrain/nn/transformer.h"

namespace dtrain::applications {

struct DTRAIN_API GPTConfig {
  int64_t vocab_size = 50257;
  int64_t context_length = 1024;  // nanoGPT's block_size
  int num_layers = 12;
  int num_heads = 12;
  int64_t dim = 768;  // n_embd
  float dropout = 0.f;
  bool tie_weights = true;  // the head is the token embedding's matrix transposed
  // Activation recomputation per transformer block (Layer::set_recompute_grad): training keeps
  // each block's input instead of its activations, for one more forward pass of the blocks.
  bool recompute = false;
  // Fully sharded parameters per transformer block (Layer::set_shard_parameters): under
  // Sharding::kParameters each block's weights are kept as one part per replica and gathered for
  // its forward and backward (ZeRO-3 / FSDP, one unit per block; the embeddings, final norm and
  // tied head stay whole). A no-op under other strategies.
  bool shard_parameters = false;
  // By name (above); throws InvalidArgument listing the names.
  static GPTConfig preset(const std::string& name);
  // Parameters of this configuration (what the model's count_params() returns once built).
  int64_t num_parameters() const;
};

class DTRAIN_API GPT : public Model {
 public:
  explicit GPT(GPTConfig config, std::string name = "gpt");
  const GPTConfig& config() const { return config_; }
  std::shared_ptr<Embedding> wte;
  std::shared_ptr<PositionEmbedding> wpe;
  std::shared_ptr<LayerNormalization> ln_f;
  std::shared_ptr<Dense> lm_head;  // only when !tie_weights

 protected:
  using Model::call;
  Tensor call(const Tensor& ids, bool training) override;

 private:
  GPTConfig config_;
  std::shared_ptr<Dropout> drop_;
  std::vector<std::shared_ptr<TransformerBlock>> blocks_;
};

}  // namespace dtrain::applications
