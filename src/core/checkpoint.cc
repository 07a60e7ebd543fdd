// Safetensors files (CheckpointManager: checkpoint_manager.cc). nlohmann/json's exceptions are
// caught where it is called and rethrown as dtrain errors.
//
// Loading never trusts the header: every size is checked against the file size before anything
// is allocated, and the entries must tile the data section exactly (the same rule as the Rust
// reference implementation), so a corrupt file is reported, not half-loaded.
#include "dtrain/core/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "core/checkpoint_files.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

using detail::Fd;
using detail::Piece;
using detail::printable;
using detail::write_atomically;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this host needs byte swapping added");

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int kMaxJsonDepth = 16;  // a safetensors header nests 3 deep

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypes[] = {{DType::kFloat32, "F32"}, {DType::kFloat64, "F64"},
                                 {DType::kFloat16, "F16"}, {DType::kBFloat16, "BF16"},
                                 {DType::kInt32, "I32"},   {DType::kInt64, "I64"}};
// Valid in the safetensors spec but not a dtrain DType.
constexpr const char* kOtherSpecDTypes[] = {"BOOL", "U8",      "I8",      "U16",     "I16",
                                            "U32",  "U64",     "F8_E4M3", "F8_E5M2", "F8_E8M0",
                                            "F4",   "F6_E2M3", "F6_E3M2", "C64"};

const char* safetensors_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.dtype == t) return d.name;
  throw Internal(std::string("no safetensors name for dtype ") + dtype_name(t));
}

