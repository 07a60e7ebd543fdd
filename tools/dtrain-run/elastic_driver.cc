#include "elastic_driver.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <set>
#include <stdexcept>

#include "cluster_config.h"
#include "dtrain/train/elastic.h"
#include "spawn.h"

namespace dtrain::run {
namespace {

using Clock = std::chrono::steady_clock;

// Runs `make` with this thread in network namespace `ns` (sockets made there stay there).
template <typename F>
auto in_netns(const std::string& ns, F make) {
  if (ns.empty()) return make();
  const int self = ::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  const int target = ::open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
  if (self < 0 || target < 0 || ::setns(target, CLONE_NEWNET) != 0) {
    if (self >= 0) ::close(self);
    if (target >= 0) ::close(target);
    throw std::runtime_error("cannot enter network namespace " + ns +
                             " for the elastic rendezvous");
  }
  ::close(target);
  try {
    auto r = make();
    if (::setns(self, CLONE_NEWNET) != 0)
      throw std::runtime_error("cannot return to the launcher's network namespace");
    ::close(self);
    return r;
  } catch (...) {
    (void)::setns(self, CLONE_NEWNET);
    ::close(self);
    throw;
  }
}

}  // namespace

ElasticDriver::ElasticDriver(ElasticOptions options, const std::string& token,
                             const sigset_t& child_mask, int stdin_fd)
    : o_(std::move(options)),
      token_(token),
      next_tick_(Clock::now()),
      child_mask_(child_mask),
      stdin_fd_(stdin_fd) {
  elastic::RendezvousOptions r;
  r.address = o_.rendezvous_address;
  r.token = token;
  r.min_np = o_.min_np;
  r.max_np = o_.max_np;
  r.settle = std::chrono::milliseconds(static_cast<int64_t>(o_.settle_s * 1000));
  server_ =
      in_netns(o_.rendezvous_netns, [&] { return std::make_unique<elastic::RendezvousServer>(r); });
}

ElasticDriver::~ElasticDriver() { end_discovery(); }

ElasticSpawn ElasticDriver::make_spawn(const ElasticHost& host) {
  if (next_id_ >= elastic::Job::kMaxWorkers)
    throw std::runtime_error("an elastic job starts at most " +
                             std::to_string(elastic::Job::kMaxWorkers) + " workers over its life");
  ElasticSpawn s;
  s.id = next_id_++;
  s.host = host;
  if (o_.port_base > 0) {
    s.port = o_.port_base + s.id;
  } else {
    // A port probed and closed is free again, and the next probe may return it: never hand out
    // a port this job has handed out before (a CI run of 2026-11-27 started worker:0 and
    // worker:1 on one port, and every worker refused the cluster).
    for (int attempt = 1;; ++attempt) {
      std::vector<Task> one(1);
      assign_local_ports(one, 0);
      if (ports_.insert(one[0].port).second) {
        s.port = one[0].port;
        break;
      }
      if (attempt == 100)
        throw std::runtime_error(
            "no free port on 127.0.0.1 that this elastic job has not used (100 probes); use "
            "--port-base");
    }
  }
  s.env = {"DTRAIN_ELASTIC_RENDEZVOUS=" + o_.rendezvous_address,
           "DTRAIN_ELASTIC_ID=" + std::to_string(s.id),
           "DTRAIN_ELASTIC_ADDRESS=" + host.address + ":" + std::to_string(s.port),
           "DTRAIN_ELASTIC_TIMEOUT=" + std::to_string(static_cast<int>(o_.timeout_s))};
  server_->expect(s.id);
  running_[s.id] = host.name;
  return s;
}

std::vector<ElasticSpawn> ElasticDriver::initial() {
  std::vector<ElasticSpawn> out;
  std::map<std::string, int> used;
  for (int i = 0; i < o_.np; ++i) {
    // Fill the hosts in order, as -H does; past their slots, round robin.
    const ElasticHost* pick = nullptr;
    for (const auto& h : o_.hosts)
      if (used[h.name] < h.slots) {
        pick = &h;
        break;
      }
    if (!pick) pick = &o_.hosts[static_cast<size_t>(i) % o_.hosts.size()];
    ++used[pick->name];
    out.push_back(make_spawn(*pick));
  }
  return out;
}

void ElasticDriver::end_discovery() {
  if (script_.pid > 0) {
    ::kill(-script_.pid, SIGKILL);
    int status = 0;
    while (::waitpid(script_.pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  for (int& fd : script_.fds)
    if (fd >= 0) {
      ::close(fd);
      fd = -1;
    }
  script_ = Discovery{};
}

bool ElasticDriver::poll_discovery(Clock::time_point now, std::string* text, std::string* error) {
  if (script_.pid < 0) {
    Spawned s;
    std::vector<std::string> env;
    for (char** e = ::environ; *e; ++e) env.emplace_back(*e);
    const std::string err =
        spawn({o_.discovery_script}, env, stdin_fd_, child_mask_, /*cpus=*/{}, s);
    if (!err.empty()) {
      *error = "cannot run the host discovery script " + o_.discovery_script + ": " + err;
      return true;
    }
    script_.pid = s.pid;
    script_.fds[0] = s.out_fd;
    script_.fds[1] = s.err_fd;
    script_.deadline = now + std::chrono::seconds(10);
  }
  // What it wrote so far (the pipes do not block; at most 64 KiB a stream a call, so that a
  // script writing without end cannot hold the supervisor here); its output ends with both pipes.
  char buf[4096];
  bool too_much = false;
  for (int w = 0; w < 2; ++w) {
    std::string& into = w == 0 ? script_.out : script_.err;
    for (int reads = 0; reads < 16 && script_.fds[w] >= 0; ++reads) {
      const ssize_t n = ::read(script_.fds[w], buf, sizeof(buf));
      if (n > 0) {
        into.append(buf, static_cast<size_t>(n));
        too_much = too_much || into.size() > (1u << 20);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      ::close(script_.fds[w]);
      script_.fds[w] = -1;
    }
  }
  if (too_much) {
    *error = "the host discovery script " + o_.discovery_script +
             " wrote more than 1 MiB; killed it (SIGKILL)";
    end_discovery();
    return true;
  }
  int status = 0;
  const bool open = script_.fds[0] >= 0 || script_.fds[1] >= 0;
  const pid_t r = open ? 0 : ::waitpid(script_.pid, &status, WNOHANG);
  if (r == 0 || (r < 0 && errno == EINTR)) {
    if (now < script_.deadline) return false;
    *error = "the host discovery script " + o_.discovery_script +
             " did not finish within 10 s; killed it (SIGKILL)";
    end_discovery();
    return true;
  }
  std::string errors = script_.err.substr(0, 200);
  *text = std::move(script_.out);
  script_.pid = -1;  // reaped
  end_discovery();
  if (r < 0) {
    *error = "cannot wait for the host discovery script " + o_.discovery_script;
  } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *error = "the host discovery script " + o_.discovery_script + " failed (" +
             (WIFEXITED(status) ? "status " + std::to_string(WEXITSTATUS(status))
                                : "killed by signal " + std::to_string(WTERMSIG(status))) +
             ")" + (errors.empty() ? "" : ": " + errors);
  }
  return true;
}

bool ElasticDriver::parse_discovery(const std::string& text, std::vector<ElasticHost>* hosts,
                                    std::string* error) const {
  try {
    std::string spec;
    for (char c : text) spec += (c == '\n' ? ',' : c);
    while (!spec.empty() && (spec.back() == ',' || spec.back() == ' ')) spec.pop_back();
    if (spec.empty()) return true;  // no hosts
    for (const HostSlots& h : parse_hosts(spec)) {
      auto it = o_.known.find(h.host);
      if (it == o_.known.end()) {
        *error = "the host discovery script names host '" + h.host +
                 "', which this launcher cannot start workers on";
        return false;
      }
      ElasticHost e = it->second;
      e.slots = h.slots;
      hosts->push_back(e);
    }
  } catch (const std::exception& e) {
    *error = std::string("the host discovery script's output is malformed: ") + e.what();
    return false;
  }
  return true;
}

std::vector<ElasticSpawn> ElasticDriver::tick(Clock::time_point now, std::vector<int>* stop) {
  std::vector<ElasticSpawn> out;
  if (o_.discovery_script.empty() || now < next_tick_) return out;
  std::string text, error;
  if (!poll_discovery(now, &text, &error)) {
    next_tick_ = now + std::chrono::milliseconds(50);  // running: look again soon
    return out;
  }
  next_tick_ = now + std::chrono::seconds(1);
  std::vector<ElasticHost> hosts;
  if (error.empty()) parse_discovery(text, &hosts, &error);
  if (!error.empty()) {
    if (error != last_error_)
      std::fprintf(stderr, "dtrain-run: elastic: %s; keeping the workers as they are\n",
                   error.c_str());
    last_error_ = error;
    return out;
  }
  last_error_.clear();
  std::map<std::string, int> used;
  for (const auto& [id, host] : running_) {
    const bool listed = std::any_of(hosts.begin(), hosts.end(),
                                    [&](const ElasticHost& h) { return h.name == host; });
    if (!listed) {
      stop->push_back(id);
    } else {
      ++used[host];
    }
  }
  int slots = 0;
  for (const auto& h : hosts) slots += h.slots;
  int live = running() - static_cast<int>(stop->size());
  const int target = std::min(o_.max_np, slots);
  for (const auto& h : hosts) {
    if (auto c = cooldown_.find(h.name); c != cooldown_.end() && now < c->second.until) continue;
    while (live < target && used[h.name] < h.slots) {
      out.push_back(make_spawn(h));
      ++used[h.name];
      ++live;
    }
  }
  return out;
}

std::vector<int> ElasticDriver::members() const { return server_->members(); }

void ElasticDriver::exited(int id, bool failed) {
  auto it = running_.find(id);
  if (failed && it != running_.end()) {
    // A host may lose one worker and take a new one at once (a process killed); a host whose
    // workers keep failing (cut off, broken) gets none for 10 s after the second failure, doubling
    // after each.
    Cooldown& c = cooldown_[it->second];
    if (++c.failures >= 2) {
      const auto pause = std::chrono::seconds(10) * (1 << std::min(c.failures - 2, 5));
      c.until = Clock::now() + pause;
      std::fprintf(
          stderr, "dtrain-run: elastic: no new worker on %s for %lld s (%d workers failed there)\n",
          it->second.c_str(),
          static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(pause).count()),
          c.failures);
    }
  }
  if (it != running_.end()) running_.erase(it);
  server_->lost(id);
}

}  // namespace dtrain::run
