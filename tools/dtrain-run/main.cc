// dtrain-run: starts a multi-process dtrain job on this machine, like torchrun or horovodrun.
//
//   dtrain-run -np 2 -- ./fashion_mnist --strategy=multi_worker_mirrored --steps=100
//   dtrain-run -np 2 --ps 1 --devices cpu:2 --timeout 600 -- ./prog --flag
//   dtrain-run -np 4 --ps 2 --restart-workers 3 -- ./prog --strategy=parameter_server
//   dtrain-run --print-config -H node1:2,node2:2 --port-base 23456 [-- ./prog args]
//
// Every task gets TF_CONFIG (free loopback ports), DTRAIN_TASK ("worker:1") and one
// DTRAIN_JOB_TOKEN per job; its output lines are prefixed with "[worker:1] ". See launcher.h for
// how the job is supervised and the exit statuses. Bad usage exits 2.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "cluster_config.h"
#include "dtrain/core/timeline.h"
#include "launcher.h"

namespace {

using dtrain::run::UsageError;

constexpr int kExitUsage = 2;

struct Args {
  int np = 0;
  int ps = 0;
  int restart_workers = 0;
  int max_restarts = 0;
  std::string timeline;
  bool evaluator = false;
  std::string devices;
  std::string bind_to = "core";
  double timeout_s = 0;
  double grace_s = 10;
  double evaluator_grace_s = 300;
  bool print_config = false;
  std::string hosts;
  std::string netns;  // --netns PREFIX: the test hosts of tools/netns/dtrain-netns
  int port_base = 23456;
  bool port_base_given = false;
  bool np_given = false;
  int min_np = 0, max_np = 0;  // an elastic job when given
  std::string discovery_script;
  double elastic_timeout_s = 300, elastic_settle_s = 10;
  std::vector<std::string> command;
};

// MPI spells it -np; CLI11 takes only one-letter names after a single dash.
std::vector<std::string> normalise_argv(int argc, char** argv) {
  std::vector<std::string> out;
  bool in_command = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") in_command = true;
    if (!in_command && (a == "-np" || a.rfind("-np=", 0) == 0)) a = "-" + a;
    out.push_back(a);
  }
  std::reverse(out.begin(), out.end());  // CLI11 parses a reversed vector
  return out;
}

int print_config(const Args& a) {
  using namespace dtrain::run;
  std::vector<HostSlots> hosts;
  int workers = a.np;
  const int others = a.ps + (a.evaluator ? 1 : 0);
  if (!a.hosts.empty()) {
    hosts = parse_hosts(a.hosts);
    if (!a.np_given) {
      int slots = 0;
      for (const auto& h : hosts) slots += h.slots;
      workers = slots - others;
      if (workers < 1) {
        throw UsageError("-H '" + a.hosts + "' has " + std::to_string(slots) +
                         " slots, no room for a " + "worker beside " + std::to_string(others) +
                         " other task(s); add slots");
      }
    }
  } else if (a.np_given) {
    hosts.push_back({"127.0.0.1", a.np + others});
  } else {
    throw UsageError("--print-config needs the hosts, e.g. --print-config -H node1:2,node2:2");
  }
  std::vector<Task> tasks = plan_tasks(workers, a.ps, a.evaluator);
  assign_hosts(tasks, hosts, a.port_base);
  std::string command;
  for (const auto& c : a.command) command += " " + shell_quote(c);
  for (size_t i = 0; i < tasks.size(); ++i) {
    std::cout << tasks[i].name() << " " << tasks[i].host << " TF_CONFIG='" << tf_config(tasks, i)
              << "'" << command << "\n";
  }
  std::cout.flush();
  const char* token = std::getenv("DTRAIN_JOB_TOKEN");
  if (token == nullptr || *token == '\0') {
    std::fprintf(stderr,
                 "dtrain-run: also give every task the same DTRAIN_JOB_TOKEN, e.g. "
                 "export DTRAIN_JOB_TOKEN=%s\n",
                 make_job_token().c_str());
  }
  return 0;
}

