#include "dtrain/data/augment.h"

#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/core/random.h"

namespace dtrain::augment {

Tensor random_crop_flip(const Tensor& images, int pad, uint64_t seed, uint64_t epoch,
                        uint64_t step) {
  const Shape& s = images.shape();
  if (s.rank() != 4 || images.dtype() != DType::kFloat32 || !images.device().host_accessible())
    throw InvalidArgument("random_crop_flip expects float32 images [N, H, W, C] on the CPU, got " +
                          images.to_string());
  if (pad < 0) throw InvalidArgument("random_crop_flip: pad must be >= 0");
  const int64_t n = s[0], h = s[1], w = s[2], c = s[3];
  Tensor out = Tensor::zeros(s, DType::kFloat32);
  const float* src = static_cast<const float*>(images.raw_data());
  float* dst = static_cast<float*>(out.raw_data());
  // One Philox stream per (epoch, step): its block i decides image i.
  const Philox rng(seed, (epoch << 40) ^ step);
  const uint64_t side = static_cast<uint64_t>(2 * pad + 1);
  for (int64_t i = 0; i < n; ++i) {
    const std::array<uint32_t, 4> r = rng.block(static_cast<uint64_t>(i));
    // Window origin in the padded image: [0, 2 pad]; the source row of output row y is
    // y + dy - pad (zero when outside the image).
    const int64_t dy = static_cast<int64_t>(r[0] % side), dx = static_cast<int64_t>(r[1] % side);
    const bool flip = (r[2] & 1u) != 0;
    const float* img = src + i * h * w * c;
    float* o = dst + i * h * w * c;
    for (int64_t y = 0; y < h; ++y) {
      const int64_t sy = y + dy - pad;
      if (sy < 0 || sy >= h) continue;
      for (int64_t x = 0; x < w; ++x) {
        const int64_t ox = flip ? w - 1 - x : x;
        const int64_t sx = x + dx - pad;
        if (sx < 0 || sx >= w) continue;
        std::memcpy(o + (y * w + ox) * c, img + (sy * w + sx) * c,
                    static_cast<size_t>(c) * sizeof(float));
      }
    }
  }
  return out;
}

}  // namespace dtrain::augment
