// Images for input pipelines: JPEG (libjpeg-turbo) and PNG (libpng) decoding and encoding, and the
// transforms image models train with (resize, center crop, random resized crop, flip,
// normalisation), fused into one pass that writes the float32 image a model takes.
//
// Random choices are a function of (seed, epoch, index) only (Philox), so an image gets the same
// crop whichever worker or thread decodes it, and a job resumed mid-epoch sees what the
// uninterrupted run saw.
//
// A JPEG is decoded at the smallest of libjpeg's 1/8 ... 8/8 scales that still covers the output
// at full resolution, and only down to the crop window's last row (the rows above it skipped), as
// TF's decode_and_crop_jpeg saves work; the bilinear resize then reads from that.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain::image {

// An 8-bit image, rows of width * channels bytes (HWC order; channels 1 = gray, 3 = RGB).
struct Image {
  int height = 0, width = 0, channels = 0;
  std::vector<uint8_t> pixels;
};

// Decodes a JPEG or PNG (told apart by their first bytes) to `channels` (0: the file's own, gray or
// RGB; 1: gray; 3: RGB; a PNG's alpha is dropped; a 16-bit PNG becomes 8-bit through libpng's
// simplified API, which treats 16-bit samples as linear and encodes them as sRGB). Throws DataLoss
// naming `what` (a file name, a record) for data that is not a whole JPEG or PNG: truncated,
// corrupt, empty, another format. libjpeg's warnings (a premature end of data) count as errors:
// a half-decoded image is never returned.
DTRAIN_API Image decode_image(std::string_view bytes, int channels = 0,
                              const std::string& what = "image");
// Encoders (tests, tools, writing datasets). Throw InvalidArgument for an image whose size does
// not match its pixels or whose channels are not 1 or 3.
DTRAIN_API std::string encode_jpeg(const Image& image, int quality = 90);
DTRAIN_API std::string encode_png(const Image& image);

struct DTRAIN_API ImageTransform {
  // Output size (Keras image_dataset_from_directory's image_size default is 256x256) and
  // channels (Keras color_mode: 1 "grayscale", 3 "rgb").
  int height = 256, width = 256;
  int channels = 3;
  enum class Resize {
    kStretch,           // the whole image resized to height x width (Keras' default)
    kCenterCrop,        // the central window of the output's aspect ratio, times
                        // central_fraction of it (Keras crop_to_aspect_ratio; 0.875 = ImageNet
                        // evaluation's resize 256, center crop 224), resized
    kRandomResizedCrop  // torchvision's RandomResizedCrop / TF's sample_distorted_bounding_box:
                        // a window of a random area (scale) and aspect ratio (ratio), resized
  };
  Resize resize = Resize::kStretch;
  float central_fraction = 1.0f;
  float scale_min = 0.08f, scale_max = 1.0f;               // share of the image's area
  float ratio_min = 3.0f / 4.0f, ratio_max = 4.0f / 3.0f;  // width / height, drawn log-uniform
  bool random_flip = false;                                // left-right with probability 1/2
  // value = (pixel * rescale - mean[c]) / stddev[c]; empty mean/stddev: 0 and 1. ImageNet as
  // torchvision: rescale 1/255, mean {0.485, 0.456, 0.406}, stddev {0.229, 0.224, 0.225}. A
  // rescale of 1/n (n whole) divides by n, as torchvision's ToTensor does: 1/255 gives exactly
  // pixel / 255.0f (the values load_fashion_mnist and ToTensor give).
  float rescale = 1.0f;
  std::vector<float> mean, stddev;

  // True when the output depends on (seed, epoch, index).
  bool random() const { return resize == Resize::kRandomResizedCrop || random_flip; }
  // Throws InvalidArgument naming the field that is out of range.
  void validate() const;
  // Every field, exactly (floats in hexadecimal): what a cache file's fingerprint holds.
  std::string to_string() const;
};

// Decodes `bytes` and writes the transformed image, float32 [height, width, channels], to `out`.
// Throws as decode_image.
DTRAIN_API void decode_transformed(std::string_view bytes, const ImageTransform& transform,
                                   uint64_t seed, uint64_t epoch, int64_t index, float* out,
                                   const std::string& what = "image");
// The same on an image already decoded.
DTRAIN_API void transform_image(const Image& image, const ImageTransform& transform, uint64_t seed,
                                uint64_t epoch, int64_t index, float* out);
// As decode_transformed, returning a new float32 [height, width, channels] tensor.
DTRAIN_API Tensor load_image(const std::string& path, const ImageTransform& transform,
                             uint64_t seed = 0, uint64_t epoch = 0, int64_t index = 0);

// The whole file as bytes. Throws NotFound (missing) or DataLoss (unreadable), naming it.
DTRAIN_API std::string read_file(const std::string& path);

}  // namespace dtrain::image
