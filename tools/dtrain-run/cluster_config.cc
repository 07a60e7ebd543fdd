#include "cluster_config.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "dtrain/core/strings.h"

namespace dtrain::run {
namespace {

// Each local task holds two pipes in the launcher; stay well inside the usual 1024-fd limit.
constexpr int kMaxTasks = 256;
constexpr const char* kHostsExample = "e.g. -H node1:2,node2:2 (host:slots, comma-separated)";

bool valid_host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '-' || c == '_';
}

// A positive decimal integer of at most 5 digits, or -1.
int parse_small_positive(const std::string& s) {
  if (s.empty() || s.size() > 5) return -1;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v > 0 ? v : -1;
}

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

std::vector<Task> plan_tasks(int workers, int ps, bool evaluator) {
  if (workers < 1) {
    throw UsageError("-np must be at least 1 (got " + std::to_string(workers) +
                     "); e.g. dtrain-run -np 2 -- ./prog");
  }
  if (ps < 0) throw UsageError("--ps must be 0 or more (got " + std::to_string(ps) + ")");
  if (workers + ps > kMaxTasks) {
    throw UsageError("at most " + std::to_string(kMaxTasks) + " tasks per job (got " +
                     std::to_string(workers + ps) + "); lower -np or --ps");
  }
  std::vector<Task> tasks;
  for (int i = 0; i < workers; ++i) tasks.push_back({"worker", i, "", 0});
  for (int i = 0; i < ps; ++i) tasks.push_back({"ps", i, "", 0});
  if (evaluator) tasks.push_back({"evaluator", 0, "", 0});
  return tasks;
}

bool is_chief(const std::vector<Task>& tasks, size_t i) {
  const Task& t = tasks.at(i);
  if (t.type == "chief") return true;
  const bool has_chief =
      std::any_of(tasks.begin(), tasks.end(), [](const Task& o) { return o.type == "chief"; });
  return t.type == "worker" && t.index == 0 && !has_chief;
}

std::vector<HostSlots> parse_hosts(const std::string& spec) {
  if (spec.empty()) throw UsageError(std::string("-H needs a host list, ") + kHostsExample);
  std::vector<HostSlots> hosts;
  std::set<std::string> seen;
  for (const std::string_view item : dtrain::split_list(spec)) {
    const std::string entry(item);
    const auto bad = [&](const std::string& why) {
      return UsageError("malformed -H entry '" + entry + "' in '" + spec + "': " + why + "; " +
                        kHostsExample);
    };
    if (entry.empty()) throw bad("empty host");
    const size_t colon = entry.find(':');
    HostSlots h{entry.substr(0, colon), 1};
    if (colon != std::string::npos) {
      h.slots = parse_small_positive(entry.substr(colon + 1));
      if (h.slots < 0) throw bad("slots must be a positive number");
    }
    if (h.host.empty()) throw bad("empty host name");
    for (char c : h.host) {
      if (!valid_host_char(c)) throw bad(std::string("unexpected character '") + c + "' in host");
    }
    // localhost and 127.0.0.1 are one machine: slot s of each would get the same port.
    if (!seen.insert(h.host == "localhost" ? "127.0.0.1" : h.host).second) {
      throw bad("host '" + h.host + "' is listed twice" +
                (h.host == "localhost" || h.host == "127.0.0.1"
                     ? std::string(" (localhost and 127.0.0.1 are the same host)")
                     : std::string()) +
                "; give it once with all its slots");
    }
    hosts.push_back(h);
  }
  return hosts;
}

void assign_hosts(std::vector<Task>& tasks, const std::vector<HostSlots>& hosts, int port_base) {
  if (port_base < 1 || port_base > 65535) {
    throw UsageError("--port-base must be in 1..65535 (got " + std::to_string(port_base) + ")");
  }
  size_t total = 0;
  for (const auto& h : hosts) total += static_cast<size_t>(h.slots);
  if (tasks.size() > total) {
    throw UsageError("the job has " + std::to_string(tasks.size()) + " tasks but -H gives only " +
                     std::to_string(total) + " slots; add slots (host:slots) or lower -np/--ps");
  }
  size_t t = 0;
  for (const auto& h : hosts) {
    for (int s = 0; s < h.slots && t < tasks.size(); ++s, ++t) {
      if (port_base + s > 65535) {
        throw UsageError("port " + std::to_string(port_base + s) + " for " + tasks[t].name() +
                         " on " + h.host + " exceeds 65535; lower --port-base");
      }
      tasks[t].host = h.host;
      tasks[t].port = port_base + s;
    }
  }
}

void assign_local_ports(std::vector<Task>& tasks, int port_base) {
  if (port_base > 0) {
    if (port_base + static_cast<int>(tasks.size()) - 1 > 65535) {
      throw UsageError("--port-base " + std::to_string(port_base) + " leaves no room for " +
                       std::to_string(tasks.size()) + " ports below 65536; lower it");
    }
    for (size_t i = 0; i < tasks.size(); ++i) {
      tasks[i].host = "127.0.0.1";
      tasks[i].port = port_base + static_cast<int>(i);
    }
    return;
  }
  std::vector<int> probes;
  const auto close_all = [&] {
    for (int fd : probes) ::close(fd);
  };
  for (auto& task : tasks) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      const std::string msg = sys_error("cannot create a socket to find a free port");
      close_all();
      throw std::runtime_error(msg);
    }
    probes.push_back(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const std::string msg = sys_error("cannot bind a free port on 127.0.0.1");
      close_all();
      throw std::runtime_error(msg);
    }
    task.host = "127.0.0.1";
    task.port = ntohs(addr.sin_port);
  }
  close_all();
}

std::string tf_config(const std::vector<Task>& tasks, size_t i) {
  nlohmann::ordered_json cluster = nlohmann::ordered_json::object();
  for (const char* type : {"worker", "ps", "evaluator"}) {
    nlohmann::ordered_json addrs = nlohmann::ordered_json::array();
    for (const auto& t : tasks) {
      if (t.type == type) addrs.push_back(t.address());
    }
    if (!addrs.empty()) cluster[type] = addrs;
  }
  nlohmann::ordered_json config;
  config["cluster"] = cluster;
  config["task"] = {{"type", tasks.at(i).type}, {"index", tasks.at(i).index}};
  return config.dump();
}

std::string make_job_token() {
  unsigned char bytes[32];
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(sys_error("cannot open /dev/urandom for the job token"));
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string msg = sys_error("cannot read /dev/urandom for the job token");
      ::close(fd);
      throw std::runtime_error(msg);
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  return token;
}

std::string shell_quote(const std::string& s) {
  bool safe = !s.empty();
  for (char c : s) {
    safe = safe && (valid_host_char(c) || c == '/' || c == ':' || c == '=' || c == ',' || c == '+');
  }
  if (safe) return s;
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

}  // namespace dtrain::run
