#include "dtrain/data/fashion_mnist.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>

namespace dtrain {
namespace {

namespace fs = std::filesystem;

constexpr uint8_t kUnsignedByteCode = 0x08;
constexpr int kMaxDims = 16;

std::string install_hint() {
  return detail::str_cat(
      "Point dtrain at the Fashion-MNIST files with the --data-dir flag or the DTRAIN_DATA_DIR "
      "environment variable, or install them into ",
      kDefaultFashionMnistDir, " with `apt-get install dataset-fashion-mnist`.");
}

std::string dims_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// gzread handles raw files transparently (it passes through data without a gzip header), so one
// code path reads both; it also reports truncated or corrupt gzip streams through gzerror.
class GzFile {
 public:
  explicit GzFile(const std::string& path) : path_(path) {
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr) {
      const int err = errno;
      if (err == ENOENT || !fs::exists(path))
        throw NotFound(detail::str_cat("IDX file ", path, " does not exist. ", install_hint()));
      throw Unavailable(detail::str_cat("cannot open IDX file ", path, ": ", std::strerror(err)));
    }
    gzbuffer(file_, 1 << 20);
  }
  ~GzFile() { gzclose(file_); }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  // Reads up to n bytes; returns how many were read (fewer only at the end of the data).
  // Throws DataLoss when the compressed stream is corrupt.
  size_t read(void* dst, size_t n) {
    size_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
      const int got = gzread(file_, static_cast<char*>(dst) + done, chunk);
      if (got < 0) check_stream();
      if (got <= 0) break;
      done += static_cast<size_t>(got);
    }
    // A truncated gzip stream returns short reads and records Z_BUF_ERROR.
    if (done < n) check_stream();
    return done;
  }

 private:
  void check_stream() {
    int code = Z_OK;
    const char* msg = gzerror(file_, &code);
    if (code != Z_OK && code != Z_STREAM_END)
      throw DataLoss(detail::str_cat("IDX file ", path_,
                                     " is a corrupt or truncated gzip stream (zlib: ",
                                     msg ? msg : "unknown error", "); download it again"));
  }

  std::string path_;
  gzFile file_ = nullptr;
};

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// base.gz if present, else base; NotFound naming both otherwise.
std::string find_data_file(const std::string& dir, const std::string& base,
                           const std::string& how_chosen) {
  const fs::path gz = fs::path(dir) / (base + ".gz");
  const fs::path raw = fs::path(dir) / base;
  if (is_file(gz)) return gz.string();
  if (is_file(raw)) return raw.string();
  throw NotFound(detail::str_cat("Fashion-MNIST file ", base, "(.gz) not found in ", dir, " (",
                                 how_chosen, "): neither ", gz.string(), " nor ", raw.string(),
                                 " exists. ", install_hint()));
}

Tensor images_to_tensor(const IdxArray& a, const std::string& path) {
  if (a.dims.size() != 3 || a.dims[1] != 28 || a.dims[2] != 28)
    throw DataLoss(detail::str_cat("Fashion-MNIST image file ", path, " holds dims ",
                                   dims_string(a.dims), "; expected [N, 28, 28]"));
  std::array<float, 256> scale;
  for (int v = 0; v < 256; ++v) scale[v] = static_cast<float>(v) / 255.0f;
  Tensor t = Tensor::empty(Shape{a.dims[0], 28, 28, 1}, DType::kFloat32);
  float* dst = t.data<float>();
  for (size_t i = 0; i < a.data.size(); ++i) dst[i] = scale[a.data[i]];
  return t;
}

Tensor labels_to_tensor(const IdxArray& a, const std::string& path) {
  if (a.dims.size() != 1)
    throw DataLoss(detail::str_cat("Fashion-MNIST label file ", path, " holds dims ",
                                   dims_string(a.dims), "; expected [N]"));
  Tensor t = Tensor::empty(Shape{a.dims[0]}, DType::kInt32);
  int32_t* dst = t.data<int32_t>();
  for (size_t i = 0; i < a.data.size(); ++i) {
    if (a.data[i] > 9)
      throw DataLoss(detail::str_cat("Fashion-MNIST label file ", path, " holds label ",
                                     static_cast<int>(a.data[i]), " at index ", i,
                                     "; labels must be 0..9 (is this the right file?)"));
    dst[i] = a.data[i];
  }
  return t;
}

void load_split(const std::string& dir, const std::string& how, const std::string& prefix,
                int64_t max_rows, Tensor* images, Tensor* labels) {
  const std::string image_path = find_data_file(dir, prefix + "-images-idx3-ubyte", how);
  const std::string label_path = find_data_file(dir, prefix + "-labels-idx1-ubyte", how);
  const IdxArray image_idx = read_idx(image_path, max_rows);
  const IdxArray label_idx = read_idx(label_path, max_rows);
  if (image_idx.dims.empty() || label_idx.dims.empty() || image_idx.dims[0] != label_idx.dims[0])
    throw DataLoss(detail::str_cat(
        "mislabelled data: ", image_path, " holds ", image_idx.dims.empty() ? 0 : image_idx.dims[0],
        " images but ", label_path, " holds ", label_idx.dims.empty() ? 0 : label_idx.dims[0],
        " labels; the counts must agree (are the files from the same split and release?)"));
  *images = images_to_tensor(image_idx, image_path);
  *labels = labels_to_tensor(label_idx, label_path);
}

}  // namespace

