// Images for input pipelines: JPEG/PNG decoding and encoding (gray and colour, either way), bad
// data refused naming it, and the transforms: stretch, flip, normalisation (1/255 bitwise
// pixel / 255), center crop, box-filtered shrinking, random resized crops as a function of (seed,
// epoch, index), and the fast JPEG path (DCT scaling, window-only decode) against a full decode.
#include "dtrain/data/image.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "data/input_test_util.h"
#include "data/testdata_dir.h"
#include "dtrain/core/error.h"

namespace dtrain::data {
namespace {

using namespace test_util;  // NOLINT(google-build-using-namespace): the test helpers

TEST(Image, PngRoundTripsExactlyGrayAndRgb) {
  for (int c : {1, 3}) {
    const image::Image im = noise(7, 5, c, 3);
    const image::Image back = image::decode_image(image::encode_png(im));
    EXPECT_EQ(back.height, 7);
    EXPECT_EQ(back.width, 5);
    EXPECT_EQ(back.channels, c);
    EXPECT_EQ(back.pixels, im.pixels);
  }
  // Gray to RGB repeats the value; RGB to gray is a luminance.
  const image::Image rgb = image::decode_image(image::encode_png(marked(2, 2, 40)), 3);
  EXPECT_EQ(rgb.channels, 3);
  EXPECT_EQ(rgb.pixels[0], 41);
  EXPECT_EQ(rgb.pixels[2], 41);
  EXPECT_EQ(rgb.pixels[3], 40);
}

TEST(Image, JpegDecodesCloseToTheOriginal) {
  const image::Image im = smooth(40, 56);
  const image::Image back = image::decode_image(image::encode_jpeg(im, 95));
  ASSERT_EQ(back.pixels.size(), im.pixels.size());
  double err = 0;
  for (size_t i = 0; i < im.pixels.size(); ++i) err += std::abs(back.pixels[i] - im.pixels[i]);
  EXPECT_LT(err / static_cast<double>(im.pixels.size()), 3.0);
}

TEST(Image, GrayAndColorJpegsConvertEitherWay) {
  const image::Image gray = noise(16, 24, 1, 9);
  const std::string jpeg = image::encode_jpeg(gray, 100);
  const image::Image as_rgb = image::decode_image(jpeg, 3);
  const image::Image as_gray = image::decode_image(jpeg);
  ASSERT_EQ(as_rgb.channels, 3);
  ASSERT_EQ(as_gray.channels, 1);
  for (size_t i = 0; i < as_gray.pixels.size(); ++i)
    for (size_t k = 0; k < 3; ++k) ASSERT_EQ(as_rgb.pixels[i * 3 + k], as_gray.pixels[i]) << i;
  const image::Image color = image::decode_image(image::encode_jpeg(smooth(16, 24), 95), 1);
  EXPECT_EQ(color.channels, 1);
  EXPECT_EQ(color.pixels.size(), 16u * 24u);
}

TEST(Image, BadDataIsDataLossNamingIt) {
  const std::string jpeg = image::encode_jpeg(smooth(64, 64), 90);
  const std::string png = image::encode_png(noise(16, 16, 3, 1));
  auto fails = [](const std::string& bytes, const std::string& part) {
    try {
      image::decode_image(bytes, 0, "cat.jpg");
      ADD_FAILURE() << "decoded bad data: " << part;
    } catch (const DataLoss& e) {
      EXPECT_NE(std::string(e.what()).find("cat.jpg"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  fails("", "empty");
  fails("GIF89a....", "not a JPEG or PNG");
  fails(jpeg.substr(0, jpeg.size() / 2), "JPEG");  // truncated: libjpeg's warning is an error
  fails(png.substr(0, png.size() / 2), "PNG");
  std::string flipped = png;
  flipped[png.size() / 2] = static_cast<char>(flipped[png.size() / 2] ^ 0x55);
  fails(flipped, "PNG");  // zlib/CRC
  std::string header_only = jpeg.substr(0, 200);
  fails(header_only, "JPEG");
  EXPECT_THROW(image::decode_image(jpeg, 2), InvalidArgument);
  // A header claiming 60000 x 60000 pixels over a few hundred bytes: DataLoss before any buffer
  // (decoding it would zero-fill 10.8 GB, or end in an untyped bad_alloc).
  std::string huge = jpeg;
  const size_t sof = huge.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  for (size_t at : {sof + 5, sof + 7}) {  // height, then width, big-endian
    huge[at] = static_cast<char>(60000 >> 8);
    huge[at + 1] = static_cast<char>(60000 & 0xff);
  }
  fails(huge, "more than 2^28 pixels");
  std::string big_png = png;  // IHDR: width and height at 16 and 20, its CRC at 29
  for (size_t at : {16, 20}) {
    big_png[at] = big_png[at + 1] = 0;
    big_png[at + 2] = static_cast<char>(60000 >> 8);
    big_png[at + 3] = static_cast<char>(60000 & 0xff);
  }
  uint32_t crc = 0xffffffffu;  // over the chunk's type and data: bytes 12..28
  for (size_t i = 12; i < 29; ++i) {
    crc ^= static_cast<uint8_t>(big_png[i]);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  crc ^= 0xffffffffu;
  for (int k = 0; k < 4; ++k)
    big_png[29 + static_cast<size_t>(k)] = static_cast<char>(crc >> (24 - 8 * k));
  fails(big_png, "more than 2^28 pixels");
}

TEST(Image, StretchAtTheSameSizeIsTheImageAndFlipMirrorsIt) {
  const image::Image im = noise(6, 9, 3, 4);
  image::ImageTransform t;
  t.height = 6;
  t.width = 9;
  t.rescale = 0.5f;
  std::vector<float> out(6 * 9 * 3);
  image::decode_transformed(image::encode_png(im), t, 0, 0, 0, out.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 0.5f * im.pixels[i]) << i;
  // 1/255 divides, as torchvision's ToTensor and load_fashion_mnist: bitwise pixel / 255.
  t.rescale = 1.0f / 255.0f;
  image::decode_transformed(image::encode_png(im), t, 0, 0, 0, out.data());
  for (size_t i = 0; i < out.size(); ++i)
    ASSERT_EQ(out[i], static_cast<float>(im.pixels[i]) / 255.0f) << i;
  t.rescale = 0.5f;
  // Flip: some indices flip and some do not; a flipped one is the mirror, exactly.
  t.random_flip = true;
  t.mean = {1, 2, 3};
  t.stddev = {2, 4, 8};
  int flipped = 0, kept = 0;
  for (int64_t index = 0; index < 16; ++index) {
    image::decode_transformed(image::encode_png(im), t, 5, 0, index, out.data());
    bool mirror = true, same = true;
    for (int y = 0; y < 6; ++y)
      for (int x = 0; x < 9; ++x)
        for (int k = 0; k < 3; ++k) {
          const float v = out[static_cast<size_t>((y * 9 + x) * 3 + k)];
          const auto px = [&](int xx) {
            return (0.5f * im.pixels[static_cast<size_t>((y * 9 + xx) * 3 + k)] - t.mean[k]) /
                   t.stddev[k];
          };
          mirror = mirror && std::abs(v - px(8 - x)) < 1e-5f;
          same = same && std::abs(v - px(x)) < 1e-5f;
        }
    ASSERT_TRUE(mirror || same) << index;
    (mirror ? flipped : kept)++;
  }
  EXPECT_GT(flipped, 2);
  EXPECT_GT(kept, 2);
}

TEST(Image, CenterCropTakesTheMiddleAndResizeKeepsAConstantImage) {
  // 4 x 12: the middle 4 x 4 (columns 4..7) has value 200, the rest 10.
  image::Image im{4, 12, 1, std::vector<uint8_t>(48, 10)};
  for (int y = 0; y < 4; ++y)
    for (int x = 4; x < 8; ++x) im.pixels[static_cast<size_t>(y * 12 + x)] = 200;
  image::ImageTransform t;
  t.height = t.width = 2;
  t.channels = 1;
  t.resize = image::ImageTransform::Resize::kCenterCrop;
  std::vector<float> out(4);
  image::decode_transformed(image::encode_png(im), t, 0, 0, 0, out.data());
  for (float v : out) EXPECT_EQ(v, 200.0f);
  // Shrinking a constant image by 37x (box filter, then bilinear) stays constant.
  image::Image flat{300, 370, 3, std::vector<uint8_t>(300 * 370 * 3, 77)};
  t.channels = 3;
  t.resize = image::ImageTransform::Resize::kStretch;
  out.resize(12);
  image::decode_transformed(image::encode_png(flat), t, 0, 0, 0, out.data());
  for (float v : out) EXPECT_EQ(v, 77.0f);
}

TEST(Image, JpegScaledAndCroppedDecodeMatchesFullDecodeThenTransform) {
  // The fast path (DCT scaling + decoding only the window's rows and columns) against a full
  // decode of the same file transformed afterwards: the same crops, pixels within JPEG's noise.
  const image::Image big = smooth(480, 640);
  const std::string jpeg = image::encode_jpeg(big, 92);
  const image::Image full = image::decode_image(jpeg, 3);
  image::ImageTransform t;
  t.height = t.width = 56;
  t.resize = image::ImageTransform::Resize::kRandomResizedCrop;
  t.random_flip = true;
  std::vector<float> fast(56 * 56 * 3), slow(fast.size());
  for (int64_t index = 0; index < 12; ++index) {
    image::decode_transformed(jpeg, t, 9, 2, index, fast.data());
    image::transform_image(full, t, 9, 2, index, slow.data());
    double err = 0;
    for (size_t i = 0; i < fast.size(); ++i) err += std::abs(fast[i] - slow[i]);
    EXPECT_LT(err / static_cast<double>(fast.size()), 6.0) << "index " << index;
  }
}

// A CMYK JPEG (Adobe's inverted form, as Photoshop and Pillow write it; a few dozen of ImageNet's
// are CMYK), and the same file without its Adobe marker (plain CMYK, not inverted): decoded to the
// RGB TensorFlow 2.21's decode_jpeg gives (tests/data/testdata/make_cmyk.py), bit for bit; gray
// from that RGB by libjpeg's weights (TensorFlow refuses it); the transformed path too. It was
// DataLoss "Unsupported color conversion request" before.
TEST(Image, CmykJpegsDecodeToTensorFlowsRgb) {
  const std::string dir = dtrain::testing::testdata_dir();
  std::ifstream in(dir + "/cmyk.json");
  ASSERT_TRUE(in);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& [name, key] :
       {std::pair<std::string, std::string>{"cmyk.jpg", "rgb"}, {"cmyk_plain.jpg", "rgb_plain"}}) {
    SCOPED_TRACE(name);
    const std::string jpeg = image::read_file(dir + "/" + name);
    const size_t at = json.find("\"" + key + "\": [");
    ASSERT_NE(at, std::string::npos);
    std::vector<uint8_t> want;
    for (const char* p = json.c_str() + at + key.size() + 5; *p && *p != ']'; ++p)
      if (*p >= '0' && *p <= '9') {
        want.push_back(static_cast<uint8_t>(std::strtol(p, nullptr, 10)));
        while (p[1] >= '0' && p[1] <= '9') ++p;
      }
    ASSERT_EQ(want.size(), 6u * 8 * 3);
    for (int channels : {0, 3}) {
      const image::Image rgb = image::decode_image(jpeg, channels, name);
      ASSERT_EQ(rgb.channels, 3);
      ASSERT_EQ(rgb.width, 8);
      ASSERT_EQ(rgb.height, 6);
      EXPECT_EQ(rgb.pixels, want) << "channels " << channels;
    }
    const image::Image gray = image::decode_image(jpeg, 1, name);
    ASSERT_EQ(gray.pixels.size(), 6u * 8);
    for (size_t i = 0; i < gray.pixels.size(); ++i)
      EXPECT_EQ(
          gray.pixels[i],
          (19595 * want[3 * i] + 38470 * want[3 * i + 1] + 7471 * want[3 * i + 2] + 32768) >> 16)
          << i;
    image::ImageTransform t;
    t.height = 6;
    t.width = 8;
    std::vector<float> px(6 * 8 * 3);
    image::decode_transformed(jpeg, t, 0, 0, 0, px.data(), name);
    for (size_t i = 0; i < px.size(); ++i) EXPECT_EQ(px[i], static_cast<float>(want[i])) << i;
  }
}

// Progressive JPEGs (common in photo collections; written by PIL with progressive=True, committed
// in tests/data/testdata): the window-only decode (row skipping, column cropping) agrees with a
// full decode, colour and gray.
TEST(Image, ProgressiveJpegsDecodeThroughTheFastPathToo) {
  for (const char* name : {"progressive.jpg", "progressive_gray.jpg"}) {
    const std::string jpeg = image::read_file(dtrain::testing::testdata_dir() + "/" + name);
    const image::Image full = image::decode_image(jpeg, 3, name);
    ASSERT_EQ(full.width, 160) << name;
    ASSERT_EQ(full.height, 120) << name;
    image::ImageTransform t;
    t.height = t.width = 40;
    t.resize = image::ImageTransform::Resize::kRandomResizedCrop;
    std::vector<float> fast(40 * 40 * 3), slow(fast.size());
    for (int64_t index = 0; index < 8; ++index) {
      image::decode_transformed(jpeg, t, 4, 0, index, fast.data(), name);
      image::transform_image(full, t, 4, 0, index, slow.data());
      double err = 0;
      for (size_t i = 0; i < fast.size(); ++i) err += std::abs(fast[i] - slow[i]);
      EXPECT_LT(err / static_cast<double>(fast.size()), 6.0) << name << " index " << index;
    }
  }
}

TEST(Image, RandomResizedCropIsAFunctionOfSeedEpochAndIndex) {
  const std::string png = image::encode_png(noise(64, 80, 3, 2));
  image::ImageTransform t;
  t.height = t.width = 16;
  t.resize = image::ImageTransform::Resize::kRandomResizedCrop;
  std::vector<float> a(16 * 16 * 3), b(a.size()), c(a.size());
  image::decode_transformed(png, t, 1, 3, 7, a.data());
  image::decode_transformed(png, t, 1, 3, 7, b.data());
  EXPECT_EQ(a, b);
  image::decode_transformed(png, t, 1, 4, 7, c.data());  // another epoch: another crop
  EXPECT_NE(a, c);
  image::decode_transformed(png, t, 2, 3, 7, c.data());  // another seed
  EXPECT_NE(a, c);
  t.scale_min = 2;
  EXPECT_THROW(t.validate(), InvalidArgument);
}

// rescale = 1 / 255 (integers: 0) turned every image blank without a word.
TEST(Image, ARescaleOfZeroOrNotFiniteIsRefused) {
  image::ImageTransform t;
  t.height = t.width = 4;
  t.validate();
  for (float r : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    t.rescale = r;
    try {
      t.validate();
      ADD_FAILURE() << "rescale " << r << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rescale must be finite and > 0"), std::string::npos)
          << e.what();
      if (r == 0) {
        EXPECT_NE(std::string(e.what()).find("1.0f / 255"), std::string::npos);
      }
    }
  }
  t.rescale = 1.0f / 255;
  t.mean = {std::numeric_limits<float>::quiet_NaN()};
  t.channels = 1;
  EXPECT_THROW(t.validate(), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::data
