// The TCP transport of the collectives: a full mesh of authenticated connections (mesh.h), framed
// segments that carry each collective's fingerprint, heartbeats, and the ABORT frame. It implements
// the algorithms' Transport (collectives/algorithms/transport.h) with one poll loop that sends
// segments to one peer while receiving segments from another (full duplex, no threads), checking
// every received header's fingerprint and watching every other peer for an ABORT or a closed
// socket.
//
// Thread-safety: one thread runs exchanges; abort() and the heartbeat thread may run concurrently
// (a per-peer send mutex keeps frames whole; an exchange that fails with a frame half written ends
// that socket's stream, so nothing else is ever read as its payload). The transport must outlive an
// abort() in progress: a collective it fails can return before abort() has told every peer.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/algorithms/transport.h"
#include "collectives/tcp/mesh.h"
#include "collectives/tcp/shm_channel.h"

namespace dtrain::tcp {

// How long a TCP exchange polls (yielding the core) before it blocks in poll(): spinning answers
// a quick peer without a wake-up's tens of microseconds, but on a slow link almost every wait
// blocks anyway and the spinning only burns CPU. So the budget adapts: halved (down to kMinSpin)
// after a wait that spinning did not end, raised to four times what a successful spin took (up to
// kMaxSpin). `spun` is how long this wait spun, `found` whether it found work.
inline constexpr std::chrono::microseconds kMinSpin{4}, kMaxSpin{100};
inline std::chrono::microseconds next_spin_budget(std::chrono::microseconds budget,
                                                  std::chrono::microseconds spun, bool found) {
  if (!found) return std::max(kMinSpin, budget / 2);
  return std::clamp(std::max(budget, 4 * spun + kMinSpin), kMinSpin, kMaxSpin);
}

class TcpTransport final : public collectives::Transport {
 public:
  TcpTransport(TcpGroupOptions options, std::vector<Peer> peers);
  ~TcpTransport() override;
  int rank() const override { return o_.rank; }
  int size() const override { return static_cast<int>(peers_.size()); }
  void exchange(int to, const void* sbuf, size_t sbytes, int from, void* rbuf, size_t rbytes,
                const collectives::Fingerprint& fp,
                const collectives::SegmentFn& on_segment) override;
  // Tells every peer (an ABORT frame, best effort, non-blocking) and fails every later collective
  // here with Unavailable(reason); an exchange running on another thread fails at its next step
  // (a wake-up of its poll; through shared memory, within its wait's 500 us). Idempotent.
  void abort(const std::string& reason);
  // Throws Unavailable with the abort reason once aborted.
  void check_not_aborted() const;
  // "worker:1", for messages.
  std::string name() const;
  const TcpGroupOptions& options() const { return o_; }
  // Sent in the seq field of this rank's heartbeats; the last one heard from each peer (-1: none).
  void set_progress_marker(int64_t marker) { marker_.store(marker, std::memory_order_relaxed); }
  std::vector<int64_t> peer_markers() const;
  // Whether collective data goes through shared memory (every rank on this host agreed to it).
  bool uses_shared_memory() const { return shm_; }

 private:
  void heartbeat_loop();
  void shut_down();  // stops the heartbeat thread and closes the sockets
  void setup_shared_memory();
  void exchange_shm(int to, const char* sbuf, size_t sbytes, int from, char* rbuf, size_t rbytes,
                    const FrameHeader& fp, const collectives::SegmentFn& on_segment);
  // Reads whatever the sockets hold while data moves through shared memory: heartbeats (liveness),
  // an ABORT (throws), an EOF (throws when that peer is still needed).
  void watch_sockets(const FrameHeader& fp, int need_a, int need_b, Clock::time_point deadline);
  [[noreturn]] void mismatch(const Peer& p, const FrameHeader& got, const FrameHeader& want) const;
  FrameHeader header_of(const collectives::Fingerprint& fp) const;

  TcpGroupOptions o_;
  std::vector<Peer> peers_;
  std::vector<bool> closed_;                // peers whose socket reached EOF
  std::vector<std::mutex> send_mu_;         // per peer: one frame at a time (data vs heartbeat)
  std::vector<Clock::time_point> last_rx_;  // per peer: last byte received (liveness)
  std::thread heartbeat_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool stop_ = false;
  mutable std::mutex abort_mu_;  // guards abort_reason_
  std::atomic<bool> aborted_{false};
  int wake_fd_ = -1;  // an eventfd abort() writes: wakes an exchange's poll
  std::string abort_reason_;
  std::atomic<int64_t> marker_{-1};
  std::atomic<int> spin_budget_us_{static_cast<int>(kMaxSpin.count())};  // next_spin_budget
  std::unique_ptr<std::atomic<int64_t>[]> peer_marker_;  // per peer, from its heartbeats
  bool shm_ = false;
  std::vector<ShmChannel> tx_, rx_;  // per peer, when shm_: to it and from it
};

}  // namespace dtrain::tcp
