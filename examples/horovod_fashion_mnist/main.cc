// Horovod's Keras MNIST example (horovod/examples/tensorflow2/tensorflow2_keras_mnist.py), ported
// line by line to dtrain::hvd and Fashion-MNIST. Start it like horovodrun:
//
//   dtrain-run -np 2 -- ./horovod_fashion_mnist --epochs=5          (or dtrain-run -H localhost:2)
//   mpirun -np 2 ./horovod_fashion_mnist --epochs=5                 (dtrain built with OpenMPI)
//   srun -n 2 ./horovod_fashion_mnist --epochs=5
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "../fashion_mnist/reference_cnn.h"
#include "dtrain/dtrain.h"

namespace hvd = dtrain::hvd;

int main(int argc, char** argv) {
  CLI::App app{"Horovod's Keras MNIST example on dtrain::hvd, with Fashion-MNIST"};
  int epochs = 5, warmup_epochs = 3;
  int64_t batch = 32, steps = 0, train_limit = 0;
  float lr = 1e-3f;
  uint64_t seed = 42;
  bool json = false, no_shuffle = false;
  std::string data_dir, checkpoint_dir, compression = "none", devices = "auto";
  app.add_option("--epochs", epochs, "epochs to train")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--batch-size", batch, "batch size per rank (the global batch is this x size)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", lr, "Adam learning rate for one rank; scaled by hvd::size()")
      ->capture_default_str();
  app.add_option("--warmup-epochs", warmup_epochs, "Horovod's learning-rate warm-up (0: none)")
      ->capture_default_str();
  app.add_option("--steps", steps, "train this many steps instead of whole epochs (0 = off)");
  app.add_option("--seed", seed, "seed for weights and shuffling")->capture_default_str();
  app.add_option("--compression", compression, "gradient compression: none, fp16 or bf16")
      ->capture_default_str();
  app.add_option("--devices", devices,
                 "auto (the GPU of this local rank if any, else the CPU), cpu or gpu")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", checkpoint_dir, "rank 0 saves a checkpoint here each epoch");
  app.add_option("--data-dir", data_dir, "Fashion-MNIST IDX directory");
  app.add_option("--train-limit", train_limit, "train on the first N images only (tests)");
  app.add_flag(
      "--no-shuffle", no_shuffle,
      "read each rank's shard in order (tests: -np 2 then equals -np 1 at twice the batch)");
  app.add_flag("--json", json, "rank 0 prints one JSON object with the results as the last line");
  CLI11_PARSE(app, argc, argv);

  try {
    // Horovod: initialize Horovod.
    hvd::init();

    // Horovod: pin GPU to be used to process local rank (one GPU per process).
    // (More ranks on a machine than GPUs: ranks share them round-robin, as CUDA_VISIBLE_DEVICES
    // would.)
    const int gpu_count = static_cast<int>(dtrain::list_devices(dtrain::DeviceType::kCUDA).size());
    const bool gpus = devices == "gpu" || (devices == "auto" && gpu_count > 0);
    if (gpus && gpu_count == 0) throw dtrain::NotFound("--devices=gpu but no CUDA GPU is visible");
    const dtrain::DeviceSpec device =
        gpus ? dtrain::DeviceSpec::gpu(hvd::local_rank() % gpu_count) : dtrain::DeviceSpec::cpu();
    dtrain::OneDeviceStrategy strategy(device);

    // A seed per rank, so the ranks' initial weights differ as they do in a framework seeded by
    // nobody: rank 0's reach every rank through BroadcastGlobalVariablesCallback below.
    dtrain::set_global_seed(seed + static_cast<uint64_t>(hvd::rank()));
    dtrain::FashionMnist data = dtrain::load_fashion_mnist(data_dir, train_limit);
    if (train_limit > 0 && train_limit < data.train_images.shape()[0]) {
      data.train_images = data.train_images.slice_rows(0, train_limit);
      data.train_labels = data.train_labels.slice_rows(0, train_limit);
    }
    // Horovod: each rank reads its own shard of the data.
    // Every rank takes the same number of examples (the smallest shard), so all run the same steps.
    const int64_t per_rank = data.train_images.shape()[0] / hvd::size();
    const auto dataset = dtrain::Dataset::from_tensors({data.train_images, data.train_labels})
                             .shard(hvd::size(), hvd::rank())
                             .take(per_rank);
    const auto test = dtrain::Dataset::from_tensors({data.test_images, data.test_labels});

    dtrain::Sequential mnist_model;
    std::unique_ptr<dtrain::Optimizer> opt;
    {
      auto scope = strategy.scope();
      mnist_model = dtrain::examples::reference_cnn();
      // Horovod: adjust learning rate based on number of GPUs.
      const float scaled_lr = lr * static_cast<float>(hvd::size());
      // Horovod: add Horovod DistributedOptimizer.
      opt = hvd::DistributedOptimizer(std::make_unique<dtrain::Adam>(scaled_lr),
                                      hvd::parse_compression(compression));
    }

    std::vector<dtrain::Callback*> callbacks;
    // Horovod: average metrics among workers at the end of every epoch (first, so the others see
    // it).
    hvd::MetricAverageCallback average;
    callbacks.push_back(&average);
    // Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd::BroadcastGlobalVariablesCallback broadcast(0);
    callbacks.push_back(&broadcast);
    // Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final accuracy;
    // scale it up gradually over the first epochs.
    std::optional<hvd::LearningRateWarmupCallback> warmup;
    if (warmup_epochs > 0) callbacks.push_back(&warmup.emplace(warmup_epochs, /*verbose=*/1));
    // Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    std::optional<dtrain::ModelCheckpoint> checkpoint;
    if (hvd::rank() == 0 && !checkpoint_dir.empty())
      callbacks.push_back(&checkpoint.emplace(checkpoint_dir, "val_loss"));
    // Horovod: write logs on worker 0.
    dtrain::ProgressBar progress(json ? stderr : stdout);
    if (hvd::rank() == 0) callbacks.push_back(&progress);

    dtrain::FitOptions fit;
    fit.epochs = epochs;
    fit.steps = steps;
    fit.global_batch_size = batch;  // one device per rank: the per-rank batch
    fit.shuffle = !no_shuffle;
    fit.shuffle_seed = seed + static_cast<uint64_t>(hvd::rank());
    fit.callbacks = callbacks;
    const dtrain::History h = dtrain::fit(strategy, mnist_model, *opt, dataset, &test, fit);

    if (json && hvd::rank() == 0) {
      nlohmann::json j{{"example", "horovod_fashion_mnist"},
                       {"size", hvd::size()},
                       {"device", device.to_string()},
                       {"global_batch", batch * hvd::size()},
                       {"compression", compression},
                       {"steps", h.steps},
                       {"images_per_sec", h.images_per_sec * hvd::size()},
                       {"final_loss", h.history.at("loss").back()},
                       {"test_accuracy", h.history.at("val_accuracy").back()},
                       {"test_loss", h.history.at("val_loss").back()}};
      std::printf("%s\n", j.dump().c_str());
    }
    hvd::shutdown();
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
