// The timeline: a Chrome trace (chrome://tracing, Perfetto) of what every thread of every rank did,
// as Horovod's HOROVOD_TIMELINE gives. Set DTRAIN_TIMELINE=path (dtrain-run --timeline-filename
// sets it for every task): fit() records each step's data fetch, forward and backward passes, every
// gradient pack (waiting for its gradients, packing, the all-reduce stages, unpacking) and the
// optimizer update, on each replica's thread; hvd records its negotiations and collectives.
//
// Files: a process started by dtrain-run (DTRAIN_TASK set) writes `<path>.<task>.json` at exit and
// dtrain-run merges them into `<path>`, one process row per task; a process under mpirun or srun
// writes `<path>.rank<N>.json` (merge them with merge_timeline_files or `dtrain-run
// --merge-timeline`); a lone process writes `<path>`. Timestamps are the system clock in
// microseconds, so rows of tasks on one machine line up.
//
// Cost: when off, a Span is one relaxed atomic load. When on, events go to a buffer per thread
// (an uncontended lock per event) and are written at the end of every fit(), at exit, and by
// flush_timeline(); after 4 million events recording stops with a WARNING. A task stopped by a
// signal keeps what the last flush wrote.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/export.h"

namespace dtrain::timeline {

// Whether events are being recorded (DTRAIN_TIMELINE was set, or enable() was called).
DTRAIN_API bool enabled();
// Starts recording to `path` (the file this process writes, as described above).
DTRAIN_API void enable(const std::string& path);
// Microseconds on the system clock.
DTRAIN_API int64_t now_us();
// Records a finished event on the calling thread.
DTRAIN_API void complete(const std::string& name, const char* category, int64_t begin_us,
                         int64_t end_us);
// Names the calling thread's row ("CPU:0 replica 0", "hvd"): the last name given wins.
DTRAIN_API void set_thread_name(const std::string& name);
// Writes this process's events now (also done at exit). Returns the file written ("" when off).
DTRAIN_API std::string flush_timeline();
// Merges per-process trace files into one (process rows keep their names; each input's pid becomes
// its index). Throws DataLoss naming a file that is not a trace, Unavailable when one cannot be
// read.
DTRAIN_API void merge_timeline_files(const std::vector<std::string>& inputs,
                                     const std::string& output);

// An event from construction to destruction, on the calling thread.
class DTRAIN_API Span {
 public:
  Span(const char* name, const char* category = "dtrain") : on_(enabled()) {
    if (on_) {
      name_ = name;
      category_ = category;
      begin_ = now_us();
    }
  }
  Span(std::string name, const char* category = "dtrain") : on_(enabled()) {
    if (on_) {
      name_ = std::move(name);
      category_ = category;
      begin_ = now_us();
    }
  }
  ~Span() {
    if (on_) complete(name_, category_, begin_, now_us());
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool on_;
  std::string name_;
  const char* category_ = "";
  int64_t begin_ = 0;
};

}  // namespace dtrain::timeline