[[noreturn]] void throw_io(const std::string& what, const std::string& path, int err) {
  throw Unavailable(detail::str_cat(what, " ", path, ": ", std::strerror(err)));
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_io("cannot write", path, errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Reads exactly n bytes at `offset`; a short file is DataLoss (it shrank after we checked its
// size).
void pread_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r =
        ::pread(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_io("cannot read", path, errno);
    }
    if (r == 0)
      throw DataLoss(detail::str_cat(path, ": truncated: end of file at byte ", offset, " while ",
                                     n, " more bytes were expected"));
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

std::string parent_dir(const std::string& path) {
  const std::string parent = fs::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// Makes a rename in `dir` durable.
void fsync_dir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) throw_io("cannot open directory", dir, errno);
  if (::fsync(fd.get()) != 0 && errno != EINVAL) throw_io("cannot fsync directory", dir, errno);
}

bool is_valid_utf8(const std::string& s) {
  try {
    (void)ojson(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

}  // namespace

namespace detail {

void write_atomically(const std::string& path, const std::vector<Piece>& pieces) {
  static std::atomic<uint64_t> seq{0};
  const std::string tmp = detail::str_cat(path, ".tmp.", ::getpid(), ".", seq.fetch_add(1));
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_io("cannot create", tmp, errno);
  try {
    for (const Piece& piece : pieces) {
      if (piece.streamed) {
        const CheckpointData::Streamed& st = *piece.streamed;
        Tensor t = st.produce();
        if (!t.defined() || t.dtype() != st.dtype || t.shape() != st.shape)
          throw Internal(detail::str_cat("checkpoint tensor '", st.name, "' was declared ",
                                         dtype_name(st.dtype), " ", st.shape.to_string(),
                                         " but produced ", t.to_string()));
        if (!t.device().host_accessible()) t = t.to(DeviceSpec::cpu());
        if (t.nbytes() > 0) write_all(fd.get(), t.raw_data(), t.nbytes(), tmp);
        continue;
      }
      if (piece.size > 0) write_all(fd.get(), piece.data, piece.size, tmp);
    }
    if (::fsync(fd.get()) != 0) throw_io("cannot fsync", tmp, errno);
    if (const int err = fd.close(); err != 0) throw_io("cannot close", tmp, err);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw_io("cannot rename " + tmp + " to", path, errno);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(parent_dir(path));
}

}  // namespace detail

const Tensor* CheckpointData::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

void CheckpointData::materialize() {
  for (const Streamed& s : streamed) tensors.emplace_back(s.name, s.produce());
  streamed.clear();
}

void save_safetensors(const std::string& path, const CheckpointData& data) {
  const std::string where = "save_safetensors(" + path + "): ";
  std::set<std::string> seen;
  std::vector<Tensor> host;
  host.reserve(data.tensors.size());
  ojson header = ojson::object();
  uint64_t offset = 0;
  // One header entry: the name checked, the bytes placed after the previous entry's.
  auto add_entry = [&](const std::string& name, DType dtype, const Shape& shape) {
    if (name.empty()) throw InvalidArgument(where + "a tensor has an empty name");
    if (name.rfind("__", 0) == 0)
      throw InvalidArgument(where + "tensor name '" + printable(name) +
                            "' starts with \"__\", which safetensors reserves; rename it");
    if (!seen.insert(name).second)
      throw InvalidArgument(where + "duplicate tensor name '" + printable(name) + "'");
    if (!is_valid_utf8(name))
      throw InvalidArgument(where + "tensor name '" + printable(name) + "' is not valid UTF-8");
    const uint64_t end = offset + static_cast<uint64_t>(shape.numel()) * dtype_size(dtype);
    ojson entry = ojson::object();
    entry["dtype"] = safetensors_name(dtype);
    entry["shape"] = shape.dims();
    entry["data_offsets"] = ojson::array({offset, end});
    header[name] = std::move(entry);
    offset = end;
  };
  for (const auto& [name, t] : data.tensors) {
    if (!t.defined())
      throw InvalidArgument(where + "tensor '" + name + "' is undefined (default-constructed)");
    add_entry(name, t.dtype(), t.shape());
    host.push_back(t.device().host_accessible() ? t : t.to(DeviceSpec::cpu()));
  }
  for (const CheckpointData::Streamed& st : data.streamed) {
    if (!st.produce)
      throw InvalidArgument(where + "streamed tensor '" + st.name + "' has no producer");
    add_entry(st.name, st.dtype, st.shape);
  }
  if (!data.metadata.empty()) {
    ojson meta = ojson::object();
    for (const auto& [k, v] : data.metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(where + "metadata is not valid UTF-8 (" + printable(e.what()) + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i)
    prefix[i] = static_cast<unsigned char>(uint64_t{text.size()} >> (8 * i));

  std::vector<Piece> pieces{{prefix, 8}, {text.data(), text.size()}};
  for (const Tensor& t : host) pieces.push_back({t.raw_data(), t.nbytes()});
  for (const CheckpointData::Streamed& st : data.streamed) pieces.push_back({nullptr, 0, &st});
  write_atomically(path, pieces);
}

namespace {

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> dims;
  uint64_t begin, end;
};

DType parse_dtype(const std::string& where, const std::string& name, const ojson& v) {
  if (!v.is_string()) throw DataLoss(where + "tensor '" + name + "' has a non-string dtype");
  const auto& s = v.get_ref<const std::string&>();
  for (const auto& d : kDTypes)
    if (s == d.name) return d.dtype;
  for (const char* other : kOtherSpecDTypes)
    if (s == other)
      throw Unimplemented(where + "tensor '" + name + "' has dtype " + s +
                          ", which dtrain cannot hold (supported: F32, F64, F16, BF16, I32, I64)");
  throw DataLoss(where + "tensor '" + name + "' has unknown dtype '" + printable(s, 40) + "'");
}

uint64_t as_u64(const std::string& what, const ojson& v) {
  if (!v.is_number_unsigned()) throw DataLoss(what + " is not a non-negative integer");
  return v.get<uint64_t>();
}

Entry parse_entry(const std::string& where, const std::string& name, const ojson& v) {
  const std::string tn = "tensor '" + printable(name) + "'";
  if (!v.is_object()) throw DataLoss(where + tn + " is not a JSON object");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) throw DataLoss(where + tn + " has no \"" + key + "\"");
  Entry e;
  e.name = name;
  e.dtype = parse_dtype(where, printable(name), v["dtype"]);
  const ojson& shape = v["shape"];
  if (!shape.is_array()) throw DataLoss(where + tn + " has a shape that is not an array");
  uint64_t numel = 1;
  bool overflow = false;
  for (const ojson& d : shape) {
    const uint64_t dim = as_u64(where + tn + " shape entry", d);
    if (dim > static_cast<uint64_t>(INT64_MAX))
      throw DataLoss(where + tn + " has a dimension over 2^63");
    overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    e.dims.push_back(static_cast<int64_t>(dim));
  }
  const ojson& offs = v["data_offsets"];
  if (!offs.is_array() || offs.size() != 2)
    throw DataLoss(where + tn + " data_offsets is not an array [begin, end]");
  e.begin = as_u64(where + tn + " data_offsets[0]", offs[0]);
  e.end = as_u64(where + tn + " data_offsets[1]", offs[1]);
  if (e.end < e.begin)
    throw DataLoss(
        detail::str_cat(where, tn, " data_offsets [", e.begin, ", ", e.end, "] end before begin"));
  uint64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, uint64_t{dtype_size(e.dtype)}, &bytes);
  if (overflow || bytes != e.end - e.begin)
    throw DataLoss(detail::str_cat(
        where, tn, ": shape ", Shape(e.dims).to_string(), " of ", v["dtype"].get<std::string>(),
        " needs ", overflow ? std::string("over 2^64") : std::to_string(bytes),
        " bytes but data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin));
  return e;
}

// Parses and checks the header of a file whose data section holds `data_size` bytes.
std::vector<Entry> parse_header(const std::string& where, const std::string& text,
                                uint64_t data_size, std::map<std::string, std::string>* metadata) {
  if (text.empty() || text[0] != '{') throw DataLoss(where + "header does not start with '{'");
  // nlohmann stops at a NUL byte as if the input ended there; the format has none.
  if (text.find('\0') != std::string::npos) throw DataLoss(where + "header contains a NUL byte");
  ojson h;
  try {
    h = ojson::parse(text, [&](int depth, ojson::parse_event_t, ojson&) {
      if (depth > kMaxJsonDepth) throw DataLoss(where + "header JSON is nested too deeply");
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    throw DataLoss(where + "header is not valid JSON: " + printable(e.what()));
  }
  if (!h.is_object()) throw DataLoss(where + "header is not a JSON object");
  std::vector<Entry> entries;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() != "__metadata__") {
      entries.push_back(parse_entry(where, it.key(), it.value()));
      continue;
    }
    if (!it->is_object()) throw DataLoss(where + "__metadata__ is not a JSON object");
    for (auto m = it->begin(); m != it->end(); ++m) {
      if (!m->is_string())
        throw DataLoss(where + "__metadata__ value of '" + printable(m.key()) +
                       "' is not a string");
      (*metadata)[m.key()] = m->get<std::string>();
    }
  }
  // File order; an empty tensor sorts before a non-empty one at the same offset.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (e.begin < cursor)
      throw DataLoss(detail::str_cat(where, "tensor '", printable(e.name), "' data_offsets [",
                                     e.begin, ", ", e.end, "] overlap tensor '",
                                     printable(entries[i - 1].name), "' which ends at ", cursor));
    if (e.begin > cursor)
      throw DataLoss(detail::str_cat(where, "data bytes [", cursor, ", ", e.begin,
                                     ") belong to no tensor (gap before '", printable(e.name),
                                     "')"));
    cursor = e.end;
  }
  if (cursor > data_size)
    throw DataLoss(detail::str_cat(where, "truncated: header says ", cursor,
                                   " bytes of data, file has ", data_size));
  if (cursor < data_size)
    throw DataLoss(detail::str_cat(where, "header says ", cursor, " bytes of data, file has ",
                                   data_size, ": ", data_size - cursor,
                                   " trailing bytes belong to no tensor"));
  return entries;
}

}  // namespace

namespace {
std::string source_of(const std::string& path, const struct stat& st) {
  return detail::str_cat(path, "@", st.st_dev, ":", st.st_ino, ":", st.st_mtim.tv_sec, ".",
                         st.st_mtim.tv_nsec, ":", st.st_size);
}
}  // namespace

std::string file_source(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return source_of(path, st);
}

CheckpointData load_safetensors(const std::string& path) {
  const std::string where = "safetensors file " + path + ": ";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) throw NotFound("checkpoint file " + path + " does not exist");
    throw_io("cannot open checkpoint file", path, err);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_io("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) throw Unavailable(where + "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8)
    throw DataLoss(detail::str_cat(where, "truncated: file has ", file_size,
                                   " bytes, fewer than the 8-byte header length"));
  unsigned char prefix[8];
  pread_all(fd.get(), prefix, 8, 0, path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{prefix[i]} << (8 * i);
  if (n > kMaxHeaderBytes)
    throw DataLoss(detail::str_cat(where, "header length ", n, " exceeds the ", kMaxHeaderBytes,
                                   "-byte limit (corrupt length prefix?)"));
  if (n > file_size - 8)
    throw DataLoss(detail::str_cat(where, "truncated: header length says ", n, " bytes, file has ",
                                   file_size - 8, " after the length prefix"));
  if (n < 2) throw DataLoss(detail::str_cat(where, "header length ", n, " is too small for JSON"));
  std::string text(n, '\0');
  pread_all(fd.get(), text.data(), n, 8, path);

  CheckpointData out;
  out.source = source_of(path, st);
  const std::vector<Entry> entries = parse_header(where, text, file_size - 8 - n, &out.metadata);
  out.tensors.reserve(entries.size());
  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(Shape(e.dims), e.dtype);
    pread_all(fd.get(), t.raw_data(), e.end - e.begin, 8 + n + e.begin, path);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace dtrain
