// `dtrain-bench chaos`: R training jobs across the test hosts of tools/netns/dtrain-netns, one
// fault injected into each at a random moment — kill -9 a task, SIGSTOP it, cut its link at the
// switch, or take its own interface down (all its packets dropped) — and then what happened:
// whether the job ended (no hang), whether every survivor exited non-zero naming the lost task and
// how soon, and whether the same job relaunched from its BackupAndRestore backup finished.
// MultiWorkerMirrored jobs lose a non-chief worker; ParameterServer jobs lose their ps task (a
// ParameterServer job goes on without a lost worker by design). Random loss needs tc netem, which
// some kernels lack; the probe says so and leaves it out.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "bench_util.h"

namespace dtrain::bench {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

int run_quiet(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

// Starts `cmd` under /bin/sh with stdout and stderr to `log`; returns the pid.
pid_t start(const std::string& cmd, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    const std::string full = "exec " + cmd + " >" + log + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// Waits up to `limit` for pid; returns its exit status, or -1 when it is still running.
int wait_for(pid_t pid, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (Clock::now() >= end) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<pid_t> pids_in(const std::string& ns) {
  std::vector<pid_t> out;
  std::FILE* p = ::popen(("ip netns pids " + ns + " 2>/dev/null").c_str(), "r");
  if (!p) return out;
  for (long v; std::fscanf(p, "%ld", &v) == 1;) out.push_back(static_cast<pid_t>(v));
  ::pclose(p);
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Heals host `victim` after a fault: stopped processes continued and killed, links restored.
void heal(const std::string& netns_tool, const std::string& prefix, int victim) {
  const std::string ns = prefix + "-h" + std::to_string(victim);
  for (pid_t p : pids_in(ns)) ::kill(p, SIGCONT), ::kill(p, SIGKILL);
  run_quiet(netns_tool + " link --prefix " + prefix + " " + std::to_string(victim) + " --up");
  run_quiet("ip -n " + ns + " link set eth0 up");
}

void inject(const std::string& fault, const std::string& netns_tool, const std::string& prefix,
            int victim) {
  const std::string ns = prefix + "-h" + std::to_string(victim);
  if (fault == "kill" || fault == "stop")
    for (pid_t p : pids_in(ns)) ::kill(p, fault == "kill" ? SIGKILL : SIGSTOP);
  else if (fault == "link_down")
    run_quiet(netns_tool + " link --prefix " + prefix + " " + std::to_string(victim) + " --down");
  else
    run_quiet("ip -n " + ns + " link set eth0 down");
}

// Elastic jobs: W workers on hosts 0..W-1 (any may be hit, rank 0 included) and a spare host W, all
// listed by the discovery script; each job must re-form and finish with every optimizer step
// applied once (the example's JSON), within a bound.
int elastic_chaos(const ChaosArgs& a, const std::string& netns_tool, const std::string& dtrain_run,
                  const fs::path& dir) {
  const std::string example =
      (fs::path(self_dir()).parent_path() / "examples" / "elastic_fashion_mnist").string();
  const std::string hosts_file = (dir / "hosts").string(), script = (dir / "discover.sh").string();
  {
    std::ofstream h(hosts_file);
    for (int i = 0; i <= a.workers; ++i) h << a.prefix << "-h" << i << ":1\n";
    std::ofstream s(script);
    s << "#!/bin/sh\ncat " << hosts_file << "\n";
  }
  fs::permissions(script, fs::perms::owner_all);
  const int64_t steps = 2 * 9600 / 96;
  std::mt19937_64 rng(a.seed);
  const std::vector<std::string> faults = {"kill", "stop", "link_down", "drop"};
  struct Tally {
    int jobs = 0, finished = 0, failed = 0, hung = 0, wrong_steps = 0, no_reset = 0;
    double worst_s = 0;
  };
  std::map<std::string, Tally> tally;
  int bad = 0;
  for (int j = 0; j < a.jobs; ++j) {
    // Every (strategy, fault) pair in turn, so 8 jobs cover them all; victim and moment are drawn.
    const std::string fault = faults[static_cast<size_t>(j / 2) % faults.size()];
    const int victim = static_cast<int>(rng() % static_cast<uint64_t>(a.workers));
    const double at_s = 1.0 + std::uniform_real_distribution<double>(0.0, a.max_fault_s - 1.0)(rng);
    const std::string job =
        dtrain_run + " --netns " + a.prefix + " --timeout 150 --grace 2 --min-np 2 --max-np " +
        std::to_string(a.workers) + " -np " + std::to_string(a.workers) +
        " --host-discovery-script " + script + " --elastic-settle 3 --elastic-timeout 40 -- " +
        example + " --train-limit=9600 --epochs=2 --batch-size=96 --commit-every=10 --json";
    const std::string log = (dir / ("elastic" + std::to_string(j) + ".log")).string();
    const auto t0 = Clock::now();
    const pid_t pid = start(job, log);
    int status = wait_for(pid, std::chrono::milliseconds(static_cast<int64_t>(at_s * 1000)));
    const bool before = status >= 0;
    if (!before) {
      inject(fault, netns_tool, a.prefix, victim);
      status = wait_for(pid, std::chrono::seconds(170));
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    Tally& t = tally[fault];
    ++t.jobs;
    std::string what;
    if (status < 0) {
      ++t.hung, ++bad;
      ::kill(-pid, SIGKILL);
      wait_for(pid, std::chrono::seconds(10));
      what = "HUNG";
    } else {
      const std::string out = slurp(log);
      nlohmann::json r;
      for (size_t at = out.find("{\"example\""); at != std::string::npos;
           at = out.find("{\"example\"", at + 1))
        r = nlohmann::json::parse(out.substr(at, out.find('\n', at) - at), nullptr, false);
      const bool ok =
          status == 0 && r.is_object() && r.value("optimizer_steps", int64_t{-1}) == steps;
      const int resets = r.is_object() ? r.value("resets", 0) : 0;
      if (ok) {
        ++t.finished;
        t.worst_s = std::max(t.worst_s, took);
        if (resets == 0) ++t.no_reset;  // the fault came after the last collective
      } else {
        ++bad;
        if (status != 0)
          ++t.failed;
        else
          ++t.wrong_steps;
      }
      char buf[160];
      std::snprintf(
          buf, sizeof(buf), "exit %d after %.1f s, %s, %d reset(s)%s", status, took,
          r.is_object()
              ? (std::to_string(r.value("optimizer_steps", int64_t{-1})) + " steps").c_str()
              : "no result",
          resets, before ? " (ended before the fault)" : "");
      what = buf;
    }
    heal(netns_tool, a.prefix, victim);
    std::fprintf(stderr, "elastic job %d/%d: %s on worker host %d at %.1f s: %s\n", j + 1, a.jobs,
                 fault.c_str(), victim, at_s, what.c_str());
  }
  std::printf(
      "chaos --elastic: %d jobs of %d workers (--min-np 2) on %d test hosts (%s links), %lld steps "
      "each\n",
      a.jobs, a.workers, a.workers + 1, a.rate.c_str(), static_cast<long long>(steps));
  std::printf("%-12s %5s %9s %14s %7s %12s %12s\n", "fault", "jobs", "finished", "slowest (s)",
              "hung", "failed", "wrong steps");
  for (const auto& [k, t] : tally) {
    std::printf("%-12s %5d %9d %14.1f %7d %12d %12d\n", k.c_str(), t.jobs, t.finished, t.worst_s,
                t.hung, t.failed, t.wrong_steps);
    if (a.json)
      std::printf("%s\n", nlohmann::json{{"benchmark", "chaos_elastic"},
                                         {"fault", k},
                                         {"jobs", t.jobs},
                                         {"finished", t.finished},
                                         {"hung", t.hung},
                                         {"failed", t.failed},
                                         {"wrong_steps", t.wrong_steps},
                                         {"slowest_s", t.worst_s}}
                              .dump()
                              .c_str());
  }
  return bad;
}

}  // namespace

int chaos_bench(const ChaosArgs& a) {
  const std::string netns_tool = source_dir() + "/tools/netns/dtrain-netns";
  const std::string dtrain_run = self_dir() + "/dtrain-run";
  const std::string example =
      (fs::path(self_dir()).parent_path() / "examples" / "fashion_mnist").string();
  const std::string prefix = a.prefix;
  const int hosts =
      a.workers + 1;  // MWMS uses the first `workers`; a PS job adds its ps on the last
  const int up = std::system((netns_tool + " up --prefix " + prefix + " --hosts " +
                              std::to_string(hosts) + " --rate " + a.rate + " >/dev/null")
                                 .c_str());
  if (up != 0) {
    std::fprintf(
        stderr,
        "dtrain-bench chaos: cannot make the test hosts (dtrain-netns up exited %d; needs root)\n",
        WEXITSTATUS(up));
    return WEXITSTATUS(up) == 77 ? 77 : 1;
  }
  const fs::path dir = fs::temp_directory_path() / ("dtrain-chaos-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  // Every job's TCP groups take the heartbeat timeout the bound below is computed from.
  ::setenv("DTRAIN_HEARTBEAT_TIMEOUT", std::to_string(a.heartbeat_timeout_s).c_str(), 1);
  if (a.elastic) {
    const int bad = elastic_chaos(a, netns_tool, dtrain_run, dir);
    run_quiet(netns_tool + " down --prefix " + prefix);
    if (bad == 0)
      fs::remove_all(dir);
    else
      std::printf("logs of every job: %s\n", dir.c_str());
    return bad == 0 ? 0 : 1;
  }
  std::mt19937_64 rng(a.seed);
  const std::vector<std::string> faults = {"kill", "stop", "link_down", "drop"};
  struct Tally {
    int jobs = 0, hung = 0, named = 0, failed_not_named = 0, finished_anyway = 0, resumed = 0;
    double worst_detect_s = 0;
  };
  std::map<std::string, Tally> tally;  // by "strategy fault"
  const double bound_s = 2 * a.heartbeat_timeout_s;
  int bad = 0;
  // Every (strategy, fault) pair in turn, so 8 jobs cover them all (or the pairs --cases names);
  // victim and moment are drawn.
  std::vector<std::pair<std::string, std::string>> cases;
  if (a.cases.empty()) {
    for (const auto& f : faults)
      for (const char* s : {"multi_worker_mirrored", "parameter_server"}) cases.emplace_back(s, f);
  } else {
    for (const auto& c : a.cases)
      cases.emplace_back(c.substr(0, c.find(':')), c.substr(c.find(':') + 1));
  }
  for (int j = 0; j < a.jobs; ++j) {
    const auto& [strategy, fault] = cases[static_cast<size_t>(j) % cases.size()];
    const bool ps = strategy == "parameter_server";
    const int victim =
        ps ? a.workers : 1 + static_cast<int>(rng() % static_cast<uint64_t>(a.workers - 1));
    const std::string victim_task = ps ? "ps:0" : "worker:" + std::to_string(victim);
    const double at_s = 1.0 + std::uniform_real_distribution<double>(0.0, a.max_fault_s - 1.0)(rng);
    const fs::path backup = dir / ("job" + std::to_string(j));
    const std::string job = dtrain_run + " --netns " + prefix + " --timeout 120 --grace 2 -np " +
                            std::to_string(a.workers) + (ps ? " --ps 1" : "") + " -- " + example +
                            " --strategy=" + strategy + " --steps=" + std::to_string(a.steps) +
                            " --batch-size=96 --train-limit=6144 --no-eval --backup-dir " +
                            backup.string() + " --backup-every 10 --json";
    const std::string log = (dir / ("job" + std::to_string(j) + ".log")).string();
    const pid_t pid = start(job, log);
    int status = wait_for(pid, std::chrono::milliseconds(static_cast<int64_t>(at_s * 1000)));
    Tally& t = tally[strategy + " " + fault];
    ++t.jobs;
    std::string what;
    if (status >= 0) {
      ++t.finished_anyway;  // ended before the fault: nothing was lost
      what = "ended before the fault (" + std::to_string(status) + ")";
    } else {
      const auto fault_at = Clock::now();
      inject(fault, netns_tool, prefix, victim);
      status =
          wait_for(pid, std::chrono::milliseconds(static_cast<int64_t>((bound_s + 15) * 1000)));
      const double took = std::chrono::duration<double>(Clock::now() - fault_at).count();
      if (status < 0) {
        ++t.hung;
        ++bad;
        ::kill(-pid, SIGKILL);
        wait_for(pid, std::chrono::seconds(10));
        what = "HUNG";
      } else if (status == 0 || slurp(log).find("all workers finished") != std::string::npos) {
        ++t.finished_anyway;  // the fault came as training ended: every worker finished its steps
        what = "training had ended (" + std::to_string(status) + ")";
      } else {
        const std::string out = slurp(log);
        // The lost task is named: by the survivors' errors (Unavailable naming it), or by
        // dtrain-run when it saw the task die first and stopped the job.
        const bool named = status != 0 && out.find(victim_task) != std::string::npos &&
                           (out.find("Unavailable") != std::string::npos ||
                            out.find("dtrain-run: " + victim_task) != std::string::npos);
        if (named) {
          ++t.named;
          t.worst_detect_s = std::max(t.worst_detect_s, took);
          if (took > bound_s + 2) ++bad;  // + the launcher's grace and process teardown
        } else {
          ++t.failed_not_named;
          ++bad;
        }
        char buf[96];
        std::snprintf(buf, sizeof(buf), "exit %d after %.1f s%s", status, took,
                      named ? ", lost task named" : ", NOT NAMED");
        what = buf;
      }
      heal(netns_tool, prefix, victim);
    }
    // The same job again: BackupAndRestore resumes from the last backup and it must finish.
    const pid_t again = start(job, log + ".relaunch");
    const int rs = wait_for(again, std::chrono::seconds(150));
    if (rs == 0) {
      ++t.resumed;
    } else {
      ++bad;
      if (rs < 0) ::kill(-again, SIGKILL), wait_for(again, std::chrono::seconds(10));
    }
    std::fprintf(stderr, "job %d/%d: %s, %s on %s at %.1f s: %s; relaunch %s\n", j + 1, a.jobs,
                 strategy.c_str(), fault.c_str(), victim_task.c_str(), at_s, what.c_str(),
                 rs == 0 ? "finished" : "FAILED");
    if (rs != 0) {  // why, in the output itself (a CI log outlives the machine's /tmp)
      std::vector<std::string> lines;
      std::istringstream in(slurp(log + ".relaunch"));
      for (std::string line; std::getline(in, line);) lines.push_back(line);
      std::fprintf(stderr, "  the relaunch's last lines:\n");
      for (size_t i = lines.size() > 8 ? lines.size() - 8 : 0; i < lines.size(); ++i)
        std::fprintf(stderr, "  %s\n", lines[i].c_str());
    }
  }
  run_quiet(netns_tool + " down --prefix " + prefix);
  std::printf(
      "chaos: %d jobs on %d test hosts (%s links), heartbeat timeout %.0f s, bound %.0f s after "
      "the fault\n",
      a.jobs, hosts, a.rate.c_str(), a.heartbeat_timeout_s, bound_s);
  std::printf("%-34s %5s %5s %14s %10s %8s %12s %8s\n", "strategy / fault", "jobs", "hung",
              "named (worst)", "not named", "no fault", "", "resumed");
  for (const auto& [k, t] : tally) {
    char worst[32];
    std::snprintf(worst, sizeof(worst), "%d (%.1f s)", t.named, t.worst_detect_s);
    std::printf("%-34s %5d %5d %14s %10d %8d %12s %8d\n", k.c_str(), t.jobs, t.hung, worst,
                t.failed_not_named, t.finished_anyway, "", t.resumed);
    if (a.json) {
      nlohmann::json js{{"benchmark", "chaos"},
                        {"case", k},
                        {"jobs", t.jobs},
                        {"hung", t.hung},
                        {"named", t.named},
                        {"worst_detect_s", t.worst_detect_s},
                        {"not_named", t.failed_not_named},
                        {"ended_before_fault", t.finished_anyway},
                        {"resumed", t.resumed}};
      std::printf("%s\n", js.dump().c_str());
    }
  }
  std::printf(
      "random packet loss: not injected (needs tc netem%s)\n",
      run_quiet("tc qdisc add dev lo root netem loss 0%") == 0 ? "" : ", which this kernel lacks");
  run_quiet("tc qdisc del dev lo root");
  if (bad == 0)
    fs::remove_all(dir);
  else
    std::printf("logs of every job: %s\n", dir.c_str());
  return bad == 0 ? 0 : 1;
}

}  // namespace dtrain::bench
