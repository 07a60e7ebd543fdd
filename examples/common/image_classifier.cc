// The Fashion-MNIST image-classification program behind examples/fashion_mnist (the reference
// CNN) and examples/resnet (ResNet-20): every strategy by --strategy, every task of a job by
// run_task(), checkpoints, BackupAndRestore, TensorBoard, CSV logs. The model and training code
// contain no strategy-specific branch.
#include "image_classifier.h"

#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "dtrain/data/augment.h"
#include "dtrain/data/files.h"
#include "dtrain/data/image.h"
#include "dtrain/dtrain.h"
#include "models.h"

namespace dtrain::examples {
namespace {
// The data a run trains and evaluates on: Fashion-MNIST's IDX files in memory, or folders of
// image files read by the input pipeline (--image-dir).
struct Inputs {
  Dataset train, test;
  Tensor test_labels;
  Shape example;  // one input's shape, [1, h, w, c]
};

Inputs load_inputs(const std::string& data_dir, const std::string& image_dir,
                   const std::string& model_name, int64_t train_limit, int input_threads) {
  if (image_dir.empty()) {
    FashionMnist data = fit_to_model(load_fashion_mnist(data_dir, train_limit), model_name);
    if (train_limit > 0 && train_limit < data.train_images.shape()[0]) {
      data.train_images = data.train_images.slice_rows(0, train_limit);
      data.train_labels = data.train_labels.slice_rows(0, train_limit);
    }
    std::vector<int64_t> dims = data.test_images.shape().dims();
    dims[0] = 1;
    return {Dataset::from_tensors({data.train_images, data.train_labels}),
            Dataset::from_tensors({data.test_images, data.test_labels}), data.test_labels,
            Shape(dims)};
  }
  // Keras' image_dataset_from_directory: gray images at the model's input size, in [0, 1].
  data::ImageFolderOptions o;
  o.transform.height = o.transform.width = wants_32x32(model_name) ? 32 : 28;
  o.transform.channels = 1;
  o.transform.rescale = 1.0f / 255.0f;
  o.num_parallel_calls = input_threads > 0 ? input_threads : Dataset::kAutotune;
  const data::ImageFolder train = data::image_dataset_from_directory(image_dir + "/train", o);
  const data::ImageFolder test = data::image_dataset_from_directory(image_dir + "/test", o);
  if (train.class_names != test.class_names)
    throw InvalidArgument("--image-dir: " + image_dir + "/train and " + image_dir +
                          "/test have different class folders");
  const auto n = static_cast<int64_t>(test.labels.size());
  return {train_limit > 0 ? train.dataset.take(train_limit) : train.dataset, test.dataset,
          Tensor::from_vector(test.labels, Shape{n}),
          Shape{1, o.transform.height, o.transform.width, 1}};
}

// Fashion-MNIST as PNG files in class folders (DIR/train/0_T-shirt_top/00000.png, ...).
void write_image_folders(const std::string& data_dir, const std::string& out, int64_t train_limit) {
  static const char* const kNames[10] = {"T-shirt_top", "Trouser",   "Pullover", "Dress",
                                         "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                         "Bag",         "Ankle_boot"};
  const FashionMnist data = load_fashion_mnist(data_dir, train_limit);
  for (const auto& [split, images, labels] :
       {std::tuple{"train", data.train_images, data.train_labels},
        std::tuple{"test", data.test_images, data.test_labels}}) {
    const std::vector<float> px = images.to_vector<float>();
    const std::vector<int32_t> y = labels.to_vector<int32_t>();
    for (int c = 0; c < 10; ++c)
      std::filesystem::create_directories(std::string(out) + "/" + split + "/" + std::to_string(c) +
                                          "_" + kNames[c]);
    // Images i, i + T, i + 2T, ... on each of T threads (encoding is most of the time); the first
    // failure is rethrown here.
    const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
    std::vector<std::exception_ptr> failed(threads);
    std::vector<std::thread> pool;
    for (size_t t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        try {
          for (size_t i = t; i < y.size(); i += threads) {
            image::Image im{28, 28, 1, std::vector<uint8_t>(784)};
            for (size_t k = 0; k < 784; ++k)
              im.pixels[k] = static_cast<uint8_t>(std::lround(px[i * 784 + k] * 255.0f));
            char name[32];
            std::snprintf(name, sizeof(name), "/%05zu.png", i);
            const std::string path =
                out + "/" + split + "/" + std::to_string(y[i]) + "_" + kNames[y[i]] + name;
            const std::string bytes = image::encode_png(im);
            std::FILE* f = std::fopen(path.c_str(), "wb");
            const bool ok =
                f != nullptr && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
            if (f != nullptr && std::fclose(f) != 0) throw DataLoss("cannot write " + path);
            if (!ok) throw DataLoss("cannot write " + path);
          }
        } catch (...) {
          failed[t] = std::current_exception();
        }
      });
    for (std::thread& th : pool) th.join();
    for (const std::exception_ptr& e : failed)
      if (e) std::rethrow_exception(e);
    std::fprintf(stderr, "wrote %zu %s images to %s/%s\n", y.size(), split, out.c_str(), split);
  }
}
}  // namespace

int image_classifier_main(int argc, char** argv, const ImageClassifierExample& example) {
  CLI::App app{example.title};
  std::string strategy_name = "one_device", devices_flag = "cpu", data_dir;
  int epochs = example.epochs, threads = 0, warmup = 5;
  int64_t steps = 0, batch = example.batch_size;
  float lr = example.learning_rate;
  std::string model_name = example.model;
  bool augment = example.augment;
  uint64_t seed = 42;
  bool json = false;
  std::string valid;
  for (const auto& n : dtrain::strategy_names()) valid += (valid.empty() ? "" : ", ") + n;
  app.add_option("--strategy", strategy_name, "distribution strategy: " + valid)
      ->capture_default_str();
  app.add_option("--devices", devices_flag,
                 "cpu, cpu:N (N logical CPU devices), gpu, gpu:0,1, auto")
      ->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads per CPU device (0 = cores / devices)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--epochs", epochs, "epochs to train")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bool no_eval = false;
  app.add_flag("--no-eval", no_eval, "skip the test-set evaluation (benchmarks)");
  app.add_option("--steps", steps, "train this many steps instead of whole epochs (0 = off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", batch, "global batch size (split over replicas)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--model", model_name, "the model: " + model_names())->capture_default_str();
  bool sync_bn = false;
  app.add_flag("--sync-bn", sync_bn,
               "synchronized batch normalization: the global batch's statistics on every replica");
  app.add_flag("--augment,!--no-augment", augment,
               "random crops (4-pixel padding) and horizontal flips of the training images, in the "
               "input pipeline (one thread per core, batches ahead of training)")
      ->capture_default_str();
  app.add_option("--lr", lr, "learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", seed, "seed for weights, shuffling and dropout")->capture_default_str();
  app.add_option("--data-dir", data_dir,
                 "Fashion-MNIST IDX directory (default $DTRAIN_DATA_DIR, then "
                 "/usr/share/datasets/fashion-mnist)");
  std::string image_dir, write_image_dir;
  int input_threads = 0;
  app.add_option("--image-dir", image_dir,
                 "read the images from files through the input pipeline instead of the IDX files: "
                 "DIR/train/<class>/*.png|jpg and DIR/test/<class>/ (Keras' "
                 "image_dataset_from_directory; labels from the sorted class folders), decoded "
                 "at the model's input size in gray");
  app.add_option("--input-threads", input_threads,
                 "threads that decode --image-dir files (0 = one per core)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--write-image-dir", write_image_dir,
                 "write Fashion-MNIST as PNG class folders under DIR (for --image-dir; "
                 "--train-limit N: the first N training images), and exit");
  app.add_option("--warmup", warmup, "steps excluded from images/sec")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  std::string optimizer_flag = example.optimizer, schedule_flag = example.lr_schedule, backup_dir,
              tensorboard_dir, csv_path;
  double warmup_epochs = 0;
  int accumulate = 1;
  int64_t backup_every = 0, train_limit = 0;
  bool scale_lr = false;
  app.add_option(
         "--optimizer", optimizer_flag,
         "sgd, adam, adamw, rmsprop or adagrad, with Keras' hyper-parameters as key=value, e.g. "
         "\"sgd momentum=0.9 nesterov=1\" or \"adamw weight_decay=0.01 global_clipnorm=1\"; "
         "the rate comes from --lr unless the line sets learning_rate")
      ->capture_default_str();
  app.add_option(
      "--lr-schedule", schedule_flag,
      "a learning-rate schedule: \"piecewise_constant boundaries=500;1000 values=1e-3;5e-4;1e-4\", "
      "\"exponential decay_steps=1000 decay_rate=0.9\", \"cosine decay_steps=5000 "
      "warmup_target=0.01 warmup_steps=500\", \"polynomial decay_steps=5000\"; "
      "initial_learning_rate defaults to --lr");
  app.add_flag("--scale-lr", scale_lr,
               "multiply the learning rate by the number of replicas (Horovod's rule)");
  app.add_option(
         "--warmup-epochs", warmup_epochs,
         "Horovod's gradual warm-up: the rate rises from lr / replicas to lr over this many epochs")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--accumulate", accumulate,
                 "sum the gradients of this many batches per update (one all-reduce)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  std::string sharding_flag;
  app.add_option(
      "--sharding", sharding_flag,
      "mirrored / multi_worker_mirrored: shard the optimizer's state, none, "
      "optimizer_state (ZeRO-1), gradients (ZeRO-2) or parameters (ZeRO-3: each ResNet block's "
      "weights sharded too); default none, or DTRAIN_SHARDING");
  std::string compression_flag = "none";
  app.add_option("--compression", compression_flag,
                 "multi_worker_mirrored: cross-worker gradient compression, none, fp16 or bf16 "
                 "(half the bytes "
                 "on the wire)")
      ->capture_default_str();
  app.add_option(
      "--backup-dir", backup_dir,
      "BackupAndRestore: back up each epoch (and every --backup-every steps) here; running the "
      "same command again after a failure resumes from the last backup, with the same result");
  app.add_option("--backup-every", backup_every,
                 "also back up every this many steps (0: at epoch ends only)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--tensorboard-dir", tensorboard_dir,
                 "write TensorBoard event files here (chief)");
  app.add_option(
      "--csv-log", csv_path,
      "append one CSV row of logs per epoch here (chief); tools/plot_history.py draws it");
  std::string restore_path;
  bool eval_only = false;
  app.add_option(
      "--restore", restore_path,
      "start from this checkpoint (a final.safetensors or ckpt-N.safetensors from any strategy "
      "and replica count): weights, optimizer state and the random state");
  app.add_flag("--eval-only", eval_only,
               "evaluate (the restored model) on the test set and stop; no training");
  app.add_option("--train-limit", train_limit, "train on the first N training images only (tests)")
      ->check(CLI::NonNegativeNumber);
  dtrain::ParameterServerOptions ps;
  int ps_shards = 0;
  std::string checkpoint_dir;
  app.add_option(
      "--checkpoint-dir", checkpoint_dir,
      "ModelCheckpoint: a checkpoint each epoch (parameter_server: the chief's checkpoints of the "
      "servers, restored from on start), and the final weights as final.safetensors");
  app.add_option("--checkpoint-every", ps.checkpoint_every,
                 "parameter_server: global steps between checkpoints")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-staleness", ps.max_staleness,
                 "parameter_server: steps a worker may run ahead of the slowest (-1 = unbounded)")
      ->capture_default_str();
  app.add_option(
         "--ps-shards", ps_shards,
         "parameter_server: split each variable with >= 2 rows into this many shards (0 = whole)")
      ->check(CLI::NonNegativeNumber);
  std::string precision_flag = "fp32";
  app.add_option("--precision", precision_flag,
                 "fp32, or bf16: Keras' mixed_bfloat16 policy (convolutions and matmuls in "
                 "bfloat16 with float32 "
                 "accumulation; float32 variables, optimizer and losses; CPU devices)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    if (!write_image_dir.empty()) {
      write_image_folders(data_dir, write_image_dir, train_limit);
      return 0;
    }
    dtrain::set_global_seed(seed);
    dtrain::set_precision_policy(dtrain::parse_precision(precision_flag));
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, threads);
    if (ps_shards > 0) ps.partitioner = dtrain::fixed_shards_partitioner(ps_shards);
    if (strategy_name == "parameter_server") ps.checkpoint_dir = checkpoint_dir;
    opts.communication.compression = dtrain::parse_compression(compression_flag);
    if (!sharding_flag.empty()) opts.mirrored.sharding = dtrain::parse_sharding(sharding_flag);
    // ZeRO-3: each ResNet residual block is a unit whose weights are gathered when it runs.
    const bool shard_blocks =
        dtrain::apply_environment(opts).mirrored.sharding == dtrain::Sharding::kParameters;
    opts.parameter_server = ps;

    // One binary for every task of a job: run_task() serves a ps task, calls evaluate on an
    // evaluator task and train on the chief and the workers.
    dtrain::TaskFunctions task;
    task.evaluate = [&](const dtrain::TaskInfo& info) {
      // TF's sidecar evaluation: evaluates each checkpoint the chief writes, until the final one,
      // on plain variables of its own. SIGTERM means "finish the newest checkpoint, then exit";
      // taken by StopSignals, not a handler (see stop_signals.h: oneDNN's GEMM kernels).
      dtrain::StopSignals stop({SIGTERM});
      const Inputs data = load_inputs(data_dir, image_dir, model_name, 0, input_threads);
      std::shared_ptr<dtrain::Model> model = make_model(model_name, sync_bn);
      model->build(data.example);
      dtrain::SidecarEvaluatorOptions so;
      so.checkpoint_dir = info.checkpoint_dir;
      so.stop = &stop.flag();
      so.json = json;
      dtrain::SidecarEvaluator(*model, data.test, so).run();
    };
    task.train = [&](dtrain::Strategy& strategy) {
      const Inputs data = load_inputs(data_dir, image_dir, model_name, train_limit, input_threads);
      std::shared_ptr<dtrain::Model> model;
      std::unique_ptr<dtrain::Optimizer> optimizer;
      const float rate =
          scale_lr ? dtrain::scale_learning_rate(lr, strategy.num_replicas_in_sync()) : lr;
      {
        auto scope = strategy.scope();
        model = make_model(model_name, sync_bn, shard_blocks);
        std::string line = optimizer_flag;
        char rate_text[32];
        std::snprintf(rate_text, sizeof(rate_text), "%.9g", static_cast<double>(rate));
        if (line.find("learning_rate=") == std::string::npos)
          line += std::string(" learning_rate=") + rate_text;
        optimizer = dtrain::Optimizer::from_config(line);
        if (!schedule_flag.empty()) {
          std::string s = schedule_flag;
          const bool has_initial = s.find("initial_learning_rate=") != std::string::npos;
          if (!has_initial && s.rfind("piecewise_constant", 0) != 0 && s.rfind("constant", 0) != 0)
            s += std::string(" initial_learning_rate=") + rate_text;
          optimizer->set_schedule(dtrain::LearningRateSchedule::from_config(s));
        }
      }
      std::fprintf(stderr,
                   "strategy %s, %d replica(s) in sync; local devices:", strategy.name().c_str(),
                   strategy.num_replicas_in_sync());
      for (const auto& d : strategy.worker_devices())
        std::fprintf(stderr, " %s", dtrain::get_device(d).description().c_str());
      std::fprintf(stderr, "\n");

      const dtrain::Dataset& train = data.train;
      const dtrain::Dataset& test = data.test;
      if (!restore_path.empty()) {
        {
          auto scope = strategy.scope();
          model->build(data.example);
        }
        const dtrain::TrainingPosition p =
            dtrain::Checkpoint(*model, optimizer.get(), &strategy).restore(restore_path);
        std::fprintf(stderr, "restored %s (saved after %lld steps)\n", restore_path.c_str(),
                     static_cast<long long>(p.global_step));
      }
      if (eval_only) {
        const dtrain::EvalResult r = dtrain::evaluate(strategy, *model, test, 1000);
        // predict() under this strategy, scored here by hand: the same accuracy as evaluate().
        const dtrain::Tensor logits = dtrain::predict(strategy, *model, test, 1000);
        dtrain::SparseCategoricalAccuracy by_hand;
        by_hand.update_state(logits, data.test_labels);
        if (strategy.extended().is_chief() || !strategy.extended().synchronous()) {
          nlohmann::json j{
              {"strategy", strategy_name}, {"replicas", strategy.num_replicas_in_sync()},
              {"examples", r.examples},    {"test_accuracy", r.accuracy},
              {"test_loss", r.loss},       {"predict_accuracy", by_hand.result()}};
          if (json)
            std::printf("%s\n", j.dump().c_str());
          else
            std::printf("test loss %.4f, test accuracy %.2f%% over %lld images\n", r.loss,
                        100 * r.accuracy, static_cast<long long>(r.examples));
        }
        strategy.extended().on_training_end();
        return;
      }
      dtrain::ProgressBar progress(json ? stderr : stdout);
      dtrain::FitOptions fit;
      fit.epochs = epochs;
      fit.steps = steps;
      fit.global_batch_size = batch;
      fit.shuffle_seed = seed;
      const dtrain::StrategyExtended& ext = strategy.extended();
      fit.accumulate = accumulate;
      fit.warmup_steps = warmup;
      if (augment)
        fit.augment = [seed](std::vector<dtrain::Tensor> b, int epoch, int64_t step) {
          b[0] = dtrain::augment::random_crop_flip(b[0], 4, seed, static_cast<uint64_t>(epoch),
                                                   static_cast<uint64_t>(step));
          return b;
        };
      // Every worker runs the callbacks (they agree on stopping); only the chief prints and writes.
      std::optional<dtrain::LearningRateWarmup> warm;
      if (warmup_epochs > 0) fit.callbacks.push_back(&warm.emplace(warmup_epochs));
      std::optional<dtrain::BackupAndRestore> backup;
      if (!backup_dir.empty()) fit.callbacks.push_back(&backup.emplace(backup_dir, backup_every));
      std::optional<dtrain::ModelCheckpoint> ckpt;
      if (!checkpoint_dir.empty() && strategy_name != "parameter_server")
        fit.callbacks.push_back(&ckpt.emplace(checkpoint_dir, no_eval ? "loss" : "val_loss"));
      std::optional<dtrain::CSVLogger> csv;
      if (!csv_path.empty()) fit.callbacks.push_back(&csv.emplace(csv_path));
      std::unique_ptr<dtrain::Callback> board;
      if (!tensorboard_dir.empty()) {
        board = std::make_unique<dtrain::TensorBoard>(tensorboard_dir);
        fit.callbacks.push_back(board.get());
      }
      fit.callbacks.push_back(
          &progress);  // last: it reports what the others did (a restored backup)
      const dtrain::History h =
          dtrain::fit(strategy, *model, *optimizer, train, no_eval ? nullptr : &test, fit);
      if (!checkpoint_dir.empty()) {
        std::filesystem::create_directories(checkpoint_dir);
        const std::string final_path = checkpoint_dir + "/final.safetensors";
        if (dtrain::Checkpoint(*model, optimizer.get(), &strategy)
                .save(final_path, {epochs, 0, h.steps}))
          std::fprintf(stderr, "final weights: %s\n", final_path.c_str());
      }
      // Peak resident memory: this process's, or the largest worker's of a synchronous job.
      struct rusage usage {};
      getrusage(RUSAGE_SELF, &usage);
      double peak_rss_mb = static_cast<double>(usage.ru_maxrss) / 1024.0;
      if (ext.synchronous() && ext.num_workers() > 1) {
        const std::vector<double> all =
            strategy.extended()
                .gather_across_workers(
                    dtrain::Tensor::from_vector<double>({peak_rss_mb}, dtrain::Shape{1}))
                .to_vector<double>();
        peak_rss_mb = *std::max_element(all.begin(), all.end());
      }
      if (json && (ext.is_chief() || !ext.synchronous())) {  // async workers: each its own
        const std::optional<int64_t> job_step = ext.job_step();
        nlohmann::json j{
            {"strategy", strategy_name},
            {"model", model_name},
            {"precision", dtrain::precision_name(dtrain::precision_policy())},
            {"replicas", strategy.num_replicas_in_sync()},
            {"devices", devices_flag},
            {"steps", h.steps},
            {"job_step", job_step ? nlohmann::json(*job_step) : nlohmann::json()},
            {"global_batch", batch},
            {"images_per_sec", h.images_per_sec},
            {"final_loss", h.final_loss},
            {"test_accuracy", no_eval ? nlohmann::json() : nlohmann::json(h.test_accuracy)},
            {"test_loss", no_eval ? nlohmann::json() : nlohmann::json(h.test_loss)},
            {"peak_rss_mb", peak_rss_mb}};
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

}  // namespace dtrain::examples