IdxArray read_idx(const std::string& path, int64_t max_rows) {
  GzFile file(path);
  uint8_t magic[4];
  const size_t got_magic = file.read(magic, 4);
  if (got_magic < 4)
    throw DataLoss(detail::str_cat(
        "IDX file ", path, " is truncated: expected a 4-byte header, got ", got_magic, " bytes"));
  if (magic[0] != 0 || magic[1] != 0)
    throw DataLoss(
        detail::str_cat("IDX file ", path, " has bad magic 0x", std::hex,
                        (magic[0] << 24 | magic[1] << 16 | magic[2] << 8 | magic[3]), std::dec,
                        ": an IDX file starts with two zero bytes, a type code and the number of "
                        "dimensions; is this an IDX file?"));
  if (magic[2] != kUnsignedByteCode)
    throw DataLoss(detail::str_cat("IDX file ", path, " has type code 0x", std::hex,
                                   static_cast<int>(magic[2]), std::dec,
                                   "; only unsigned-byte data (0x08) is supported"));
  const int ndims = magic[3];
  if (ndims < 1 || ndims > kMaxDims)
    throw DataLoss(detail::str_cat("IDX file ", path, " declares ", ndims,
                                   " dimensions; expected 1..", kMaxDims));

  IdxArray out;
  std::vector<uint8_t> raw_dims(4 * static_cast<size_t>(ndims));
  const size_t got_dims = file.read(raw_dims.data(), raw_dims.size());
  if (got_dims < raw_dims.size())
    throw DataLoss(detail::str_cat("IDX file ", path, " is truncated inside its header: expected ",
                                   4 + raw_dims.size(), " header bytes, got ", 4 + got_dims));
  uint64_t expected = 1;
  for (int d = 0; d < ndims; ++d) {
    const uint8_t* b = &raw_dims[4 * d];
    const uint64_t dim = uint64_t{b[0]} << 24 | uint64_t{b[1]} << 16 | uint64_t{b[2]} << 8 | b[3];
    out.dims.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && expected > (uint64_t{1} << 48) / dim)
      throw DataLoss(detail::str_cat("IDX file ", path, " declares dims ", dims_string(out.dims),
                                     "..., more than 2^48 bytes; the header is corrupt"));
    expected *= dim;
  }
  const size_t header_bytes = 4 + raw_dims.size();
  // Only the first max_rows rows: the payload is row-major, so they are its first bytes.
  const bool partial = max_rows > 0 && max_rows < out.dims[0];
  if (partial) {
    expected = expected / static_cast<uint64_t>(out.dims[0]) * static_cast<uint64_t>(max_rows);
    out.dims[0] = max_rows;
  }

  // Grow the buffer as data arrives so that a corrupt header cannot make us allocate terabytes.
  constexpr size_t kChunk = size_t{64} << 20;
  size_t have = 0;
  while (have < expected) {
    const size_t want = std::min<size_t>(expected - have, kChunk);
    out.data.resize(have + want);
    const size_t got = file.read(out.data.data() + have, want);
    have += got;
    if (got < want) break;
  }
  if (have < expected)
    throw DataLoss(detail::str_cat(
        "IDX file ", path, " is truncated: its header declares dims ", dims_string(out.dims), " = ",
        expected, " payload bytes (", header_bytes + expected, " bytes in all) but it holds only ",
        have, " payload bytes (", header_bytes + have, " in all); download it again"));
  if (partial) return out;
  uint64_t extra = 0;
  std::vector<uint8_t> sink(1 << 16);
  for (size_t got; (got = file.read(sink.data(), sink.size())) > 0;) extra += got;
  if (extra > 0)
    throw DataLoss(detail::str_cat("IDX file ", path, " holds ", expected + extra,
                                   " payload bytes but its header declares dims ",
                                   dims_string(out.dims), " = ", expected,
                                   " bytes; the header or the file is corrupt"));
  return out;
}

std::string resolve_data_dir(const std::string& dir) {
  if (!dir.empty()) return dir;
  const char* env = std::getenv("DTRAIN_DATA_DIR");
  if (env != nullptr && *env != '\0') return env;
  return kDefaultFashionMnistDir;
}

FashionMnist load_fashion_mnist(const std::string& dir, int64_t max_train_rows) {
  const std::string resolved = resolve_data_dir(dir);
  const char* env = std::getenv("DTRAIN_DATA_DIR");
  std::string how;
  if (!dir.empty()) {
    how = "given by the caller, e.g. --data-dir";
  } else if (env != nullptr && *env != '\0') {
    how = "from DTRAIN_DATA_DIR";
  } else {
    how = "the default; neither --data-dir nor DTRAIN_DATA_DIR was set";
  }
  FashionMnist out;
  load_split(resolved, how, "train", max_train_rows, &out.train_images, &out.train_labels);
  load_split(resolved, how, "t10k", 0, &out.test_images, &out.test_labels);
  return out;
}

}  // namespace dtrain
