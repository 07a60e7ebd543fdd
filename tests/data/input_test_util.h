// Helpers of the input-pipeline tests (image_test.cc, files_test.cc): scratch folders and files,
// and small images with known pixels.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dtrain/data/dataset.h"
#include "dtrain/data/image.h"

namespace dtrain::data::test_util {

namespace fs = std::filesystem;

inline fs::path temp_dir(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("dtrain_input_test_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

inline void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A gray h x w image whose pixels are all `v`, except pixel (0, 0) = v + 1 (to see flips).
inline image::Image marked(int h, int w, int v, int channels = 1) {
  image::Image im{
      h, w, channels,
      std::vector<uint8_t>(static_cast<size_t>(h * w * channels), static_cast<uint8_t>(v))};
  for (int k = 0; k < channels; ++k)
    im.pixels[static_cast<size_t>(k)] = static_cast<uint8_t>(v + 1);
  return im;
}

inline image::Image noise(int h, int w, int channels, uint32_t seed) {
  image::Image im{h, w, channels, std::vector<uint8_t>(static_cast<size_t>(h * w * channels))};
  uint32_t x = seed * 2654435761u + 1;
  for (auto& p : im.pixels) {
    x = x * 1664525u + 1013904223u;
    p = static_cast<uint8_t>(x >> 24);
  }
  return im;
}

// A smooth RGB image (JPEG-friendly).
inline image::Image smooth(int h, int w) {
  image::Image im{h, w, 3, std::vector<uint8_t>(static_cast<size_t>(h * w * 3))};
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < 3; ++k)
        im.pixels[static_cast<size_t>((y * w + x) * 3 + k)] =
            static_cast<uint8_t>(20 + x * 150 / w + y * 60 / h + 10 * k);
  return im;
}

inline std::vector<std::vector<Tensor>> all_batches(const Dataset& ds) {
  std::vector<std::vector<Tensor>> out;
  auto it = ds.make_iterator();
  std::vector<Tensor> e;
  while (it->next(&e)) out.push_back(e);
  return out;
}

}  // namespace dtrain::data::test_util
