// Test helper: trains the reference CNN (or --model) for --steps steps on the first steps*batch (or
// --rows) Fashion-MNIST images under --strategy (the same code path as the example) and, on the
// chief, writes every trainable weight as float32 to --out, preceded by the final loss. Used by
// multiworker_test.py to compare MultiWorkerMirrored (via dtrain-run) with OneDevice.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>

#include "common/models.h"
#include "dtrain/dtrain.h"

int main(int argc, char** argv) {
  CLI::App app{"train the reference CNN and dump the weights"};
  std::string strategy_name = "one_device", devices = "cpu", out,
              optimizer = "adam learning_rate=0.001";
  int64_t steps = 10, batch = 64, rows = 0, declared_batch = 0;
  app.add_option("--strategy", strategy_name);
  app.add_option("--devices", devices);
  app.add_option("--steps", steps);
  app.add_option("--batch-size", batch);
  app.add_option("--rows", rows,
                 "train on this many images (default steps * batch); a short last batch when not a "
                 "multiple of the batch");
  app.add_option("--declared-batch", declared_batch,
                 "only take one batch of the data batched by --batch-size from distribute_dataset, "
                 "declaring this "
                 "global batch size (a misuse test: larger batches than declared must be refused)");
  app.add_option("--optimizer", optimizer, "Optimizer::from_config line (default Adam, rate 1e-3)");
  std::string model_name = "reference_cnn";
  app.add_option("--model", model_name, dtrain::examples::model_names());
  bool sync_bn = false;
  app.add_flag("--sync-bn", sync_bn, "synchronized batch normalization");
  std::string checkpoint_dir;
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "a ModelCheckpoint each epoch into this directory");
  int patience = -1;
  app.add_option("--patience", patience,
                 "EarlyStopping on the loss with this patience, restoring the best weights");
  double decay = 0;
  app.add_option("--lr-decay", decay, "a LearningRateScheduler: the rate times this each epoch");
  bool chief_only = false;
  app.add_flag("--callbacks-on-chief-only", chief_only,
               "the callbacks above on the chief only (Horovod's `if rank == 0` idiom)");
  int64_t steps_per_epoch = 0;
  app.add_option("--steps-per-epoch", steps_per_epoch, "epochs of this many steps");
  app.add_option("--out", out)->required();
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::StrategyOptions o;
    o.devices = dtrain::parse_devices_flag(devices, 1);
    auto strategy = dtrain::make_strategy(strategy_name, o);
    // A seed per worker: their initial weights differ until the chief's are broadcast to all
    // (MultiWorkerMirrored does it as variables are created), which the equivalence tests check.
    dtrain::set_global_seed(7 + static_cast<uint64_t>(strategy->extended().worker_rank()));
    const int64_t n = rows > 0 ? rows : steps * batch;
    const dtrain::FashionMnist data =
        dtrain::examples::fit_to_model(dtrain::load_fashion_mnist("", n), model_name);
    if (declared_batch > 0) {
      const auto next = strategy->distribute_dataset(
          dtrain::Dataset::from_tensors(
              {data.train_images.slice_rows(0, n), data.train_labels.slice_rows(0, n)})
              .batch(batch),
          declared_batch);
      dtrain::PerReplica p;
      next(&p);
      std::printf("took a batch of %lld rows\n", static_cast<long long>(p.global_rows));
      return 0;
    }
    std::shared_ptr<dtrain::Model> model;
    std::unique_ptr<dtrain::Optimizer> opt;
    {
      auto scope = strategy->scope();
      model = dtrain::examples::make_model(model_name, sync_bn);
      opt = dtrain::Optimizer::from_config(optimizer);
    }
    dtrain::FitOptions f;
    f.steps = steps;
    f.steps_per_epoch = steps_per_epoch;
    std::optional<dtrain::ModelCheckpoint> checkpoint;
    std::optional<dtrain::EarlyStopping> early;
    std::optional<dtrain::LearningRateScheduler> scheduler;
    if (!chief_only || strategy->extended().is_chief()) {
      if (!checkpoint_dir.empty())
        f.callbacks.push_back(&checkpoint.emplace(checkpoint_dir, "loss"));
      if (patience >= 0)
        f.callbacks.push_back(&early.emplace("loss", 0.0, patience, dtrain::MonitorMode::kAuto,
                                             /*restore_best_weights=*/true));
      if (decay > 0)
        f.callbacks.push_back(&scheduler.emplace([decay](int, double lr) { return lr * decay; }));
    }
    f.global_batch_size = batch;
    f.shuffle_seed = 11;
    const auto ds = dtrain::Dataset::from_tensors(
        {data.train_images.slice_rows(0, n), data.train_labels.slice_rows(0, n)});
    const dtrain::History h = dtrain::fit(*strategy, *model, *opt, ds, nullptr, f);
    // The optimizer state this process holds (sharded: its parts only).
    int64_t slot_elements = 0;
    for (const auto& s : opt->slot_variables()) slot_elements += s->shape().numel();
    for (const auto& p : opt->slot_shards()) slot_elements += p.value.numel();
    std::printf("worker %d holds %lld optimizer slot elements\n",
                strategy->extended().worker_rank(), static_cast<long long>(slot_elements));
    if (strategy->extended().is_chief()) {
      std::FILE* fp = std::fopen(out.c_str(), "wb");
      const double loss = h.final_loss;
      std::fwrite(&loss, sizeof(loss), 1, fp);
      // Every variable: the batch-norm statistics too.
      for (const auto& v : model->variables()) {
        const auto w = v->value().to_vector<float>();
        const int64_t count = static_cast<int64_t>(w.size());
        std::fwrite(&count, sizeof(count), 1, fp);
        std::fwrite(w.data(), sizeof(float), w.size(), fp);
      }
      std::fclose(fp);
    }
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
