#include "cluster/cluster_util.h"

#include <cstdlib>
#include <map>

#include "dtrain/core/error.h"

namespace dtrain::cluster_detail {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_alnum(char c) { return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// Host names (RFC 1123 plus '_', which some clusters use) and IPv4 literals.
std::string host_problem(std::string_view host, const std::string& q) {
  for (char c : host)
    if (!is_alnum(c) && c != '-' && c != '.' && c != '_')
      return q + " has " + quote(std::string_view(&c, 1)) +
             " in its host; a host has only letters, digits, '-', '.' and '_' (\"host0:2222\")";
  if (host.front() == '-' || host.front() == '.')
    return q + " has a host that starts with '" + std::string(1, host.front()) +
           "'; write a host name or IP address such as \"host0:2222\"";
  return "";
}

}  // namespace

std::string quote(std::string_view s, size_t max_chars) {
  static const char* kHex = "0123456789abcdef";
  std::string out = "\"";
  const size_t n = s.size() < max_chars ? s.size() : max_chars;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c >= 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  if (n < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string address_problem(std::string_view a, HostPort* out) {
  const std::string q = quote(a);
  const std::string fix = "; write \"host:port\" such as \"host0:2222\" or \"[::1]:2222\"";
  if (a.empty()) return q + " is empty" + fix;
  for (char c : a)
    if (is_space(c)) return q + " contains whitespace; remove it (\"host0:2222\")";
  if (a.find("://") != std::string_view::npos)
    return q + " has a scheme; give only \"host:port\" such as \"host0:2222\"";
  std::string_view host, port;
  if (a.front() == '[') {
    const size_t close = a.find(']');
    if (close == std::string_view::npos)
      return q + " has an unclosed '['; an IPv6 address is written \"[::1]:2222\"";
    host = a.substr(1, close - 1);
    if (host.empty()) return q + " has an empty host between the brackets" + fix;
    if (host.find(':') == std::string_view::npos)
      return q + " has brackets around " + quote(host) +
             ", which is not an IPv6 address; brackets are for IPv6 only (\"[::1]:2222\")";
    for (size_t i = 0; i < host.size(); ++i) {
      const char c = host[i];
      if (c == '%') {  // a zone id such as fe80::1%eth0
        if (i + 1 == host.size()) return q + " has an empty IPv6 zone after '%'" + fix;
        for (char z : host.substr(i + 1))
          if (!is_alnum(z) && z != '.' && z != '_' && z != '-')
            return q + " has an invalid IPv6 zone" + fix;
        break;
      }
      if (!is_hex(c) && c != ':' && c != '.')
        return q + " has " + quote(std::string_view(&host[i], 1)) +
               " inside the brackets, which only hold an IPv6 address such as \"[::1]:2222\"";
    }
    if (close + 1 == a.size()) return q + " has no port" + fix;
    if (a[close + 1] != ':') return q + " needs ':' right after ']'" + fix;
    port = a.substr(close + 2);
  } else {
    const size_t colon = a.rfind(':');
    if (colon == std::string_view::npos) return q + " has no port" + fix;
    host = a.substr(0, colon);
    port = a.substr(colon + 1);
    if (host.find(':') != std::string_view::npos)
      return q + " looks like an IPv6 address; put the host in brackets, as in \"[::1]:2222\"";
    if (host.empty()) return q + " has an empty host" + fix;
    std::string p = host_problem(host, q);
    if (!p.empty()) return p;
  }
  if (port.empty()) return q + " has no port after ':'" + fix;
  for (char c : port)
    if (!is_digit(c)) return q + " has a port " + quote(port) + " that is not a number" + fix;
  const auto value = parse_int(port, 1, 65535);
  if (!value) return q + " has port " + std::string(port) + ", outside 1-65535" + fix;
  if (out) {
    out->host = std::string(host);
    out->port = static_cast<int>(*value);
  }
  return "";
}

std::string cluster_problem(const ClusterSpec::JobMap& jobs) {
  const std::string chief = task_type_name(TaskType::kChief);
  const std::string worker = task_type_name(TaskType::kWorker);
  int total = 0;
  for (const auto& [job, tasks] : jobs) total += static_cast<int>(tasks.size());
  if (total == 0) return "the cluster is empty; list at least one worker";
  auto count = [&](TaskType t) {
    auto it = jobs.find(t);
    return it == jobs.end() ? size_t{0} : it->second.size();
  };
  auto list = [&](TaskType t) {
    std::string s = "[";
    for (const auto& a : jobs.at(t)) s += (s.size() > 1 ? ", " : "") + quote(a, 40);
    return s + "]";
  };
  if (count(TaskType::kChief) > 1)
    return "job \"chief\" has " + std::to_string(count(TaskType::kChief)) + " tasks " +
           list(TaskType::kChief) +
           "; there must be at most one chief: keep one and move the others to \"worker\"";
  if (count(TaskType::kEvaluator) > 1)
    return "job \"evaluator\" has " + std::to_string(count(TaskType::kEvaluator)) + " tasks " +
           list(TaskType::kEvaluator) + "; there must be at most one evaluator";
  if (count(TaskType::kChief) + count(TaskType::kWorker) == 0)
    return "the cluster has no \"chief\" or \"worker\" job; training needs at least one worker";
  // Duplicates compare hosts case-insensitively and ports as numbers.
  std::map<std::string, std::string> seen;  // normalised address -> "job:index"
  for (const auto& [job, tasks] : jobs) {
    for (size_t i = 0; i < tasks.size(); ++i) {
      const std::string name = std::string(task_type_name(job)) + ":" + std::to_string(i);
      HostPort hp;
      std::string p = address_problem(tasks[i], &hp);
      if (!p.empty()) return "task " + name + " " + p;
      const std::string key = lower(hp.host) + "|" + std::to_string(hp.port);
      auto [it, inserted] = seen.emplace(key, name);
      if (!inserted)
        return "address " + quote(tasks[i]) + " of task " + name + " is also used by task " +
               it->second + "; every task needs its own host:port";
    }
  }
  return "";
}

std::optional<std::string> get_env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

std::optional<long long> parse_int(std::string_view text, long long min, long long max) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  size_t i = 0;
  bool negative = false;
  if (text[0] == '-' || text[0] == '+') {
    negative = text[0] == '-';
    i = 1;
    if (text.size() == 1) return std::nullopt;
  }
  long long v = 0;
  for (; i < text.size(); ++i) {
    if (!is_digit(text[i])) return std::nullopt;
    v = v * 10 + (text[i] - '0');
  }
  if (negative) v = -v;
  if (v < min || v > max) return std::nullopt;
  return v;
}

std::optional<int> env_int(const char* name, int min, int max, const std::string& hint) {
  auto v = get_env(name);
  if (!v) return std::nullopt;
  auto parsed = parse_int(*v, min, max);
  if (!parsed)
    throw InvalidArgument(std::string(name) + "=" + quote(*v) + " is not an integer in [" +
                          std::to_string(min) + ", " + std::to_string(max) + "]; " + hint);
  return static_cast<int>(*parsed);
}

}  // namespace dtrain::cluster_detail
