// A byte-level GPT trained on real English text: the Perl documentation that Debian's perl-doc
// package ships (about 8 MB of POD, under Perl's licence: GPL-1+ or the Artistic License), under
// any strategy picked by --strategy (and TF_CONFIG through dtrain-run). nanoGPT's recipe: random
// windows of T + 1 bytes, AdamW (betas 0.9/0.95, weight decay 0.1 off biases, norms and
// embeddings), global-norm clipping at 1, a linear warm-up then cosine decay to a tenth. Each epoch
// reports the validation loss (the last 10% of the text) in nats and bits per byte; --generate
// samples text from a prompt (top-k).
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "dtrain/core/allocator.h"
#include "dtrain/dtrain.h"

namespace {

namespace fs = std::filesystem;

// The corpus: every .pod file of the newest Perl under /usr/share/perl, in name order, less the
// two generated tables (perltoc, perluniprops).
std::string read_corpus(const std::string& dir_flag, std::string* used_dir) {
  std::string dir = dir_flag;
  if (dir.empty() && fs::exists("/usr/share/perl")) {
    std::vector<std::string> found;
    for (const auto& e : fs::directory_iterator("/usr/share/perl"))
      if (fs::exists(e.path() / "pod" / "perlfunc.pod"))
        found.push_back((e.path() / "pod").string());
    std::sort(found.begin(), found.end());
    if (!found.empty()) dir = found.back();
  }
  if (dir.empty() || !fs::is_directory(dir))
    throw dtrain::NotFound(
        "no text corpus: the Perl documentation is missing. Install it with `apt-get install "
        "perl-doc` (setup.sh does), or point --corpus-dir at a folder of .pod or .txt files");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    const std::string ext = e.path().extension().string();
    if ((ext == ".pod" || ext == ".txt") && name != "perltoc.pod" && name != "perluniprops.pod")
      files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
    text += '\n';
  }
  if (text.size() < 1024)
    throw dtrain::InvalidArgument("the corpus in " + dir + " has " + std::to_string(text.size()) +
                                  " bytes; it needs at least a few kilobytes of text");
  *used_dir = dir;
  return text;
}

