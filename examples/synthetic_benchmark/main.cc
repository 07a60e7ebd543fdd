// Horovod's synthetic benchmark (examples/pytorch/pytorch_synthetic_benchmark.py and the TF2 one)
// in C++: a model from dtrain::applications trained with SGD on one fixed random batch per replica,
// timed in iterations of --num-batches-per-iter batches after --num-warmup-batches, with Horovod's
// defaults and output ("Img/sec per device: mean +-1.96 sigma" and the total). Any strategy by
// --strategy; dtrain-run -np N for N processes; --compression (or --fp16-allreduce, Horovod's flag)
// compresses the cross-worker all-reduce.
//
//   ./synthetic_benchmark --model=resnet50 --batch-size=32 --threads=1
//   dtrain-run -np 2 -- ./synthetic_benchmark --strategy=multi_worker_mirrored --threads=1
//
// --image-dir DIR trains on a folder of images instead (DIR/<class>/*.jpg, ImageNet's training
// input: random resized crop to --image-size, flip, normalisation, on the input pipeline's reader
// threads), and reports how long the steps waited for input ("input batch" in the timeline).
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "dtrain/core/allocator.h"
#include "dtrain/data/files.h"
#include "dtrain/dtrain.h"

namespace {

double peak_rss_mb() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Horovod's synthetic benchmark with dtrain: images/sec of a model on random data"};
  std::string model_name = "resnet50", strategy_name = "one_device", devices_flag = "cpu",
              compression_flag = "none", precision_flag = "fp32", style_flag = "keras";
  int64_t batch = 32, image_size = 224;
  int warmup = 10, per_iter = 10, iters = 10, threads = 0;
  bool fp16_allreduce = false, json = false;
  std::string image_dir;
  int input_threads = 0;
  bool recompute = false, tf32 = false;
  app.add_option("--model", model_name,
                 "resnet18, resnet34, resnet50, resnet101, resnet152 (ImageNet's), or the CIFAR "
                 "resnet20, resnet32, resnet44, resnet56, resnet110 (6n+2 layers)")
      ->capture_default_str();
  app.add_option("--resnet-style", style_flag,
                 "keras: keras.applications' ResNet50/101/152 (v1, convolution biases; Horovod's "
                 "TensorFlow script), torchvision: torchvision's (v1.5, no biases; its PyTorch "
                 "script)")
      ->check(CLI::IsMember({"keras", "torchvision"}))
      ->capture_default_str();
  app.add_option("--batch-size", batch, "input batch size per replica")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--image-size", image_size, "height and width of the random images")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--num-warmup-batches", warmup, "number of warm-up batches that don't count")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--num-batches-per-iter", per_iter, "number of batches per benchmark iteration")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--num-iters", iters, "number of benchmark iterations")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--strategy", strategy_name, "distribution strategy")->capture_default_str();
  app.add_option("--devices", devices_flag, "cpu, cpu:N, gpu, gpu:0,1")->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads per CPU device (0 = cores / devices)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--compression", compression_flag, "cross-worker all-reduce: none, fp16, bf16")
      ->capture_default_str();
  app.add_flag("--fp16-allreduce", fp16_allreduce, "Horovod's flag: --compression=fp16");
  app.add_option("--precision", precision_flag, "fp32, or bf16 (mixed_bfloat16)")
      ->capture_default_str();
  app.add_flag("--tf32", tf32,
               "float32 products on GPU tensor cores as TensorFloat-32 "
               "(enable_tensor_float_32_execution; CPUs ignore it)");
  app.add_flag("--json", json, "print one JSON object with the results as the last line");
  app.add_option("--image-dir", image_dir,
                 "train on image files (DIR/<class>/*.jpg|png) through the input pipeline instead "
                 "of one random batch");
  app.add_flag("--recompute", recompute,
               "recompute each residual block's activations in the backward pass "
               "(ResNetOptions::recompute)");
  app.add_option("--input-threads", input_threads,
                 "threads decoding --image-dir files (0 = one per core)");
  CLI11_PARSE(app, argc, argv);

  try {
    dtrain::set_global_seed(1);
    dtrain::set_precision_policy(dtrain::parse_precision(precision_flag));
    dtrain::enable_tensor_float_32_execution(tf32);
    dtrain::StrategyOptions opts;
    opts.devices = dtrain::parse_devices_flag(devices_flag, threads);
    opts.communication.compression =
        dtrain::parse_compression(fp16_allreduce ? "fp16" : compression_flag);
    dtrain::TaskFunctions task;
    task.train = [&](dtrain::Strategy& strategy) {
      dtrain::applications::ResNetOptions ro;
      ro.input_shape = dtrain::Shape{image_size, image_size, 3};
      ro.classes = 1000;
      ro.recompute = recompute;
      ro.style = style_flag == "torchvision" ? dtrain::applications::ResNetStyle::kTorchvision
                                             : dtrain::applications::ResNetStyle::kKeras;
      std::shared_ptr<dtrain::Model> model;
      std::unique_ptr<dtrain::Optimizer> opt;
      {
        auto scope = strategy.scope();
        model = dtrain::applications::resnet_by_name(model_name, ro);
        model->build();
        opt = std::make_unique<dtrain::SGD>(0.01f);
        opt->build(model->trainable_variables());
      }
      const dtrain::VariableList vars = model->trainable_variables();
      const int replicas = strategy.num_replicas_in_sync();
      const bool chief = strategy.extended().is_chief() || !strategy.extended().synchronous();
      // One random batch per replica, on its device (Horovod's fixed synthetic data).
      const dtrain::PerReplica data =
          strategy.experimental_distribute_values_from_function([&](const dtrain::ValueContext& c) {
            const uint64_t r = static_cast<uint64_t>(c.replica_id_in_sync_group);
            std::vector<float> x(static_cast<size_t>(batch * image_size * image_size * 3));
            dtrain::Philox rng(7, r);
            for (size_t i = 0; i < x.size(); ++i) x[i] = rng.uniform(i);
            std::vector<int32_t> y(static_cast<size_t>(batch));
            for (size_t i = 0; i < y.size(); ++i)
              y[i] = static_cast<int32_t>(rng.block(x.size() + i)[0] % 1000);
            return std::vector<dtrain::Tensor>{
                dtrain::Tensor::from_vector<float>(x,
                                                   dtrain::Shape{batch, image_size, image_size, 3}),
                dtrain::Tensor::from_vector<int32_t>(y, dtrain::Shape{batch})};
          });
      const dtrain::ReplicaFn step = [&](dtrain::ReplicaContext&,
                                         const std::vector<dtrain::Tensor>& in) {
        // Spans named as fit() names them: the timeline (DTRAIN_TIMELINE) then shows each step's
        // phases, and `dtrain-bench simulate` reads its compute profile from them.
        dtrain::GradientTape tape;
        dtrain::Tensor loss;
        {
          dtrain::timeline::Span s("forward", "compute");
          const dtrain::Tensor logits = (*model)(in[0], true);
          loss = dtrain::compute_average_loss(
              dtrain::ops::sparse_softmax_cross_entropy(logits, in[1]), batch * replicas);
        }
        std::vector<dtrain::Tensor> grads;
        {
          dtrain::timeline::Span s("backward", "compute");
          grads = tape.gradient(loss, vars);
        }
        dtrain::timeline::Span s("optimizer update", "compute");
        opt->apply_gradients(grads, vars);
        return std::vector<dtrain::Tensor>{loss};
      };
      // --image-dir: the global batch of each step from the files, as fit() reads them.
      std::function<bool(dtrain::PerReplica*)> next_batch;
      std::optional<dtrain::data::ImageFolder> folder;
      int epoch = 0;
      double input_seconds = 0;
      if (!image_dir.empty()) {
        dtrain::data::ImageFolderOptions fo;
        fo.transform.height = fo.transform.width = static_cast<int>(image_size);
        fo.transform.resize = dtrain::image::ImageTransform::Resize::kRandomResizedCrop;
        fo.transform.random_flip = true;
        fo.transform.rescale = 1.0f / 255.0f;
        fo.transform.mean = {0.485f, 0.456f, 0.406f};
        fo.transform.stddev = {0.229f, 0.224f, 0.225f};
        fo.num_parallel_calls = input_threads > 0 ? input_threads : dtrain::Dataset::kAutotune;
        folder = dtrain::data::image_dataset_from_directory(image_dir, fo);
      }
      dtrain::PerReplica batch_in;
      auto input = [&]() -> const dtrain::PerReplica& {
        if (!folder) return data;
        dtrain::timeline::Span span("input batch", "data");
        const auto t0 = std::chrono::steady_clock::now();
        while (!next_batch || !next_batch(&batch_in)) {  // a new epoch when one ends
          const int64_t global = batch * replicas;
          next_batch = strategy.distribute_dataset(
              folder->dataset.shuffle(1, false, static_cast<uint64_t>(epoch))
                  .with_epoch(static_cast<uint64_t>(epoch))
                  .batch(global, true)
                  .prefetch(2),
              global);
          ++epoch;
        }
        input_seconds +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return batch_in;
      };
      auto run_batches = [&](int n) {
        for (int i = 0; i < n; ++i)
          strategy.reduce(dtrain::ReduceOp::kSum, strategy.run(step, input()));
      };
      if (chief) {
        std::printf("Model: %s (%s form)\nBatch size: %lld\nNumber of devices: %d (%s)\n",
                    model_name.c_str(), style_flag.c_str(), static_cast<long long>(batch), replicas,
                    strategy.name().c_str());
        std::printf("Local devices:");
        for (const auto& d : strategy.worker_devices())
          std::printf(" %s", dtrain::get_device(d).description().c_str());
        std::printf("\n");
        std::printf("Running warmup...\n");
        std::fflush(stdout);
      }
      run_batches(warmup);
      if (chief) {
        std::printf("Running benchmark...\n");
        std::fflush(stdout);
      }
      std::vector<double> img_secs;
      input_seconds = 0;
      const auto timed_start = std::chrono::steady_clock::now();
      for (int it = 0; it < iters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        run_batches(per_iter);
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double img_sec = static_cast<double>(batch * per_iter) / secs;
        if (chief) {
          std::printf("Iter #%d: %.1f img/sec per device\n", it, img_sec);
          std::fflush(stdout);
        }
        img_secs.push_back(img_sec);
      }
      double mean = 0, var = 0;
      for (double v : img_secs) mean += v / static_cast<double>(img_secs.size());
      for (double v : img_secs)
        var += (v - mean) * (v - mean) / static_cast<double>(img_secs.size());
      const double conf = 1.96 * std::sqrt(var);
      const double rss = peak_rss_mb();
      const double timed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_start).count();
      // The share of the timed steps spent waiting for input, the largest over the workers.
      double input_share = input_seconds / timed;
      if (strategy.extended().synchronous() && strategy.extended().num_workers() > 1) {
        const std::vector<double> all =
            strategy.extended()
                .gather_across_workers(
                    dtrain::Tensor::from_vector<double>({input_share}, dtrain::Shape{1}))
                .to_vector<double>();
        input_share = *std::max_element(all.begin(), all.end());
      }
      if (chief) {
        std::printf("Img/sec per device: %.1f +-%.1f\n", mean, conf);
        std::printf("Total img/sec on %d device(s): %.1f +-%.1f\n", replicas, replicas * mean,
                    replicas * conf);
        std::printf("Peak RSS: %.0f MB (this process)\n", rss);
        if (folder)
          std::printf("Input: %zu files from %s; steps waited for input %.2f%% of the time\n",
                      folder->files.size(), image_dir.c_str(), 100 * input_share);
        if (json)
          std::printf(
              "%s\n",
              nlohmann::json{{"model", model_name},
                             {"resnet_style", style_flag},
                             {"strategy", strategy_name},
                             {"replicas", replicas},
                             {"batch_size", batch},
                             {"img_sec_per_device", mean},
                             {"img_sec_per_device_conf", conf},
                             {"total_img_sec", replicas * mean},
                             {"peak_rss_mb", rss},
                             {"recompute", recompute},
                             {"precision", precision_flag},
                             {"tf32", tf32},
                             {"allocator_peak_mb",
                              static_cast<double>(dtrain::host_allocator().get_memory_info().peak) /
                                  1048576.0},
                             {"input", folder ? image_dir : "synthetic"},
                             {"input_wait_fraction", folder ? input_share : 0.0},
                             {"params", model->count_params()}}
                  .dump()
                  .c_str());
      }
      strategy.extended().on_training_end();
    };
    dtrain::run_task(strategy_name, opts, task);
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
