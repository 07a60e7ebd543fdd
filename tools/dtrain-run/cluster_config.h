// The job's tasks and their TF_CONFIG: which tasks a `dtrain-run` job has (workers, parameter
// servers, an evaluator), the address each listens on, and the TF_CONFIG JSON each one is started
// with.
//
// Addresses come from one of two places: free loopback ports for a job started on this machine, or
// host:slots lists (`-H host1:2,host2:2`) with ports port_base + slot for --print-config of a
// multi-host job. Plain functions over values; no shared state, safe from any thread.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::run {

// Bad command-line input. The message says what is wrong and how to fix it; main exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One process of the job.
struct Task {
  std::string type;  // "worker", "ps" or "evaluator" ("chief" in hand-written clusters)
  int index = 0;     // index within its type
  std::string host;
  int port = 0;
  // "worker:1": the prefix of its output lines and the value of DTRAIN_TASK.
  std::string name() const { return type + ":" + std::to_string(index); }
  std::string address() const { return host + ":" + std::to_string(port); }
};

// A host of a multi-host job and how many tasks it runs.
struct HostSlots {
  std::string host;
  int slots = 0;
};

// The tasks of a job in launch order: workers, then parameter servers, then the evaluator.
// Addresses are left empty. Throws UsageError when workers < 1 or ps < 0.
std::vector<Task> plan_tasks(int workers, int ps, bool evaluator);

// Whether tasks[i] is the chief, as TensorFlow decides it: the "chief" task, or worker 0 when the
// job has no "chief" task (dtrain-run jobs have none, so theirs is worker:0).
bool is_chief(const std::vector<Task>& tasks, size_t i);

// Parses "host1:2,host2:2" (a host without ":slots" has one slot). Throws UsageError quoting the
// malformed entry and showing a correct example.
std::vector<HostSlots> parse_hosts(const std::string& spec);

// Places tasks on hosts in order, filling each host's slots before the next; the task in slot s of
// a host listens on port_base + s. Throws UsageError when the tasks do not fit the slots or a port
// would exceed 65535.
void assign_hosts(std::vector<Task>& tasks, const std::vector<HostSlots>& hosts, int port_base);

// Gives every task a distinct free port on 127.0.0.1, found by binding port 0 (all probe sockets
// stay open until every port is chosen, so the ports differ). With port_base > 0, uses port_base +
// i instead. Throws std::runtime_error when no socket can be bound.
void assign_local_ports(std::vector<Task>& tasks, int port_base);

// The TF_CONFIG of tasks[i]: {"cluster": {"worker": [...], "ps": [...], "evaluator": [...]},
// "task": {"type": ..., "index": ...}}, compact, with empty types left out.
std::string tf_config(const std::vector<Task>& tasks, size_t i);

// 32 random bytes from /dev/urandom as 64 hex digits. Throws std::runtime_error when /dev/urandom
// cannot be read.
std::string make_job_token();

// `s` quoted for a POSIX shell (left bare when it has only safe characters).
std::string shell_quote(const std::string& s);

}  // namespace dtrain::run
