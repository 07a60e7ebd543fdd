// TFRecord files and tf.train.Example (files.h).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>

#include "data/tfrecord_format.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"
#include "dtrain/core/strings.h"
#include "dtrain/data/files.h"
#include "example.pb.h"

namespace dtrain::data {
namespace {

using detail::str_cat;

// A file mapped read-only.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) throw NotFound(str_cat(path, ": no such TFRecord file"));
      throw DataLoss(str_cat(path, ": cannot open: ", std::strerror(errno)));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw DataLoss(str_cat(path, ": cannot stat: ", std::strerror(errno)));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        throw DataLoss(str_cat(path, ": cannot map: ", std::strerror(errno)));
      }
      data_ = static_cast<const unsigned char*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

struct RecordRef {
  size_t offset;  // of the data
  size_t length;
};

// The records of a file, from their headers. A truncated file or a header whose checksum fails
// ends the scan: with `ignore_errors` the records before it are kept and a warning is logged,
// otherwise DataLoss names the record and its offset.
std::vector<RecordRef> index_records(const MappedFile& f, bool ignore_errors) {
  std::vector<RecordRef> out;
  const unsigned char* p = f.data();
  if (f.size() >= 2 && p[0] == 0x1f && p[1] == 0x8b)
    throw InvalidArgument(str_cat(f.path(),
                                  ": a GZIP-compressed TFRecord file; dtrain reads "
                                  "uncompressed ones: gunzip it (TFRecordWriter writes none)"));
  size_t at = 0;
  while (at < f.size()) {
    std::string problem;
    if (f.size() - at < 12) {
      problem =
          str_cat("truncated: ", f.size() - at, " bytes where a 12-byte record header starts");
    } else if (detail::masked_crc32c(p + at, 8) != detail::load_le32(p + at + 8)) {
      problem = "the length's checksum does not match (a corrupt header, or not a TFRecord file)";
    } else {
      const uint64_t len = detail::load_le64(p + at);
      if (len > f.size() - at - 12 || f.size() - at - 12 - len < 4)
        problem = str_cat("truncated: the record says ", len, " bytes of data and the file has ",
                          f.size() - at - 12 < 4 ? 0 : f.size() - at - 16, " left");
      else {
        out.push_back({at + 12, static_cast<size_t>(len)});
        at += 16 + static_cast<size_t>(len);
        continue;
      }
    }
    const std::string msg =
        str_cat(f.path(), ": record ", out.size(), " at byte ", at, ": ", problem);
    if (!ignore_errors) throw DataLoss(msg);
    DTRAIN_LOG(WARNING) << "TFRecordDataset: " << msg << "; the file's records end there";
    break;
  }
  return out;
}

void check_data(const MappedFile& f, const RecordRef& r, size_t index) {
  if (detail::masked_crc32c(f.data() + r.offset, r.length) !=
      detail::load_le32(f.data() + r.offset + r.length))
    throw DataLoss(str_cat(f.path(), ": record ", index, " at byte ", r.offset - 12,
                           ": the data's checksum does not match (corrupt data)"));
}

const char* kind_name(proto::Feature::KindCase k) {
  switch (k) {
    case proto::Feature::kBytesList:
      return "bytes_list";
    case proto::Feature::kFloatList:
      return "float_list";
    case proto::Feature::kInt64List:
      return "int64_list";
    default:
      return "no value";
  }
}

// tf.data's interleave(cycle_length, block_length) order over files with these record counts:
// (file, record) pairs.
std::vector<std::pair<size_t, size_t>> interleave_order(const std::vector<size_t>& counts,
                                                        size_t cycle, size_t block) {
  std::vector<std::pair<size_t, size_t>> order;
  struct Slot {
    bool open = false;
    size_t file = 0, next = 0;
  };
  std::vector<Slot> slots(cycle);
  size_t next_file = 0, open = 0, index = 0, in_block = 0;
  while (next_file < counts.size() || open > 0) {
    Slot& s = slots[index];
    if (s.open) {
      if (s.next < counts[s.file]) {
        order.emplace_back(s.file, s.next++);
        if (++in_block == block) {
          in_block = 0;
          index = (index + 1) % cycle;
        }
        continue;
      }
      s.open = false;
      --open;
      in_block = 0;
      index = (index + 1) % cycle;
    } else if (next_file < counts.size()) {
      s = Slot{true, next_file++, 0};
      ++open;
    } else {
      in_block = 0;
      index = (index + 1) % cycle;
    }
  }
  return order;
}

struct Source {
  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<std::pair<size_t, size_t>> rows;  // (file, record index)
  std::vector<std::vector<RecordRef>> records;
  std::vector<FeatureSpec> specs;
  bool ignore_errors = false;
  uint64_t seed = 0;
};

void write_feature(const Source& s, const FeatureSpec& spec, const proto::Example& ex, int64_t row,
                   uint64_t epoch, void* dst, const std::string& where) {
  const auto& map = ex.features().feature();
  const auto it = map.find(spec.key);
  const int64_t n = spec.kind == FeatureSpec::Kind::kImage ? 0 : spec.shape.numel();
  if (it == map.end()) {
    if (spec.default_value.empty())
      throw DataLoss(str_cat(where, ": no feature '", spec.key, "' (and the spec has no default)"));
    for (int64_t i = 0; i < n; ++i) {
      const double v = spec.default_value[static_cast<size_t>(i) % spec.default_value.size()];
      if (spec.dtype == DType::kFloat32) static_cast<float*>(dst)[i] = static_cast<float>(v);
      if (spec.dtype == DType::kInt32) static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
      if (spec.dtype == DType::kInt64) static_cast<int64_t*>(dst)[i] = static_cast<int64_t>(v);
    }
    return;
  }
  const proto::Feature& f = it->second;
  const proto::Feature::KindCase want =
      spec.kind == FeatureSpec::Kind::kFloat   ? proto::Feature::kFloatList
      : spec.kind == FeatureSpec::Kind::kInt64 ? proto::Feature::kInt64List
                                               : proto::Feature::kBytesList;
  if (f.kind_case() != want)
    throw DataLoss(str_cat(where, ": feature '", spec.key, "' is a ", kind_name(f.kind_case()),
                           " and the spec reads a ", kind_name(want)));
  auto count_error = [&](int64_t have) {
    return DataLoss(str_cat(where, ": feature '", spec.key, "' has ", have,
                            " values and the spec's shape ", spec.shape.to_string(), " needs ", n));
  };
  switch (spec.kind) {
    case FeatureSpec::Kind::kFloat: {
      if (f.float_list().value_size() != n) throw count_error(f.float_list().value_size());
      std::memcpy(dst, f.float_list().value().data(), static_cast<size_t>(n) * sizeof(float));
      break;
    }
    case FeatureSpec::Kind::kInt64: {
      const auto& v = f.int64_list().value();
      if (v.size() != n) throw count_error(v.size());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t x = v.Get(static_cast<int>(i));
        if (spec.dtype == DType::kInt64) {
          static_cast<int64_t*>(dst)[i] = x;
        } else {
          if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
            throw DataLoss(str_cat(where, ": feature '", spec.key, "' value ", x,
                                   " does not fit int32; read it as DType::kInt64"));
          static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(x);
        }
      }
      break;
    }
    case FeatureSpec::Kind::kImage: {
      if (f.bytes_list().value_size() != 1)
        throw DataLoss(str_cat(where, ": image feature '", spec.key, "' holds ",
                               f.bytes_list().value_size(), " byte strings; it needs one"));
      image::decode_transformed(f.bytes_list().value(0), spec.transform, s.seed, epoch, row,
                                static_cast<float*>(dst),
                                str_cat(where, " feature '", spec.key, "'"));
      break;
    }
  }
}

}  // namespace

