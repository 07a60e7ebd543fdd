// `dtrain-bench input`: the ImageNet-style training input pipeline over a folder of 224x224 JPEGs
// (decode, random resized crop to 224, flip, normalise, batch 64), dtrain's image_dataset_from_
// directory against tf.data (bench/input/tf_input.py, map with AUTOTUNE) and PyTorch's DataLoader
// with torchvision transforms (bench/input/torch_input.py), in one run, interleaved rounds,
// medians; each on 1 core (taskset -c 0, one decoding thread / worker: images/sec per core) and on
// all cores (--cores). The JPEGs are Fashion-MNIST items enlarged to 224x224 in colour with noise
// (made once under <build>/bench-data).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "bench_util.h"
#include "dtrain/data/fashion_mnist.h"
#include "dtrain/data/files.h"
#include "dtrain/data/image.h"

namespace dtrain::bench {
namespace {

namespace fs = std::filesystem;

// N JPEGs, DIR/<label>/<k>.jpg, from the first N Fashion-MNIST training images.
void make_images(const fs::path& dir, int n) {
  if (fs::exists(dir / "done")) return;
  std::fprintf(stderr, "input: writing %d 224x224 JPEGs to %s\n", n, dir.c_str());
  const FashionMnist data = load_fashion_mnist("", n);
  const std::vector<float> px = data.train_images.to_vector<float>();
  const std::vector<int32_t> y = data.train_labels.to_vector<int32_t>();
  image::ImageTransform up;
  up.height = up.width = 224;
  up.channels = 1;
  std::vector<float> big(224 * 224);
  uint32_t noise = 12345;
  for (int i = 0; i < n; ++i) {
    image::Image small{28, 28, 1, std::vector<uint8_t>(784)};
    for (size_t k = 0; k < 784; ++k)
      small.pixels[k] =
          static_cast<uint8_t>(std::lround(px[static_cast<size_t>(i) * 784 + k] * 255));
    image::transform_image(small, up, 0, 0, 0, big.data());
    image::Image rgb{224, 224, 3, std::vector<uint8_t>(224 * 224 * 3)};
    for (int r = 0; r < 224; ++r)
      for (int c = 0; c < 224; ++c) {
        const float v = big[static_cast<size_t>(r * 224 + c)];
        const float tint[3] = {v, 0.6f * v + 80.0f * c / 224, 255 - 0.5f * v - 60.0f * r / 224};
        for (int k = 0; k < 3; ++k) {
          noise = noise * 1664525u + 1013904223u;
          const float x = tint[k] + static_cast<float>(static_cast<int>(noise >> 28) - 8);
          rgb.pixels[static_cast<size_t>((r * 224 + c) * 3 + k)] =
              static_cast<uint8_t>(std::clamp(x, 0.0f, 255.0f));
        }
      }
    const fs::path cls = dir / std::to_string(y[static_cast<size_t>(i)]);
    fs::create_directories(cls);
    const std::string bytes = image::encode_jpeg(rgb, 90);
    std::ofstream(cls / (std::to_string(i) + ".jpg"), std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::ofstream(dir / "done") << n << "\n";
}

}  // namespace

// The first 16 images of a batch, un-normalised, as a 4 x 4 grid PNG (to look at the crops).
void write_samples(const Tensor& images, const image::ImageTransform& t, const std::string& path) {
  const int n = static_cast<int>(std::min<int64_t>(16, images.shape()[0]));
  const int s = t.height, side = 4;
  image::Image grid{side * s, side * s, 3,
                    std::vector<uint8_t>(static_cast<size_t>(side * s * side * s * 3), 255)};
  const std::vector<float> px = images.to_vector<float>();
  for (int i = 0; i < n; ++i)
    for (int y = 0; y < s; ++y)
      for (int x = 0; x < s; ++x)
        for (int k = 0; k < 3; ++k) {
          const float v =
              px[static_cast<size_t>(((i * s + y) * s + x) * 3 + k)] * t.stddev[k] + t.mean[k];
          grid.pixels[static_cast<size_t>(
              (((i / side) * s + y) * side * s + (i % side) * s + x) * 3 + k)] =
              static_cast<uint8_t>(std::clamp(v * 255.0f, 0.0f, 255.0f));
        }
  const std::string bytes = image::encode_png(grid);
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

int input_run(const std::string& dir, int threads, int batch, int epochs, int warmup,
              const std::string& samples) {
  data::ImageFolderOptions o;
  o.transform.height = o.transform.width = 224;
  o.transform.resize = image::ImageTransform::Resize::kRandomResizedCrop;
  o.transform.random_flip = true;
  o.transform.rescale = 1.0f / 255.0f;
  o.transform.mean = {0.485f, 0.456f, 0.406f};
  o.transform.stddev = {0.229f, 0.224f, 0.225f};
  o.num_parallel_calls = threads;
  o.seed = 1;
  const data::ImageFolder folder = data::image_dataset_from_directory(dir, o);
  int64_t images = 0, seen = 0;
  auto start = std::chrono::steady_clock::now();
  for (int e = 0; e < epochs; ++e) {
    // What fit() builds for an epoch.
    auto it = folder.dataset.shuffle(1, false, static_cast<uint64_t>(e))
                  .with_epoch(static_cast<uint64_t>(e))
                  .batch(batch)
                  .prefetch(2)
                  .make_iterator();
    std::vector<Tensor> b;
    while (it->next(&b)) {
      if (seen == 0 && !samples.empty()) write_samples(b[0], o.transform, samples);
      if (++seen == warmup)
        start = std::chrono::steady_clock::now();
      else if (seen > warmup)
        images += b[0].shape()[0];
    }
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  nlohmann::json j{{"system", "dtrain"},
                   {"images_per_sec", static_cast<double>(images) / secs},
                   {"images", images},
                   {"peak_rss_mb", static_cast<double>(u.ru_maxrss) / 1024.0}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

int input_bench(const InputArgs& a) {
  const fs::path bin = fs::path(self_dir()).parent_path();
  const fs::path dir = bin / "bench-data" / ("input-jpeg-" + std::to_string(a.images));
  make_images(dir, a.images);
  const fs::path bench_dir = fs::path(source_dir()) / "bench" / "input";
  const std::string peers =
      a.peers_python.empty() ? (bin / "peers-venv" / "bin" / "python").string() : a.peers_python;
  auto have = [&](const std::string& module) {
    return std::system((peers + " -c 'import " + module + "' >/dev/null 2>&1").c_str()) == 0;
  };
  std::vector<std::string> systems = {"dtrain"};
  if (have("tensorflow")) systems.push_back("tf");
  if (have("torchvision")) systems.push_back("torch");
  if (systems.size() < 3)
    std::fprintf(stderr, "input: a peer is missing (bench/peers/setup.sh installs them)\n");
  const int all_cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> cores = {1};
  if (all_cores > 1) cores.push_back(all_cores);
  const std::string common = " --batch-size " + std::to_string(a.batch) + " --epochs " +
                             std::to_string(a.epochs) + " --warmup " + std::to_string(a.warmup);
  auto command = [&](const std::string& sys, int n) {
    const std::string pin = n == 1 ? "taskset -c 0 " : "";
    const std::string t = " --threads " + std::to_string(n);
    if (sys == "dtrain")
      return pin + (fs::path(self_dir()) / "dtrain-bench").string() + " input-run --dir " +
             dir.string() + t + common;
    return pin + peers + " " + (bench_dir / (sys + "_input.py")).string() + " --dir " +
           dir.string() + t + common;
  };
  std::map<std::pair<std::string, int>, std::vector<double>> ips, rss;
  for (int round = 0; round < a.runs; ++round)
    for (int n : cores)
      for (const std::string& sys : systems) {
        const nlohmann::json j = run_json_lines(command(sys, n)).back();
        ips[{sys, n}].push_back(j.at("images_per_sec").get<double>());
        rss[{sys, n}].push_back(j.value("peak_rss_mb", 0.0));
        std::fprintf(stderr, "round %d/%d  %d core(s)  %-7s %8.1f images/sec  %6.0f MB\n",
                     round + 1, a.runs, n, sys.c_str(), ips[{sys, n}].back(), rss[{sys, n}].back());
      }
  std::printf(
      "\ninput pipeline: %d JPEGs 224x224 -> random resized crop 224, flip, normalise, batch %d; "
      "median of %d interleaved rounds: images/sec (peak RSS MB)\n",
      a.images, a.batch, a.runs);
  std::printf("%-28s", "cores");
  for (const std::string& s : systems) std::printf(" %18s", s.c_str());
  for (const std::string& s : systems)
    if (s != "dtrain") std::printf(" %10s", ("vs " + s).c_str());
  std::printf("\n");
  for (int n : cores) {
    std::printf("%-28s", (std::to_string(n) + (n == 1 ? " (taskset -c 0)" : " (all)")).c_str());
    for (const std::string& s : systems)
      std::printf(" %11.1f (%4.0f)", median(ips[{s, n}]), median(rss[{s, n}]));
    for (const std::string& s : systems)
      if (s != "dtrain") std::printf(" %9.2fx", median(ips[{"dtrain", n}]) / median(ips[{s, n}]));
    std::printf("\n");
    if (a.json)
      for (const std::string& s : systems) {
        nlohmann::json j{{"benchmark", "input"},
                         {"system", s},
                         {"cores", n},
                         {"images_per_sec", median(ips[{s, n}])},
                         {"peak_rss_mb", median(rss[{s, n}])},
                         {"ratio_dtrain", median(ips[{"dtrain", n}]) / median(ips[{s, n}])},
                         {"runs", a.runs},
                         {"images", a.images}};
        std::printf("%s\n", j.dump().c_str());
      }
  }
  return 0;
}

}  // namespace dtrain::bench
