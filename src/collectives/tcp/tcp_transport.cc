#include "collectives/tcp/tcp_transport.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "collectives/algorithms/algorithms.h"
#include "dtrain/core/logging.h"

namespace dtrain::tcp {

TcpTransport::TcpTransport(TcpGroupOptions o, std::vector<Peer> peers)
    : o_(std::move(o)),
      peers_(std::move(peers)),
      closed_(peers_.size(), false),
      send_mu_(peers_.size()),
      last_rx_(peers_.size()) {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    const std::string why = std::strerror(errno);
    for (auto& p : peers_)
      if (p.fd >= 0) ::close(p.fd);
    throw Unavailable("eventfd failed: " + why + " (the process is out of file descriptors?)");
  }
  peer_marker_ = std::make_unique<std::atomic<int64_t>[]>(peers_.size());
  for (size_t r = 0; r < peers_.size(); ++r) peer_marker_[r].store(-1);
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
  try {
    setup_shared_memory();
  } catch (...) {
    shut_down();  // no destructor runs for a constructor that throws
    throw;
  }
}

TcpTransport::~TcpTransport() { shut_down(); }

void TcpTransport::shut_down() {
  {
    std::lock_guard<std::mutex> lock(hb_mu_);
    stop_ = true;
  }
  hb_cv_.notify_all();
  heartbeat_.join();
  for (auto& p : peers_)
    if (p.fd >= 0) ::close(p.fd);
  ::close(wake_fd_);
}

void TcpTransport::check_not_aborted() const {
  if (!aborted_) return;
  std::lock_guard<std::mutex> lock(abort_mu_);
  throw Unavailable(abort_reason_);
}

FrameHeader TcpTransport::header_of(const collectives::Fingerprint& fp) const {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::kData);
  h.seq = fp.seq;
  h.op = fp.op;
  h.dtype = static_cast<uint8_t>(fp.dtype);
  h.reduce = fp.reduce;
  h.sender = static_cast<uint32_t>(rank());
  h.count = fp.count;
  return h;
}

