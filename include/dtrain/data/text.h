// Text for language models: a byte-level tokenizer (vocabulary 256, nothing to download), token
// files (nanoGPT's flat .bin of uint8 or uint16 tokens) read through a memory map, and a Dataset of
// (input, target) windows over them, as nanoGPT's get_batch draws them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/data/dataset.h"

namespace dtrain::text {

// Each byte is one token: encode("hi") = {104, 105}; decode inverts it for ids in [0, 256) and
// throws InvalidArgument naming the first id outside.
class DTRAIN_API ByteTokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;
  int64_t vocab_size() const { return kVocabSize; }
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
};

// Writes tokens as a flat little-endian file of `token_bytes` (1 or 2) per token. Throws
// InvalidArgument for a token that does not fit, DataLoss when the file cannot be written whole.
DTRAIN_API void write_token_file(const std::string& path, const std::vector<int32_t>& tokens,
                                 int token_bytes = 1);

// A token file mapped read-only into memory: pages are read when touched, so a corpus larger than
// memory works. Throws NotFound for a missing file, DataLoss for one whose size is not a multiple
// of token_bytes, InvalidArgument for token_bytes other than 1 or 2.
class DTRAIN_API TokenFile {
 public:
  explicit TokenFile(const std::string& path, int token_bytes = 1);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  int64_t size() const { return size_; }  // tokens
  int token_bytes() const { return token_bytes_; }
  const std::string& path() const { return path_; }
  int32_t operator[](int64_t i) const {
    return token_bytes_ == 1 ? static_cast<int32_t>(data_[i])
                             : static_cast<int32_t>(data_[2 * i] | (data_[2 * i + 1] << 8));
  }
  // tokens [begin, begin + count) as int32.
  void read(int64_t begin, int64_t count, int32_t* out) const;

 private:
  std::string path_;
  int token_bytes_;
  int64_t size_ = 0;
  size_t bytes_ = 0;
  const unsigned char* data_ = nullptr;
};

struct DTRAIN_API TokenWindowOptions {
  int64_t sequence_length = 256;  // T: inputs [T], targets [T] (the inputs shifted by one)
  // The tokens windows come from: [begin, end) of the file (end -1: its end). A validation split
  // is a second range.
  int64_t begin = 0, end = -1;
  // Random windows (nanoGPT's get_batch): row r starts at begin + a Philox(seed, r) draw over every
  // start whose window fits, so the rows are fixed by the seed and an epoch (a shuffle of the rows)
  // visits each once. false: consecutive windows at begin + r T, none overlapping.
  bool random = true;
  uint64_t seed = 0;
  // Rows (windows) in the dataset; 0: (end - begin - 1) / T, one pass over the range's tokens.
  int64_t windows = 0;
};

// A Dataset of (inputs int32 [T], targets int32 [T]) rows, read from the file on demand. Throws
// InvalidArgument when the range holds fewer than T + 1 tokens or options are out of range.
DTRAIN_API Dataset token_windows(std::shared_ptr<const TokenFile> file,
                                 const TokenWindowOptions& options);

}  // namespace dtrain::text