// Merges the tasks' "<path>.<task>.json" files into <path> (dtrain/core/timeline.h).
void merge_task_timelines(const std::vector<dtrain::run::Task>& tasks, const std::string& path) {
  std::vector<std::string> parts;
  for (const auto& t : tasks) {
    std::string file = t.name();
    for (char& c : file)
      if (c == ':') c = '-';
    file = path + "." + file + ".json";
    if (std::filesystem::exists(file)) parts.push_back(file);
  }
  if (parts.empty()) {
    std::fprintf(stderr, "dtrain-run: no task wrote a timeline (%s.<task>.json)\n", path.c_str());
    return;
  }
  try {
    dtrain::timeline::merge_timeline_files(parts, path);
    for (const auto& p : parts) std::filesystem::remove(p);
    std::fprintf(
        stderr, "dtrain-run: timeline of %zu task(s) in %s (chrome://tracing or ui.perfetto.dev)\n",
        parts.size(), path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-run: could not merge the timelines: %s\n", e.what());
  }
}

// --min-np / --max-np: where the workers of an elastic job may run and where they meet.
void set_up_elastic(const Args& a, int np, dtrain::run::LaunchOptions& o) {
  using namespace dtrain::run;
  if (a.min_np < 1 || a.max_np < a.min_np || np < a.min_np || np > a.max_np)
    throw UsageError("an elastic job needs 1 <= --min-np <= -np <= --max-np, got --min-np " +
                     std::to_string(a.min_np) + ", -np " + std::to_string(np) + ", --max-np " +
                     std::to_string(a.max_np));
  if (a.ps > 0 || a.evaluator || a.max_restarts > 0)
    throw UsageError(
        "--min-np/--max-np make a MultiWorkerMirrored job elastic; it takes no --ps, --evaluator "
        "or "
        "--max-restarts (its workers re-form on their own)");
  ElasticOptions& e = o.elastic;
  e.min_np = a.min_np;
  e.max_np = a.max_np;
  e.np = np;
  e.discovery_script = a.discovery_script;
  e.timeout_s = a.elastic_timeout_s;
  e.settle_s = a.elastic_settle_s;
  if (!a.netns.empty()) {
    if (a.port_base_given && a.port_base < 2)
      throw UsageError("--port-base " + std::to_string(a.port_base) +
                       ": an elastic job on --netns hosts puts its rendezvous at port-base - 1; "
                       "give 2 or more");
    for (size_t i = 0; i < o.tasks.size(); ++i)
      e.hosts.push_back(ElasticHost{o.netns[i], o.tasks[i].host, o.netns[i], 1});
    std::ifstream in("/run/dtrain-netns/" + a.netns + ".hosts");
    for (std::string ns, addr; in >> ns >> addr;) e.known[ns] = ElasticHost{ns, addr, ns, 1};
    // The switch's own address (tools/netns/dtrain-netns gives br0 192.0.2.1): every host reaches
    // it.
    e.rendezvous_address =
        "192.0.2.1:" + std::to_string(a.port_base_given ? a.port_base - 1 : 29400);
    e.rendezvous_netns = a.netns + "-sw";
    e.port_base = a.port_base;
  } else {
    e.hosts.push_back(ElasticHost{"localhost", "127.0.0.1", "", np});
    e.known["localhost"] = e.known["127.0.0.1"] = ElasticHost{"localhost", "127.0.0.1", "", 1};
    std::vector<Task> one(1);
    assign_local_ports(one, 0);
    e.rendezvous_address = one[0].address();
  }
}

// A SIGINT, SIGTERM or SIGHUP pending (blocked) here, taken; 0 when none.
int take_pending_stop_signal() {
  sigset_t stops;
  sigemptyset(&stops);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&stops, sig);
  const timespec now{0, 0};
  const int sig = sigtimedwait(&stops, nullptr, &now);
  return sig > 0 ? sig : 0;
}