// Sends a heartbeat header to every peer that is between frames and has socket room, so a peer
// waiting on us can tell "busy" from "hung" even while we compute.
void TcpTransport::heartbeat_loop() {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::kHeartbeat);
  h.sender = static_cast<uint32_t>(rank());
  std::unique_lock<std::mutex> lock(hb_mu_);
  while (!hb_cv_.wait_for(lock, o_.heartbeat_interval, [this] { return stop_; })) {
    h.seq = static_cast<uint64_t>(marker_.load(std::memory_order_relaxed));
    for (size_t r = 0; r < peers_.size(); ++r) {
      if (peers_[r].fd < 0) continue;  // a closed peer just fails the send (MSG_NOSIGNAL)
      std::unique_lock<std::mutex> send(send_mu_[r], std::try_to_lock);
      if (!send.owns_lock()) continue;  // a data frame is in progress: that is traffic enough
      int queued = 0;
      if (::ioctl(peers_[r].fd, SIOCOUTQ, &queued) == 0 && queued > (1 << 20))
        continue;  // full: skip
      // Only into a socket with room (POLLOUT: a third of its buffer free), so that the 48 bytes
      // go whole; else skip this beat.
      pollfd room{peers_[r].fd, POLLOUT, 0};
      if (::poll(&room, 1, 0) != 1 || !(room.revents & POLLOUT)) continue;
      const char* at = reinterpret_cast<const char*>(&h);
      ssize_t w = ::send(peers_[r].fd, at, sizeof(h), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w <= 0 || w == static_cast<ssize_t>(sizeof(h))) continue;
      // Part of the header went all the same: the rest must follow before any other byte on this
      // stream (the send lock is held), or the peer would read the next frame's bytes as the
      // heartbeat's. Within a second (the locks held meanwhile); else the stream ends and the
      // peer fails on its close.
      size_t left = sizeof(h) - static_cast<size_t>(w);
      const auto until = Clock::now() + std::chrono::seconds(1);
      while (left > 0 && Clock::now() < until) {
        pollfd pfd{peers_[r].fd, POLLOUT, 0};
        ::poll(&pfd, 1, 50);
        w = ::send(peers_[r].fd, at + sizeof(h) - left, left, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) left -= static_cast<size_t>(w);
        if (w == 0 || (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
      }
      if (left > 0) ::shutdown(peers_[r].fd, SHUT_WR);
    }
  }
}

void TcpTransport::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (aborted_) return;
    abort_reason_ = "collective group aborted on " + name() + ": " + reason;
    aborted_ = true;
  }
  // Wakes an exchange blocked in poll() on another thread: it fails at once instead of waiting for
  // a peer to answer, to echo the ABORT, or to go quiet for the heartbeat timeout; and it gives up
  // the send lock of a frame it was writing, which the loop below needs (that peer's stream is
  // ended then, so it gets EOF rather than the ABORT frame).
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  const std::string msg = reason.substr(0, 4000);
  for (size_t r = 0; r < peers_.size(); ++r) {
    const Peer& p = peers_[r];
    if (p.fd < 0) continue;
    std::lock_guard<std::mutex> whole_frame(send_mu_[r]);  // never interleaved with a heartbeat
    FrameHeader h;
    h.kind = static_cast<uint16_t>(FrameKind::kAbort);
    h.sender = static_cast<uint32_t>(rank());
    h.payload_bytes = msg.size();
    // Best effort, non-blocking: a dead peer must not stall the survivors.
    ::send(p.fd, &h, sizeof(h), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::send(p.fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
}

std::vector<int64_t> TcpTransport::peer_markers() const {
  std::vector<int64_t> out(peers_.size());
  for (size_t r = 0; r < peers_.size(); ++r)
    out[r] = peer_marker_[r].load(std::memory_order_relaxed);
  if (rank() >= 0 && static_cast<size_t>(rank()) < out.size())
    out[static_cast<size_t>(rank())] = marker_.load();
  return out;
}

std::string TcpTransport::name() const {
  return o_.rank < static_cast<int>(o_.task_names.size())
             ? o_.task_names[static_cast<size_t>(o_.rank)]
             : "rank " + std::to_string(o_.rank);
}

[[noreturn]] void TcpTransport::mismatch(const Peer& p, const FrameHeader& got,
                                         const FrameHeader& want) const {
  throw InvalidArgument("collective mismatch: " + name() + " issued " + tcp::describe(want) +
                        " but " + p.name + " issued " + tcp::describe(got) +
                        "; every worker must run the same collectives on tensors of the same "
                        "shape, in the same order");
}

// Sends sbytes from sbuf to rank `to` (as data frames of at most segment_bytes) while receiving
// rbytes from rank `from` into rbuf; on_segment(offset, n) runs after each received segment.
void TcpTransport::exchange(int to, const void* sbuf_v, size_t sbytes, int from, void* rbuf_v,
                            size_t rbytes, const collectives::Fingerprint& print,
                            const collectives::SegmentFn& on_segment) {
  const char* sbuf = static_cast<const char*>(sbuf_v);
  char* rbuf = static_cast<char*>(rbuf_v);
  const FrameHeader fp = header_of(print);
  if (shm_) return exchange_shm(to, sbuf, sbytes, from, rbuf, rbytes, fp, on_segment);
  const auto deadline = Clock::now() + o_.collective.timeout;
  const size_t esize = dtype_size(static_cast<DType>(fp.dtype));
  const size_t seg = std::max(esize, o_.segment_bytes / esize * esize);
  // send state
  size_t s_done = 0, s_hdr_sent = sizeof(FrameHeader), s_pay_left = 0;
  FrameHeader sh = fp;
  // receive state
  size_t r_done = 0, r_hdr_got = 0, r_pay_left = 0, r_seg_start = 0;
  FrameHeader rh;
  std::vector<bool> parked(peers_.size(), false);  // peers with an early frame for a later step
  const auto start = Clock::now();
  for (auto& t : last_rx_) t = start;
  std::unique_lock<std::mutex> send_lock;  // held while a frame to `to` is partly written
  // Leaving with a frame to `to` partly written (an abort, an error from another peer, a timeout):
  // whatever this rank sent next on that socket (its ABORT frame, heartbeats) would be read by the
  // peer as the rest of the payload, so end the stream instead: the peer fails on the closed
  // connection. Declared after send_lock, so it runs while the lock is still held. A frame none of
  // which has been sent yet needs nothing.
  struct EndHalfFrame {
    const std::unique_lock<std::mutex>& lock;
    const size_t& header_sent;
    int fd;
    ~EndHalfFrame() {
      if (lock.owns_lock() && header_sent > 0) ::shutdown(fd, SHUT_WR);
    }
  } end_half_frame{send_lock, s_hdr_sent, to >= 0 ? peers_[static_cast<size_t>(to)].fd : -1};
  for (int r : {to, from})
    if (r >= 0 && closed_[static_cast<size_t>(r)])
      throw Unavailable("connection to " + peers_[static_cast<size_t>(r)].name + " (" +
                        peers_[static_cast<size_t>(r)].address +
                        ") is closed: that task exited, died or was killed before " +
                        tcp::describe(fp));
  while (s_done < sbytes || s_pay_left > 0 || s_hdr_sent < sizeof(FrameHeader) || r_done < rbytes) {
    check_not_aborted();  // by another thread (a half-written frame: end_half_frame)
    std::vector<pollfd> pfds;
    std::vector<int> who;
    pfds.push_back({wake_fd_, POLLIN, 0});  // abort() on another thread
    who.push_back(-1);
    for (int r = 0; r < size(); ++r) {
      if (r == rank() || closed_[static_cast<size_t>(r)]) continue;
      const bool sending =
          r == to && (s_done < sbytes || s_pay_left > 0 || s_hdr_sent < sizeof(FrameHeader));
      // Every peer: an ABORT or a closed socket must wake us; but a parked one (its next frame is
      // for a later step) only for what we still send it: it stopped being polled at all, and an
      // exchange sending to a peer that had sent ahead stalled until the heartbeat timeout.
      short ev = parked[static_cast<size_t>(r)] ? 0 : POLLIN;
      if (sending) ev |= POLLOUT;
      if (ev == 0) continue;
      pfds.push_back({peers_[static_cast<size_t>(r)].fd, ev, 0});
      who.push_back(r);
    }
    for (int r : {to, from}) {
      if (r < 0) continue;
      const bool needed =
          (r == from && r_done < rbytes) || (r == to && (s_done < sbytes || s_pay_left > 0));
      if (needed && Clock::now() - last_rx_[static_cast<size_t>(r)] > o_.heartbeat_timeout)
        throw Unavailable(detail::str_cat(
            peers_[static_cast<size_t>(r)].name, " (", peers_[static_cast<size_t>(r)].address,
            ") sent nothing, not even a heartbeat, for ", o_.heartbeat_timeout.count(),
            " ms during ", tcp::describe(fp),
            ": it is hung (stopped, swapping, or its host is unreachable)"));
    }
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (left <= 0)
      throw DeadlineExceeded(detail::str_cat(tcp::describe(fp), " on ", name(), " timed out after ",
                                             o_.collective.timeout.count(), " ms waiting for ",
                                             r_done < rbytes
                                                 ? peers_[static_cast<size_t>(from)].name
                                                 : peers_[static_cast<size_t>(to)].name,
                                             "; that task is stuck or unreachable"));
    // Poll without sleeping for a short while (yielding the core, which matters when ranks
    // outnumber cores), then block: small messages complete in microseconds, big ones sleep. How
    // long to spin adapts (next_spin_budget): on a slow link almost every wait ends in the blocking
    // poll anyway. With a fixed 200 polls before each, two ranks all-reducing at 1 Gbit/s burnt
    // 4.6 ns of CPU per byte moved; adaptive, 1.3 (docs/performance.md, "CPU while waiting").
    int pr = ::poll(pfds.data(), pfds.size(), 0);
    if (pr == 0) {
      const auto spin_start = Clock::now();
      const auto budget =
          std::chrono::microseconds(spin_budget_us_.load(std::memory_order_relaxed));
      auto spun = Clock::duration::zero();
      while (pr == 0 && spun < budget) {
        sched_yield();
        pr = ::poll(pfds.data(), pfds.size(), 0);
        spun = Clock::now() - spin_start;
      }
      spin_budget_us_.store(
          static_cast<int>(
              tcp::next_spin_budget(
                  budget, std::chrono::duration_cast<std::chrono::microseconds>(spun), pr != 0)
                  .count()),
          std::memory_order_relaxed);
    }
    if (pr == 0) pr = ::poll(pfds.data(), pfds.size(), std::min(left, 1000));
    if (pr < 0 && errno != EINTR)
      throw Unavailable(std::string("poll failed: ") + std::strerror(errno));
    for (size_t i = 0; i < pfds.size(); ++i) {
      const int r = who[i];
      if (r < 0) continue;  // the wake-up: the loop's next round sees the abort
      Peer& p = peers_[static_cast<size_t>(r)];
      if (pfds[i].revents & POLLOUT) {
        // Start a new segment, then push header and payload bytes as far as the socket takes.
        if (s_hdr_sent == sizeof(FrameHeader) && s_pay_left == 0 && s_done < sbytes) {
          if (!send_lock.owns_lock())
            send_lock = std::unique_lock<std::mutex>(send_mu_[static_cast<size_t>(to)]);
          const size_t n = std::min(seg, sbytes - s_done);
          sh = fp;
          sh.payload_bytes = n;
          sh.offset = s_done;
          s_hdr_sent = 0;
          s_pay_left = n;
        }
        // Header and payload leave in one gathered sendmsg, straight from the tensor's memory.
        while (s_hdr_sent < sizeof(FrameHeader) || s_pay_left > 0) {
          iovec iov[2];
          int n_iov = 0;
          if (s_hdr_sent < sizeof(FrameHeader))
            iov[n_iov++] = {reinterpret_cast<char*>(&sh) + s_hdr_sent,
                            sizeof(FrameHeader) - s_hdr_sent};
          if (s_pay_left > 0) iov[n_iov++] = {const_cast<char*>(sbuf + s_done), s_pay_left};
          msghdr msg{};
          msg.msg_iov = iov;
          msg.msg_iovlen = static_cast<size_t>(n_iov);
          const ssize_t w = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
          if (w <= 0)
            throw Unavailable("connection to " + p.name + " (" + p.address +
                              ") closed while sending " + tcp::describe(fp) +
                              ": that task died, was killed, or aborted the job");
          size_t k = static_cast<size_t>(w);
          const size_t h = std::min(k, sizeof(FrameHeader) - s_hdr_sent);
          s_hdr_sent += h;
          k -= h;
          s_done += k;
          s_pay_left -= k;
        }
        if (s_hdr_sent == sizeof(FrameHeader) && s_pay_left == 0 && send_lock.owns_lock())
          send_lock.unlock();
      }
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (r != from || r_done >= rbytes) {
        // Not our sender (or nothing more expected): only an ABORT or EOF matters; data for a
        // later step is left queued and the peer parked until this exchange ends.
        FrameHeader peek;
        const ssize_t k = ::recv(p.fd, &peek, sizeof(peek), MSG_PEEK | MSG_DONTWAIT);
        if (k == 0) {
          // A peer we do not need right now closed: it may simply have finished. Fatal only if
          // a later exchange needs it (then its neighbours fail and ABORT reaches everyone).
          closed_[static_cast<size_t>(r)] = true;
          continue;
        }
        if (k == static_cast<ssize_t>(sizeof(peek)) && peek.magic == tcp::kMagic &&
            peek.kind == static_cast<uint16_t>(FrameKind::kAbort))
          tcp::read_header(p, o_.max_frame_bytes, deadline);  // throws Unavailable with the message
        if (k > 0) last_rx_[static_cast<size_t>(r)] = Clock::now();
        if (k == static_cast<ssize_t>(sizeof(peek)) && peek.magic == tcp::kMagic &&
            peek.kind == static_cast<uint16_t>(FrameKind::kHeartbeat)) {
          ::recv(p.fd, &peek, sizeof(peek), MSG_DONTWAIT);  // consume it
          peer_marker_[static_cast<size_t>(r)].store(static_cast<int64_t>(peek.seq),
                                                     std::memory_order_relaxed);
          continue;
        }
        // A frame of this collective with another fingerprint is a mismatch now, not at this
        // peer's turn (which may never come: ranks disagreeing on a broadcast's root). Seq 0 is
        // the shared-memory set-up's, whose steps differ in op.
        if (k == static_cast<ssize_t>(sizeof(peek)) && peek.magic == tcp::kMagic &&
            peek.kind == static_cast<uint16_t>(FrameKind::kData) && fp.seq > 0 &&
            peek.seq == fp.seq &&
            (peek.op != fp.op || peek.dtype != fp.dtype || peek.count != fp.count ||
             peek.reduce != fp.reduce))
          mismatch(p, peek, fp);
        if (k > 0) parked[static_cast<size_t>(r)] = true;
        continue;
      }
      // Our sender: header, then payload straight into place.
      for (;;) {
        if (r_pay_left == 0 && r_hdr_got < sizeof(FrameHeader)) {
          const ssize_t k = ::recv(p.fd, reinterpret_cast<char*>(&rh) + r_hdr_got,
                                   sizeof(FrameHeader) - r_hdr_got, MSG_DONTWAIT);
          if (k == 0)
            throw Unavailable("connection to " + p.name + " (" + p.address + ") closed during " +
                              tcp::describe(fp) +
                              ": that task died, was killed, or aborted the job");
          if (k < 0) break;
          last_rx_[static_cast<size_t>(r)] = Clock::now();
          r_hdr_got += static_cast<size_t>(k);
          if (r_hdr_got < sizeof(FrameHeader)) continue;
          if (rh.magic == tcp::kMagic && rh.kind == static_cast<uint16_t>(FrameKind::kHeartbeat)) {
            peer_marker_[static_cast<size_t>(r)].store(static_cast<int64_t>(rh.seq),
                                                       std::memory_order_relaxed);
            r_hdr_got = 0;  // nothing follows a heartbeat
            continue;
          }
          if (rh.magic != tcp::kMagic || rh.version != tcp::kVersion)
            throw DataLoss(detail::str_cat("malformed frame from ", p.name,
                                           " (bad magic or version) during ", tcp::describe(fp)));
          if (rh.kind == static_cast<uint16_t>(FrameKind::kAbort)) {
            std::string msg(static_cast<size_t>(std::min<uint64_t>(rh.payload_bytes, 4096)), '\0');
            tcp::read_exact(p, msg.data(), msg.size(), deadline);
            throw Unavailable(p.name + " aborted the job: " + msg);
          }
          if (rh.kind != static_cast<uint16_t>(FrameKind::kData) || rh.seq != fp.seq ||
              rh.op != fp.op || rh.dtype != fp.dtype || rh.count != fp.count ||
              rh.reduce != fp.reduce)
            mismatch(p, rh, fp);
          // Our senders cut segments at whole elements and never send an empty one: an empty
          // segment left this loop reading nothing from that socket again (a spin, then a false
          // "hung"); a part of an element reduced the rest misaligned (a silent wrong sum).
          if (rh.payload_bytes == 0 || rh.payload_bytes > rbytes - r_done || rh.offset != r_done ||
              (on_segment && rh.payload_bytes % esize != 0))
            throw DataLoss(detail::str_cat("malformed frame from ", p.name, ": ", rh.payload_bytes,
                                           " bytes at offset ", rh.offset, " but ", rbytes - r_done,
                                           " expected at offset ", r_done, " in segments of whole ",
                                           esize, "-byte elements, none empty"));
          r_pay_left = rh.payload_bytes;
          r_seg_start = r_done;
        }
        if (r_pay_left == 0) break;
        const ssize_t k = ::recv(p.fd, rbuf + r_done, r_pay_left, MSG_DONTWAIT);
        if (k > 0) last_rx_[static_cast<size_t>(r)] = Clock::now();
        if (k == 0)
          throw Unavailable("connection to " + p.name + " (" + p.address + ") closed during " +
                            tcp::describe(fp) + ": that task died, was killed, or aborted the job");
        if (k < 0) break;
        r_done += static_cast<size_t>(k);
        r_pay_left -= static_cast<size_t>(k);
        if (r_pay_left == 0) {
          r_hdr_got = 0;
          if (on_segment) on_segment(r_seg_start, r_done - r_seg_start);
          if (r_done >= rbytes) break;
        }
      }
    }
  }
}

// Every rank decides alike from the address list (the same on all ranks): shared memory only when
// all of them name one host. Each rank then creates one segment per peer (its sending side), the
// names go to the peers over the sockets, every rank maps the segments meant for it, and an
// all-reduce over the sockets (MIN of "mapped them all") makes the choice collective. The names are
// unlinked as soon as everyone has mapped them, so nothing is left in /dev/shm whatever happens
// later.
void TcpTransport::setup_shared_memory() {
  const int n = size(), me = rank();
  if (!o_.shared_memory || n < 2) return;
  auto host = [](const std::string& a) { return a.substr(0, a.rfind(':')); };
  for (const std::string& a : o_.addresses)
    if (host(a) != host(o_.addresses[static_cast<size_t>(me)])) return;
  constexpr size_t kName = 64;
  std::random_device rd;
  char nonce[24];
  std::snprintf(nonce, sizeof(nonce), "%08x%08x", rd(), rd());
  std::vector<ShmChannel> tx(static_cast<size_t>(n)), rx(static_cast<size_t>(n));
  std::vector<std::string> created;
  int32_t ok = 1;
  try {
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const std::string ring = "/dtrain-" + std::string(nonce) + "-" + std::to_string(::getpid()) +
                               "-" + std::to_string(me) + "-" + std::to_string(p);
      tx[static_cast<size_t>(p)] = ShmChannel::create(ring);
      created.push_back(ring);
    }
  } catch (const Unavailable& e) {
    DTRAIN_LOG(WARNING) << name() << ": no shared memory for collectives (" << e.what()
                        << "); using TCP";
    ok = 0;
  }
  collectives::Fingerprint hs;
  hs.op = 100;  // the handshake: never a collective's op
  hs.dtype = DType::kInt32;
  hs.count = kName;
  try {
    for (int d = 1; d < n; ++d) {
      const int to = (me + d) % n, from = (me - d + n) % n;
      char out[kName] = {}, in[kName] = {};
      if (ok) {
        const std::string& nm = created[static_cast<size_t>(to < me ? to : to - 1)];
        std::memcpy(out, nm.data(), std::min(nm.size(), kName - 1));
      }
      exchange(to, out, kName, from, in, kName, hs, nullptr);
      in[kName - 1] = '\0';
      if (in[0] == '\0') {
        ok = 0;
        continue;
      }
      rx[static_cast<size_t>(from)] = ShmChannel::open(in);
      if (!rx[static_cast<size_t>(from)].ok()) ok = 0;
    }
    hs.op = 101;
    hs.count = static_cast<uint64_t>(n);  // an element per rank: every ring step moves data
    hs.reduce = static_cast<uint8_t>(ReduceOp::kMin);
    std::vector<int32_t> all(static_cast<size_t>(n), ok);
    collectives::ring_allreduce(*this, all.data(), n, DType::kInt32, ReduceOp::kMin, hs);
    ok = all[0];
  } catch (...) {
    for (const std::string& nm : created) ShmChannel::unlink(nm);
    throw;
  }
  for (const std::string& nm : created) ShmChannel::unlink(nm);
  if (!ok) {
    DTRAIN_LOG(INFO) << name()
                     << ": collective data goes over TCP (a peer could not map shared memory)";
    return;
  }
  tx_ = std::move(tx);
  rx_ = std::move(rx);
  shm_ = true;
}

void TcpTransport::watch_sockets(const FrameHeader& fp, int need_a, int need_b,
                                 Clock::time_point deadline) {
  std::vector<pollfd> pfds;
  std::vector<int> who;
  for (int r = 0; r < size(); ++r) {
    if (r == rank() || closed_[static_cast<size_t>(r)]) continue;
    pfds.push_back({peers_[static_cast<size_t>(r)].fd, POLLIN, 0});
    who.push_back(r);
  }
  if (::poll(pfds.data(), pfds.size(), 0) > 0) {
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const int r = who[i];
      Peer& p = peers_[static_cast<size_t>(r)];
      for (;;) {  // every whole frame queued on this socket
        FrameHeader peek;
        const ssize_t k = ::recv(p.fd, &peek, sizeof(peek), MSG_PEEK | MSG_DONTWAIT);
        if (k == 0) {
          closed_[static_cast<size_t>(r)] = true;
          if (r == need_a || r == need_b)
            throw Unavailable("connection to " + p.name + " (" + p.address + ") closed during " +
                              tcp::describe(fp) +
                              ": that task died, was killed, or aborted the job");
          break;
        }
        if (k < 0) break;
        last_rx_[static_cast<size_t>(r)] = Clock::now();
        if (k < static_cast<ssize_t>(sizeof(peek))) break;  // the rest is on its way
        if (peek.magic != tcp::kMagic || peek.version != tcp::kVersion)
          throw DataLoss(detail::str_cat("malformed frame from ", p.name,
                                         " (bad magic or version) during ", tcp::describe(fp)));
        if (peek.kind == static_cast<uint16_t>(FrameKind::kAbort))
          tcp::read_header(p, o_.max_frame_bytes, deadline);  // throws
        if (peek.kind != static_cast<uint16_t>(FrameKind::kHeartbeat))
          throw DataLoss(detail::str_cat(
              "unexpected frame from ", p.name, " on its socket during ", tcp::describe(fp),
              ": collective data goes through shared memory between these tasks"));
        ::recv(p.fd, &peek, sizeof(peek), MSG_DONTWAIT);
        peer_marker_[static_cast<size_t>(r)].store(static_cast<int64_t>(peek.seq),
                                                   std::memory_order_relaxed);
      }
    }
  }
  for (int r : {need_a, need_b}) {
    if (r < 0) continue;
    if (Clock::now() - last_rx_[static_cast<size_t>(r)] > o_.heartbeat_timeout)
      throw Unavailable(detail::str_cat(
          peers_[static_cast<size_t>(r)].name, " (", peers_[static_cast<size_t>(r)].address,
          ") sent nothing, not even a heartbeat, for ", o_.heartbeat_timeout.count(), " ms during ",
          tcp::describe(fp), ": it is hung (stopped, swapping, or its host is unreachable)"));
  }
  if (Clock::now() > deadline) {
    const int r = need_a >= 0 ? need_a : need_b;
    throw DeadlineExceeded(detail::str_cat(
        tcp::describe(fp), " on ", name(), " timed out after ", o_.collective.timeout.count(),
        " ms waiting for ", r >= 0 ? peers_[static_cast<size_t>(r)].name : std::string("a peer"),
        "; that task is stuck or unreachable"));
  }
}

