// Adam's update over the reference CNN's 225k weights, timed alone on core 0 and then on cores 0
// and 1 at the same moment, each after streaming a buffer that evicts the weights and their state
// from the caches (as a training step's forward and backward passes do). It shows whether two
// replicas slow each other down in the optimizer through the memory system. Not built by CMake:
//
//   g++ -O3 -march=native -fno-math-errno bench/micro/adam_memory.cc -o /tmp/adam_memory -pthread
//   /tmp/adam_memory 16      # MB streamed before each update (0: the state stays in the caches)
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

void pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

std::atomic<int> arrived{0};

// Mean microseconds of one update; `threads` callers start each update together.
double adam_us(int core, int threads, size_t evict_mb, int reps) {
  pin(core);
  const size_t n = 225034;  // the reference CNN's trainable weights
  std::vector<float> w(n, 1.f), g(n, 0.1f), m(n, 0.f), v(n, 0.f), junk(evict_mb << 18);
  double total = 0;
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < junk.size(); i += 16) junk[i] += 1.f;
    arrived.fetch_add(1);
    while (arrived.load() < (r + 1) * threads) {
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < n; ++i) {
      m[i] = 0.9f * m[i] + 0.1f * g[i];
      v[i] = 0.999f * v[i] + 0.001f * g[i] * g[i];
      w[i] -= 1e-3f * m[i] / (std::sqrt(v[i]) + 1e-7f);
    }
    total +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  return total / reps;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t mb = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 16;
  const int reps = 300;
  arrived = 0;
  std::printf("evicting %zu MB: alone %.1f us\n", mb, adam_us(0, 1, mb, reps));
  arrived = 0;
  double a = 0, b = 0;
  std::thread t0([&] { a = adam_us(0, 2, mb, reps); }), t1([&] { b = adam_us(1, 2, mb, reps); });
  t0.join();
  t1.join();
  std::printf("evicting %zu MB: both cores at once %.1f and %.1f us\n", mb, a, b);
}
