// The TCP transport's receiver against frames dtrain's senders never send, from a peer that
// completed the real handshake: the test plays that peer (build_mesh) and answers a real rank's
// first data frame itself.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collectives/tcp/frame.h"
#include "collectives/tcp/mesh.h"
#include "dtrain/collectives/tcp.h"
#include "testing/ports.h"

namespace dtrain {
namespace {

TcpGroupOptions options(const std::vector<std::string>& addrs, int rank) {
  TcpGroupOptions o;
  o.shared_memory = false;
  o.rank = rank;
  o.addresses = addrs;
  for (size_t i = 0; i < addrs.size(); ++i) o.task_names.push_back("worker:" + std::to_string(i));
  o.token = "0123456789abcdef0123";
  o.connect_timeout = std::chrono::seconds(20);
  o.collective.timeout = std::chrono::seconds(20);
  return o;
}

// A peer that completed the handshake, then sends DATA frames our senders never send: an empty
// segment (the receiver then read nothing more from that socket: a spin at 100% CPU, then a false
// "worker:1 is hung"), or a segment cutting a float32 in two (reduced misaligned: a silent wrong
// sum). Both must be DataLoss naming the peer, at once. Rank 1 is the test itself, through the
// real handshake (build_mesh), answering rank 0's first frame.
TEST(Tcp, EmptyAndMisalignedDataSegmentsAreMalformed) {
  // Rank 1's answer to rank 0's first data frame, cut into segments of these sizes (0: all of it
  // in one segment of that size); 5 elements go by recursive doubling, 20,000 by the ring, whose
  // segments are reduced as they come.
  struct Case {
    int64_t count;
    std::vector<int64_t> cuts;
  };
  for (const Case& k : {Case{5, {0}}, Case{20000, {3, -1}}}) {
    const auto addrs = testing::free_loopback_addresses(2);
    std::string err0;
    std::vector<float> got;
    double secs = 0;
    std::thread r0([&] {
      try {
        auto o = options(addrs, 0);
        o.heartbeat_timeout = std::chrono::seconds(6);
        auto c = connect_tcp_group(o);
        Tensor t = Tensor::full(Shape{k.count}, 2.f);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          c->allreduce(t, ReduceOp::kSum).wait();
          got = t.to_vector<float>();
        } catch (...) {
          secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          throw;
        }
      } catch (const std::exception& e) {
        err0 = e.what();
      }
    });
    auto o1 = options(addrs, 1);
    std::vector<tcp::Peer> peers = tcp::build_mesh(o1);
    const int fd = peers[0].fd;
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const auto read_all = [fd](void* p, size_t n) {
      for (size_t at = 0; at < n;) {
        const ssize_t k = ::recv(fd, static_cast<char*>(p) + at, n - at, 0);
        ASSERT_GT(k, 0);
        at += static_cast<size_t>(k);
      }
    };
    tcp::FrameHeader h;
    do {  // rank 0's heartbeats, then its data frame
      read_all(&h, sizeof(h));
    } while (h.kind != static_cast<uint16_t>(tcp::FrameKind::kData));
    std::vector<char> payload(h.payload_bytes);
    read_all(payload.data(), payload.size());
    h.sender = 1;
    uint64_t offset = 0;
    for (int64_t cut : k.cuts) {
      const uint64_t n = cut < 0 ? payload.size() - offset : static_cast<uint64_t>(cut);
      h.payload_bytes = n;
      h.offset = offset;
      ASSERT_EQ(::send(fd, &h, sizeof(h), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(h)));
      if (n > 0)
        ASSERT_EQ(::send(fd, payload.data() + offset, n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
      offset += n;
    }
    r0.join();
    for (auto& p : peers)
      if (p.fd >= 0) ::close(p.fd);
    EXPECT_NE(err0.find("DataLoss: malformed frame from worker:1"), std::string::npos)
        << k.count << " elements: " << err0 << (got.empty() ? "" : " (it summed to ")
        << (got.empty() ? 0.f : got[4]) << (got.empty() ? "" : ")");
    EXPECT_LT(secs, 3) << err0;
  }
}

}  // namespace
}  // namespace dtrain
