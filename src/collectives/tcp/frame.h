// Wire format of the TCP transport. Every message starts with this header (little-endian, packed
// to 48 bytes); payload_bytes follow. Receivers reject a bad magic/version, an unknown kind, or a
// payload over the group's bound before reading the payload.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::tcp {

constexpr uint32_t kMagic = 0x4e525444;  // "DTRN"
constexpr uint16_t kVersion = 1;

// kHeartbeat: sent between frames by every rank's heartbeat thread; carries nothing and is skipped
// by receivers, which treat a needed peer that sends no byte for the heartbeat timeout as hung.
// kRequest / kResponse: the request/response traffic of rpc.h (parameter servers); seq is the
// request id, op the method, reduce the response status, count the number of tensors.
enum class FrameKind : uint16_t {
  kHello = 1,
  kProof = 2,
  kData = 3,
  kAbort = 4,
  kHeartbeat = 5,
  kRequest = 6,
  kResponse = 7
};
constexpr uint16_t kMaxFrameKind = 7;

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t kind = 0;
  uint64_t seq = 0;  // collective sequence number (fingerprint)
  uint16_t op = 0;   // collective op
  uint8_t dtype = 0;
  uint8_t reduce = 0;
  uint32_t sender = 0;  // sender's rank
  uint64_t count = 0;   // elements in the whole collective
  uint64_t payload_bytes = 0;
  uint64_t offset = 0;  // element offset of this payload in the collective's buffer
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 48, "frame header must be 48 bytes");

// "allreduce #12 (float32 x 1000, SUM)" for error messages.
std::string describe(const FrameHeader& h);

}  // namespace dtrain::tcp
