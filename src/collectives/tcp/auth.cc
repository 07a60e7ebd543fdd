// The job-token challenge-response every dtrain TCP connection runs (collective mesh and
// parameter-server RPC alike). Both sides send Hello(nonce, world size, job fingerprint, rank); the
// dialer sends Proof = HMAC-SHA256(token, acceptor's nonce | dialer rank | fingerprint); the
// acceptor verifies it before answering with its own Proof, or sends ABORT and closes.
#include "collectives/tcp/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

namespace dtrain::tcp {
namespace {

#pragma pack(push, 1)
struct Hello {
  unsigned char nonce[32];
  uint32_t world;
  uint64_t fingerprint;
  uint32_t rank;
};
#pragma pack(pop)

uint64_t job_fingerprint_impl(const std::vector<std::string>& addresses) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the ordered address list
  for (const auto& a : addresses) {
    for (unsigned char c : a) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  }
  return h;
}

}  // namespace

uint64_t job_fingerprint(const std::vector<std::string>& a) { return job_fingerprint_impl(a); }

std::string name_of(const TcpGroupOptions& o, int r) {
  return r < static_cast<int>(o.task_names.size()) ? o.task_names[static_cast<size_t>(r)]
                                                   : "rank " + std::to_string(r);
}

namespace {

void send_frame(const Peer& p, FrameKind kind, uint32_t sender, const void* payload, size_t n,
                Clock::time_point dl) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(kind);
  h.sender = sender;
  h.payload_bytes = n;
  write_exact(p, &h, sizeof(h), dl);
  if (n) write_exact(p, payload, n, dl);
}

template <typename T>
T read_payload(const Peer& p, FrameKind kind, Clock::time_point dl) {
  const FrameHeader h = read_header(p, sizeof(T), dl);
  if (h.kind != static_cast<uint16_t>(kind) || h.payload_bytes != sizeof(T))
    throw DataLoss(detail::str_cat("malformed handshake from ", p.address, ": expected frame kind ",
                                   static_cast<int>(kind), " of ", sizeof(T), " bytes"));
  T t;
  read_exact(p, &t, sizeof(T), dl);
  return t;
}

struct Proof {
  unsigned char mac[32];
};

Proof prove(const std::string& token, const unsigned char* peer_nonce, uint32_t rank, uint64_t fp) {
  unsigned char msg[32 + 4 + 8];
  std::memcpy(msg, peer_nonce, 32);
  std::memcpy(msg + 32, &rank, 4);
  std::memcpy(msg + 36, &fp, 8);
  Proof p;
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), msg, sizeof(msg), p.mac, &len);
  return p;
}

bool verify(const Proof& got, const Proof& want) {
  return CRYPTO_memcmp(got.mac, want.mac, 32) == 0;
}

}  // namespace

int authenticate(Peer& p, const TcpGroupOptions& o, uint64_t fp, int expected, bool any_rank,
                 Clock::time_point dl, bool* heard) {
  Hello mine{};
  if (RAND_bytes(mine.nonce, sizeof(mine.nonce)) != 1) throw Internal("RAND_bytes failed");
  mine.world = static_cast<uint32_t>(o.addresses.size());
  mine.fingerprint = fp;
  mine.rank = static_cast<uint32_t>(o.rank);
  send_frame(p, FrameKind::kHello, mine.rank, &mine, sizeof(mine), dl);
  const Hello theirs = read_payload<Hello>(p, FrameKind::kHello, dl);
  if (heard) *heard = true;
  auto refuse = [&](const std::string& why) {
    try {
      send_frame(p, FrameKind::kAbort, mine.rank, why.data(), why.size(), dl);
    } catch (const Error&) {
    }
    throw PermissionDenied(why);
  };
  if (theirs.world != mine.world)
    refuse(detail::str_cat("world size mismatch: ", p.address, " believes the job has ",
                           theirs.world, " tasks, this task (", name_of(o, o.rank), ") has ",
                           mine.world, "; give every task the same TF_CONFIG cluster"));
  if (theirs.fingerprint != fp)
    refuse("job mismatch: " + p.address +
           " was started with a different cluster address list than " + name_of(o, o.rank) +
           "; give every task the same TF_CONFIG cluster");
  const int peer = static_cast<int>(theirs.rank);
  if (peer < 0 || peer >= static_cast<int>(mine.world) || peer == o.rank ||
      (expected >= 0 && peer != expected) || (expected < 0 && !any_rank && peer < o.rank))
    refuse(detail::str_cat("unexpected rank ", peer, " connecting from ", p.address));
  p.rank = peer;
  p.name = name_of(o, peer);
  if (expected >= 0) {  // dialer: prove first, then check the acceptor's proof
    const Proof mp = prove(o.token, theirs.nonce, mine.rank, fp);
    send_frame(p, FrameKind::kProof, mine.rank, &mp, sizeof(mp), dl);
    Proof tp;
    try {
      tp = read_payload<Proof>(p, FrameKind::kProof, dl);
    } catch (const Unavailable& e) {
      throw PermissionDenied(
          p.name + " (" + p.address + ") refused this task's job token: " + e.what() +
          ". Set the same DTRAIN_JOB_TOKEN on every task (dtrain-run does this)");
    }
    if (!verify(tp, prove(o.token, mine.nonce, theirs.rank, fp)))
      throw PermissionDenied(p.name + " (" + p.address +
                             ") could not prove the job token; is another job using "
                             "that address? Set the same DTRAIN_JOB_TOKEN on every task");
  } else {  // acceptor: check the dialer's proof before proving ourselves
    const Proof tp = read_payload<Proof>(p, FrameKind::kProof, dl);
    if (!verify(tp, prove(o.token, mine.nonce, theirs.rank, fp)))
      refuse("job token mismatch: the connection from " + p.address + " claiming to be " + p.name +
             " was refused");
    const Proof mp = prove(o.token, theirs.nonce, mine.rank, fp);
    send_frame(p, FrameKind::kProof, mine.rank, &mp, sizeof(mp), dl);
  }
  return peer;
}

}  // namespace dtrain::tcp
