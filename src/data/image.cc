// JPEG and PNG through libjpeg-turbo and libpng, and the fused crop/resize/flip/normalise pass.
#include "dtrain/data/image.h"

// clang-format off
#include <cstdio>  // jpeglib.h needs FILE first
#include <jpeglib.h>
// clang-format on
#include <png.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstring>
#include <fstream>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/random.h"
#include "dtrain/core/strings.h"

namespace dtrain::image {
namespace {

using detail::str_cat;

bool is_jpeg(std::string_view b) {
  return b.size() >= 3 && static_cast<unsigned char>(b[0]) == 0xFF &&
         static_cast<unsigned char>(b[1]) == 0xD8 && static_cast<unsigned char>(b[2]) == 0xFF;
}
bool is_png(std::string_view b) {
  static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  return b.size() >= 8 && std::memcmp(b.data(), sig, 8) == 0;
}

[[noreturn]] void not_an_image(std::string_view b, const std::string& what) {
  if (b.empty()) throw DataLoss(str_cat(what, ": empty, not a JPEG or PNG image"));
  std::ostringstream first;
  for (size_t i = 0; i < std::min<size_t>(4, b.size()); ++i)
    first << (i ? " " : "") << std::hex << static_cast<int>(static_cast<unsigned char>(b[i]));
  throw DataLoss(str_cat(what, ": not a JPEG or PNG image (it starts with bytes ", first.str(),
                         "); dtrain decodes .jpg/.jpeg and .png"));
}

// A crop window in source pixels, and whether to mirror it.
struct Window {
  double x = 0, y = 0, w = 0, h = 0;
  bool flip = false;
};

Window choose_window(int W, int H, const ImageTransform& t, uint64_t seed, uint64_t epoch,
                     int64_t index) {
  const Philox rng(seed, epoch);
  const uint64_t base = static_cast<uint64_t>(index) * 64;
  Window win{0, 0, static_cast<double>(W), static_cast<double>(H), false};
  if (t.random_flip) win.flip = rng.uniform(base + 63) < 0.5f;
  if (t.resize == ImageTransform::Resize::kCenterCrop) {
    const double a = static_cast<double>(t.width) / t.height;
    double cw = W, ch = H;
    if (static_cast<double>(W) / H > a)
      cw = H * a;
    else
      ch = W / a;
    cw *= t.central_fraction;
    ch *= t.central_fraction;
    win = {(W - cw) / 2, (H - ch) / 2, cw, ch, win.flip};
  } else if (t.resize == ImageTransform::Resize::kRandomResizedCrop) {
    // torchvision's RandomResizedCrop.get_params: ten tries, then a center crop.
    const double area = static_cast<double>(W) * H;
    const double log_rmin = std::log(t.ratio_min), log_rmax = std::log(t.ratio_max);
    for (int attempt = 0; attempt < 10; ++attempt) {
      const uint64_t k = base + static_cast<uint64_t>(attempt) * 4;
      const double target = area * (t.scale_min + (t.scale_max - t.scale_min) * rng.uniform(k));
      const double ratio = std::exp(log_rmin + (log_rmax - log_rmin) * rng.uniform(k + 1));
      const int w = static_cast<int>(std::lround(std::sqrt(target * ratio)));
      const int h = static_cast<int>(std::lround(std::sqrt(target / ratio)));
      if (w > 0 && h > 0 && w <= W && h <= H) {
        const int y = static_cast<int>(rng.uniform(k + 2) * static_cast<float>(H - h + 1));
        const int x = static_cast<int>(rng.uniform(k + 3) * static_cast<float>(W - w + 1));
        return {static_cast<double>(std::min(x, W - w)), static_cast<double>(std::min(y, H - h)),
                static_cast<double>(w), static_cast<double>(h), win.flip};
      }
    }
    const double in_ratio = static_cast<double>(W) / H;
    double w = W, h = H;
    if (in_ratio < t.ratio_min)
      h = std::round(w / t.ratio_min);
    else if (in_ratio > t.ratio_max)
      w = std::round(h * t.ratio_max);
    win = {std::floor((W - w) / 2), std::floor((H - h) / 2), w, h, win.flip};
  }
  return win;
}

// Resamples window `win` (in src pixels) of an 8-bit src [h, w, c] to out [oh, ow, c] float32,
// bilinear with half-pixel centres, applying flip and normalisation. A window more than twice the
// output is first averaged over f x f boxes, so shrinking does not alias.
void resample(const uint8_t* src, int w, int h, int c, Window win, const ImageTransform& t,
              float* out) {
  std::vector<uint8_t> boxed;
  const int f = static_cast<int>(std::floor(std::min(win.w / t.width, win.h / t.height)));
  if (f >= 2) {
    const int bw = w / f, bh = h / f;
    if (bw >= 1 && bh >= 1) {
      boxed.resize(static_cast<size_t>(bw) * bh * c);
      const int area = f * f;
      for (int y = 0; y < bh; ++y)
        for (int x = 0; x < bw; ++x)
          for (int k = 0; k < c; ++k) {
            int sum = 0;
            for (int dy = 0; dy < f; ++dy) {
              const uint8_t* row = src + (static_cast<size_t>(y * f + dy) * w + x * f) * c + k;
              for (int dx = 0; dx < f; ++dx) sum += row[dx * c];
            }
            boxed[(static_cast<size_t>(y) * bw + x) * c + k] =
                static_cast<uint8_t>((sum + area / 2) / area);
          }
      src = boxed.data();
      w = bw;
      h = bh;
      win.x /= f;
      win.y /= f;
      win.w /= f;
      win.h /= f;
    }
  }
  const int ow = t.width, oh = t.height;
  std::vector<int> x0(ow), x1(ow);
  std::vector<float> fx(ow);
  for (int x = 0; x < ow; ++x) {
    double sx = win.x + (x + 0.5) * win.w / ow - 0.5;
    sx = std::clamp(sx, 0.0, static_cast<double>(w - 1));
    const int i = static_cast<int>(sx);
    const int dst = win.flip ? ow - 1 - x : x;
    x0[dst] = i;
    x1[dst] = std::min(i + 1, w - 1);
    fx[dst] = static_cast<float>(sx - i);
  }
  // torchvision's arithmetic: ToTensor divides by 255 and Normalize computes (x - mean) / std, so a
  // rescale of 1/n (n whole) divides by n; other rescales multiply (Keras' Rescaling).
  const float inv = 1.0f / t.rescale;
  const bool divide = std::abs(inv - std::round(inv)) < 1e-3f * inv;
  const float divisor = std::round(inv);
  const bool normalize = !t.mean.empty() || !t.stddev.empty();
  float mean[4] = {0, 0, 0, 0}, stddev[4] = {1, 1, 1, 1};
  for (int k = 0; k < c; ++k) {
    if (!t.mean.empty()) mean[k] = t.mean[static_cast<size_t>(k)];
    if (!t.stddev.empty()) stddev[k] = t.stddev[static_cast<size_t>(k)];
  }

  for (int y = 0; y < oh; ++y) {
    double sy = win.y + (y + 0.5) * win.h / oh - 0.5;
    sy = std::clamp(sy, 0.0, static_cast<double>(h - 1));
    const int j = static_cast<int>(sy);
    const float wy = static_cast<float>(sy - j);
    const uint8_t* r0 = src + static_cast<size_t>(j) * w * c;
    const uint8_t* r1 = src + static_cast<size_t>(std::min(j + 1, h - 1)) * w * c;
    float* o = out + static_cast<size_t>(y) * ow * c;
    for (int x = 0; x < ow; ++x) {
      const int a = x0[x] * c, b = x1[x] * c;
      const float wx = fx[x];
      for (int k = 0; k < c; ++k) {
        const float top = r0[a + k] + wx * (r0[b + k] - r0[a + k]);
        const float bottom = r1[a + k] + wx * (r1[b + k] - r1[a + k]);
        float v = top + wy * (bottom - top);
        v = divide ? v / divisor : v * t.rescale;
        o[x * c + k] = normalize ? (v - mean[k]) / stddev[k] : v;
      }
    }
  }
}

// A header's size past this many pixels (16384 x 16384; Pillow refuses 179 million) is taken for
// corrupt data or a decompression bomb: decoding it would allocate gigabytes, per reader thread
// (or end in an untyped bad_alloc), for a file of a few bytes.
constexpr uint64_t kMaxPixels = uint64_t{1} << 28;

void check_size(uint64_t width, uint64_t height, const std::string& what, const char* kind) {
  if (width * height > kMaxPixels)
    throw DataLoss(str_cat(what, ": the ", kind, " header says ", width, "x", height,
                           ", more than 2^28 pixels: corrupt, or too large to decode"));
}

// ---- JPEG ----

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}
void jpeg_message(j_common_ptr cinfo, int level) {
  if (level < 0) jpeg_fail(cinfo);  // a warning (corrupt or truncated data) is an error here
}

// Decodes the part of a JPEG a transform needs: the rows of its window, at the smallest
// DCT scale that keeps the window at least the output's size. t == nullptr: the whole image at
// full size. Fills `pixels` and the decoded region's geometry; `win` comes back in its pixels.
struct JpegRegion {
  std::vector<uint8_t> pixels;
  int width = 0, height = 0, channels = 0;
  Window win;
};

void decode_jpeg(std::string_view bytes, int channels, const ImageTransform* t, uint64_t seed,
                 uint64_t epoch, int64_t index, const std::string& what, JpegRegion* r) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_message;
  std::vector<JSAMPROW> rows;
  std::vector<uint8_t>
      four;  // a CMYK JPEG as decoded (before setjmp: a longjmp skips no destructor)
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw DataLoss(str_cat(what, ": cannot decode the JPEG: ", err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, reinterpret_cast<const unsigned char*>(bytes.data()),
               static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&cinfo, TRUE);
  if (static_cast<uint64_t>(cinfo.image_width) * cinfo.image_height > kMaxPixels) {
    const uint64_t w = cinfo.image_width, h = cinfo.image_height;
    jpeg_destroy_decompress(&cinfo);
    check_size(w, h, what, "JPEG");
  }
  const int file_channels = cinfo.num_components == 1 ? 1 : 3;
  const int c = channels == 0 ? file_channels : channels;
  // CMYK (and YCCK) JPEGs, as Photoshop writes them (a few dozen in ImageNet): decoded as CMYK and
  // made RGB as TensorFlow's decode_jpeg does (gray from that RGB, where TensorFlow refuses).
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  const bool adobe = cinfo.saw_Adobe_marker != 0;
  cinfo.out_color_space = cmyk ? JCS_CMYK : c == 1 ? JCS_GRAYSCALE : JCS_RGB;
  const int dc = cmyk ? 4 : c;  // channels as decoded
  const int W = static_cast<int>(cinfo.image_width), H = static_cast<int>(cinfo.image_height);
  Window win{0, 0, static_cast<double>(W), static_cast<double>(H), false};
  int num = 8;
  if (t != nullptr) {
    win = choose_window(W, H, *t, seed, epoch, index);
    for (num = 1; num < 8; ++num)
      if (win.w * num / 8 >= t->width && win.h * num / 8 >= t->height) break;
  }
  cinfo.scale_num = static_cast<unsigned>(num);
  cinfo.scale_denom = 8;
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  const int sw = static_cast<int>(cinfo.output_width), sh = static_cast<int>(cinfo.output_height);
  const double sx = static_cast<double>(sw) / W, sy = static_cast<double>(sh) / H;
  win.x *= sx;
  win.w *= sx;
  win.y *= sy;
  win.h *= sy;
  // The decoded region: the window's rows, one pixel of margin for the filter.
  const int r0 = std::clamp(static_cast<int>(std::floor(win.y)) - 1, 0, sh - 1);
  const int r1 = std::clamp(static_cast<int>(std::ceil(win.y + win.h)) + 1, r0 + 1, sh);
  // Whole rows: jpeg_crop_scanline (libjpeg-turbo 2.1.5) leaves some samples of a cropped row
  // uninitialised (valgrind showed it), so columns are not cropped; the rows above the window are
  // skipped (jpeg_skip_scanlines) and those below it never decoded.
  if (r0 > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(r0));
  r->width = static_cast<int>(cinfo.output_width);
  r->height = r1 - r0;
  r->channels = c;
  std::vector<uint8_t>& decoded = cmyk ? four : r->pixels;
  decoded.resize(static_cast<size_t>(r->width) * r->height * dc);
  rows.resize(static_cast<size_t>(r->height));
  for (int y = 0; y < r->height; ++y)
    rows[static_cast<size_t>(y)] = decoded.data() + static_cast<size_t>(y) * r->width * dc;
  int got = 0;
  while (got < r->height) {
    const auto n = static_cast<int>(
        jpeg_read_scanlines(&cinfo, rows.data() + got, static_cast<JDIMENSION>(r->height - got)));
    if (n == 0) {  // no progress: never a partly filled image
      jpeg_destroy_decompress(&cinfo);
      throw DataLoss(str_cat(what, ": cannot decode the JPEG: it ends before its last row"));
    }
    got += n;
  }
  if (cinfo.output_scanline < cinfo.output_height)
    jpeg_abort_decompress(&cinfo);  // the rows below the window are not needed
  else
    jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (cmyk) {
    // TensorFlow's rule (jpeg_mem.cc): Adobe's inverted CMYK, r = k c / 255; else
    // r = (255 - k)(255 - c) / 255. Gray: libjpeg's RGB weights, 16-bit fixed point.
    const size_t n = static_cast<size_t>(r->width) * r->height;
    r->pixels.resize(n * static_cast<size_t>(c));
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* p = four.data() + 4 * i;
      const int k = p[3];
      int rgb[3];
      for (int j = 0; j < 3; ++j) rgb[j] = adobe ? k * p[j] / 255 : (255 - k) * (255 - p[j]) / 255;
      if (c == 3) {
        for (int j = 0; j < 3; ++j)
          r->pixels[3 * i + static_cast<size_t>(j)] = static_cast<uint8_t>(rgb[j]);
      } else {
        r->pixels[i] =
            static_cast<uint8_t>((19595 * rgb[0] + 38470 * rgb[1] + 7471 * rgb[2] + 32768) >> 16);
      }
    }
  }
  win.y -= r0;
  r->win = win;
}

