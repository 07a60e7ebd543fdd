// The elastic half of dtrain-run (--min-np / --max-np): hosts the rendezvous the workers meet at
// (dtrain/train/elastic.h), decides where workers run and when new ones start.
//
// Hosts come from -H / --netns / localhost at the start and, with --host-discovery-script, from the
// script's output ("host:slots" per line, as horovodrun's) read every second (the script runs
// beside the supervisor's loop, in its own process group with the launcher's original signal mask;
// one that has not finished within 10 s is killed, SIGKILL to its group, and counts as failed):
// while fewer workers
// run than min(--max-np, the slots listed), a worker is started on a listed host with a free slot;
// the workers of a host that is no longer listed are stopped (SIGTERM). Without a script nothing is
// started after the first workers: the job goes on with the survivors while at least --min-np
// remain. Each worker gets a launcher id (0, 1, ... never reused) that names it ("worker:<id>") and
// keys it at the rendezvous. Not thread-safe: the supervisor's thread only.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace dtrain::elastic {
class RendezvousServer;
}

namespace dtrain::run {

struct ElasticHost {
  std::string name;     // as the discovery script names it: "localhost", or a --netns namespace
  std::string address;  // the IP workers there listen on
  std::string netns;    // the namespace they run in ("" = ours)
  int slots = 1;
};

struct ElasticOptions {
  int min_np = 0, max_np = 0;  // 0 = not an elastic job
  int np = 0;                  // workers at the start
  std::string discovery_script;
  std::vector<ElasticHost> hosts;  // at the start
  // Known hosts by name, for the discovery script's names (--netns: every test host).
  std::map<std::string, ElasticHost> known;
  std::string rendezvous_address;  // host:port
  std::string rendezvous_netns;    // namespace the rendezvous listens in ("" = ours)
  int port_base = 0;               // workers' ports: port_base + id (0: a free port on 127.0.0.1)
  double settle_s = 10, timeout_s = 300;
};

// One worker to start.
struct ElasticSpawn {
  int id = 0;
  ElasticHost host;
  int port = 0;
  std::vector<std::string> env;  // DTRAIN_ELASTIC_* for it
};

class ElasticDriver {
 public:
  // Starts the rendezvous. Throws std::runtime_error (or a dtrain::Error) when it cannot listen.
  // The discovery script gets `child_mask` as its signal mask and `stdin_fd` as its stdin.
  ElasticDriver(ElasticOptions options, const std::string& token, const sigset_t& child_mask,
                int stdin_fd);
  ~ElasticDriver();
  // The first np workers.
  std::vector<ElasticSpawn> initial();
  // Starts the discovery script when due, or reads what it wrote so far without waiting; once it
  // has ended, returns workers to start now, and `stop` gets the ids of running workers whose host
  // is no longer listed.
  std::vector<ElasticSpawn> tick(std::chrono::steady_clock::time_point now, std::vector<int>* stop);
  // `failed`: a non-zero exit. A host whose workers keep failing gets no new worker for a while (10
  // s after the second failure there, doubling after each), as Horovod blacklists a failing host.
  void exited(int id, bool failed);
  int running() const { return static_cast<int>(running_.size()); }
  // The launcher ids of the last round's workers.
  std::vector<int> members() const;
  std::chrono::steady_clock::time_point next_tick() const { return next_tick_; }
  // The running discovery script's pid (its own to reap), or -1.
  pid_t discovery_pid() const { return script_.pid; }

 private:
  ElasticSpawn make_spawn(const ElasticHost& host);
  // false while the script runs; true once it ended, with *error set when it failed.
  bool poll_discovery(std::chrono::steady_clock::time_point now, std::string* text,
                      std::string* error);
  bool parse_discovery(const std::string& text, std::vector<ElasticHost>* hosts,
                       std::string* error) const;
  void end_discovery();  // kills the script's group (if still running), reaps it, closes its pipes
  ElasticOptions o_;
  std::string token_;
  std::unique_ptr<elastic::RendezvousServer> server_;
  std::map<int, std::string> running_;  // id -> host name
  std::set<int> ports_;                 // every port handed out on 127.0.0.1 (no --port-base)
  struct Cooldown {
    int failures = 0;
    std::chrono::steady_clock::time_point until{};
  };
  std::map<std::string, Cooldown> cooldown_;  // by host name
  int next_id_ = 0;
  std::chrono::steady_clock::time_point next_tick_;
  std::string last_error_;
  sigset_t child_mask_{};
  int stdin_fd_ = -1;
  struct Discovery {
    pid_t pid = -1;  // also its process group
    int fds[2] = {-1, -1};
    std::string out, err;
    std::chrono::steady_clock::time_point deadline{};
  } script_;
};

}  // namespace dtrain::run
