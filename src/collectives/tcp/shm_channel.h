// Shared-memory channels between ranks of one TCP group that run on the same host: one ring buffer
// per direction of each pair, in a POSIX shared-memory segment the sender creates and the receiver
// maps. The TCP transport moves collective data through them instead of loopback sockets (one copy
// in, one copy out, no system call per segment), and keeps the sockets for everything else: the
// rendezvous, heartbeats, ABORT frames and noticing a peer that died.
//
// A channel carries the same frames as the socket (a FrameHeader with the collective's fingerprint,
// then the payload), so a mismatch or a malformed frame is detected and named the same way.
// Private to src/collectives/tcp.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "collectives/tcp/frame.h"

namespace dtrain::tcp {

class ShmChannel {
 public:
  // Ring bytes per direction. Both sides map the segment with MAP_POPULATE: a ring whose pages are
  // first touched during collectives costs a page fault every 4 KB (a 64 KB all-reduce ran 3x
  // slower than over sockets until the cursor had gone once round the ring).
  static constexpr size_t kCapacity = size_t{4} << 20;
  static constexpr size_t kAlign = 64;

  // Creates a fresh segment named `name` ("/dtrain-..."), mode 0600; throws Unavailable on failure.
  static ShmChannel create(const std::string& name);
  // Maps the segment a peer created; returns an unmapped channel (ok() false) when it cannot.
  static ShmChannel open(const std::string& name);
  static void unlink(const std::string& name);

  ShmChannel() = default;
  ShmChannel(ShmChannel&& o) noexcept;
  ShmChannel& operator=(ShmChannel&& o) noexcept;
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;
  ~ShmChannel();
  bool ok() const { return ctl_ != nullptr; }

  // Sender: writes one frame (header, then n payload bytes) if the ring has room for it; false if
  // not (nothing written). A frame is at most kCapacity / 4 bytes.
  bool try_send(const FrameHeader& h, const void* payload, size_t n);
  // Receiver: the header of the next frame, if a whole frame is there.
  bool peek(FrameHeader* h) const;
  // Receiver: copies the payload of the frame peek() returned into dst and releases the frame.
  // Throws DataLoss, releasing nothing, when the header claims more payload than the sender
  // published (a corrupt header or a foreign writer): those bytes would be stale ring contents.
  void consume(const FrameHeader& h, void* dst);
  // Bytes published and not yet released (headers, payloads and padding).
  uint64_t pending() const;
  // Waits until the other side moves (a frame sent or released) or `max_us` pass.
  void wait(uint32_t seen, int max_us);
  // The counter wait() compares against; read it before checking for progress.
  uint32_t bell() const;

 private:
  struct Control {
    alignas(64) std::atomic<uint64_t> head{0};  // bytes the sender has published
    alignas(64) std::atomic<uint64_t> tail{0};  // bytes the receiver has released
    alignas(64) std::atomic<uint32_t> bell{0};  // bumped on every change of head or tail (a futex)
    std::atomic<uint32_t> sleepers{0};
  };
  static size_t frame_bytes(size_t payload) {
    return (sizeof(FrameHeader) + payload + kAlign - 1) / kAlign * kAlign;
  }
  void copy_in(uint64_t pos, const void* src, size_t n);
  void copy_out(uint64_t pos, void* dst, size_t n) const;
  void ring();

  Control* ctl_ = nullptr;
  char* data_ = nullptr;
  size_t mapped_ = 0;
};

}  // namespace dtrain::tcp