// ---- PNG ----

Image decode_png(std::string_view bytes, int channels, const std::string& what) {
  png_image img;
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  auto fail = [&](const char* stage) -> DataLoss {
    const std::string msg = img.message;
    png_image_free(&img);
    return DataLoss(str_cat(what, ": cannot decode the PNG (", stage, "): ", msg));
  };
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size())) throw fail("header");
  if (static_cast<uint64_t>(img.width) * img.height > kMaxPixels) {
    const uint64_t w = img.width, h = img.height;
    png_image_free(&img);
    check_size(w, h, what, "PNG");
  }
  const bool color = (img.format & PNG_FORMAT_FLAG_COLOR) != 0;
  const bool alpha = (img.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  const int c = channels == 0 ? (color ? 3 : 1) : channels;
  // With alpha, read it and drop it (TF's decode_png and PIL's convert do not composite).
  const int read_c = c + (alpha ? 1 : 0);
  img.format = c == 1 ? (alpha ? PNG_FORMAT_GA : PNG_FORMAT_GRAY)
                      : (alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB);
  std::vector<uint8_t> buf(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, buf.data(), 0, nullptr)) throw fail("pixels");
  Image out;
  out.width = static_cast<int>(img.width);
  out.height = static_cast<int>(img.height);
  out.channels = c;
  if (!alpha) {
    out.pixels = std::move(buf);
  } else {
    const size_t n = static_cast<size_t>(out.width) * out.height;
    out.pixels.resize(n * c);
    for (size_t i = 0; i < n; ++i)
      for (int k = 0; k < c; ++k) out.pixels[i * c + k] = buf[i * read_c + k];
  }
  png_image_free(&img);
  return out;
}

