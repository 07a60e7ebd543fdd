#include "dtrain/core/timeline.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain::timeline {
namespace {

struct Event {
  std::string name;
  const char* category;
  int64_t begin, end;
};

struct ThreadBuffer {
  int tid;
  std::string name;
  std::vector<Event> events;
  std::mutex mu;  // taken by the owner per event (uncontended) and by flush
};

constexpr int64_t kMaxEvents =
    4'000'000;                    // about 400 MB of trace: then recording stops, with a warning
thread_local std::string t_name;  // set_thread_name's, kept until the buffer exists

struct Recorder {
  std::atomic<bool> on{false};
  std::atomic<int64_t> events{0};
  std::mutex mu;
  std::string path;
  std::vector<std::shared_ptr<ThreadBuffer>> threads;
  int next_tid = 0;
  bool flushed = false;

  Recorder() {
    if (const char* p = std::getenv("DTRAIN_TIMELINE"); p && *p) start(p);
  }
  void start(const std::string& p) {
    std::lock_guard<std::mutex> lock(mu);
    path = p;
    flushed = false;
    if (!on.exchange(true)) std::atexit([] { flush_timeline(); });
  }
  std::shared_ptr<ThreadBuffer> buffer() {
    thread_local std::shared_ptr<ThreadBuffer> mine;
    if (!mine) {
      mine = std::make_shared<ThreadBuffer>();
      std::lock_guard<std::mutex> lock(mu);
      mine->tid = next_tid++;
      mine->name = !t_name.empty()  ? t_name
                   : mine->tid == 0 ? "main"
                                    : "thread " + std::to_string(mine->tid);
      threads.push_back(mine);
    }
    return mine;
  }
};

Recorder& recorder() {
  static Recorder* r = new Recorder;  // never destroyed: threads may record during exit
  return *r;
}

// Where this process writes, and the name of its row.
std::pair<std::string, std::string> destination(const std::string& path) {
  if (const char* task = std::getenv("DTRAIN_TASK"); task && *task) {
    std::string t = task;
    std::string file = t;
    for (char& c : file)
      if (c == ':') c = '-';
    return {path + "." + file + ".json", t};
  }
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"})
    if (const char* r = std::getenv(v); r && *r)
      return {path + ".rank" + std::string(r) + ".json", "rank " + std::string(r)};
  return {path, "pid " + std::to_string(::getpid())};
}

int process_index(const std::string& row) {
  const size_t colon = row.find_last_of(": ");
  if (colon == std::string::npos) return 0;
  try {
    return std::stoi(row.substr(colon + 1));
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

bool enabled() { return recorder().on.load(std::memory_order_relaxed); }

void enable(const std::string& path) {
  if (path.empty()) throw InvalidArgument("timeline::enable: the path is empty");
  recorder().start(path);
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void complete(const std::string& name, const char* category, int64_t begin, int64_t end) {
  if (!enabled()) return;
  if (recorder().events.fetch_add(1, std::memory_order_relaxed) >= kMaxEvents) {
    if (recorder().on.exchange(false)) {
      DTRAIN_LOG(WARNING) << "timeline: " << kMaxEvents
                          << " events recorded; recording stops here (the file keeps them)";
    }
    return;
  }
  auto b = recorder().buffer();
  std::lock_guard<std::mutex> lock(b->mu);
  b->events.push_back({name, category, begin, std::max(begin, end)});
}

void set_thread_name(const std::string& name) {
  t_name = name;
  // The system's name too (15 characters), for top -H, perf and gdb.
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  if (!enabled()) return;  // the buffer, made at the first event, takes the name then
  auto b = recorder().buffer();
  std::lock_guard<std::mutex> lock(b->mu);
  b->name = name;
}

std::string flush_timeline() {
  Recorder& r = recorder();
  if (r.path.empty()) return "";
  std::lock_guard<std::mutex> lock(r.mu);
  const auto [file, row] = destination(r.path);
  const int pid = process_index(row);
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", row}}}});
  events.push_back(
      {{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
  // Threads of the same name share a row (one input pipeline thread per epoch, say).
  std::map<std::string, int> row_of;
  for (const auto& t : r.threads) {
    std::lock_guard<std::mutex> tl(t->mu);
    auto [it, fresh] = row_of.try_emplace(t->name, static_cast<int>(row_of.size()));
    if (fresh)
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", it->second},
                        {"args", {{"name", t->name}}}});
    for (const Event& e : t->events)
      events.push_back({{"name", e.name},
                        {"cat", e.category},
                        {"ph", "X"},
                        {"pid", pid},
                        {"tid", it->second},
                        {"ts", e.begin},
                        {"dur", e.end - e.begin}});
  }
  const std::string tmp = file + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) {
      DTRAIN_LOG(WARNING) << "timeline: cannot write " << file;
      return "";
    }
    f << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
  }
  std::rename(tmp.c_str(), file.c_str());
  return file;
}

void merge_timeline_files(const std::vector<std::string>& inputs, const std::string& output) {
  nlohmann::json all = nlohmann::json::array();
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::ifstream f(inputs[i]);
    if (!f) throw Unavailable("timeline: cannot read " + inputs[i]);
    nlohmann::json j;
    try {
      f >> j;
    } catch (const nlohmann::json::exception& e) {
      throw DataLoss("timeline: " + inputs[i] + " is not a trace file: " + e.what());
    }
    if (!j.contains("traceEvents") || !j["traceEvents"].is_array())
      throw DataLoss("timeline: " + inputs[i] + " has no traceEvents array");
    for (auto& e : j["traceEvents"]) {
      e["pid"] = static_cast<int>(i);
      if (e.value("name", "") == "process_sort_index")
        e["args"]["sort_index"] = static_cast<int>(i);
      all.push_back(std::move(e));
    }
  }
  const std::string tmp = output + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) throw Unavailable("timeline: cannot write " + output);
    f << nlohmann::json{{"traceEvents", all}, {"displayTimeUnit", "ms"}}.dump();
  }
  if (std::rename(tmp.c_str(), output.c_str()) != 0)
    throw Unavailable("timeline: cannot write " + output);
}

}  // namespace dtrain::timeline
