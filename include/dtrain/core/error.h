// Typed exceptions. Every error dtrain raises derives from dtrain::Error; the message names what
// went wrong and how to fix it. Thread-safety: plain value types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "dtrain/core/export.h"

namespace dtrain {

class DTRAIN_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

#define DTRAIN_DECLARE_ERROR(Name)                                     \
  class DTRAIN_API Name : public Error {                               \
   public:                                                             \
    explicit Name(const std::string& msg) : Error(#Name ": " + msg) {} \
  }

DTRAIN_DECLARE_ERROR(InvalidArgument);     // the caller passed something wrong
DTRAIN_DECLARE_ERROR(FailedPrecondition);  // the system is not in a state to do this yet
DTRAIN_DECLARE_ERROR(Unavailable);         // a peer, device or file cannot be reached
DTRAIN_DECLARE_ERROR(DeadlineExceeded);    // a bounded wait ran out
DTRAIN_DECLARE_ERROR(DataLoss);            // data is truncated or corrupt
DTRAIN_DECLARE_ERROR(PermissionDenied);    // authentication failed
DTRAIN_DECLARE_ERROR(NotFound);            // a named thing does not exist
DTRAIN_DECLARE_ERROR(Unimplemented);       // not supported on this device/configuration
DTRAIN_DECLARE_ERROR(Internal);            // a bug in dtrain

#undef DTRAIN_DECLARE_ERROR

namespace detail {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] DTRAIN_API void check_failed(const char* file, int line, const char* cond,
                                          const std::string& msg);
}  // namespace detail

}  // namespace dtrain

// Programmer errors only (violated invariants); user-facing problems throw typed errors.
#define DTRAIN_CHECK(cond, ...)                                                                 \
  do {                                                                                          \
    if (!(cond))                                                                                \
      ::dtrain::detail::check_failed(__FILE__, __LINE__, #cond,                                 \
                                     ::dtrain::detail::str_cat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
