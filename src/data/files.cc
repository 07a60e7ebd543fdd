// list_files and image_dataset_from_directory (files.h).
#include "dtrain/data/files.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"
#include "dtrain/core/random.h"
#include "dtrain/core/strings.h"

namespace dtrain::data {
namespace {

using detail::str_cat;
namespace fs = std::filesystem;

bool is_image_file(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

// Image files under `dir` (recursively), sorted. A folder that cannot be read (permissions, a
// symlink loop with follow_links) is DataLoss naming it (not Unavailable, which elastic training
// takes for a lost peer).
std::vector<std::string> images_under(const fs::path& dir, bool follow_links) {
  std::vector<std::string> out;
  auto opts =
      follow_links ? fs::directory_options::follow_directory_symlink : fs::directory_options::none;
  try {
    for (auto it = fs::recursive_directory_iterator(dir, opts);
         it != fs::recursive_directory_iterator(); ++it)
      if (it->is_regular_file() && is_image_file(it->path())) out.push_back(it->path().string());
  } catch (const fs::filesystem_error& e) {
    throw DataLoss(str_cat("image_dataset_from_directory: cannot list '", e.path1().string(),
                           "': ", e.code().message()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull + (h >> 29); }
uint64_t mix(uint64_t h, const std::string& s) { return mix(h, std::hash<std::string>{}(s)); }

// What identifies the rows an image source reads: the files (names, sizes, times) and the
// transform.
std::string fingerprint(const std::vector<std::string>& files, const std::vector<int32_t>& labels,
                        const image::ImageTransform& t, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < files.size(); ++i) {
    h = mix(h, files[i]);
    h = mix(h, static_cast<uint64_t>(labels[i]));
    std::error_code ec;
    h = mix(h, static_cast<uint64_t>(fs::file_size(files[i], ec)));
    const auto time = fs::last_write_time(files[i], ec);
    h = mix(h, static_cast<uint64_t>(time.time_since_epoch().count()));
  }
  std::string ts = str_cat(t.height, "x", t.width, "x", t.channels, " ", static_cast<int>(t.resize),
                           " ", t.central_fraction, " ", t.rescale, " ", seed);
  for (float m : t.mean) ts += str_cat(" m", m);
  for (float s : t.stddev) ts += str_cat(" s", s);
  return str_cat(files.size(), " files ", hex(mix(h, ts)));
}

}  // namespace

std::vector<std::string> list_files(const std::string& pattern, const ListFilesOptions& options) {
  if (options.num_shards < 1 || options.shard_index < 0 ||
      options.shard_index >= options.num_shards)
    throw InvalidArgument(str_cat("list_files: need num_shards >= 1 and 0 <= shard_index < ",
                                  "num_shards, got ", options.num_shards, ", ",
                                  options.shard_index));
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> all;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) all.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && all.empty()))
    throw NotFound(str_cat("list_files: no files match '", pattern, "'"));
  if (rc != 0) throw DataLoss(str_cat("list_files: cannot read the folders of '", pattern, "'"));
  std::sort(all.begin(), all.end());
  std::vector<std::string> mine;
  for (size_t i = static_cast<size_t>(options.shard_index); i < all.size();
       i += static_cast<size_t>(options.num_shards))
    mine.push_back(all[i]);
  return mine;
}

ImageFolder image_dataset_from_directory(const std::string& directory,
                                         const ImageFolderOptions& options) {
  options.transform.validate();
  const fs::path root(directory);
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    throw NotFound(str_cat("image_dataset_from_directory: '", directory,
                           "' is not a folder; it needs one subfolder of images per class"));
  if (options.validation_split < 0 || options.validation_split >= 1)
    throw InvalidArgument(str_cat("image_dataset_from_directory: validation_split must be in ",
                                  "[0, 1), got ", options.validation_split));
  if (options.subset.empty() ? options.validation_split != 0
                             : (options.subset != "training" && options.subset != "validation") ||
                                   options.validation_split == 0)
    throw InvalidArgument(str_cat("image_dataset_from_directory: subset '", options.subset,
                                  "' with validation_split ", options.validation_split,
                                  ": give both (subset \"training\" or \"validation\" and a ",
                                  "split in (0, 1)) or neither"));

  struct {
    std::vector<std::string> class_names, files;
    std::vector<int32_t> labels;
  } out;
  out.class_names = options.class_names;
  if (out.class_names.empty()) {
    try {
      for (const auto& entry : fs::directory_iterator(root))
        if (entry.is_directory() && (options.follow_links || !entry.is_symlink()))
          out.class_names.push_back(entry.path().filename().string());
    } catch (const fs::filesystem_error& e) {
      throw DataLoss(str_cat("image_dataset_from_directory: cannot list '", directory,
                             "': ", e.code().message()));
    }
    std::sort(out.class_names.begin(), out.class_names.end());
    if (out.class_names.empty())
      throw InvalidArgument(str_cat("image_dataset_from_directory: '", directory,
                                    "' has no subfolders; put each class's images in a folder "
                                    "of its own (",
                                    directory, "/<class>/<image>.jpg)"));
  }
  std::vector<std::string> files;
  std::vector<int32_t> labels;
  for (size_t c = 0; c < out.class_names.size(); ++c) {
    const fs::path dir = root / out.class_names[c];
    if (!fs::is_directory(dir, ec))
      throw InvalidArgument(str_cat("image_dataset_from_directory: class '", out.class_names[c],
                                    "' has no folder ", dir.string()));
    std::vector<std::string> f = images_under(dir, options.follow_links);
    if (f.empty())
      throw InvalidArgument(str_cat("image_dataset_from_directory: the class folder ", dir.string(),
                                    " holds no .jpg, .jpeg or .png files"));
    for (std::string& name : f) {
      files.push_back(std::move(name));
      labels.push_back(static_cast<int32_t>(c));
    }
  }
  // Keras: shuffle the files by seed, the last validation_split of them are "validation".
  std::vector<size_t> keep(files.size());
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = i;
  if (options.validation_split > 0) {
    const Philox rng(options.seed, 0x5a11);
    for (size_t i = keep.size(); i > 1; --i)
      std::swap(keep[i - 1], keep[static_cast<size_t>(rng.block(i)[0]) % i]);
    const auto n_val =
        static_cast<size_t>(options.validation_split * static_cast<double>(keep.size()));
    if (options.subset == "training")
      keep.resize(keep.size() - n_val);
    else
      keep.erase(keep.begin(), keep.end() - static_cast<std::ptrdiff_t>(n_val));
    std::sort(keep.begin(), keep.end());
  }
  for (size_t i : keep) {
    out.files.push_back(files[i]);
    out.labels.push_back(labels[i]);
  }
  if (out.files.empty())
    throw InvalidArgument(str_cat("image_dataset_from_directory: the ", options.subset,
                                  " subset of ", directory, " is empty"));

  const image::ImageTransform t = options.transform;
  auto list = std::make_shared<const std::pair<std::vector<std::string>, std::vector<int32_t>>>(
      out.files, out.labels);
  const uint64_t seed = options.seed;
  const bool ignore = options.ignore_errors;
  Dataset::ReaderOptions ro;
  ro.num_parallel_calls = options.num_parallel_calls;
  ro.epoch_dependent = t.random();
  ro.name = "image_dataset_from_directory";
  ro.fingerprint = fingerprint(out.files, out.labels, t, seed);
  Dataset dataset = Dataset::from_reader(
      static_cast<int64_t>(out.files.size()),
      {{Shape{t.height, t.width, t.channels}, DType::kFloat32}, {Shape{}, DType::kInt32}},
      [list, t, seed, ignore](int64_t row, uint64_t epoch, void* const* dst) {
        const std::string& path = list->first[static_cast<size_t>(row)];
        try {
          image::decode_transformed(image::read_file(path), t, seed, epoch, row,
                                    static_cast<float*>(dst[0]), path);
        } catch (const Error& e) {
          if (!ignore) throw;
          DTRAIN_LOG(WARNING) << "image_dataset_from_directory: skipped " << e.what();
          return false;
        }
        *static_cast<int32_t*>(dst[1]) = list->second[static_cast<size_t>(row)];
        return true;
      },
      ro);
  return ImageFolder{std::move(dataset), std::move(out.class_names), std::move(out.files),
                     std::move(out.labels)};
}

}  // namespace dtrain::data
