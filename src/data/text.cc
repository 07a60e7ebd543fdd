#include "dtrain/data/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dtrain/core/random.h"
#include "dtrain/core/strings.h"

namespace dtrain::text {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= kVocabSize)
      throw InvalidArgument("ByteTokenizer::decode: id " + std::to_string(ids[i]) +
                            " at position " + std::to_string(i) + " is not a byte (0-255)");
    s[i] = static_cast<char>(ids[i]);
  }
  return s;
}

void write_token_file(const std::string& path, const std::vector<int32_t>& tokens,
                      int token_bytes) {
  if (token_bytes != 1 && token_bytes != 2)
    throw InvalidArgument("write_token_file: token_bytes must be 1 or 2, got " +
                          std::to_string(token_bytes));
  const int32_t limit = token_bytes == 1 ? 256 : 65536;
  std::vector<unsigned char> bytes(tokens.size() * static_cast<size_t>(token_bytes));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= limit)
      throw InvalidArgument("write_token_file: token " + std::to_string(tokens[i]) +
                            " at position " + std::to_string(i) + " does not fit " +
                            std::to_string(token_bytes) + " byte(s)");
    bytes[i * static_cast<size_t>(token_bytes)] = static_cast<unsigned char>(tokens[i] & 0xff);
    if (token_bytes == 2) bytes[2 * i + 1] = static_cast<unsigned char>(tokens[i] >> 8);
  }
  // Written beside the target and renamed: a reader never maps a half-written file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.close();  // a full disk may show only when the last bytes are flushed
    if (out.fail()) {
      std::remove(tmp.c_str());
      throw DataLoss("write_token_file: could not write " + tmp);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw DataLoss("write_token_file: could not rename " + tmp + " to " + path + ": " +
                   std::strerror(errno));
}

TokenFile::TokenFile(const std::string& path, int token_bytes)
    : path_(path), token_bytes_(token_bytes) {
  if (token_bytes != 1 && token_bytes != 2)
    throw InvalidArgument("TokenFile: token_bytes must be 1 or 2, got " +
                          std::to_string(token_bytes));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw NotFound("TokenFile: cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw DataLoss("TokenFile: cannot stat " + path);
  }
  bytes_ = static_cast<size_t>(st.st_size);
  if (bytes_ % static_cast<size_t>(token_bytes) != 0) {
    ::close(fd);
    throw DataLoss("TokenFile: " + path + " has " + std::to_string(bytes_) +
                   " bytes, not a multiple of " + std::to_string(token_bytes) +
                   " (a truncated file, or another token width)");
  }
  size_ = static_cast<int64_t>(bytes_ / static_cast<size_t>(token_bytes));
  if (bytes_ > 0) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw DataLoss("TokenFile: cannot map " + path + ": " + std::strerror(errno));
    }
    data_ = static_cast<const unsigned char*>(p);
  }
  ::close(fd);  // the mapping stays valid
}

TokenFile::~TokenFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), bytes_);
}

void TokenFile::read(int64_t begin, int64_t count, int32_t* out) const {
  if (begin < 0 || count < 0 || begin + count > size_)
    throw InvalidArgument("TokenFile::read: [" + std::to_string(begin) + ", " +
                          std::to_string(begin + count) + ") is outside the " +
                          std::to_string(size_) + " tokens of " + path_);
  if (token_bytes_ == 1)
    for (int64_t i = 0; i < count; ++i) out[i] = data_[begin + i];
  else
    for (int64_t i = 0; i < count; ++i) out[i] = (*this)[begin + i];
}

Dataset token_windows(std::shared_ptr<const TokenFile> file, const TokenWindowOptions& o) {
  if (!file) throw InvalidArgument("token_windows: no token file");
  const int64_t t = o.sequence_length;
  const int64_t end = o.end < 0 ? file->size() : o.end;
  if (t < 1 || o.begin < 0 || end > file->size() || o.windows < 0)
    throw InvalidArgument(
        "token_windows: sequence_length must be >= 1 and [begin, end) inside the " +
        std::to_string(file->size()) + " tokens of " + file->path() + "; got T " +
        std::to_string(t) + ", [" + std::to_string(o.begin) + ", " + std::to_string(end) + ")");
  const int64_t span = end - o.begin;
  if (span < t + 1)
    throw InvalidArgument("token_windows: [" + std::to_string(o.begin) + ", " +
                          std::to_string(end) + ") of " + file->path() + " holds " +
                          std::to_string(span) + " tokens; a window needs " +
                          std::to_string(t + 1));
  const int64_t starts = span - t;  // every start whose window (T + 1 tokens) fits
  const int64_t rows = o.windows > 0 ? o.windows : (span - 1) / t;
  if (!o.random && rows > (span - 1) / t)
    throw InvalidArgument("token_windows: " + std::to_string(rows) +
                          " consecutive windows do not fit " + std::to_string(span) + " tokens");
  const Philox rng(o.seed, 0x746f6b656e73ULL);  // "tokens"
  const bool random = o.random;
  const int64_t begin = o.begin;
  auto start_of = [rng, random, begin, starts, t](int64_t row) -> int64_t {
    if (!random) return begin + row * t;
    const auto b = rng.block(static_cast<uint64_t>(row));
    const uint64_t r = (static_cast<uint64_t>(b[0]) << 32) | b[1];
    return begin + static_cast<int64_t>(r % static_cast<uint64_t>(starts));
  };
  // What identifies the rows (a cache file of other windows is refused): the file (name, size,
  // time) and the windows' options.
  std::error_code ec;
  const auto time = std::filesystem::last_write_time(file->path(), ec);
  Dataset::ReaderOptions ro;
  ro.name = "token_windows";
  ro.fingerprint = detail::str_cat(
      file->path(), " ", file->size(), " tokens ",
      ec ? 0 : static_cast<int64_t>(time.time_since_epoch().count()), " T ", t, " [", begin, ", ",
      end, ") ", random ? "random seed " : "consecutive ", random ? o.seed : 0, " windows ", rows);
  return Dataset::from_reader(
      rows, {{Shape{t}, DType::kInt32}, {Shape{t}, DType::kInt32}},
      [file, start_of, t](int64_t row, uint64_t, void* const* dst) {
        const int64_t start = start_of(row);
        for (int64_t c = 0; c < 2; ++c) file->read(start + c, t, static_cast<int32_t*>(dst[c]));
        return true;
      },
      ro);
}

}  // namespace dtrain::text
