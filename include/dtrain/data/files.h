// Input pipelines from files: file lists, folders of images (Keras' image_dataset_from_directory,
// torchvision's ImageFolder) and TFRecord files of tf.train.Example (tf.data.TFRecordDataset).
//
// Each source is a Dataset of rows read on demand (Dataset::from_reader): an element is a file or
// a record, read and decoded when batch() gathers it, on a pool of reader threads
// (num_parallel_calls, one per core by default). Because rows are addressed by index, what
// tf.data needs several stages for falls out of the pipeline fit() already builds:
//   - sharding across workers is exact: each global batch's rows are split between the workers,
//     and a worker reads and decodes only its own (every example once per epoch, none twice);
//   - the position is the (epoch, step) checkpoints and BackupAndRestore save: a resumed job
//     skips to it without reading the skipped rows, and gets the same rows and the same random
//     crops (they are drawn from (seed, epoch, row));
//   - shuffling permutes indices: a full-size shuffle at no cost per byte.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/image.h"

namespace dtrain::data {

// ---- file lists ----

struct DTRAIN_API ListFilesOptions {
  // This worker's share of the list, taken after sorting (tf.data's list_files(...).shard(n, i)):
  // file k goes to worker k % num_shards.
  int num_shards = 1, shard_index = 0;
};
// The files matching a glob pattern ("data/train-*.tfrecord", "images/*/*.jpg"), sorted, so
// every worker lists the same order. Throws NotFound when nothing matches (naming the pattern),
// InvalidArgument for a bad shard.
DTRAIN_API std::vector<std::string> list_files(const std::string& pattern,
                                               const ListFilesOptions& options = {});

// ---- image folders ----

struct DTRAIN_API ImageFolderOptions {
  // Class folders to use, in label order; empty: every subfolder, sorted (Keras' inferred labels:
  // label i is the i-th folder in alphanumeric order).
  std::vector<std::string> class_names;
  // How each image is decoded and transformed (size, color mode, crops, flips, normalisation).
  image::ImageTransform transform;
  // Seeds the random transforms, and validation_split's shuffle of the files.
  uint64_t seed = 0;
  // Keras: a fraction of the files set aside (after a shuffle by seed) as "validation"; subset
  // picks "training" or "validation" (empty: all files, validation_split must be 0).
  double validation_split = 0;
  std::string subset;
  int num_parallel_calls = Dataset::kAutotune;
  // Files that cannot be decoded (or are not images) are skipped and counted
  // (Dataset::skipped_records()) instead of failing the batch with DataLoss.
  bool ignore_errors = false;
  bool follow_links = false;
};

struct DTRAIN_API ImageFolder {
  // Rows (float32 [height, width, channels] image, int32 label), unbatched.
  Dataset dataset;
  std::vector<std::string> class_names;
  std::vector<std::string> files;  // row i's file
  std::vector<int32_t> labels;     // row i's label
};

// A folder with one subfolder per class of .jpg/.jpeg/.png files (case-insensitive; others are
// ignored). Throws NotFound for a missing folder, InvalidArgument for a folder with no class
// subfolders, a named class that is missing, a class with no images, or bad options.
DTRAIN_API ImageFolder image_dataset_from_directory(const std::string& directory,
                                                    const ImageFolderOptions& options = {});

// ---- TFRecord ----

// Writes a TFRecord file (TensorFlow's framing with masked CRC-32C checksums). The records go to
// `path`.tmp and the file is renamed into place by close(), so a reader never sees half a file.
// Throws DataLoss when the file cannot be written whole.
class DTRAIN_API TFRecordWriter {
 public:
  explicit TFRecordWriter(const std::string& path);
  ~TFRecordWriter();  // closes; errors are only reported by an explicit close()
  TFRecordWriter(const TFRecordWriter&) = delete;
  TFRecordWriter& operator=(const TFRecordWriter&) = delete;
  void write(std::string_view record);
  void close();

 private:
  std::string path_, tmp_;
  void* file_ = nullptr;
};

// Every record of a TFRecord file, checksums verified. Throws NotFound, or DataLoss naming the
// file, the record and its byte offset (truncated, a bad length or data checksum).
DTRAIN_API std::vector<std::string> read_tfrecord_file(const std::string& path);

// tf.train.Example: feature name -> one of a list of bytes, floats or int64s.
struct DTRAIN_API Feature {
  enum class Kind { kBytes, kFloat, kInt64 };
  Kind kind = Kind::kFloat;
  std::vector<std::string> bytes;
  std::vector<float> floats;
  std::vector<int64_t> ints;
  static Feature of_bytes(std::vector<std::string> v);
  static Feature of_floats(std::vector<float> v);
  static Feature of_ints(std::vector<int64_t> v);
};
using Example = std::map<std::string, Feature>;
DTRAIN_API std::string serialize_example(const Example& example);
// Throws DataLoss for bytes that are not a tf.train.Example.
DTRAIN_API Example parse_example(std::string_view bytes);

// One fixed-size feature of every record (tf.io.FixedLenFeature), a component of the dataset.
struct DTRAIN_API FeatureSpec {
  std::string key;
  enum class Kind {
    kFloat,  // a float_list of shape.numel() values -> float32 [shape]
    kInt64,  // an int64_list of shape.numel() values -> `dtype` (int32, range-checked, or int64)
    kImage   // a bytes_list of one encoded JPEG/PNG -> float32 [height, width, channels]
  };
  Kind kind = Kind::kFloat;
  Shape shape;
  DType dtype = DType::kFloat32;
  std::vector<double> default_value;  // used when the record lacks the feature; empty: required
  image::ImageTransform transform;    // kImage: how the bytes are decoded

  static FeatureSpec float32(std::string key, Shape shape = Shape{});
  static FeatureSpec int64(std::string key, Shape shape = Shape{}, DType dtype = DType::kInt32);
  static FeatureSpec image(std::string key, const image::ImageTransform& transform);
};

struct DTRAIN_API TFRecordOptions {
  // Reading order across files, as files.interleave(TFRecordDataset, cycle_length, block_length):
  // block_length records from each of cycle_length open files in turn, the next file taking a
  // finished one's place. cycle_length 1: file after file (TFRecordDataset's own order).
  int cycle_length = 1, block_length = 1;
  int num_parallel_calls = Dataset::kAutotune;
  // A record whose data checksum fails, or that does not parse or lacks a required feature, is
  // skipped and counted (Dataset::skipped_records()); a broken header or a truncated file ends
  // that file's records there (TFRecord cannot find the next record past a broken length), with a
  // warning naming it. false: DataLoss naming file, record and offset.
  bool ignore_errors = false;
  uint64_t seed = 0;  // random image transforms
};

// A Dataset with one component per feature, one row per record of `files` (indexed when called:
// the files are memory-mapped and only the 12-byte record headers are read; each record's data
// checksum is verified when the record is read). Uncompressed files only (a GZIP one is refused
// by name: gunzip it). Throws NotFound for a missing file, DataLoss for a broken header or a
// truncated file (unless ignore_errors), InvalidArgument for bad specs.
DTRAIN_API Dataset TFRecordDataset(const std::vector<std::string>& files,
                                   const std::vector<FeatureSpec>& features,
                                   const TFRecordOptions& options = {});

}  // namespace dtrain::data