void check_image(const Image& image, const char* fn) {
  if ((image.channels != 1 && image.channels != 3) || image.width < 1 || image.height < 1 ||
      image.pixels.size() != static_cast<size_t>(image.width) * image.height * image.channels)
    throw InvalidArgument(str_cat(fn, ": need a 1- or 3-channel image whose pixels hold height x ",
                                  "width x channels bytes; got ", image.height, "x", image.width,
                                  "x", image.channels, " with ", image.pixels.size(), " bytes"));
}

}  // namespace

void ImageTransform::validate() const {
  auto bad = [](const std::string& m) { throw InvalidArgument("ImageTransform: " + m); };
  if (height < 1 || width < 1)
    bad(str_cat("height and width must be >= 1, got ", height, "x", width));
  if (channels != 1 && channels != 3)
    bad(str_cat("channels must be 1 (grayscale) or 3 (rgb), got ", channels));
  if (!(central_fraction > 0 && central_fraction <= 1))
    bad(str_cat("central_fraction must be in (0, 1], got ", central_fraction));
  if (!(scale_min > 0 && scale_min <= scale_max && scale_max <= 1))
    bad(str_cat("need 0 < scale_min <= scale_max <= 1, got ", scale_min, ", ", scale_max));
  if (!(ratio_min > 0 && ratio_min <= ratio_max))
    bad(str_cat("need 0 < ratio_min <= ratio_max, got ", ratio_min, ", ", ratio_max));
  for (const auto* v : {&mean, &stddev})
    if (!v->empty() && v->size() != static_cast<size_t>(channels))
      bad(str_cat("mean and stddev need one value per channel (", channels, "), got ", v->size()));
  for (float s : stddev)
    if (!(s > 0)) bad(str_cat("stddev values must be > 0, got ", s));
  for (float m : mean)
    if (!std::isfinite(m)) bad(str_cat("mean values must be finite, got ", m));
  // 1 / 255 in integers is 0: every image would become blank.
  if (!(rescale > 0) || !std::isfinite(rescale))
    bad(str_cat("rescale must be finite and > 0, got ", rescale,
                rescale == 0 ? " (1 / 255 in integers is 0: write 1.0f / 255)" : ""));
}

