#include "line_relay.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace dtrain::run {

bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void LineRelay::feed(const char* data, size_t n) {
  const char* end = data + n;
  while (data < end) {
    const char* nl =
        static_cast<const char*>(std::memchr(data, '\n', static_cast<size_t>(end - data)));
    if (nl == nullptr) {
      pending_.append(data, static_cast<size_t>(end - data));
      while (pending_.size() >= kMaxLine) {
        emit(pending_.data(), kMaxLine);
        pending_.erase(0, kMaxLine);
      }
      return;
    }
    if (pending_.empty()) {
      emit(data, static_cast<size_t>(nl - data));
    } else {
      pending_.append(data, static_cast<size_t>(nl - data));
      emit(pending_.data(), pending_.size());
      pending_.clear();
    }
    data = nl + 1;
  }
}

void LineRelay::finish() {
  if (!pending_.empty()) emit(pending_.data(), pending_.size());
  pending_.clear();
}

void LineRelay::emit(const char* begin, size_t n) {
  line_.assign(prefix_);
  line_.append(begin, n);
  line_.push_back('\n');
  // A reader that went away (EPIPE) loses the output; the job itself goes on.
  write_all(out_fd_, line_);
}

}  // namespace dtrain::run
