#include "dtrain/core/error.h"

namespace dtrain::detail {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  throw Internal(str_cat("check failed at ", file, ":", line, ": ", cond, (msg.empty() ? "" : ": "),
                         msg, " (this is a dtrain bug; please report it)"));
}

}  // namespace dtrain::detail
