// StopSignals: SIGTERM and SIGINT as a flag a loop polls (SidecarEvaluatorOptions::stop, a training
// loop's "stop after this step"), taken without a signal handler.
//
//   int main() {
//     dtrain::StopSignals stop;   // first, before any thread starts
//     ...
//     while (!stop.requested()) step();
//   }
//
// Why not std::signal(SIGTERM, handler): a handler runs on the stack of whichever thread the signal
// interrupts, and oneDNN's float32 GEMM kernels before 3.11 (jit_avx512_common_gemm_f32 and the
// AVX2 ones; Debian 12 ships 2.6) point the stack register at a heap workspace while they run, so
// the kernel writes the handler's signal frame (2-3 KB with the AVX-512 registers) over the heap
// below it: glibc aborts later with "corrupted size vs. prev_size" (uxlfoundation/oneDNN#4845).
// dtrain's sidecar evaluator did, in about 1 job in 40. The same holds for any handler, a sampling
// profiler's included.
//
// StopSignals blocks its signals in the calling thread, so every thread started after it inherits
// the blocked mask, and takes them with sigwait on a thread of its own ("stop signals"): the first
// sets requested(); a second one ends the process as the signal would have without a handler (a
// second Ctrl-C stops for good). Threads already running keep their masks: the constructor logs a
// warning when there are any (a signal delivered to one of them ends the process at once).
//
// Thread-safety: requested(), signal() and flag() from any thread.
#pragma once

#include <atomic>
#include <csignal>
#include <thread>
#include <vector>

#include "dtrain/core/export.h"

namespace dtrain {

class DTRAIN_API StopSignals {
 public:
  explicit StopSignals(std::vector<int> signals = {SIGTERM, SIGINT});
  // Stops its thread and unblocks the signals again in the calling thread: destroy it on the thread
  // that made it. Threads started meanwhile keep them blocked (the signals' default actions then
  // reach the process through the threads that do not).
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  bool requested() const { return flag_.load(); }
  // The first signal taken (SIGTERM, ...), 0 before.
  int signal() const { return signal_.load(); }
  // requested() as the flag SidecarEvaluatorOptions::stop points to.
  const std::atomic<bool>& flag() const { return flag_; }

 private:
  void wait_loop();
  std::vector<int> signals_;
  std::atomic<bool> flag_{false}, closing_{false};
  std::atomic<int> signal_{0};
  bool was_blocked_[65] = {};  // in the constructing thread, before
  std::thread waiter_;
};

}  // namespace dtrain
