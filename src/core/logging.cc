#include "dtrain/core/logging.h"

#include <strings.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

namespace dtrain {
namespace {

LogLevel level_from_env() {
  const char* v = std::getenv("DTRAIN_LOG_LEVEL");
  if (!v || !*v) return LogLevel::WARNING;
  LogLevel level = LogLevel::WARNING;
  if (!parse_log_level(v, &level))  // said once, at start-up, on stderr (no logger yet)
    std::fprintf(stderr,
                 "dtrain: DTRAIN_LOG_LEVEL=%s is not DEBUG, INFO, WARNING or ERROR; logging at "
                 "WARNING\n",
                 v);
  return level;
}

std::atomic<int> g_level{static_cast<int>(level_from_env())};
std::mutex g_mu;
std::string g_prefix;

}  // namespace

bool parse_log_level(const std::string& name, LogLevel* level) {
  static const std::pair<const char*, LogLevel> kNames[] = {{"DEBUG", LogLevel::DEBUG},
                                                            {"INFO", LogLevel::INFO},
                                                            {"WARNING", LogLevel::WARNING},
                                                            {"WARN", LogLevel::WARNING},
                                                            {"ERROR", LogLevel::ERROR}};
  for (const auto& [n, l] : kNames)
    if (strcasecmp(name.c_str(), n) == 0) {
      *level = l;
      return true;
    }
  return false;
}

LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
void set_log_prefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_prefix = prefix;
}

namespace detail {

LogLine::LogLine(LogLevel level, const char* file, int line) : level_(level) {
  static const char* kNames[] = {"D", "I", "W", "E"};
  const char* base = std::strrchr(file, '/');
  os_ << kNames[static_cast<int>(level)] << " " << (base ? base + 1 : file) << ":" << line << "] ";
}

LogLine::~LogLine() {
  os_ << '\n';
  std::lock_guard<std::mutex> lock(g_mu);
  std::string s = g_prefix + os_.str();
  std::fwrite(s.data(), 1, s.size(), stderr);
  (void)level_;
}

}  // namespace detail
}  // namespace dtrain
