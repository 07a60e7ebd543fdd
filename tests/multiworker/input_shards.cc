// A worker of tests/multiworker/input_shards_test.py: reads a folder of images through the input
// pipeline fit() builds (shuffle by epoch, with_epoch, skip to a resumed step, batch by the global
// batch, prefetch) and Strategy::distribute_dataset, under MultiWorkerMirrored with however many
// workers dtrain-run started. Each image's pixels say which row it is (value = row, the mark at
// (0, 0) = row + 1, so a flip moves it). The chief prints, per step, every worker's rows in
// replica order and whether each was flipped, gathered across the workers:
//   {"epoch": 0, "step": 3, "rows": [...], "flipped": [...]}
//
//   input_shards --make DIR N          writes N 4x4 gray PNGs in 3 class folders
//   dtrain-run -np 3 -- input_shards --dir DIR --batch 7 --epochs 2 [--resume-epoch 1 --resume-step
//   2] [--ignore-errors]
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dtrain/data/files.h"
#include "dtrain/dtrain.h"

int main(int argc, char** argv) {
  CLI::App app{"input pipeline sharding check"};
  std::string dir, make_dir;
  int n = 0, epochs = 2, batch = 7, resume_epoch = 0, resume_step = 0;
  app.add_option("--make", make_dir);
  app.add_option("-n", n);
  app.add_option("--dir", dir);
  app.add_option("--epochs", epochs);
  app.add_option("--batch", batch);
  app.add_option("--resume-epoch", resume_epoch);
  app.add_option("--resume-step", resume_step);
  bool ignore_errors = false;
  app.add_flag("--ignore-errors", ignore_errors, "skip images that cannot be decoded");
  CLI11_PARSE(app, argc, argv);
  using namespace dtrain;
  try {
    if (!make_dir.empty()) {
      for (int i = 0; i < n; ++i) {
        image::Image im{4, 4, 1, std::vector<uint8_t>(16, static_cast<uint8_t>(i))};
        im.pixels[0] = static_cast<uint8_t>(i + 1);
        const std::string cls = make_dir + "/class_" + std::to_string(i % 3);
        std::filesystem::create_directories(cls);
        char name[32];
        std::snprintf(name, sizeof(name), "/%03d.png", i);
        const std::string bytes = image::encode_png(im);
        std::ofstream(cls + name, std::ios::binary)
            .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      }
      return 0;
    }
    TaskFunctions task;
    task.train = [&](Strategy& strategy) {
      data::ImageFolderOptions o;
      o.transform.height = o.transform.width = 4;
      o.transform.channels = 1;
      o.transform.random_flip = true;
      o.seed = 7;
      o.num_parallel_calls = 2;
      o.ignore_errors = ignore_errors;
      const data::ImageFolder folder = data::image_dataset_from_directory(dir, o);
      StrategyExtended& ext = strategy.extended();
      for (int epoch = resume_epoch; epoch < epochs; ++epoch) {
        const int first = epoch == resume_epoch ? resume_step : 0;
        // What fit() builds for an epoch (fit.cc, epoch_data).
        const Dataset d = folder.dataset.shuffle(11, false, static_cast<uint64_t>(epoch))
                              .with_epoch(static_cast<uint64_t>(epoch))
                              .skip(static_cast<int64_t>(first) * batch)
                              .batch(batch)
                              .prefetch(2);
        auto next = strategy.distribute_dataset(d, batch);
        PerReplica in;
        for (int step = first; next(&in); ++step) {
          // This worker's rows (each replica's, in order), padded to the batch with -1.
          std::vector<double> mine(static_cast<size_t>(2 * batch), -1.0);
          size_t k = 0;
          for (const auto& replica : in.values) {
            const std::vector<float> px = replica.at(0).to_vector<float>();
            for (size_t r = 0; r * 16 < px.size(); ++r, ++k) {
              const float row = px[r * 16 + 5];
              mine[2 * k] = row;
              mine[2 * k + 1] = px[r * 16 + 3] == row + 1 ? 1 : 0;  // the mark moved: flipped
            }
          }
          const std::vector<double> all =
              ext.gather_across_workers(Tensor::from_vector<double>(mine, Shape{2 * batch}))
                  .to_vector<double>();
          if (ext.is_chief()) {
            std::string rows, flips;
            for (size_t i = 0; i + 1 < all.size(); i += 2)
              if (all[i] >= 0) {
                rows += (rows.empty() ? "" : ",") + std::to_string(static_cast<int>(all[i]));
                flips += (flips.empty() ? "" : ",") + std::to_string(static_cast<int>(all[i + 1]));
              }
            std::printf("{\"epoch\": %d, \"step\": %d, \"rows\": [%s], \"flipped\": [%s]}\n", epoch,
                        step, rows.c_str(), flips.c_str());
            std::fflush(stdout);
          }
        }
      }
      ext.on_training_end();
    };
    StrategyOptions opts;
    run_task("multi_worker_mirrored", opts, task);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
