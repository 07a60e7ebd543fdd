// A thread that runs submitted closures in FIFO order. Used by every Device so that each replica
// has its own thread. Exceptions thrown by a closure are delivered through its future.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace dtrain {

class WorkerThread {
 public:
  // `init` runs first on the new thread (thread counts, CUDA context).
  explicit WorkerThread(std::function<void()> init);
  ~WorkerThread();  // drains the queue, then joins
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  std::future<void> submit(std::function<void()> fn);
  bool on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void loop(const std::function<void()>& init);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dtrain
