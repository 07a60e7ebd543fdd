// Private to the checkpoint files (checkpoint.cc: safetensors; checkpoint_manager.cc:
// CheckpointManager): what both use to read and write files. Not a public header.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include "dtrain/core/checkpoint.h"

namespace dtrain::detail {

constexpr const char* kIndexName = "checkpoint";  // CheckpointManager's index file
constexpr size_t kMaxIndexBytes = 64 << 10;

// nlohmann's messages and file contents may hold raw bytes; keep messages printable and short.
inline std::string printable(const std::string& s, size_t limit = 200) {
  std::string out = s.substr(0, limit);
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  if (s.size() > limit) out += "...";
  return out;
}

// Owns a file descriptor.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now, returning close()'s errno (0 on success): on NFS a failed close is a failed write.
  int close() {
    const int r = ::close(fd_);
    fd_ = -1;
    return r == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

struct Piece {
  const void* data;
  size_t size;
  const CheckpointData::Streamed* streamed = nullptr;  // produced when its turn comes
};

// Writes the pieces to a temporary file beside `path`, fsyncs it and renames it over `path`. The
// name carries pid and a sequence number so concurrent writers never share a temporary file.
void write_atomically(const std::string& path, const std::vector<Piece>& pieces);

}  // namespace dtrain::detail
