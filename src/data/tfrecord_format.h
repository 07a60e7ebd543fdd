// Private to the library: TFRecord framing (TensorFlow's record_writer.cc format), shared by the
// TFRecord reader/writer and TensorBoard's event files. A record is
//   uint64 length, uint32 masked_crc32c(length), byte data[length], uint32 masked_crc32c(data)
// all little-endian; the mask is ((crc >> 15) | (crc << 17)) + 0xa282ead8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtrain::detail {

// CRC-32C (Castagnoli) with the SSE4.2 instruction where the CPU has it, else Boost.CRC.
uint32_t crc32c(const void* data, size_t n);
inline uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}
inline uint32_t load_le32(const unsigned char* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
inline uint64_t load_le64(const unsigned char* p) {
  return uint64_t{load_le32(p)} | uint64_t{load_le32(p + 4)} << 32;
}
// The 12-byte header and the 4-byte footer around `data`.
std::string record_header(size_t length);
std::string record_footer(std::string_view data);

}  // namespace dtrain::detail
