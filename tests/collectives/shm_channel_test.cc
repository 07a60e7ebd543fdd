// The shared-memory ring of the TCP transport (ranks on one host): frames round-trip byte for byte
// across the ring's wrap-around, a full ring refuses a frame without writing it, a frame whose
// header claims more payload than was published is refused with DataLoss and releases nothing, and
// a segment that is missing or of the wrong size is not mapped.
#include "collectives/tcp/shm_channel.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain::tcp {
namespace {

std::string fresh_name() {
  static int n = 0;
  return "/dtrain-shm-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

// A sender (creator) and a receiver (opener) of one fresh segment, unlinked at once.
struct Pair {
  ShmChannel tx, rx;
  Pair() {
    const std::string name = fresh_name();
    tx = ShmChannel::create(name);
    rx = ShmChannel::open(name);
    ShmChannel::unlink(name);
  }
};

FrameHeader header(uint64_t seq, size_t bytes) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::kData);
  h.seq = seq;
  h.count = bytes;
  h.payload_bytes = bytes;
  return h;
}

TEST(ShmChannel, FramesRoundTripAcrossTheWrapAround) {
  Pair p;
  ASSERT_TRUE(p.tx.ok());
  ASSERT_TRUE(p.rx.ok());
  // Odd sizes, so frames straddle the end of the ring at many offsets; ~5 times round the ring.
  const size_t sizes[] = {1, 63, 64, 65, 4096, 100003, ShmChannel::kCapacity / 4 - 64};
  uint64_t seq = 0;
  size_t moved = 0;
  while (moved < 5 * ShmChannel::kCapacity) {
    for (size_t n : sizes) {
      std::vector<unsigned char> out(n), in(n, 0xEE);
      for (size_t i = 0; i < n; ++i)
        out[i] = static_cast<unsigned char>((i * 131 + seq * 7) & 0xFF);
      ASSERT_TRUE(p.tx.try_send(header(seq, n), out.data(), n)) << "frame " << seq;
      FrameHeader h;
      ASSERT_TRUE(p.rx.peek(&h));
      EXPECT_EQ(h.seq, seq);
      EXPECT_EQ(h.payload_bytes, n);
      p.rx.consume(h, in.data());
      ASSERT_EQ(in, out) << "frame " << seq << " of " << n << " bytes";
      EXPECT_FALSE(p.rx.peek(&h));
      EXPECT_EQ(p.rx.pending(), 0u);
      moved += n;
      ++seq;
    }
  }
}

TEST(ShmChannel, AFullRingRefusesAFrameAndWritesNothing) {
  Pair p;
  const size_t n = ShmChannel::kCapacity / 4 - 64;
  std::vector<char> buf(n, 'x');
  int sent = 0;
  while (p.tx.try_send(header(static_cast<uint64_t>(sent), n), buf.data(), n)) ++sent;
  EXPECT_EQ(sent, 4);  // a frame of the largest payload is a quarter of the ring, header included
  const uint64_t before = p.rx.pending();
  EXPECT_FALSE(p.tx.try_send(header(99, n), buf.data(), n));
  EXPECT_EQ(p.rx.pending(), before);
  // Released frames make room again, in order.
  FrameHeader h;
  ASSERT_TRUE(p.rx.peek(&h));
  EXPECT_EQ(h.seq, 0u);
  p.rx.consume(h, buf.data());
  EXPECT_TRUE(p.tx.try_send(header(4, n), buf.data(), n));
  EXPECT_FALSE(p.tx.try_send(header(5, 1), buf.data(), 1));
  for (uint64_t want = 1; want <= 4; ++want) {
    ASSERT_TRUE(p.rx.peek(&h));
    EXPECT_EQ(h.seq, want);
    p.rx.consume(h, buf.data());
  }
  EXPECT_EQ(p.rx.pending(), 0u);
}

TEST(ShmChannel, AHeaderClaimingUnpublishedBytesIsRefused) {
  Pair p;
  // A header that says 4096 payload bytes, on a frame that carries 16: the rest of the "payload"
  // would be whatever the ring held before.
  std::vector<char> small(16, 's'), dst(1 << 20, 0);
  FrameHeader forged = header(5, 4096);
  ASSERT_TRUE(p.tx.try_send(forged, small.data(), small.size()));
  const uint64_t published = p.rx.pending();
  FrameHeader h;
  ASSERT_TRUE(p.rx.peek(&h));
  EXPECT_EQ(h.payload_bytes, 4096u);
  try {
    p.rx.consume(h, dst.data());
    FAIL() << "a frame claiming unpublished bytes was consumed";
  } catch (const DataLoss& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("claims 4096 payload bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("published " + std::to_string(published)), std::string::npos) << what;
  }
  EXPECT_EQ(p.rx.pending(), published);  // nothing released
  EXPECT_EQ(dst[0], 0);                  // nothing copied
  // A header claiming more than the whole ring is refused the same way.
  h.payload_bytes = uint64_t{1} << 62;
  EXPECT_THROW(p.rx.consume(h, dst.data()), DataLoss);
  EXPECT_EQ(p.rx.pending(), published);
}

TEST(ShmChannel, AMissingOrWrongSizedSegmentIsNotMapped) {
  EXPECT_FALSE(ShmChannel::open(fresh_name()).ok());
  const std::string name = fresh_name();
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  ::close(fd);
  EXPECT_FALSE(ShmChannel::open(name).ok());
  ShmChannel::unlink(name);
  // create() refuses a name that exists.
  const std::string taken = fresh_name();
  ShmChannel first = ShmChannel::create(taken);
  EXPECT_THROW(ShmChannel::create(taken), Unavailable);
  ShmChannel::unlink(taken);
}

}  // namespace
}  // namespace dtrain::tcp
