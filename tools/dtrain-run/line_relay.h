// LineRelay copies one child's output stream (stdout or stderr) to the launcher's matching stream,
// a whole line at a time with the task's prefix ("[worker:1] "), so lines of different tasks never
// interleave mid-line. Partial lines wait in a buffer until their newline arrives; a line longer
// than kMaxLine is cut into kMaxLine pieces so a child that never writes a newline cannot exhaust
// memory.
//
// Not thread-safe: the launcher's single poll loop owns every relay.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace dtrain::run {

// Writes all of `data` to `fd` with as few write() calls as the kernel allows (one for a line that
// fits a pipe's atomic size), retrying on EINTR. Returns false when the fd is closed or broken
// (e.g. EPIPE after the reader went away); the caller then drops the output.
bool write_all(int fd, const std::string& data);

class LineRelay {
 public:
  static constexpr size_t kMaxLine = 64 * 1024;

  LineRelay(int out_fd, std::string prefix) : out_fd_(out_fd), prefix_(std::move(prefix)) {}

  // Appends `n` bytes read from the child and writes every line they complete.
  void feed(const char* data, size_t n);

  // At end of stream: writes a final line that had no newline, adding one.
  void finish();

 private:
  void emit(const char* begin, size_t n);

  int out_fd_;
  std::string prefix_;
  std::string pending_;
  std::string line_;  // reused for prefix + line, so each line is one write()
};

}  // namespace dtrain::run
