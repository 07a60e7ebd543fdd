// Fashion-MNIST and the IDX file format it ships in (http://yann.lecun.com/exdb/mnist/):
// a big-endian header of two zero bytes, a type code (0x08 = unsigned byte), the number of
// dimensions and one 32-bit size per dimension, followed by the row-major payload.
// Files may be raw or gzip-compressed. Thread-safety: free functions with no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

// An unsigned-byte IDX array: dims as stored, data row-major.
struct DTRAIN_API IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

// Reads an IDX file, raw or gzip (detected from the content, whatever the name).
// Throws NotFound when the file does not exist (the message says how to point dtrain at the data:
// --data-dir, DTRAIN_DATA_DIR, or `apt-get install dataset-fashion-mnist`), Unavailable when it
// exists but cannot be opened, and DataLoss when it is truncated or corrupt: bad magic, a type
// code other than 0x08, or a payload whose size differs from the product of the dims (the message
// names the file and the expected and actual byte counts). max_rows > 0: only the first max_rows
// rows (first dimension) are read and decompressed, and the bytes after them are not checked.
DTRAIN_API IdxArray read_idx(const std::string& path, int64_t max_rows = 0);

struct DTRAIN_API FashionMnist {
  Tensor train_images;  // float32 [60000, 28, 28, 1] in [0, 1]
  Tensor train_labels;  // int32 [60000], values 0..9
  Tensor test_images;   // float32 [10000, 28, 28, 1]
  Tensor test_labels;   // int32 [10000]
};

// The default data directory, where `apt-get install dataset-fashion-mnist` puts the files.
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// `dir` if non-empty, else $DTRAIN_DATA_DIR if set and non-empty, else kDefaultFashionMnistDir.
DTRAIN_API std::string resolve_data_dir(const std::string& dir);

// Loads the four files train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte
// and t10k-labels-idx1-ubyte (each preferring a ".gz" version) from resolve_data_dir(dir).
// Throws NotFound when a file is missing (naming the directory, how it was chosen and how to
// change it), and DataLoss when a file is corrupt, images are not N x 28 x 28, image and label
// counts differ, or a label is outside 0..9. max_train_rows > 0: only the first max_train_rows
// training images and labels are read (what --train-limit trains on; the rest is not decoded).
DTRAIN_API FashionMnist load_fashion_mnist(const std::string& dir = "", int64_t max_train_rows = 0);

}  // namespace dtrain
