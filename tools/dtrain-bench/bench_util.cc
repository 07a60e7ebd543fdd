#include "bench_util.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "dtrain/core/strings.h"

namespace dtrain::bench {

std::vector<nlohmann::json> run_json_lines(const std::string& cmd, const std::string& stderr_log) {
  std::FILE* p = ::popen((cmd + " 2>" + stderr_log).c_str(), "r");
  if (!p) throw std::runtime_error("cannot start: " + cmd);
  std::vector<nlohmann::json> out;
  std::array<char, 8192> buf;
  while (std::fgets(buf.data(), buf.size(), p)) {
    std::string line = buf.data();
    if (line.rfind("[", 0) == 0 &&
        line.find("] {") != std::string::npos)  // "[worker:0] {...}" from dtrain-run
      line = line.substr(line.find("] {") + 2);
    if (!line.empty() && line[0] == '{') {
      try {
        out.push_back(nlohmann::json::parse(line));
      } catch (const nlohmann::json::exception&) {
      }
    }
  }
  const int rc = ::pclose(p);
  if (rc != 0)
    throw std::runtime_error("command failed (status " + std::to_string(rc) +
                             "; its stderr is in " + stderr_log + "): " + cmd);
  if (out.empty()) throw std::runtime_error("no JSON result from: " + cmd);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

CpuTicks parse_cpu_ticks(const std::string& proc_stat) {
  CpuTicks t;
  std::istringstream in(proc_stat);
  for (std::string line; std::getline(in, line);) {
    // "cpu0 user nice system idle iowait irq softirq steal guest guest_nice"; guest time is
    // already counted in user and nice, so it is left out of the total.
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 ||
        !std::isdigit(static_cast<unsigned char>(line[3])))
      continue;
    std::istringstream fields(line.substr(3));
    CoreTicks core;
    if (!(fields >> core.cpu)) continue;
    std::vector<unsigned long long> v;
    for (unsigned long long x; fields >> x;) v.push_back(x);
    if (v.size() < 4) continue;  // not the kernel's format: user nice system idle at least
    for (size_t i = 0; i < v.size() && i < 8; ++i) core.total += v[i];
    core.steal = v.size() > 7 ? v[7] : 0;
    t.cores.push_back(core);
  }
  return t;
}

CpuTicks cpu_ticks() {
  std::ifstream in("/proc/stat");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_cpu_ticks(text.str());
}

double steal_share(const CpuTicks& before, const CpuTicks& after, const std::vector<int>& cpus) {
  double most = std::numeric_limits<double>::quiet_NaN();
  for (const CoreTicks& b : before.cores) {
    if (!cpus.empty() && std::find(cpus.begin(), cpus.end(), b.cpu) == cpus.end()) continue;
    const auto a = std::find_if(after.cores.begin(), after.cores.end(),
                                [&](const CoreTicks& c) { return c.cpu == b.cpu; });
    if (a == after.cores.end() || a->total <= b.total || a->steal < b.steal) continue;
    const double share =
        static_cast<double>(a->steal - b.steal) / static_cast<double>(a->total - b.total);
    most = std::isnan(most) ? share : std::max(most, share);
  }
  return most;
}

std::string self_dir() {
  return std::filesystem::canonical("/proc/self/exe").parent_path().string();
}

std::string source_dir() { return DTRAIN_SOURCE_DIR; }

namespace {
// The value of the first /proc/cpuinfo line whose key (before the tabs and ':') is `key`.
std::string cpuinfo(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    while (!k.empty() && (k.back() == '\t' || k.back() == ' ')) k.pop_back();
    if (k == key) return colon + 2 <= line.size() ? line.substr(colon + 2) : "";
  }
  return "";
}
}  // namespace

std::string cpu_model() {
  const std::string m = cpuinfo("model name");
  return m.empty() ? "unknown CPU" : m;
}

bool cpu_flag(const std::string& flag) {
  std::string flags = cpuinfo("flags"), want = flag;
  flags.insert(flags.begin(), ' ');
  flags.push_back(' ');
  want.insert(want.begin(), ' ');
  want.push_back(' ');
  return flags.find(want) != std::string::npos;  // (not " " + s: GCC 12 warns -Wrestrict on it)
}

std::string cpu_description() {
  const auto yes = [](bool b) { return b ? "yes" : "no"; };
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "CPU: %s (family %s model %s), %u logical CPUs; AVX2 %s, AVX-512F %s, AVX-512 BF16 "
                "%s, AMX-BF16 %s",
                cpu_model().c_str(), cpuinfo("cpu family").c_str(), cpuinfo("model").c_str(),
                std::thread::hardware_concurrency(), yes(cpu_flag("avx2")),
                yes(cpu_flag("avx512f")), yes(cpu_flag("avx512_bf16")), yes(cpu_flag("amx_bf16")));
  return buf;
}

std::vector<long> parse_sizes(const std::string& s) {
  std::vector<long> out;
  for (const std::string_view given : split_list(s)) {
    std::string item(given);
    long mult = 1;
    if (!item.empty() && (item.back() == 'K' || item.back() == 'k')) mult = 1024;
    if (!item.empty() && (item.back() == 'M' || item.back() == 'm')) mult = 1024 * 1024;
    if (mult != 1) item.pop_back();
    size_t used = 0;
    long v = -1;
    try {
      v = std::stol(item, &used);
    } catch (const std::exception&) {
    }
    if (v < 0 || used != item.size())
      throw std::invalid_argument("bad size '" + std::string(given) +
                                  "' in --sizes; use bytes with K/M suffixes, e.g. 4K,1M,64M");
    out.push_back(v * mult);
  }
  return out;
}

}  // namespace dtrain::bench