// Samples `count` bytes after `prompt`: each step runs the model on the last context_length
// tokens, keeps the top_k logits of the last position, divides by the temperature and draws.
std::string generate(dtrain::Model& model, int64_t context, const std::string& prompt, int count,
                     int top_k, float temperature, uint64_t seed) {
  dtrain::text::ByteTokenizer tok;
  std::vector<int32_t> ids = tok.encode(prompt.empty() ? std::string("\n") : prompt);
  const dtrain::Philox rng(seed, 0x67656e);  // "gen"
  for (int n = 0; n < count; ++n) {
    const int64_t t = std::min<int64_t>(context, static_cast<int64_t>(ids.size()));
    const std::vector<int32_t> window(ids.end() - t, ids.end());
    const dtrain::Tensor logits =
        model(dtrain::Tensor::from_vector<int32_t>(window, dtrain::Shape{1, t}), false);
    const int64_t v = logits.shape()[-1];
    const std::vector<float> all = logits.to(dtrain::DeviceSpec::cpu()).to_vector<float>();
    std::vector<std::pair<float, int32_t>> last;
    for (int64_t i = 0; i < v; ++i)
      last.emplace_back(all[static_cast<size_t>((t - 1) * v + i)], static_cast<int32_t>(i));
    const size_t k = static_cast<size_t>(std::clamp<int64_t>(top_k, 1, v));
    std::partial_sort(last.begin(), last.begin() + static_cast<long>(k), last.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    double z = 0;
    std::vector<double> p(k);
    for (size_t i = 0; i < k; ++i)
      z += p[i] = std::exp((last[i].first - last[0].first) / std::max(1e-3f, temperature));
    double u = rng.uniform(static_cast<uint64_t>(n)) * z;
    size_t pick = 0;
    while (pick + 1 < k && (u -= p[pick]) > 0) ++pick;
    ids.push_back(last[pick].second);
  }
  return tok.decode(ids);
}

class ValidationReport : public dtrain::Callback {
 public:
  explicit ValidationReport(bool chief) : chief_(chief) {}
  void on_epoch_end(const dtrain::TrainLogs& logs) override {
    auto it = logs.values.find("val_loss");
    if (!chief_ || it == logs.values.end()) return;
    std::printf("epoch %d: validation loss %.4f nats, %.4f bits per byte\n", logs.epoch + 1,
                it->second, it->second / std::log(2.0));
    std::fflush(stdout);
  }

 private:
  bool chief_;
};

// The optimizer state this process holds: whole slots, or its parts of them under --sharding.
double slot_bytes(const dtrain::Optimizer& opt) {
  double bytes = 0;
  for (const auto& s : opt.slot_variables())
    bytes += static_cast<double>(s->shape().numel()) * dtrain::dtype_size(s->dtype());
  for (const auto& p : opt.slot_shards()) bytes += static_cast<double>(p.value.nbytes());
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a byte-level GPT on the Perl documentation with dtrain"};
  std::string strategy_name = "one_device", devices_flag = "cpu", preset = "gpt-micro",
              precision_flag = "fp32";
  std::string corpus_dir, token_file, prompt, checkpoint_dir, backup_dir, restore_path, csv_path;
  std::string window_order = "random";
  int timing_warmup = 5;
  int threads = 0, epochs = 5, top_k = 20, max_new_tokens = 0, heads = 0, layers = 0, patience = 0;
  double min_delta = 0;
  int64_t steps_per_epoch = 200, batch = 32, context = 128, warmup = 100, val_windows = 256,
          steps = 0, dim = 0, backup_every = 0;
  float lr = 1e-3f, weight_decay = 0.1f, dropout = 0.f, temperature = 0.8f;
  uint64_t seed = 42;
  bool json = false, generate_only = false, tf32 = false;
  app.add_option("--strategy", strategy_name, "distribution strategy")->capture_default_str();
  app.add_option("--devices", devices_flag, "cpu, cpu:N, gpu, gpu:0,1, auto")
      ->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads per CPU device (0 = cores / devices)");
  app.add_option("--timing-warmup-steps", timing_warmup,
                 "first steps left out of tokens_per_sec (FitOptions::warmup_steps)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--precision", precision_flag,
                 "fp32, or bf16 (mixed_bfloat16: bfloat16 matrix products, float32 weights)")
      ->capture_default_str();
  app.add_flag("--tf32", tf32,
               "float32 products on GPU tensor cores as TensorFloat-32 "
               "(enable_tensor_float_32_execution; CPUs ignore it)");
  app.add_option("--preset", preset,
                 "GPT shape: gpt-nano, gpt-micro, gpt-mini (byte vocabulary), gpt2, ...")
      ->capture_default_str();
  app.add_option("--layers", layers, "override the preset's layers");
  app.add_option("--dim", dim, "override the preset's width");
  app.add_option("--heads", heads, "override the preset's heads");
  app.add_option("--context", context, "T: the window length in bytes")->capture_default_str();
  app.add_option("--dropout", dropout, "dropout rate")->capture_default_str();
  bool recompute = false;
  app.add_flag("--recompute", recompute,
               "recompute each transformer block's activations in the backward pass instead of "
               "keeping them (GPTConfig::recompute): less memory, one more forward pass");
  std::string sharding;
  app.add_option("--sharding", sharding,
                 "mirrored / multi_worker_mirrored: none, optimizer_state (ZeRO-1), gradients "
                 "(ZeRO-2) or parameters (ZeRO-3: each transformer block's weights sharded); "
                 "default none, or DTRAIN_SHARDING");
  app.add_option("--epochs", epochs, "epochs of --steps-per-epoch steps")->capture_default_str();
  app.add_option("--steps-per-epoch", steps_per_epoch, "steps in an epoch")->capture_default_str();
  app.add_option("--steps", steps, "stop after this many steps in all (0: epochs decide)");
  app.add_option("--batch-size", batch, "global batch (windows a step)")->capture_default_str();
  app.add_option("--lr", lr, "peak learning rate (AdamW)")->capture_default_str();
  app.add_option("--weight-decay", weight_decay, "AdamW's decoupled weight decay")
      ->capture_default_str();
  app.add_option("--warmup-steps", warmup, "linear warm-up steps")->capture_default_str();
  app.add_option("--val-windows", val_windows, "validation windows each epoch")
      ->capture_default_str();
  app.add_option(
         "--window-order", window_order,
         "random: nanoGPT's random windows, shuffled each epoch; consecutive: windows at 0, "
         "T, 2T, ... in order, unshuffled (what a peer script can reproduce exactly)")
      ->check(CLI::IsMember({"random", "consecutive"}))
      ->capture_default_str();
  app.add_option("--seed", seed, "seed for weights, windows and sampling")->capture_default_str();
  app.add_option("--corpus-dir", corpus_dir,
                 "a folder of .pod/.txt files (default: perl-doc's /usr/share/perl/*/pod)");
  app.add_option("--token-file", token_file,
                 "where the corpus' byte tokens are written and memory-mapped from (default: the "
                 "temp folder)");
  app.add_option("--generate", prompt, "after training, sample text from this prompt");
  app.add_option("--max-new-tokens", max_new_tokens,
                 "bytes to sample (default 300 with --generate)");
  app.add_option("--top-k", top_k, "sample from the k likeliest bytes")->capture_default_str();
  app.add_option("--temperature", temperature, "sampling temperature")->capture_default_str();
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "ModelCheckpoint each epoch, and final.safetensors at the end");
  app.add_option("--backup-dir", backup_dir,
                 "BackupAndRestore: rerunning the same command after a failure resumes here");
  app.add_option("--backup-every", backup_every, "also back up every this many steps");
  app.add_option("--restore", restore_path, "start from this checkpoint (any strategy's)");
  app.add_flag("--generate-only", generate_only, "with --restore: sample, do not train");
  app.add_option("--patience", patience,
                 "EarlyStopping on val_loss with this patience, restoring the best epoch's weights "
                 "(0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-delta", min_delta, "EarlyStopping's least improvement, in nats")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--csv-log", csv_path, "append one CSV row of logs per epoch (chief)");
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  CLI11_PARSE(app, argc, argv);
  if (!prompt.empty() && max_new_tokens == 0) max_new_tokens = 300;

  try {
    dtrain::set_global_seed(seed);
    dtrain::set_precision_policy(dtrain::parse_precision(precision_flag));
    dtrain::enable_tensor_float_32_execution(tf32);
    dtrain::applications::GPTConfig config = dtrain::applications::GPTConfig::preset(preset);
    config.context_length = context;
    config.dropout = dropout;
    config.recompute = recompute;
    if (layers > 0) config.num_layers = layers;
    if (dim > 0) config.dim = dim;
    if (heads > 0) config.num_heads = heads;
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, threads);
    if (!sharding.empty()) opts.mirrored.sharding = dtrain::parse_sharding(sharding);
    // ZeRO-3: every transformer block is a unit whose weights are gathered when it runs.
    config.shard_parameters =
        dtrain::apply_environment(opts).mirrored.sharding == dtrain::Sharding::kParameters;

    dtrain::TaskFunctions task;
    task.train = [&](dtrain::Strategy& strategy) {
      const dtrain::StrategyExtended& ext = strategy.extended();
      if (config.shard_parameters && ext.num_workers() > 1 && max_new_tokens > 0)
        throw dtrain::InvalidArgument(
            "--generate after training with --sharding=parameters and several workers: each "
            "worker holds only its part of the blocks' weights; train with --checkpoint-dir, then "
            "sample from the checkpoint on one process (--restore DIR/final.safetensors "
            "--generate-only --generate ...)");
      std::string used_dir;
      const std::string text = read_corpus(corpus_dir, &used_dir);
      const std::string path = token_file.empty()
                                   ? (fs::temp_directory_path() / "dtrain-gpt-corpus.u8").string()
                                   : token_file;
      dtrain::text::write_token_file(path, dtrain::text::ByteTokenizer().encode(text), 1);
      auto tokens = std::make_shared<const dtrain::text::TokenFile>(path, 1);
      const int64_t split = tokens->size() * 9 / 10;
      if (config.vocab_size < 256)
        throw dtrain::InvalidArgument("a byte-level corpus needs vocab_size >= 256");
      dtrain::text::TokenWindowOptions tw;
      tw.sequence_length = context;
      tw.random = window_order == "random";
      tw.end = split;
      tw.seed = seed;
      // Every step of the run gets windows of its own (nanoGPT draws fresh ones each step); an
      // epoch is --steps-per-epoch of them, the next going on where it stopped.
      const int64_t run_steps =
          steps > 0 ? (steps + steps_per_epoch - 1) / steps_per_epoch * steps_per_epoch
                    : epochs * steps_per_epoch;
      tw.windows = run_steps * batch;
      const dtrain::Dataset train = dtrain::text::token_windows(tokens, tw);
      tw.begin = split;
      tw.end = -1;
      tw.seed = seed + 1;
      tw.windows = val_windows;
      const dtrain::Dataset val = dtrain::text::token_windows(tokens, tw);
      if (ext.is_chief())
        std::fprintf(stderr,
                     "corpus: %s, %lld bytes (%lld for training, %lld for validation) mapped from "
                     "%s\n",
                     used_dir.c_str(), static_cast<long long>(tokens->size()),
                     static_cast<long long>(split), static_cast<long long>(tokens->size() - split),
                     path.c_str());

      std::shared_ptr<dtrain::applications::GPT> model;
      std::unique_ptr<dtrain::Optimizer> optimizer;
      const int64_t total = steps > 0 ? steps : epochs * steps_per_epoch;
      {
        auto scope = strategy.scope();
        model = std::make_shared<dtrain::applications::GPT>(config);
        model->build(dtrain::Shape{1, context});
        dtrain::OptimizerOptions oo;
        oo.weight_decay = weight_decay;
        oo.global_clipnorm = 1.f;
        auto adamw = std::make_unique<dtrain::AdamW>(lr, weight_decay, 0.9f, 0.95f, 1e-8f, oo);
        adamw->exclude_from_weight_decay({"bias", "gamma", "beta", "embeddings"});
        const int64_t w = std::min<int64_t>(warmup, total / 2);
        // nanoGPT's warm-up starts at lr / (warmup + 1), not 0.
        adamw->set_schedule(std::make_shared<dtrain::CosineDecay>(
            lr / static_cast<float>(w + 1), std::max<int64_t>(1, total - w), 0.1f, lr, w));
        optimizer = std::move(adamw);
      }
      if (ext.is_chief()) {
        std::fprintf(stderr,
                     "GPT %s: %d layers, %lld wide, %d heads, context %lld, %lld parameters; "
                     "strategy %s, %d replica(s); local devices:",
                     preset.c_str(), config.num_layers, static_cast<long long>(config.dim),
                     config.num_heads, static_cast<long long>(context),
                     static_cast<long long>(model->count_params()), strategy.name().c_str(),
                     strategy.num_replicas_in_sync());
        for (const auto& d : strategy.worker_devices())
          std::fprintf(stderr, " %s", dtrain::get_device(d).description().c_str());
        std::fprintf(stderr, "\n");
      }
      if (!restore_path.empty()) {
        const dtrain::TrainingPosition p =
            dtrain::Checkpoint(*model, optimizer.get(), &strategy).restore(restore_path);
        std::fprintf(stderr, "restored %s (saved after %lld steps)\n", restore_path.c_str(),
                     static_cast<long long>(p.global_step));
      }
      dtrain::History h;
      if (!generate_only) {
        // each row of a batch is one window of `context` tokens: the bar counts tokens/sec
        dtrain::ProgressBar progress(json ? stderr : stdout, "tokens",
                                     static_cast<double>(context));
        ValidationReport report(ext.is_chief());
        dtrain::FitOptions fit;
        fit.warmup_steps = timing_warmup;
        fit.epochs = epochs;
        fit.steps = steps;
        fit.global_batch_size = batch;
        fit.eval_batch_size = batch;
        fit.shuffle_seed = seed;
        fit.shuffle = window_order == "random";
        fit.steps_per_epoch = steps_per_epoch;
        fit.loss = dtrain::get_loss("sparse_categorical_crossentropy");
        std::optional<dtrain::BackupAndRestore> backup;
        if (!backup_dir.empty()) fit.callbacks.push_back(&backup.emplace(backup_dir, backup_every));
        std::optional<dtrain::ModelCheckpoint> ckpt;
        if (!checkpoint_dir.empty())
          fit.callbacks.push_back(&ckpt.emplace(checkpoint_dir, "val_loss"));
        std::optional<dtrain::CSVLogger> csv;
        if (!csv_path.empty()) fit.callbacks.push_back(&csv.emplace(csv_path));
        std::optional<dtrain::EarlyStopping> early;
        if (patience > 0)
          fit.callbacks.push_back(&early.emplace("val_loss", min_delta, patience,
                                                 dtrain::MonitorMode::kMin,
                                                 /*restore_best_weights=*/true));
        fit.callbacks.push_back(&progress);
        fit.callbacks.push_back(&report);
        h = dtrain::fit(strategy, *model, *optimizer, train, &val, fit);
        if (!checkpoint_dir.empty()) {
          fs::create_directories(checkpoint_dir);
          const std::string final_path = checkpoint_dir + "/final.safetensors";
          if (dtrain::Checkpoint(*model, optimizer.get(), &strategy)
                  .save(final_path, {epochs, 0, h.steps}))
            std::fprintf(stderr, "final weights: %s\n", final_path.c_str());
        }
      }
      std::string sample;
      if (max_new_tokens > 0)
        sample = generate(*model, context, prompt, max_new_tokens, top_k, temperature, seed);
      struct rusage usage {};
      getrusage(RUSAGE_SELF, &usage);
      if (!ext.is_chief()) return;
      if (!sample.empty() && !json)
        std::printf("--- sample ---\n%s\n--------------\n", sample.c_str());
      if (json) {
        const double val_loss = h.test_loss;
        nlohmann::json j{
            {"strategy", strategy_name},
            {"replicas", strategy.num_replicas_in_sync()},
            {"preset", preset},
            {"parameters", model->count_params()},
            {"steps", h.steps},
            {"global_batch", batch},
            {"context", context},
            {"tokens_per_sec", h.images_per_sec * static_cast<double>(context)},
            {"final_loss", h.final_loss},
            {"val_loss_nats", val_loss},
            {"val_bits_per_byte", val_loss / std::log(2.0)},
            {"recompute", recompute},
            {"sharding", dtrain::sharding_name(dtrain::apply_environment(opts).mirrored.sharding)},
            {"precision", precision_flag},
            {"tf32", tf32},
            {"optimizer_state_mb", slot_bytes(*optimizer) / 1048576.0},
            {"seconds_per_step",
             h.images_per_sec > 0 ? static_cast<double>(batch) / h.images_per_sec : 0.0},
            {"allocator_peak_mb",
             static_cast<double>(dtrain::host_allocator().get_memory_info().peak) / 1048576.0},
            {"peak_rss_mb", static_cast<double>(usage.ru_maxrss) / 1024.0}};
        if (!sample.empty()) j["sample"] = sample;
        std::printf("%s\n", j.dump().c_str());
      }
    };
    dtrain::run_task(strategy_name, opts, task);
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
