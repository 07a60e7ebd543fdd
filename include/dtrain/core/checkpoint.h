// Checkpoints in the safetensors format (https://github.com/huggingface/safetensors), and a
// CheckpointManager that keeps a directory of numbered checkpoints like TF's
// tf.train.CheckpointManager.
//
// A safetensors file is: an 8-byte little-endian length N; N bytes of a JSON object mapping each
// tensor name to {"dtype":"F32","shape":[2,3],"data_offsets":[begin,end]} plus an optional
// "__metadata__" object of string values, padded with spaces so the data starts 8-byte aligned;
// then the raw little-endian tensor bytes, offsets relative to the end of the header. Files written
// here load in Python with safetensors.torch.load_file and vice versa (for the six dtypes dtrain
// holds: F32, F64, F16, BF16, I32, I64).
//
// Durability: every file is written to `<path>.tmp.<pid>.<n>`, fsync'ed, renamed over `<path>`, and
// the directory fsync'ed, so a crash (or SIGKILL, or power loss) at any moment leaves either the
// old file or the new one, never a torn one. Loading validates the whole file before it allocates
// anything, so a corrupt or hostile file yields DataLoss, never a crash or a huge allocation.
//
// Thread-safety: the free functions share no state; saving two different paths concurrently is
// safe, and so is saving one path from two threads (the last rename wins). CheckpointManager's
// methods may be called from any thread; save() calls within a process are serialised. One writer
// process (e.g. the chief) per directory: save() removes the temporary files that it finds there.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

// The contents of one checkpoint file.
struct DTRAIN_API CheckpointData {
  // Name -> tensor, in file order (by data offset). Tensors returned by a load are on the CPU.
  std::vector<std::pair<std::string, Tensor>> tensors;
  // The safetensors "__metadata__" map (string -> string).
  std::map<std::string, std::string> metadata;
  // Set by a load: the file it read, as file_source() describes the file at a path (empty for data
  // not loaded from a file). A file replaced since (the chief's final checkpoint rewrites the file
  // of its last step) has another source, even within the file system's timestamp resolution.
  std::string source;

  // Tensors produced while the file is written, after `tensors` and one at a time (each written and
  // dropped before the next is produced), so that a checkpoint need not sit in one process's
  // memory at once: sharded optimizer slots are gathered from their parts so. produce() must return
  // a tensor of the declared dtype and shape (else Internal). find() does not see them.
  struct Streamed {
    std::string name;
    DType dtype = DType::kFloat32;
    Shape shape;
    std::function<Tensor()> produce;
  };
  std::vector<Streamed> streamed;

  // The tensor called `name`, or nullptr when there is none.
  const Tensor* find(const std::string& name) const;
  // Produces every streamed tensor now and appends it to `tensors` (streamed becomes empty).
  void materialize();
};

// Writes `data` to `path` atomically (see above), tensors in the order given. Tensors on a non-CPU
// device are copied to the host first. Throws InvalidArgument for an undefined tensor, an empty or
// duplicate name, a name starting with "__" (reserved by the format), or a name or metadata string
// that is not valid UTF-8; Unavailable when the file cannot be written (the message names the path
// and the system's error text). On failure the previous file at `path`, if any, is untouched.
DTRAIN_API void save_safetensors(const std::string& path, const CheckpointData& data);

// The file at `path` now: its path, device, inode, modification time (ns) and size, as
// CheckpointData::source records them; empty when there is no such file.
DTRAIN_API std::string file_source(const std::string& path);

// Reads a safetensors file and checks all of it: the header length (at most 100 MB and within the
// file), the JSON, each entry's dtype, shape and offsets (end - begin == numel * dtype size), and
// that the entries tile the data section exactly (no overlap, no gap, nothing missing or left
// over). Returns tensors sorted by data offset. Throws NotFound when `path` does not exist,
// Unavailable when it cannot be read, Unimplemented for a safetensors dtype dtrain does not hold
// (U8, BOOL, F8_E4M3, ...), and DataLoss naming the file and what is wrong for anything else, e.g.
// "truncated: header says 4096 bytes of data, file has 100".
DTRAIN_API CheckpointData load_safetensors(const std::string& path);

// A directory of numbered checkpoints "ckpt-<step>.safetensors" plus an index file "checkpoint"
// holding {"latest":"ckpt-120.safetensors","step":120}. The index is replaced atomically only after
// the data file it names is durable, so it never points at a missing or partial file; older files
// are deleted only after the index has moved past them.
class DTRAIN_API CheckpointManager {
 public:
  // Creates `directory` (and its parents) if needed. Keeps the newest `max_to_keep` checkpoints.
  // Throws InvalidArgument when max_to_keep < 1, Unavailable when the directory cannot be created.
  explicit CheckpointManager(std::string directory, int max_to_keep = 3);

  // Writes `data` as checkpoint `step` (with metadata["step"] set to the step), moves the index to
  // it, then deletes all but the newest max_to_keep checkpoints and the "ckpt-*.tmp.*" /
  // "checkpoint.tmp.*" leftovers of a crashed writer (restore ignores them). Newest by the order
  // they were saved in, which the index keeps, as TF's CheckpointManager does (a rerun that starts
  // at a lower step keeps its own checkpoints, not the last run's); files the index does not list
  // count as older than those it does, by step among themselves. The one just written is always
  // kept. Returns the path written. Throws InvalidArgument for a negative step or bad data
  // (see save_safetensors), Unavailable on I/O errors; on failure no checkpoint has been
  // deleted and the index still names a complete checkpoint.
  std::string save(int64_t step, CheckpointData data);

  // Loads the checkpoint the index names. If the index is missing or unreadable, or its file is
  // damaged (DataLoss), gone, or not one of ours (a dtype dtrain does not hold), falls back to the
  // newest other checkpoint that loads (in the order save() keeps), logging one WARNING line saying
  // what was skipped and why. Sets *step and *path (when given) to the step and file restored.
  // Returns nullopt when the directory holds no checkpoint at all. Throws DataLoss when checkpoint
  // files exist but none of them loads (the message lists each file and its error): starting
  // training from scratch silently would be worse. Other errors (Unavailable: EIO, EACCES) are
  // thrown, not fallen back past: on one worker of several that would restore other weights than
  // the rest.
  std::optional<CheckpointData> restore_latest(int64_t* step = nullptr,
                                               std::string* path = nullptr) const;

  // The path restore_latest() would try first: the index's file when it exists, else the newest
  // checkpoint file; nullopt when there is none. Does not read the file.
  std::optional<std::string> latest_path() const;

  const std::string& directory() const { return directory_; }
  int max_to_keep() const { return max_to_keep_; }

 private:
  std::string directory_;
  int max_to_keep_;
};

}  // namespace dtrain