int run_local(const Args& a) {
  using namespace dtrain::run;
  if (!a.netns.empty() && !a.hosts.empty())
    throw UsageError("--netns and -H both say where tasks run; give one of them");
  int np = a.np;
  if (!a.hosts.empty()) {
    // horovodrun's -H: this machine's slots run here; other hosts' tasks are started there.
    char self[256] = "";
    ::gethostname(self, sizeof(self) - 1);
    int slots = 0;
    int names_of_this_machine = 0;  // parse_hosts refuses localhost and 127.0.0.1 together
    for (const auto& h : parse_hosts(a.hosts)) {
      const bool here = h.host == "localhost" || h.host == "127.0.0.1" || h.host == self;
      if (here && ++names_of_this_machine > 1) {
        throw UsageError("-H " + a.hosts + " names this machine twice ('" + std::string(self) +
                         "' is localhost; slot s of each would get the same port); give it "
                         "once with all its slots");
      }
      if (h.host != "localhost" && h.host != "127.0.0.1" && h.host != self) {
        throw UsageError(
            "-H names host '" + h.host +
            "': dtrain-run starts tasks on this machine only; start each host's tasks there with "
            "the TF_CONFIG that `dtrain-run --print-config -H " +
            a.hosts + "` prints");
      }
      slots += h.slots;
    }
    if (!a.np_given) np = slots - a.ps - (a.evaluator ? 1 : 0);
    if (np < 1 || np + a.ps + (a.evaluator ? 1 : 0) > slots) {
      throw UsageError("-H " + a.hosts + " has " + std::to_string(slots) +
                       " slot(s), too few for " + std::to_string(std::max(np, 1)) +
                       " worker(s) and the other tasks");
    }
  } else if (!a.np_given) {
    throw UsageError(
        "give the number of workers, e.g. dtrain-run -np 2 -- ./prog (or -H localhost:2)");
  }
  if (a.command.empty()) {
    throw UsageError("no program to run; put it after --, e.g. dtrain-run -np " +
                     std::to_string(a.np) + " -- ./prog --flag");
  }
  LaunchOptions o;
  o.tasks = plan_tasks(np, a.ps, a.evaluator);
  if (!a.netns.empty()) {
    // Task i runs on test host i mod H, at that host's address; ports count up per host.
    const std::string file = "/run/dtrain-netns/" + a.netns + ".hosts";
    std::ifstream in(file);
    std::vector<std::pair<std::string, std::string>> hosts;  // namespace, address
    for (std::string ns, addr; in >> ns >> addr;) hosts.emplace_back(ns, addr);
    if (hosts.empty()) {
      throw UsageError("--netns " + a.netns + ": no test hosts are up (" + file +
                       " is missing or empty); make them "
                       "with tools/netns/dtrain-netns up --prefix " +
                       a.netns + " --hosts N");
    }
    for (size_t i = 0; i < o.tasks.size(); ++i) {
      const auto& [ns, addr] = hosts[i % hosts.size()];
      o.tasks[i].host = addr;
      o.tasks[i].port = a.port_base + static_cast<int>(i / hosts.size());
      if (o.tasks[i].port > 65535)
        throw UsageError("--port-base " + std::to_string(a.port_base) + " leaves no room for " +
                         std::to_string((o.tasks.size() + hosts.size() - 1) / hosts.size()) +
                         " ports a test host below 65536; lower it");
      o.netns.push_back(ns);
    }
  } else {
    assign_local_ports(o.tasks, a.port_base_given ? a.port_base : 0);
  }
  if (a.min_np > 0 || a.max_np > 0) set_up_elastic(a, np, o);
  o.command = a.command;
  o.devices = a.devices;
  o.bind_cores = a.bind_to == "core";
  o.timeout_s = a.timeout_s;
  o.grace_s = a.grace_s;
  o.evaluator_grace_s = a.evaluator_grace_s;
  o.restart_workers = a.restart_workers;
  const char* token = std::getenv("DTRAIN_JOB_TOKEN");
  const bool user_token = token != nullptr && *token != '\0';
  std::string timeline = a.timeline;
  if (timeline.empty())
    if (const char* t = std::getenv("DTRAIN_TIMELINE"); t && *t) timeline = t;
  if (!timeline.empty()) {
    timeline = std::filesystem::absolute(timeline).string();
    o.extra_env.push_back("DTRAIN_TIMELINE=" + timeline);
  }
  // --timeout holds for the whole job, every relaunch included.
  const auto started = std::chrono::steady_clock::now();
  if (a.max_restarts > 0) o.job_timeout_s = a.timeout_s;
  for (int attempt = 0;; ++attempt) {
    o.job_token = user_token ? token : make_job_token();
    bool task_failed = false;
    const int status = launch(o, &task_failed);
    if (!timeline.empty()) merge_task_timelines(o.tasks, timeline);
    if (status == 0 || !task_failed || attempt >= a.max_restarts) return status;
    std::fprintf(stderr,
                 "dtrain-run: the job failed (status %d); relaunching all of it, restart %d of %d "
                 "(--max-restarts); a program with --backup-dir resumes from its last backup\n",
                 status, attempt + 1, a.max_restarts);
    std::this_thread::sleep_for(std::chrono::seconds(1));
    // A stop signal that came since the last launch (it stays blocked, and pending, between
    // launches) ends the job instead of the relaunch.
    if (const int sig = take_pending_stop_signal()) {
      std::fprintf(stderr, "dtrain-run: got %s; not relaunching the job\n", strsignal(sig));
      return 128 + sig;
    }
    if (a.timeout_s > 0) {
      const double left =
          a.timeout_s -
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      if (left <= 0) {
        std::fprintf(stderr, "dtrain-run: timed out after %g s (--timeout); not relaunching\n",
                     a.timeout_s);
        return kExitTimeout;
      }
      o.timeout_s = left;
    }
    // Fresh ports on this host (the old ones may linger); a test host of --netns keeps its own.
    if (!a.port_base_given && a.netns.empty()) assign_local_ports(o.tasks, 0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dtrain-run: start a dtrain job of N worker processes (+ parameter servers) on this "
      "machine, each with its TF_CONFIG; or print the TF_CONFIGs of a multi-host job.\n"
      "  dtrain-run -np 2 [--ps 1] [--devices cpu:2] -- ./prog args...\n"
      "  dtrain-run --print-config -H node1:2,node2:2 [--port-base 23456]"};
  app.name("dtrain-run");
  app.footer(
      "When a task fails (exits non-zero or is killed by a signal), dtrain-run stops the others "
      "(SIGTERM, SIGKILL after --grace) and exits with that task's status (128 + signal).\n"
      "A job with --ps trains asynchronously (as under TensorFlow's ParameterServerStrategy) and "
      "survives workers coming and going: a non-chief worker (worker:1 and up) or the evaluator "
      "that fails does not stop it; the job goes on without that task, or restarts the worker "
      "(--restart-workers). Only the chief (worker:0) and the parameter servers stop the job by "
      "failing. Once every worker has finished, the parameter servers and the evaluator are "
      "stopped with SIGTERM, and dtrain-run exits 0 if the chief exited 0: a worker or evaluator "
      "that failed for good is named in a last line on stderr but does not make the status "
      "non-zero.\n"
      "Exit statuses: a failed task's; 124 on --timeout; 128 + signal when interrupted; 127 when "
      "the program is not found; 2 on bad usage.");
  Args a;
  auto* np = app.add_option("--np,-n", a.np, "number of worker processes (also -np)");
  app.add_option("--ps", a.ps, "number of parameter-server processes")->capture_default_str();
  app.add_flag("--evaluator", a.evaluator, "also start one evaluator task");
  app.add_option("--restart-workers", a.restart_workers,
                 "with --ps: start a failed non-chief worker again (same TF_CONFIG, after 1 s), at "
                 "most this many times per worker")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option(
         "--max-restarts", a.max_restarts,
         "relaunch the whole job after a task fails, at most this many times (as torchrun "
         "does); with BackupAndRestore (--backup-dir) the relaunched job resumes from the last "
         "backup. An interrupt or --timeout is not retried")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option(
      "--timeline-filename", a.timeline,
      "write a Chrome trace of every task (horovodrun's flag; same as DTRAIN_TIMELINE): each task "
      "records its steps, passes, gradient packs and collectives, and dtrain-run merges them into "
      "this one file, one process row per task");
  app.add_option("--devices", a.devices,
                 "passed to every task as --devices=<value> unless its arguments have --devices "
                 "(e.g. cpu:2)");
  app.add_option(
      "--netns", a.netns,
      "run task i on test host i mod H made by `tools/netns/dtrain-netns up --prefix PREFIX "
      "--hosts H` (its own network namespace, address and shaped link; needs root): each task "
      "listens on its host's 192.0.2.x address, ports from --port-base");
  app.add_option("--timeout", a.timeout_s,
                 "stop the job and exit 124 after this many seconds (0: none)")
      ->check(CLI::Range(0.0, 1e8))
      ->capture_default_str();
  app.add_option("--grace", a.grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping tasks (a stopped task is "
                 "continued with its SIGTERM, so it may finish its step first)")
      ->check(CLI::Range(0.0, 1e8))
      ->capture_default_str();
  app.add_option("--evaluator-grace", a.evaluator_grace_s,
                 "with --ps: seconds the evaluator gets, once every worker finished, to evaluate "
                 "the newest checkpoint after its SIGTERM before SIGKILL")
      ->check(CLI::Range(0.0, 1e8))
      ->capture_default_str();
  app.add_option(
         "--bind-to", a.bind_to,
         "core (default): bind each local task to an equal share of the cores this launcher may "
         "use (2 tasks on 4 cores: 2 each; more tasks than cores: one core each, round robin) "
         "and set OMP_NUM_THREADS to its share unless the environment sets it, as torchrun and "
         "mpirun do; none: no binding, every task sees every core")
      ->check(CLI::IsMember({"core", "none"}))
      ->capture_default_str();
  app.add_flag("--print-config", a.print_config,
               "print every task's TF_CONFIG (one line each) and exit; starts nothing");
  app.add_option(
      "-H,--hosts", a.hosts,
      "hosts as host:slots,... (horovodrun's -H): with --print-config, every host's TF_CONFIG; "
      "otherwise this machine's slots (localhost:N) run here, -np defaulting to their number");
  app.add_option(
      "--min-np", a.min_np,
      "elastic job (Horovod elastic, torchrun --nnodes=MIN:MAX): keep a MultiWorkerMirrored job "
      "going while at least this many workers live; the program uses dtrain::elastic (survivors "
      "roll "
      "back to the last commit and re-form; new workers get the state by broadcast)");
  app.add_option("--max-np", a.max_np, "elastic job: at most this many workers");
  app.add_option("--host-discovery-script", a.discovery_script,
                 "elastic job: a command printing the hosts workers may run on, host:slots per "
                 "line (horovodrun's "
                 "flag; localhost, or the namespaces of --netns), read every second: workers start "
                 "on new slots "
                 "up to --max-np, and those of a host no longer listed are stopped");
  app.add_option(
         "--elastic-timeout", a.elastic_timeout_s,
         "elastic job: seconds the workers wait for a round of at least --min-np workers to form "
         "(HOROVOD_ELASTIC_TIMEOUT)")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  app.add_option("--elastic-settle", a.elastic_settle_s,
                 "elastic job: seconds a round waits for a started worker that does not arrive (a "
                 "hung one) "
                 "before it forms without it")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  auto* port_base = app.add_option("--port-base", a.port_base,
                                   "with -H: task in slot s of a host listens on port-base + s; "
                                   "locally: fixed ports port-base + i instead of free ones")
                        ->check(CLI::Range(1, 65535))
                        ->capture_default_str();
  app.prefix_command();  // everything from the program on belongs to the program
  std::vector<std::string> args = normalise_argv(argc, argv);
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitUsage;
  }
  a.np_given = np->count() > 0;
  a.port_base_given = port_base->count() > 0;
  // The program and its arguments as given: normalise_argv's -np rewrite is for dtrain-run's own
  // options, not for a program started without -- (dtrain-run -np 2 ./prog -np 4).
  const std::size_t n_command = app.remaining().size();
  a.command.assign(argv + argc - static_cast<std::ptrdiff_t>(n_command), argv + argc);
  if (!a.command.empty() && a.command.front() == "--") a.command.erase(a.command.begin());
  try {
    const std::vector<std::string> rest = app.remaining();
    if (!rest.empty() && rest.front() != "--" && rest.front().rfind("-", 0) == 0) {
      throw UsageError("unknown option '" + rest.front() +
                       "'; see dtrain-run --help, and put the program and its arguments after --");
    }
    if (a.devices.empty() && app.count("--devices") > 0) {
      throw UsageError("--devices needs a value, e.g. --devices cpu:2");
    }
    if (a.restart_workers > 0 && a.ps == 0) {
      throw UsageError(
          "--restart-workers needs --ps: synchronous jobs cannot lose a worker (every step waits "
          "for all of them); give the job parameter servers, e.g. --ps 1, or drop "
          "--restart-workers");
    }
    if (a.restart_workers > 0 && a.print_config) {
      throw UsageError(
          "--restart-workers is for a job dtrain-run runs itself; --print-config "
          "starts nothing");
    }
    return a.print_config ? print_config(a) : run_local(a);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "dtrain-run: %s\n", e.what());
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-run: %s\n", e.what());
    return 1;
  }
}
