// Minimal leveled logging to stderr: DTRAIN_LOG(INFO) << "chose ring allreduce because ...";
// The level comes from DTRAIN_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR in any case; default WARNING;
// another value is said on stderr and logs at WARNING), or set_log_level(). Each line is written
// atomically. Thread-safe.
#pragma once

#include <sstream>
#include <string>

#include "dtrain/core/export.h"

namespace dtrain {

enum class LogLevel { DEBUG = 0, INFO = 1, WARNING = 2, ERROR = 3 };

DTRAIN_API LogLevel log_level();
DTRAIN_API void set_log_level(LogLevel level);
// DEBUG, INFO, WARNING (or WARN), ERROR in any case into *level; false (level unchanged) otherwise.
DTRAIN_API bool parse_log_level(const std::string& name, LogLevel* level);
// A prefix added to every line (e.g. "[worker:1] "), set by multi-process jobs.
DTRAIN_API void set_log_prefix(const std::string& prefix);

namespace detail {
class DTRAIN_API LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line);
  ~LogLine();
  std::ostream& stream() { return os_; }

 private:
  LogLevel level_;
  std::ostringstream os_;
};
}  // namespace detail

}  // namespace dtrain

#define DTRAIN_LOG(level)                                  \
  if (::dtrain::LogLevel::level < ::dtrain::log_level()) { \
  } else                                                   \
    ::dtrain::detail::LogLine(::dtrain::LogLevel::level, __FILE__, __LINE__).stream()
