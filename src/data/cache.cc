// Dataset::cache(): a source whose reader keeps every row it reads, in memory or in a file, and
// serves later reads of that row from there (tf.data's cache()). A row's state (empty, being
// written, kept, skipped) is one byte; the bytes of a row are written before its state says
// "kept", so a reader never sees a half-written row and a killed run leaves a valid partial cache.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>

#include "data/dataset_node.h"
#include "dtrain/data/dataset.h"

namespace dtrain {
namespace detail {

namespace {

enum : uint8_t { kEmpty = 0, kKept = 1, kSkipped = 2, kWriting = 3 };

// Where kept rows live.
class Store {
 public:
  virtual ~Store() = default;
  virtual void load(int64_t row, void* const* dst) = 0;
  virtual void save(int64_t row, void* const* src) = 0;
  // The state another process (file) or an earlier pass left; kEmpty if none.
  virtual uint8_t persisted_state(int64_t row) = 0;
  virtual void persist_state(int64_t row, uint8_t state) = 0;
};

class MemoryStore final : public Store {
 public:
  MemoryStore(int64_t n, const std::vector<size_t>& row_bytes) : row_bytes_(row_bytes) {
    for (size_t rb : row_bytes)  // not touched until written: untouched pages cost nothing
      data_.emplace_back(new char[static_cast<size_t>(n) * rb]);
  }
  void load(int64_t row, void* const* dst) override {
    for (size_t c = 0; c < data_.size(); ++c)
      std::memcpy(dst[c], data_[c].get() + static_cast<size_t>(row) * row_bytes_[c], row_bytes_[c]);
  }
  void save(int64_t row, void* const* src) override {
    for (size_t c = 0; c < data_.size(); ++c)
      std::memcpy(data_[c].get() + static_cast<size_t>(row) * row_bytes_[c], src[c], row_bytes_[c]);
  }
  uint8_t persisted_state(int64_t) override { return kEmpty; }
  void persist_state(int64_t, uint8_t) override {}

 private:
  std::vector<size_t> row_bytes_;
  std::vector<std::unique_ptr<char[]>> data_;
};

constexpr char kMagic[16] = "DTRAIN-CACHE-1";
constexpr size_t kHeaderBytes = 4096;

// Layout: a 4096-byte header (magic, the pipeline's signature), then each component's rows, then
// one state byte per row.
class FileStore final : public Store {
 public:
  FileStore(const std::string& path, int64_t n, const std::vector<size_t>& row_bytes,
            const std::string& signature)
      : path_(path), n_(n), row_bytes_(row_bytes) {
    uint64_t offset = kHeaderBytes;
    for (size_t rb : row_bytes) {
      offsets_.push_back(offset);
      offset += static_cast<uint64_t>(n) * rb;
    }
    states_at_ = offset;
    const uint64_t size = offset + static_cast<uint64_t>(n);
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw InvalidArgument(
          str_cat("Dataset::cache: cannot open the cache file ", path, ": ", std::strerror(errno)));
    ::flock(fd_, LOCK_EX);  // one process lays the file out; the others then check it
    try {
      struct stat st {};
      ::fstat(fd_, &st);
      std::string header(kHeaderBytes, '\0');
      std::memcpy(header.data(), kMagic, sizeof(kMagic));
      if (signature.size() > kHeaderBytes - 32)
        throw InvalidArgument("Dataset::cache: the pipeline's signature is too long");
      const uint64_t sig_len = signature.size();
      std::memcpy(header.data() + 16, &sig_len, 8);
      std::memcpy(header.data() + 24, signature.data(), signature.size());
      if (st.st_size == 0) {
        if (::ftruncate(fd_, static_cast<off_t>(size)) != 0 ||
            ::pwrite(fd_, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size()))
          throw DataLoss(str_cat("Dataset::cache: cannot write the cache file ", path, ": ",
                                 std::strerror(errno)));
      } else {
        std::string have(kHeaderBytes, '\0');
        if (::pread(fd_, have.data(), have.size(), 0) != static_cast<ssize_t>(have.size()) ||
            std::memcmp(have.data(), kMagic, sizeof(kMagic)) != 0)
          throw DataLoss(str_cat("Dataset::cache: ", path,
                                 " is not a dtrain cache file (or its header is damaged); "
                                 "delete it and the next run writes it again"));
        if (have != header) {
          uint64_t len = 0;
          std::memcpy(&len, have.data() + 16, 8);
          throw InvalidArgument(
              str_cat("Dataset::cache: ", path, " was written for another pipeline (",
                      have.substr(24, std::min<uint64_t>(len, kHeaderBytes - 24)), "), not for ",
                      signature, "; give each pipeline its own cache file, or delete this one"));
        }
        if (static_cast<uint64_t>(st.st_size) != size)
          throw DataLoss(str_cat("Dataset::cache: ", path, " is ", st.st_size,
                                 " bytes where this pipeline's cache is ", size,
                                 " (truncated?); delete it and the next run writes it again"));
      }
    } catch (...) {
      ::flock(fd_, LOCK_UN);
      ::close(fd_);
      throw;
    }
    ::flock(fd_, LOCK_UN);
  }
  ~FileStore() override { ::close(fd_); }

  void load(int64_t row, void* const* dst) override {
    for (size_t c = 0; c < row_bytes_.size(); ++c) io(false, dst[c], c, row);
  }
  void save(int64_t row, void* const* src) override {
    for (size_t c = 0; c < row_bytes_.size(); ++c) io(true, src[c], c, row);
  }
  uint8_t persisted_state(int64_t row) override {
    uint8_t s = kEmpty;
    if (::pread(fd_, &s, 1, static_cast<off_t>(states_at_ + static_cast<uint64_t>(row))) != 1)
      throw DataLoss(str_cat("Dataset::cache: cannot read ", path_, ": ", std::strerror(errno)));
    return s == kKept || s == kSkipped ? s : static_cast<uint8_t>(kEmpty);
  }
  void persist_state(int64_t row, uint8_t state) override {
    if (::pwrite(fd_, &state, 1, static_cast<off_t>(states_at_ + static_cast<uint64_t>(row))) != 1)
      throw DataLoss(str_cat("Dataset::cache: cannot write ", path_, ": ", std::strerror(errno)));
  }