std::string ImageTransform::to_string() const {
  auto exact = [](float v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%a", static_cast<double>(v));
    return std::string(buf);
  };
  std::string s = str_cat(height, "x", width, "x", channels, " resize ", static_cast<int>(resize),
                          " fraction ", exact(central_fraction), " scale ", exact(scale_min), "..",
                          exact(scale_max), " ratio ", exact(ratio_min), "..", exact(ratio_max),
                          " flip ", random_flip ? 1 : 0, " rescale ", exact(rescale));
  for (float m : mean) s += " mean " + exact(m);
  for (float d : stddev) s += " stddev " + exact(d);
  return s;
}

Image decode_image(std::string_view bytes, int channels, const std::string& what) {
  if (channels != 0 && channels != 1 && channels != 3)
    throw InvalidArgument(str_cat("decode_image: channels must be 0, 1 or 3, got ", channels));
  if (is_png(bytes)) return decode_png(bytes, channels, what);
  if (!is_jpeg(bytes)) not_an_image(bytes, what);
  JpegRegion r;
  decode_jpeg(bytes, channels, nullptr, 0, 0, 0, what, &r);
  return Image{r.height, r.width, r.channels, std::move(r.pixels)};
}

void transform_image(const Image& image, const ImageTransform& t, uint64_t seed, uint64_t epoch,
                     int64_t index, float* out) {
  check_image(image, "transform_image");
  if (image.channels != t.channels)
    throw InvalidArgument(str_cat("transform_image: the image has ", image.channels,
                                  " channels and the transform makes ", t.channels,
                                  "; decode with channels = ", t.channels));
  const Window win = choose_window(image.width, image.height, t, seed, epoch, index);
  resample(image.pixels.data(), image.width, image.height, image.channels, win, t, out);
}

