// Collectives over the TCP mesh. Data moves with `exchange`: one poll loop that sends segments to
// one peer while receiving segments from another (full duplex, no threads), checking every
// received header's fingerprint, and watching every other peer for an ABORT or a closed socket.
//
// Algorithms: allreduce is ring reduce-scatter + ring all-gather (bandwidth-optimal, segments
// pipelined through the socket buffers), or recursive doubling for small messages on a power-of-two
// group (fewest round trips). Each element is reduced in one place and copied, so every rank gets
// bitwise identical results.
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "collectives/reduction.h"
#include "collectives/tcp/mesh.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

using tcp::Clock;
using tcp::FrameHeader;
using tcp::FrameKind;
using tcp::Peer;

enum Op : uint16_t { kAllreduce = 1, kAllgather, kBroadcast, kReduce, kReduceScatter, kBarrier };
constexpr size_t kSmallMessage = 64 * 1024;

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(TcpGroupOptions o, std::vector<Peer> peers)
      : o_(std::move(o)),
        peers_(std::move(peers)),
        closed_(peers_.size(), false),
        send_mu_(peers_.size()),
        last_rx_(peers_.size()) {
    heartbeat_ = std::thread([this] { heartbeat_loop(); });
  }
  ~TcpCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(hb_mu_);
      stop_ = true;
    }
    hb_cv_.notify_all();
    heartbeat_.join();
    for (auto& p : peers_)
      if (p.fd >= 0) ::close(p.fd);
  }
  int rank() const override { return o_.rank; }
  int size() const override { return static_cast<int>(peers_.size()); }

  Work allreduce(Tensor& t, ReduceOp op) override {
    require_host(t, "allreduce");
    FrameHeader fp = begin(kAllreduce, t.dtype(), t.numel(), op);
    guarded([&] { allreduce_impl(static_cast<char*>(t.raw_data()), t.numel(), t.dtype(), op, fp); });
    return Work::completed();
  }

  Work allgather(const Tensor& in, Tensor& out) override {
    require_host(in, "allgather");
    if (out.numel() != in.numel() * size() || out.dtype() != in.dtype())
      throw InvalidArgument("allgather: output must hold size * input.numel() elements of the input's dtype, got " + out.to_string());
    FrameHeader fp = begin(kAllgather, in.dtype(), in.numel(), ReduceOp::kSum);
    guarded([&] {
      const size_t bytes = in.nbytes();
      char* o = static_cast<char*>(out.raw_data());
      std::memcpy(o + static_cast<size_t>(rank()) * bytes, in.raw_data(), bytes);
      const int n = size();
      for (int s = 0; s < n - 1; ++s) {
        const int sk = mod(rank() - s), rk = mod(rank() - s - 1);
        exchange(next(), o + static_cast<size_t>(sk) * bytes, bytes, prev(), o + static_cast<size_t>(rk) * bytes, bytes, fp, nullptr);
      }
    });
    return Work::completed();
  }

  Work broadcast(Tensor& t, int root) override {
    require_host(t, "broadcast");
    if (root < 0 || root >= size()) throw InvalidArgument("broadcast: root " + std::to_string(root) + " out of range");
    FrameHeader fp = begin(kBroadcast, t.dtype(), t.numel(), ReduceOp::kSum);
    fp.reduce = static_cast<uint8_t>(root);  // part of the fingerprint: all ranks must agree on root
    guarded([&] {
      char* b = static_cast<char*>(t.raw_data());
      if (rank() == root) {
        for (int r = 0; r < size(); ++r)
          if (r != root) exchange(r, b, t.nbytes(), -1, nullptr, 0, fp, nullptr);
      } else {
        exchange(-1, nullptr, 0, root, b, t.nbytes(), fp, nullptr);
      }
    });
    return Work::completed();
  }

  Work reduce(Tensor& t, int root, ReduceOp op) override {
    require_host(t, "reduce");
    if (root < 0 || root >= size()) throw InvalidArgument("reduce: root " + std::to_string(root) + " out of range");
    FrameHeader fp = begin(kReduce, t.dtype(), t.numel(), op);
    guarded([&] {
      std::vector<char> tmp(t.nbytes());
      std::memcpy(tmp.data(), t.raw_data(), t.nbytes());
      allreduce_impl(tmp.data(), t.numel(), t.dtype(), op, fp);
      if (rank() == root) std::memcpy(t.raw_data(), tmp.data(), t.nbytes());
    });
    return Work::completed();
  }

  Work reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    require_host(in, "reduce_scatter");
    const int n = size();
    if (in.numel() % n != 0 || out.numel() != in.numel() / n || out.dtype() != in.dtype())
      throw InvalidArgument("reduce_scatter: input must split evenly into size() outputs of the same dtype, got " + out.to_string());
    FrameHeader fp = begin(kReduceScatter, in.dtype(), in.numel(), op);
    guarded([&] {
      std::vector<char> tmp(in.nbytes());
      std::memcpy(tmp.data(), in.raw_data(), in.nbytes());
      // Shifted ring so that rank r ends with chunk r fully reduced.
      ring_reduce_scatter(tmp.data(), in.numel(), in.dtype(), op, fp, -1);
      const size_t cb = out.nbytes();
      std::memcpy(out.raw_data(), tmp.data() + static_cast<size_t>(rank()) * cb, cb);
      if (op == ReduceOp::kMean) collectives::scale_for_mean(out.raw_data(), static_cast<size_t>(out.numel()), in.dtype(), n);
    });
    return Work::completed();
  }

  Work barrier() override {
    // One element per rank so that every ring step moves data (a true rendezvous).
    std::vector<int32_t> v(static_cast<size_t>(size()), 1);
    FrameHeader fp = begin(kBarrier, DType::kInt32, size(), ReduceOp::kSum);
    guarded([&] { ring_allreduce(reinterpret_cast<char*>(v.data()), size(), DType::kInt32, ReduceOp::kSum, fp); });
    return Work::completed();
  }

  void abort(const std::string& reason) override { broadcast_abort(reason); }

 private:
  // Sends a heartbeat header to every peer that is between frames and has socket room, so a peer
  // waiting on us can tell "busy" from "hung" even while we compute.
  void heartbeat_loop() {
    FrameHeader h;
    h.kind = static_cast<uint16_t>(FrameKind::kHeartbeat);
    h.sender = static_cast<uint32_t>(rank());
    std::unique_lock<std::mutex> lock(hb_mu_);
    while (!hb_cv_.wait_for(lock, o_.heartbeat_interval, [this] { return stop_; })) {
      for (size_t r = 0; r < peers_.size(); ++r) {
        if (peers_[r].fd < 0) continue;  // a closed peer just fails the send (MSG_NOSIGNAL)
        std::unique_lock<std::mutex> send(send_mu_[r], std::try_to_lock);
        if (!send.owns_lock()) continue;  // a data frame is in progress: that is traffic enough
        int queued = 0;
        if (::ioctl(peers_[r].fd, SIOCOUTQ, &queued) == 0 && queued > (1 << 20)) continue;  // full: skip
        ::send(peers_[r].fd, &h, sizeof(h), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
  }

  int mod(int k) const { return ((k % size()) + size()) % size(); }
  int next() const { return mod(rank() + 1); }
  int prev() const { return mod(rank() - 1); }

  static void require_host(const Tensor& t, const char* op) {
    if (!t.device().host_accessible())
      throw InvalidArgument(std::string(op) + ": the TCP transport moves host memory; got " + t.to_string() +
                            " (stage GPU tensors through the host or use NCCL)");
  }

  FrameHeader begin(uint16_t op, DType dtype, int64_t count, ReduceOp red) {
    if (aborted_) throw Unavailable(abort_reason_);
    FrameHeader h;
    h.kind = static_cast<uint16_t>(FrameKind::kData);
    h.seq = ++seq_;
    h.op = op;
    h.dtype = static_cast<uint8_t>(dtype);
    h.reduce = static_cast<uint8_t>(red);
    h.sender = static_cast<uint32_t>(rank());
    h.count = static_cast<uint64_t>(count);
    return h;
  }

  // Runs a collective; on failure tells every peer (ABORT) before rethrowing.
  template <typename F>
  void guarded(F&& body) {
    try {
      body();
    } catch (const Error& e) {
      broadcast_abort(e.what());
      throw;
    }
  }

  void broadcast_abort(const std::string& reason) {
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = "collective group aborted on " + name() + ": " + reason;
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

  std::string name() const {
    return o_.rank < static_cast<int>(o_.task_names.size()) ? o_.task_names[static_cast<size_t>(o_.rank)] : "rank " + std::to_string(o_.rank);
  }

  void allreduce_impl(char* buf, int64_t count, DType dt, ReduceOp op, const FrameHeader& fp) {
    const int n = size();
    if (count == 0 || n == 1) return;
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
    if (bytes <= kSmallMessage && (n & (n - 1)) == 0) {
      recursive_doubling(buf, count, dt, op, fp);
    } else {
      ring_allreduce(buf, count, dt, op, fp);
    }
  }

  void recursive_doubling(char* buf, int64_t count, DType dt, ReduceOp op, const FrameHeader& fp) {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
    std::vector<char> scratch(bytes);
    for (int mask = 1; mask < size(); mask <<= 1) {
      const int peer = rank() ^ mask;
      exchange(peer, buf, bytes, peer, scratch.data(), bytes, fp, nullptr);
      collectives::reduce_into(buf, scratch.data(), static_cast<size_t>(count), dt, op);  // commutative: same bits on both
    }
    if (op == ReduceOp::kMean) collectives::scale_for_mean(buf, static_cast<size_t>(count), dt, size());
  }

  // Ring reduce-scatter; afterwards chunk mod(rank + 1 + shift) is fully reduced here. Returns it.
  int ring_reduce_scatter(char* buf, int64_t count, DType dt, ReduceOp op, const FrameHeader& fp, int shift) {
    const int n = size();
    const size_t es = dtype_size(dt);
    auto lo = [&](int k) { return count * k / n; };
    auto cbytes = [&](int k) { return static_cast<size_t>(lo(k + 1) - lo(k)) * es; };
    std::vector<char> scratch(static_cast<size_t>((count + n - 1) / n + 1) * es);
    for (int s = 0; s < n - 1; ++s) {
      const int sk = mod(rank() - s + shift), rk = mod(rank() - s - 1 + shift);
      char* dst = buf + static_cast<size_t>(lo(rk)) * es;
      exchange(next(), buf + static_cast<size_t>(lo(sk)) * es, cbytes(sk), prev(), scratch.data(), cbytes(rk), fp,
               [&](size_t off, size_t nb) { collectives::reduce_into(dst + off, scratch.data() + off, nb / es, dt, op); });
    }
    return mod(rank() + 1 + shift);
  }

  void ring_allreduce(char* buf, int64_t count, DType dt, ReduceOp op, const FrameHeader& fp) {
    const int n = size();
    const size_t es = dtype_size(dt);
    auto lo = [&](int k) { return count * k / n; };
    auto cbytes = [&](int k) { return static_cast<size_t>(lo(k + 1) - lo(k)) * es; };
    const int mine = ring_reduce_scatter(buf, count, dt, op, fp, 0);
    if (op == ReduceOp::kMean)
      collectives::scale_for_mean(buf + static_cast<size_t>(lo(mine)) * es, cbytes(mine) / es, dt, n);
    for (int s = 0; s < n - 1; ++s) {
      const int sk = mod(rank() - s + 1), rk = mod(rank() - s);
      exchange(next(), buf + static_cast<size_t>(lo(sk)) * es, cbytes(sk), prev(), buf + static_cast<size_t>(lo(rk)) * es,
               cbytes(rk), fp, nullptr);
    }
  }

  [[noreturn]] void mismatch(const Peer& p, const FrameHeader& got, const FrameHeader& want) {
    throw InvalidArgument("collective mismatch: " + name() + " issued " + tcp::describe(want) + " but " + p.name +
                          " issued " + tcp::describe(got) +
                          "; every worker must run the same collectives on tensors of the same shape, in the same order");
  }

  // Sends sbytes from sbuf to rank `to` (as data frames of at most segment_bytes) while receiving
  // rbytes from rank `from` into rbuf; on_segment(offset, n) runs after each received segment.
  void exchange(int to, const char* sbuf, size_t sbytes, int from, char* rbuf, size_t rbytes, const FrameHeader& fp,
                const std::function<void(size_t, size_t)>& on_segment) {
    const auto deadline = Clock::now() + o_.collective.timeout;
    const size_t seg = std::max<size_t>(dtype_size(static_cast<DType>(fp.dtype)),
                                        o_.segment_bytes / dtype_size(static_cast<DType>(fp.dtype)) * dtype_size(static_cast<DType>(fp.dtype)));
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
    for (int r : {to, from})
      if (r >= 0 && closed_[static_cast<size_t>(r)])
        throw Unavailable("connection to " + peers_[static_cast<size_t>(r)].name + " (" + peers_[static_cast<size_t>(r)].address +
                          ") is closed: that task exited, died or was killed before " + tcp::describe(fp));
    while (s_done < sbytes || s_pay_left > 0 || s_hdr_sent < sizeof(FrameHeader) || r_done < rbytes) {
      std::vector<pollfd> pfds;
      std::vector<int> who;
      for (int r = 0; r < size(); ++r) {
        if (r == rank() || parked[static_cast<size_t>(r)] || closed_[static_cast<size_t>(r)]) continue;
        short ev = POLLIN;  // every peer: an ABORT or a closed socket must wake us
        const bool sending = r == to && (s_done < sbytes || s_pay_left > 0 || s_hdr_sent < sizeof(FrameHeader));
        if (sending) ev |= POLLOUT;
        pfds.push_back({peers_[static_cast<size_t>(r)].fd, ev, 0});
        who.push_back(r);
      }
      for (int r : {to, from}) {
        if (r < 0) continue;
        const bool needed = (r == from && r_done < rbytes) || (r == to && (s_done < sbytes || s_pay_left > 0));
        if (needed && Clock::now() - last_rx_[static_cast<size_t>(r)] > o_.heartbeat_timeout)
          throw Unavailable(detail::str_cat(peers_[static_cast<size_t>(r)].name, " (", peers_[static_cast<size_t>(r)].address,
                                            ") sent nothing, not even a heartbeat, for ", o_.heartbeat_timeout.count(),
                                            " ms during ", tcp::describe(fp), ": it is hung (stopped, swapping, or its host is unreachable)"));
      }
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      if (left <= 0)
        throw DeadlineExceeded(detail::str_cat(tcp::describe(fp), " on ", name(), " timed out after ",
                                               o_.collective.timeout.count(), " ms waiting for ",
                                               r_done < rbytes ? peers_[static_cast<size_t>(from)].name : peers_[static_cast<size_t>(to)].name,
                                               "; that task is stuck or unreachable"));
      // Poll without sleeping for a short while (yielding the core, which matters when ranks
      // outnumber cores), then block: small messages complete in microseconds, big ones sleep.
      int pr = ::poll(pfds.data(), pfds.size(), 0);
      for (int spin = 0; pr == 0 && spin < 200; ++spin) {
        sched_yield();
        pr = ::poll(pfds.data(), pfds.size(), 0);
      }
      if (pr == 0) pr = ::poll(pfds.data(), pfds.size(), std::min(left, 1000));
      if (pr < 0 && errno != EINTR) throw Unavailable(std::string("poll failed: ") + std::strerror(errno));
      for (size_t i = 0; i < pfds.size(); ++i) {
        const int r = who[i];
        Peer& p = peers_[static_cast<size_t>(r)];
        if (pfds[i].revents & POLLOUT) {
          // Start a new segment, then push header and payload bytes as far as the socket takes.
          if (s_hdr_sent == sizeof(FrameHeader) && s_pay_left == 0 && s_done < sbytes) {
            if (!send_lock.owns_lock()) send_lock = std::unique_lock<std::mutex>(send_mu_[static_cast<size_t>(to)]);
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
              iov[n_iov++] = {reinterpret_cast<char*>(&sh) + s_hdr_sent, sizeof(FrameHeader) - s_hdr_sent};
            if (s_pay_left > 0) iov[n_iov++] = {const_cast<char*>(sbuf + s_done), s_pay_left};
            msghdr msg{};
            msg.msg_iov = iov;
            msg.msg_iovlen = static_cast<size_t>(n_iov);
            const ssize_t w = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
            if (w <= 0) throw Unavailable("connection to " + p.name + " (" + p.address + ") closed while sending " + tcp::describe(fp) + ": that task died or aborted");
            size_t k = static_cast<size_t>(w);
            const size_t h = std::min(k, sizeof(FrameHeader) - s_hdr_sent);
            s_hdr_sent += h;
            k -= h;
            s_done += k;
            s_pay_left -= k;
          }
          if (s_hdr_sent == sizeof(FrameHeader) && s_pay_left == 0 && send_lock.owns_lock()) send_lock.unlock();
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
          if (k == static_cast<ssize_t>(sizeof(peek)) && peek.magic == tcp::kMagic && peek.kind == static_cast<uint16_t>(FrameKind::kAbort))
            tcp::read_header(p, o_.max_frame_bytes, deadline);  // throws Unavailable with the message
          if (k > 0) last_rx_[static_cast<size_t>(r)] = Clock::now();
          if (k == static_cast<ssize_t>(sizeof(peek)) && peek.magic == tcp::kMagic &&
              peek.kind == static_cast<uint16_t>(FrameKind::kHeartbeat)) {
            ::recv(p.fd, &peek, sizeof(peek), MSG_DONTWAIT);  // consume it
            continue;
          }
          if (k > 0) parked[static_cast<size_t>(r)] = true;
          continue;
        }
        // Our sender: header, then payload straight into place.
        for (;;) {
          if (r_pay_left == 0 && r_hdr_got < sizeof(FrameHeader)) {
            const ssize_t k = ::recv(p.fd, reinterpret_cast<char*>(&rh) + r_hdr_got, sizeof(FrameHeader) - r_hdr_got, MSG_DONTWAIT);
            if (k == 0) throw Unavailable("connection to " + p.name + " (" + p.address + ") closed during " + tcp::describe(fp) + ": that task died, was killed, or aborted the job");
            if (k < 0) break;
            last_rx_[static_cast<size_t>(r)] = Clock::now();
            r_hdr_got += static_cast<size_t>(k);
            if (r_hdr_got < sizeof(FrameHeader)) continue;
            if (rh.magic == tcp::kMagic && rh.kind == static_cast<uint16_t>(FrameKind::kHeartbeat)) {
              r_hdr_got = 0;  // nothing follows a heartbeat
              continue;
            }
            if (rh.magic != tcp::kMagic || rh.version != tcp::kVersion)
              throw DataLoss(detail::str_cat("malformed frame from ", p.name, " (bad magic or version) during ", tcp::describe(fp)));
            if (rh.kind == static_cast<uint16_t>(FrameKind::kAbort)) {
              std::string msg(static_cast<size_t>(std::min<uint64_t>(rh.payload_bytes, 4096)), '\0');
              tcp::read_exact(p, msg.data(), msg.size(), deadline);
              throw Unavailable(p.name + " aborted the job: " + msg);
            }
            if (rh.kind != static_cast<uint16_t>(FrameKind::kData) || rh.seq != fp.seq || rh.op != fp.op ||
                rh.dtype != fp.dtype || rh.count != fp.count || rh.reduce != fp.reduce)
              mismatch(p, rh, fp);
            if (rh.payload_bytes > rbytes - r_done || rh.offset != r_done)
              throw DataLoss(detail::str_cat("malformed frame from ", p.name, ": ", rh.payload_bytes, " bytes at offset ",
                                             rh.offset, " but ", rbytes - r_done, " expected at offset ", r_done));
            r_pay_left = rh.payload_bytes;
            r_seg_start = r_done;
          }
          if (r_pay_left == 0) break;
          const ssize_t k = ::recv(p.fd, rbuf + r_done, r_pay_left, MSG_DONTWAIT);
          if (k > 0) last_rx_[static_cast<size_t>(r)] = Clock::now();
          if (k == 0) throw Unavailable("connection to " + p.name + " (" + p.address + ") closed during " + tcp::describe(fp) + ": that task died, was killed, or aborted the job");
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

  TcpGroupOptions o_;
  std::vector<Peer> peers_;
  std::vector<bool> closed_;  // peers whose socket reached EOF
  std::vector<std::mutex> send_mu_;          // per peer: one frame at a time (data vs heartbeat)
  std::vector<Clock::time_point> last_rx_;   // per peer: last byte received (liveness)
  std::thread heartbeat_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool stop_ = false;
  uint64_t seq_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace

std::unique_ptr<Communicator> connect_tcp_group(const TcpGroupOptions& options) {
  std::vector<Peer> peers = tcp::build_mesh(options);
  DTRAIN_LOG(INFO) << "TCP group of " << options.addresses.size() << " tasks connected and authenticated";
  return std::make_unique<TcpCommunicator>(options, std::move(peers));
}

}  // namespace dtrain