 private:
  void io(bool write, void* p, size_t c, int64_t row) {
    const size_t rb = row_bytes_[c];
    const auto at = static_cast<off_t>(offsets_[c] + static_cast<uint64_t>(row) * rb);
    const ssize_t got = write ? ::pwrite(fd_, p, rb, at) : ::pread(fd_, p, rb, at);
    if (got != static_cast<ssize_t>(rb))
      throw DataLoss(str_cat("Dataset::cache: cannot ", write ? "write" : "read", " row ", row,
                             " of ", path_, ": ", got < 0 ? std::strerror(errno) : "short"));
  }
  std::string path_;
  int64_t n_;
  std::vector<size_t> row_bytes_;
  std::vector<uint64_t> offsets_;
  uint64_t states_at_ = 0;
  int fd_ = -1;
};

// The row states in this process, over a store.
class RowCache {
 public:
  RowCache(int64_t n, std::unique_ptr<Store> store)
      : states_(new std::atomic<uint8_t>[static_cast<size_t>(n)]), store_(std::move(store)) {
    for (int64_t i = 0; i < n; ++i) states_[i].store(kEmpty, std::memory_order_relaxed);
  }
  // Serves a kept row, or reads it through `read` and keeps it.
  bool read(const std::function<bool(int64_t, uint64_t, void* const*)>& read, int64_t row,
            uint64_t epoch, void* const* dst) {
    std::atomic<uint8_t>& s = states_[row];
    uint8_t state = s.load(std::memory_order_acquire);
    if (state == kEmpty) {  // a file may hold it from an earlier run or another process
      const uint8_t on_disk = store_->persisted_state(row);
      if (on_disk != kEmpty) {
        uint8_t expected = kEmpty;
        s.compare_exchange_strong(expected, on_disk, std::memory_order_acq_rel);
        state = s.load(std::memory_order_acquire);
      }
    }
    if (state == kKept) {
      store_->load(row, dst);
      return true;
    }
    if (state == kSkipped) return false;
    const bool ok = read(row, epoch, dst);
    uint8_t expected = kEmpty;
    if (s.compare_exchange_strong(expected, kWriting, std::memory_order_acq_rel)) {
      if (ok) store_->save(row, dst);
      store_->persist_state(row, ok ? kKept : kSkipped);
      s.store(ok ? kKept : kSkipped, std::memory_order_release);
    }  // else another thread is keeping it: this read served this call only
    return ok;
  }

 private:
  std::unique_ptr<std::atomic<uint8_t>[]> states_;
  std::unique_ptr<Store> store_;
};

}  // namespace
}  // namespace detail

Dataset Dataset::cache(const std::string& filename) const {
  using detail::str_cat;
  const auto& node = detail::DatasetAccess::node(*this);
  if (!node->is_source())
    throw InvalidArgument(str_cat("Dataset::cache() on ", node->description(),
                                  ": cache() wraps a source; call it first (cache() then "
                                  "shuffle()/shard()/batch())"));
  const std::shared_ptr<const detail::DatasetSource>& src = node->source();
  if (!src->read) return *this;  // from_tensors: already in memory
  if (src->epoch_dependent)
    throw InvalidArgument(
        str_cat("Dataset::cache() on ", node->description(),
                ": its reader's rows change with the epoch (random augmentation), so a cache would "
                "repeat the first epoch's draws; cache the deterministic part (decode, resize) and "
                "augment after it"));
  if (!filename.empty() && src->fingerprint.empty())
    throw InvalidArgument(str_cat(
        "Dataset::cache(\"", filename, "\") on ", node->description(),
        ": its reader gives no fingerprint (Dataset::ReaderOptions::fingerprint: the files, sizes "
        "and "
        "times, the decoding options), so a cache file of other data would be taken for this one; "
        "give it one, or cache() in memory"));
  std::string signature = str_cat(node->description(), " fingerprint=", src->fingerprint);
  for (size_t c = 0; c < src->tensors.size(); ++c)
    signature += str_cat(" ", dtype_name(src->tensors[c].dtype()), src->tensors[c].to_string());
  std::unique_ptr<detail::Store> store;
  if (filename.empty()) {
    try {
      store = std::make_unique<detail::MemoryStore>(src->n, src->row_bytes);
    } catch (const std::bad_alloc&) {
      size_t bytes = 0;
      for (size_t rb : src->row_bytes) bytes += rb;
      throw InvalidArgument(str_cat("Dataset::cache() on ", node->description(), ": ", src->n,
                                    " rows of ", bytes, " bytes do not fit in memory; give ",
                                    "cache() a file name"));
    }
  } else {
    store = std::make_unique<detail::FileStore>(filename, src->n, src->row_bytes, signature);
  }
  auto cache = std::make_shared<detail::RowCache>(src->n, std::move(store));
  auto wrapped = std::make_shared<detail::DatasetSource>(*src);
  wrapped->read = [cache, read = src->read](int64_t row, uint64_t epoch, void* const* dst) {
    return cache->read(read, row, epoch, dst);
  };
  wrapped->suffix = filename.empty() ? ".cache()" : str_cat(".cache(\"", filename, "\")");
  return detail::DatasetAccess::make(detail::make_source_node(std::move(wrapped)));
}

}  // namespace dtrain