void decode_transformed(std::string_view bytes, const ImageTransform& t, uint64_t seed,
                        uint64_t epoch, int64_t index, float* out, const std::string& what) {
  if (is_png(bytes)) {
    transform_image(decode_png(bytes, t.channels, what), t, seed, epoch, index, out);
    return;
  }
  if (!is_jpeg(bytes)) not_an_image(bytes, what);
  JpegRegion r;
  decode_jpeg(bytes, t.channels, &t, seed, epoch, index, what, &r);
  resample(r.pixels.data(), r.width, r.height, r.channels, r.win, t, out);
}

Tensor load_image(const std::string& path, const ImageTransform& t, uint64_t seed, uint64_t epoch,
                  int64_t index) {
  t.validate();
  Tensor out = Tensor::empty(Shape{t.height, t.width, t.channels}, DType::kFloat32);
  decode_transformed(read_file(path), t, seed, epoch, index, out.data<float>(), path);
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT) throw NotFound(str_cat(path, ": no such file"));
    throw DataLoss(str_cat(path, ": cannot open: ", std::strerror(errno)));
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw DataLoss(str_cat(path, ": read error"));
  return bytes;
}

std::string encode_jpeg(const Image& image, int quality) {
  check_image(image, "encode_jpeg");
  if (quality < 1 || quality > 100)
    throw InvalidArgument(str_cat("encode_jpeg: quality must be in [1, 100], got ", quality));
  jpeg_compress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  unsigned char* mem = nullptr;
  unsigned long size = 0;
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(mem);
    throw Internal(str_cat("encode_jpeg: ", err.message));
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &mem, &size);
  cinfo.image_width = static_cast<JDIMENSION>(image.width);
  cinfo.image_height = static_cast<JDIMENSION>(image.height);
  cinfo.input_components = image.channels;
  cinfo.in_color_space = image.channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  const size_t stride = static_cast<size_t>(image.width) * image.channels;
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(image.pixels.data() + cinfo.next_scanline * stride);
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::string out(reinterpret_cast<const char*>(mem), size);
  std::free(mem);
  return out;
}

std::string encode_png(const Image& image) {
  check_image(image, "encode_png");
  png_image img;
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(image.width);
  img.height = static_cast<png_uint_32>(image.height);
  img.format = image.channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, image.pixels.data(), 0, nullptr))
    throw Internal(str_cat("encode_png: ", img.message));
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, image.pixels.data(), 0, nullptr))
    throw Internal(str_cat("encode_png: ", img.message));
  out.resize(size);
  return out;
}

}  // namespace dtrain::image
