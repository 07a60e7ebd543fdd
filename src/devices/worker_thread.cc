#include "devices/worker_thread.h"

namespace dtrain {

WorkerThread::WorkerThread(std::function<void()> init)
    : thread_([this, init = std::move(init)] { loop(init); }) {}

WorkerThread::~WorkerThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::future<void> WorkerThread::submit(std::function<void()> fn) {
  std::packaged_task<void()> task(std::move(fn));
  std::future<void> f = task.get_future();
  if (on_this_thread()) {  // re-entrant submit would deadlock waiting on itself: run inline
    task();
    return f;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return f;
}

void WorkerThread::loop(const std::function<void()>& init) {
  if (init) init();
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace dtrain
