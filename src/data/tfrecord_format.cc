#include "data/tfrecord_format.h"

#include <boost/crc.hpp>
#include <cstring>

#include "core/cpu_isa.h"

namespace dtrain::detail {
namespace {

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n) {
  uint64_t c = 0xFFFFFFFFu;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32 ^ 0xFFFFFFFFu;
}
#endif

std::string le(uint64_t v, int bytes) {
  std::string s(static_cast<size_t>(bytes), '\0');
  for (int i = 0; i < bytes; ++i) s[static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
#if defined(__x86_64__)
  if (detail::cpu_supports(detail::CpuFeature::kSse42))
    return crc32c_sse42(static_cast<const unsigned char*>(data), n);
#endif
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, n);
  return crc.checksum();
}

std::string record_header(size_t length) {
  std::string h = le(length, 8);
  return h + le(masked_crc32c(h.data(), 8), 4);
}

std::string record_footer(std::string_view data) {
  return le(masked_crc32c(data.data(), data.size()), 4);
}

}  // namespace dtrain::detail