// ---- writer / reader ----

TFRecordWriter::TFRecordWriter(const std::string& path)
    : path_(path), tmp_(path + ".tmp." + std::to_string(::getpid())) {
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (file_ == nullptr)
    throw DataLoss(str_cat("TFRecordWriter: cannot create ", tmp_, ": ", std::strerror(errno)));
}

TFRecordWriter::~TFRecordWriter() {
  try {
    close();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw; close() reports
  }
}

void TFRecordWriter::write(std::string_view record) {
  if (file_ == nullptr) throw InvalidArgument(str_cat("TFRecordWriter: ", path_, " is closed"));
  auto* f = static_cast<FILE*>(file_);
  const std::string header = detail::record_header(record.size());
  const std::string footer = detail::record_footer(record);
  if (std::fwrite(header.data(), 1, header.size(), f) != header.size() ||
      std::fwrite(record.data(), 1, record.size(), f) != record.size() ||
      std::fwrite(footer.data(), 1, footer.size(), f) != footer.size())
    throw DataLoss(str_cat("TFRecordWriter: cannot write ", tmp_, ": ", std::strerror(errno)));
}

void TFRecordWriter::close() {
  if (file_ == nullptr) return;
  auto* f = static_cast<FILE*>(file_);
  file_ = nullptr;
  const bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  std::fclose(f);
  if (!ok || std::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw DataLoss(str_cat("TFRecordWriter: cannot finish ", path_, ": ", std::strerror(errno)));
}

std::vector<std::string> read_tfrecord_file(const std::string& path) {
  MappedFile f(path);
  const std::vector<RecordRef> refs = index_records(f, false);
  std::vector<std::string> out;
  for (size_t i = 0; i < refs.size(); ++i) {
    check_data(f, refs[i], i);
    out.emplace_back(reinterpret_cast<const char*>(f.data() + refs[i].offset), refs[i].length);
  }
  return out;
}

// ---- tf.train.Example ----

Feature Feature::of_bytes(std::vector<std::string> v) {
  Feature f;
  f.kind = Kind::kBytes;
  f.bytes = std::move(v);
  return f;
}
Feature Feature::of_floats(std::vector<float> v) {
  Feature f;
  f.kind = Kind::kFloat;
  f.floats = std::move(v);
  return f;
}
Feature Feature::of_ints(std::vector<int64_t> v) {
  Feature f;
  f.kind = Kind::kInt64;
  f.ints = std::move(v);
  return f;
}

std::string serialize_example(const Example& example) {
  proto::Example ex;
  auto* map = ex.mutable_features()->mutable_feature();
  for (const auto& [key, f] : example) {
    proto::Feature& pf = (*map)[key];
    switch (f.kind) {
      case Feature::Kind::kBytes:
        for (const std::string& b : f.bytes) pf.mutable_bytes_list()->add_value(b);
        if (f.bytes.empty()) pf.mutable_bytes_list();
        break;
      case Feature::Kind::kFloat:
        for (float v : f.floats) pf.mutable_float_list()->add_value(v);
        if (f.floats.empty()) pf.mutable_float_list();
        break;
      case Feature::Kind::kInt64:
        for (int64_t v : f.ints) pf.mutable_int64_list()->add_value(v);
        if (f.ints.empty()) pf.mutable_int64_list();
        break;
    }
  }
  std::string out;
  if (!ex.SerializeToString(&out)) throw Internal("serialize_example: protobuf failed");
  return out;
}

Example parse_example(std::string_view bytes) {
  proto::Example ex;
  if (!ex.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    throw DataLoss("parse_example: the bytes are not a tf.train.Example");
  Example out;
  for (const auto& [key, pf] : ex.features().feature()) {
    switch (pf.kind_case()) {
      case proto::Feature::kBytesList:
        out[key] =
            Feature::of_bytes({pf.bytes_list().value().begin(), pf.bytes_list().value().end()});
        break;
      case proto::Feature::kFloatList:
        out[key] =
            Feature::of_floats({pf.float_list().value().begin(), pf.float_list().value().end()});
        break;
      case proto::Feature::kInt64List:
        out[key] =
            Feature::of_ints({pf.int64_list().value().begin(), pf.int64_list().value().end()});
        break;
      default:
        out[key] = Feature{};
    }
  }
  return out;
}

// ---- the dataset ----

FeatureSpec FeatureSpec::float32(std::string key, Shape shape) {
  FeatureSpec s;
  s.key = std::move(key);
  s.kind = Kind::kFloat;
  s.shape = std::move(shape);
  s.dtype = DType::kFloat32;
  return s;
}
FeatureSpec FeatureSpec::int64(std::string key, Shape shape, DType dtype) {
  FeatureSpec s;
  s.key = std::move(key);
  s.kind = Kind::kInt64;
  s.shape = std::move(shape);
  s.dtype = dtype;
  return s;
}
FeatureSpec FeatureSpec::image(std::string key, const image::ImageTransform& transform) {
  FeatureSpec s;
  s.key = std::move(key);
  s.kind = Kind::kImage;
  s.transform = transform;
  s.shape = Shape{transform.height, transform.width, transform.channels};
  s.dtype = DType::kFloat32;
  return s;
}

Dataset TFRecordDataset(const std::vector<std::string>& files,
                        const std::vector<FeatureSpec>& features, const TFRecordOptions& options) {
  if (files.empty()) throw InvalidArgument("TFRecordDataset: no files");
  if (features.empty())
    throw InvalidArgument("TFRecordDataset: no features; give a FeatureSpec per component");
  if (options.cycle_length < 1 || options.block_length < 1)
    throw InvalidArgument(str_cat("TFRecordDataset: cycle_length and block_length must be >= 1, ",
                                  "got ", options.cycle_length, ", ", options.block_length));
  std::vector<Dataset::RowSpec> specs;
  bool random = false;
  for (const FeatureSpec& f : features) {
    const std::string what = str_cat("TFRecordDataset: feature '", f.key, "': ");
    if (f.kind == FeatureSpec::Kind::kImage) {
      // A record without the image is an error (or skipped, with ignore_errors): a default would
      // have to be a whole image, and was left unwritten.
      if (!f.default_value.empty())
        throw InvalidArgument(what +
                              "an image feature takes no default_value; records without it are "
                              "an error, or skipped with ignore_errors");
      f.transform.validate();
      random = random || f.transform.random();
      specs.push_back(
          {Shape{f.transform.height, f.transform.width, f.transform.channels}, DType::kFloat32});
      continue;
    }
    if (f.kind == FeatureSpec::Kind::kFloat && f.dtype != DType::kFloat32)
      throw InvalidArgument(what + "a float feature is read as float32");
    if (f.kind == FeatureSpec::Kind::kInt64 && f.dtype != DType::kInt32 && f.dtype != DType::kInt64)
      throw InvalidArgument(what + "an int64 feature is read as int32 or int64");
    if (!f.default_value.empty() && static_cast<int64_t>(f.default_value.size()) != 1 &&
        static_cast<int64_t>(f.default_value.size()) != f.shape.numel())
      throw InvalidArgument(what + "default_value needs 1 or shape.numel() values");
    specs.push_back({f.shape, f.dtype});
  }
  auto src = std::make_shared<Source>();
  src->specs = features;
  src->ignore_errors = options.ignore_errors;
  src->seed = options.seed;
  std::vector<size_t> counts;
  std::string fp;
  for (const std::string& path : files) {
    src->files.push_back(std::make_unique<MappedFile>(path));
    src->records.push_back(index_records(*src->files.back(), options.ignore_errors));
    counts.push_back(src->records.back().size());
    std::error_code ec;  // what the files hold: names, sizes and times
    const auto time = std::filesystem::last_write_time(path, ec);
    fp += str_cat(path, ":", src->files.back()->size(), ":",
                  ec ? 0 : static_cast<int64_t>(time.time_since_epoch().count()), ";");
  }
  // How they are read: each feature, the order across files, the seed.
  for (const FeatureSpec& f : features) {
    fp += str_cat("feature ", f.key, " ", static_cast<int>(f.kind), " ", dtype_name(f.dtype),
                  f.shape.to_string());
    for (double d : f.default_value) fp += str_cat(" default ", d);
    if (f.kind == FeatureSpec::Kind::kImage) fp += " " + f.transform.to_string();
    fp += ";";
  }
  fp += str_cat("cycle ", options.cycle_length, " block ", options.block_length, " seed ",
                options.seed);
  // More open files than there are files is the same order (tf.data's too): a huge cycle_length
  // allocates and walks no empty slots.
  src->rows =
      interleave_order(counts, std::min(static_cast<size_t>(options.cycle_length), files.size()),
                       static_cast<size_t>(options.block_length));
  Dataset::ReaderOptions ro;
  ro.num_parallel_calls = options.num_parallel_calls;
  ro.epoch_dependent = random;
  ro.name = "TFRecordDataset";
  ro.fingerprint = str_cat(std::hash<std::string>{}(fp), " ", files.size(), " files");  // 64 bits
  return Dataset::from_reader(
      static_cast<int64_t>(src->rows.size()), std::move(specs),
      [src](int64_t row, uint64_t epoch, void* const* dst) {
        const auto [file, record] = src->rows[static_cast<size_t>(row)];
        const MappedFile& f = *src->files[file];
        const RecordRef& r = src->records[file][record];
        const std::string where = str_cat(f.path(), ": record ", record);
        try {
          check_data(f, r, record);
          proto::Example ex;
          if (r.length > static_cast<uint64_t>(std::numeric_limits<int>::max()))
            throw DataLoss(str_cat(where, ": ", r.length,
                                   " bytes, more than a tf.train.Example can hold (2 GiB)"));
          if (!ex.ParseFromArray(f.data() + r.offset, static_cast<int>(r.length)))
            throw DataLoss(where + ": not a tf.train.Example");
          for (size_t c = 0; c < src->specs.size(); ++c)
            write_feature(*src, src->specs[c], ex, row, epoch, dst[c], where);
        } catch (const Error& e) {
          if (!src->ignore_errors) throw;
          DTRAIN_LOG(WARNING) << "TFRecordDataset: skipped " << e.what();
          return false;
        }
        return true;
      },
      ro);
}

}  // namespace dtrain::data
