#include "collectives/tcp/tcp_environment.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "dtrain/core/error.h"

namespace dtrain::tcp {

TcpGroupOptions apply_tcp_environment(TcpGroupOptions o) {
  if (const char* v = std::getenv("DTRAIN_SHARED_MEMORY"); v && std::string(v) == "0")
    o.shared_memory = false;
  if (const char* v = std::getenv("DTRAIN_HEARTBEAT_TIMEOUT"); v && *v) {
    char* end = nullptr;
    const double seconds = std::strtod(v, &end);
    if (end == v || *end != '\0' || !std::isfinite(seconds) || seconds < 0.1 || seconds > 86400)
      throw InvalidArgument(std::string("DTRAIN_HEARTBEAT_TIMEOUT='") + v +
                            "' must be a number of seconds between 0.1 and 86400 (how long a "
                            "silent peer may go before it is reported hung; default 5)");
    o.heartbeat_timeout = std::chrono::milliseconds(std::lround(seconds * 1000));
    o.heartbeat_interval = std::min(o.heartbeat_interval, o.heartbeat_timeout / 4);
  }
  return o;
}

}  // namespace dtrain::tcp
