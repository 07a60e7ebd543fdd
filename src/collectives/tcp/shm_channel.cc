#include "collectives/tcp/shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <string>

#include "dtrain/core/error.h"

namespace dtrain::tcp {
namespace {

constexpr size_t kControlBytes = 256;

size_t segment_bytes() { return kControlBytes + ShmChannel::kCapacity; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  // Not FUTEX_PRIVATE: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

}  // namespace

ShmChannel ShmChannel::create(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw Unavailable("shm_open(" + name + ") failed: " + std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(segment_bytes())) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw Unavailable("sizing shared memory " + name + " failed: " + std::strerror(err));
  }
  void* p =
      ::mmap(nullptr, segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    throw Unavailable("mapping shared memory " + name + " failed: " + std::strerror(errno));
  }
  ShmChannel c;
  c.ctl_ = new (p) Control();
  c.data_ = static_cast<char*>(p) + kControlBytes;
  c.mapped_ = segment_bytes();
  return c;
}

ShmChannel ShmChannel::open(const std::string& name) {
  ShmChannel c;
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return c;  // another host, or another /dev/shm: the caller falls back to TCP
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != segment_bytes()) {
    ::close(fd);
    return c;
  }
  void* p =
      ::mmap(nullptr, segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return c;
  c.ctl_ = static_cast<Control*>(p);
  c.data_ = static_cast<char*>(p) + kControlBytes;
  c.mapped_ = segment_bytes();
  return c;
}

void ShmChannel::unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

ShmChannel::ShmChannel(ShmChannel&& o) noexcept : ctl_(o.ctl_), data_(o.data_), mapped_(o.mapped_) {
  o.ctl_ = nullptr;
  o.data_ = nullptr;
  o.mapped_ = 0;
}

ShmChannel& ShmChannel::operator=(ShmChannel&& o) noexcept {
  if (this != &o) {
    if (ctl_) ::munmap(ctl_, mapped_);
    ctl_ = o.ctl_;
    data_ = o.data_;
    mapped_ = o.mapped_;
    o.ctl_ = nullptr;
    o.data_ = nullptr;
    o.mapped_ = 0;
  }
  return *this;
}

ShmChannel::~ShmChannel() {
  if (ctl_) ::munmap(ctl_, mapped_);
}

void ShmChannel::copy_in(uint64_t pos, const void* src, size_t n) {
  const size_t at = static_cast<size_t>(pos % kCapacity), first = std::min(n, kCapacity - at);
  std::memcpy(data_ + at, src, first);
  if (first < n) std::memcpy(data_, static_cast<const char*>(src) + first, n - first);
}

void ShmChannel::copy_out(uint64_t pos, void* dst, size_t n) const {
  const size_t at = static_cast<size_t>(pos % kCapacity), first = std::min(n, kCapacity - at);
  std::memcpy(dst, data_ + at, first);
  if (first < n) std::memcpy(static_cast<char*>(dst) + first, data_, n - first);
}

void ShmChannel::ring() {
  ctl_->bell.fetch_add(1, std::memory_order_seq_cst);
  if (ctl_->sleepers.load(std::memory_order_seq_cst) != 0)
    futex(&ctl_->bell, FUTEX_WAKE, INT32_MAX, nullptr);
}

bool ShmChannel::try_send(const FrameHeader& h, const void* payload, size_t n) {
  const size_t need = frame_bytes(n);
  const uint64_t head = ctl_->head.load(std::memory_order_relaxed);  // only this side writes it
  if (kCapacity - (head - ctl_->tail.load(std::memory_order_acquire)) < need) return false;
  copy_in(head, &h, sizeof(h));
  if (n) copy_in(head + sizeof(h), payload, n);
  ctl_->head.store(head + need, std::memory_order_release);
  ring();
  return true;
}

bool ShmChannel::peek(FrameHeader* h) const {
  const uint64_t tail = ctl_->tail.load(std::memory_order_relaxed);  // only this side writes it
  if (ctl_->head.load(std::memory_order_acquire) - tail < sizeof(FrameHeader)) return false;
  copy_out(tail, h, sizeof(*h));  // frames are published whole, so the payload is there too
  return true;
}

uint64_t ShmChannel::pending() const {
  return ctl_->head.load(std::memory_order_acquire) - ctl_->tail.load(std::memory_order_relaxed);
}

void ShmChannel::consume(const FrameHeader& h, void* dst) {
  const uint64_t tail = ctl_->tail.load(std::memory_order_relaxed);
  const uint64_t published = ctl_->head.load(std::memory_order_acquire) - tail;
  if (h.payload_bytes > kCapacity || frame_bytes(static_cast<size_t>(h.payload_bytes)) > published)
    throw DataLoss(
        "shared-memory frame " + describe(h) + " claims " + std::to_string(h.payload_bytes) +
        " payload bytes, but the sender published " + std::to_string(published) +
        " bytes in all (header included): a corrupt frame header, or another writer on the ring");
  if (h.payload_bytes)
    copy_out(tail + sizeof(FrameHeader), dst, static_cast<size_t>(h.payload_bytes));
  ctl_->tail.store(tail + frame_bytes(static_cast<size_t>(h.payload_bytes)),
                   std::memory_order_release);
  ring();
}

uint32_t ShmChannel::bell() const { return ctl_->bell.load(std::memory_order_seq_cst); }

void ShmChannel::wait(uint32_t seen, int max_us) {
  ctl_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (ctl_->bell.load(std::memory_order_seq_cst) == seen) {
    timespec ts{max_us / 1000000, static_cast<long>(max_us % 1000000) * 1000};
    futex(&ctl_->bell, FUTEX_WAIT, seen, &ts);
  }
  ctl_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace dtrain::tcp