// The shared-memory exchange: frames go into the ring to `to` while frames come out of the ring
// from `from`; when neither moves, spin for up to 200 us (yielding), then watch the sockets and
// sleep on the ring's futex for at most half a millisecond at a time.
void TcpTransport::exchange_shm(int to, const char* sbuf, size_t sbytes, int from, char* rbuf,
                                size_t rbytes, const FrameHeader& fp,
                                const collectives::SegmentFn& on_segment) {
  const auto deadline = Clock::now() + o_.collective.timeout;
  const size_t esize = dtype_size(static_cast<DType>(fp.dtype));
  constexpr size_t kMaxPayload = ShmChannel::kCapacity / 4 - 64;
  const size_t seg = std::max(esize, std::min(o_.segment_bytes, kMaxPayload) / esize * esize);
  for (int r : {to, from})
    if (r >= 0 && closed_[static_cast<size_t>(r)])
      throw Unavailable("connection to " + peers_[static_cast<size_t>(r)].name + " (" +
                        peers_[static_cast<size_t>(r)].address +
                        ") is closed: that task exited, died or was killed before " +
                        tcp::describe(fp));
  const auto start = Clock::now();
  for (auto& t : last_rx_) t = start;
  size_t s_done = 0, r_done = 0;
  // Spin (yielding) this long without progress before sleeping on the ring's futex: a wake-up costs
  // tens of microseconds, more than a peer usually needs to publish its next segment.
  constexpr auto kSpin = std::chrono::microseconds(200);
  Clock::time_point idle_since{};
  bool idle = false;
  while (s_done < sbytes || r_done < rbytes) {
    check_not_aborted();  // by another thread: frames go whole into the ring, nothing to end
    const bool sending = to >= 0 && s_done < sbytes, receiving = from >= 0 && r_done < rbytes;
    ShmChannel* waiting_on =
        receiving ? &rx_[static_cast<size_t>(from)] : &tx_[static_cast<size_t>(to)];
    const uint32_t bell =
        waiting_on->bell();  // before looking, so a change after the look wakes the wait
    bool moved = false;
    if (sending) {
      const size_t n = std::min(seg, sbytes - s_done);
      FrameHeader h = fp;
      h.payload_bytes = n;
      h.offset = s_done;
      if (tx_[static_cast<size_t>(to)].try_send(h, sbuf + s_done, n)) {
        s_done += n;
        moved = true;
      }
    }
    FrameHeader h;
    if (receiving && rx_[static_cast<size_t>(from)].peek(&h)) {
      const Peer& p = peers_[static_cast<size_t>(from)];
      if (h.magic != tcp::kMagic || h.version != tcp::kVersion ||
          h.kind != static_cast<uint16_t>(FrameKind::kData))
        throw DataLoss(detail::str_cat("malformed frame from ", p.name, " in shared memory during ",
                                       tcp::describe(fp)));
      if (h.seq != fp.seq || h.op != fp.op || h.dtype != fp.dtype || h.count != fp.count ||
          h.reduce != fp.reduce)
        mismatch(p, h, fp);
      if (h.payload_bytes == 0 || h.payload_bytes > kMaxPayload ||
          h.payload_bytes > rbytes - r_done || h.offset != r_done ||
          (on_segment && h.payload_bytes % esize != 0))
        throw DataLoss(detail::str_cat("malformed frame from ", p.name, ": ", h.payload_bytes,
                                       " bytes at offset ", h.offset, " but ", rbytes - r_done,
                                       " expected at offset ", r_done, " in segments of whole ",
                                       esize, "-byte elements, none empty"));
      try {
        rx_[static_cast<size_t>(from)].consume(h, rbuf + r_done);
      } catch (const DataLoss& e) {
        throw DataLoss(detail::str_cat("malformed frame from ", p.name, " during ",
                                       tcp::describe(fp), " (", e.what(), ")"));
      }
      last_rx_[static_cast<size_t>(from)] = Clock::now();
      const size_t at = r_done;
      r_done += static_cast<size_t>(h.payload_bytes);
      if (on_segment) on_segment(at, static_cast<size_t>(h.payload_bytes));
      moved = true;
    }
    if (moved) {
      idle = false;
      continue;
    }
    if (!idle) {
      idle = true;
      idle_since = Clock::now();
    }
    if (Clock::now() - idle_since < kSpin) {
      sched_yield();  // the peer may be about to publish; give it the core when ranks share cores
      continue;
    }
    // Stuck: a frame of this collective from a rank we do not read from now, with another
    // fingerprint, is a mismatch now (two ranks each taking itself for a broadcast's root filled
    // their rings to each other and waited out the collective timeout). Frames of a later
    // collective, or of this one's later steps, stay where they are.
    for (int r = 0; r < size(); ++r) {
      FrameHeader early;
      if (r == rank() || r == from || !rx_[static_cast<size_t>(r)].ok() ||
          !rx_[static_cast<size_t>(r)].peek(&early) || fp.seq == 0 || early.seq != fp.seq)
        continue;
      if (early.op != fp.op || early.dtype != fp.dtype || early.count != fp.count ||
          early.reduce != fp.reduce)
        mismatch(peers_[static_cast<size_t>(r)], early, fp);
    }
    watch_sockets(fp, sending ? to : -1, receiving ? from : -1, deadline);
    waiting_on->wait(bell, 500);
  }
}

}  // namespace dtrain::tcp
