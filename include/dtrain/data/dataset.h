// Dataset: an immutable description of an input pipeline, shaped like tf.data, over a source of N
// rows: aligned tensors in memory (from_tensors), or rows read on demand (from_reader: files, image
// folders and TFRecord files in data/files.h, token files in data/text.h). Element i of the source
// is row i of every component. Transformations (shuffle, shard, repeat, take, batch,
// prefetch) return new Datasets that share the upstream stages, so copies are cheap handles.
//
// Order semantics follow tf.data exactly: stages apply in the order written, so
// shuffle().batch().repeat() reshuffles per epoch and ends each epoch with a partial batch, while
// repeat().batch() lets batches straddle epoch boundaries.
//
// Elements of an unbatched pipeline are fresh copies of one row (shape = the component's shape
// without the leading dimension); after batch() each element is a fresh contiguous CPU tensor of
// shape [b, ...]. Until batch(), stages pass row indices, so shuffle and shard cost nothing per
// byte, and batch() gathers rows with one memcpy per contiguous run.
//
// Thread-safety: a Dataset is immutable and its methods are safe from any thread. An Iterator is
// used by one thread at a time. The source tensors are held by handle: do not write them while a
// pipeline over them is being iterated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

namespace detail {
class DatasetNode;
struct DatasetAccess;
}  // namespace detail

class DTRAIN_API Dataset {
 public:
  // A pipeline whose i-th element is row i of every component (tf.data's from_tensor_slices).
  // Components on a device are copied to the CPU once. Throws InvalidArgument when `components`
  // is empty, holds an undefined or rank-0 tensor, or the leading dimensions differ.
  static Dataset from_tensors(std::vector<Tensor> components);
  static Dataset from_tensor_slices(std::vector<Tensor> components) {
    return from_tensors(std::move(components));
  }
  // A pipeline of n elements read on demand: read(component, row, dst) writes row `row` of that
  // component (RowSpec's shape and dtype, dense) to dst, when batch() gathers it (a file, a
  // memory-mapped token stream, a generator). It must be deterministic and safe to call from
  // several threads; an exception it throws propagates from next(). Throws InvalidArgument for
  // n < 0, no components or an empty reader.
  struct RowSpec {
    Shape shape;  // one row's shape
    DType dtype = DType::kFloat32;
  };
  using RowReader = std::function<void(size_t component, int64_t row, void* dst)>;
  static Dataset from_reader(int64_t n, std::vector<RowSpec> components, RowReader read);

  // The general reader (what list_files-based sources, image folders and TFRecord files are made
  // of, and what a user's own file format plugs into): read(row, epoch, dst) writes row `row` of
  // every component c to dst[c] (RowSpec's shape and dtype, dense) and returns true, or returns
  // false to skip the row (ignore_errors; the row is counted in skipped_records() and its batch is
  // one row shorter, so every other batch keeps its rows and sharding and resuming stay exact; in a
  // multi-worker job where each worker reads its replicas' rows alone, the step's mean still
  // divides by the planned global batch, the same on every worker).
  // `epoch` is the pass's epoch (with_epoch(); fit() sets it), for random augmentation that
  // differs per epoch yet is the same whichever worker, thread or resumed job reads the row.
  // PyTorch's map-style Dataset (__getitem__) with DataLoader's workers: batch() reads a batch's
  // rows on `num_parallel_calls` threads of its own, so decoding never runs on a training thread.
  using ElementReader = std::function<bool(int64_t row, uint64_t epoch, void* const* dst)>;
  struct ReaderOptions {
    int num_parallel_calls = 1;    // threads batch() reads rows on; kAutotune: one per usable core
    bool epoch_dependent = false;  // read() uses `epoch`: then cache() is refused
    std::string name;              // shown by to_string(), e.g. "image_dataset_from_directory"
    // Identifies the data (files, sizes, times, decoding options): a cache file written for
    // another fingerprint is refused.
    std::string fingerprint;
  };
  static Dataset from_reader(int64_t n, std::vector<RowSpec> components, ElementReader read,
                             const ReaderOptions& options);

  // A uniformly random permutation of all elements of the input (a full-size shuffle buffer),
  // decided by Philox(seed, pass): Fisher-Yates over the elements of one pass. Pass k is the k-th
  // time this shuffle stage starts (each repeat() epoch and each make_iterator() on this Dataset or
  // a Dataset built from it counts, in the order they start, as TF's seed generator does). With
  // reshuffle_each_iteration=false every pass uses permutation 0. Passes are numbered from
  // first_pass: shuffle(seed, false, e) is the order shuffle(seed) gives epoch e, which is how
  // fit() starts a resumed job at epoch e. Throws InvalidArgument when the input is infinite (put
  // shuffle() before repeat()).
  Dataset shuffle(uint64_t seed, bool reshuffle_each_iteration = true,
                  uint64_t first_pass = 0) const;

  // Keeps the elements i with i % num_shards == index (tf.data semantics: shard before shuffle
  // and batch for a disjoint split). Throws InvalidArgument unless 1 <= num_shards and
  // 0 <= index < num_shards.
  Dataset shard(int num_shards, int index) const;

  // The input `count` times over (-1 = forever); each repetition starts a fresh pass over the
  // input. Stops when a pass yields nothing, so repeat() of an empty dataset is empty.
  // Throws InvalidArgument for count < -1.
  Dataset repeat(int64_t count = -1) const;

  // The first `count` elements (-1 = all). Throws InvalidArgument for count < -1.
  Dataset take(int64_t count) const;

  // All but the first `count` elements (tf.data skip). Before batch() it costs nothing per
  // skipped element (indices only); fit() resumes mid-epoch with it. Throws InvalidArgument for
  // count < 0.
  Dataset skip(int64_t count) const;

  // Consecutive elements stacked into tensors of shape [b, ...]; the last batch of a finite
  // input holds the remainder unless drop_remainder. Throws InvalidArgument for batch_size < 1
  // or when the input is already batched (batching batches is not supported).
  Dataset batch(int64_t batch_size, bool drop_remainder = false) const;

  // Applies `fn` to every batch, e.g. to normalise, cast or augment (tf.data's map). With
  // num_parallel_calls = 1 it runs on the thread that reads the dataset (the prefetch thread when
  // a prefetch() follows); with N > 1 on a pool of N threads of its own that map up to N batches
  // ahead; kAutotune: one per core this process may run on (its CPU affinity). Batches come out in
  // the input's order either way, so the result never depends on N (tf.data's deterministic=True).
  // `fn` must return as many tensors as it gets (InvalidArgument from next() otherwise); an
  // exception it throws propagates from next(), in order. With one call at a time it is not called
  // for elements a later shard() drops. It must be safe to call from several threads when
  // N > 1 or several iterators run at once. Throws InvalidArgument when the dataset is not
  // batched, fn is empty or num_parallel_calls is below 1 and not kAutotune.
  static constexpr int kAutotune = -1;  // tf.data.AUTOTUNE
  using MapFn = std::function<std::vector<Tensor>(std::vector<Tensor>)>;
  Dataset map(MapFn fn, int num_parallel_calls = 1) const;
  // map() whose function also gets the batch's index in this pass (0, 1, ...; batches a later
  // shard() drops count too), as tf.data's enumerate().map(): for random transforms seeded by
  // position, the same whichever thread runs them.
  using IndexedMapFn = std::function<std::vector<Tensor>(std::vector<Tensor>, int64_t index)>;
  Dataset map_with_index(IndexedMapFn fn, int num_parallel_calls = 1) const;

  // The epoch the source's reader is given for this pipeline (default 0; the k-th repeat() pass
  // adds k). fit() calls it with each epoch, as PyTorch's DistributedSampler.set_epoch().
  Dataset with_epoch(uint64_t epoch) const;

  // Keeps every row the source reads, in memory (filename empty) or in a file, so later passes
  // (and, for a file, later runs) do not read or decode again (tf.data's cache()). Only directly
  // on a source: cache() then shuffle()/batch(). A cache file records the pipeline it belongs to;
  // one written for another pipeline, or damaged, is refused with InvalidArgument/DataLoss naming
  // it. Rows written are flagged only after their bytes, so a run killed mid-pass leaves a valid
  // partial cache. Throws InvalidArgument on a stage that is not a source, or on a reader whose
  // rows change with the epoch (cache before random augmentation, as in tf.data), or for a memory
  // cache larger than the memory. A source already in memory (from_tensors) is returned as it is.
  Dataset cache(const std::string& filename = "") const;

  // Rows the source's reader skipped so far (ignore_errors), over every pipeline built on it.
  int64_t skipped_records() const;

  // Produces up to `buffer_size` elements ahead on a background thread. An exception thrown while
  // producing is rethrown from Iterator::next() after the elements produced before it. Destroying
  // the iterator stops and joins the thread (it finishes at most the element it is producing).
  // Throws InvalidArgument for buffer_size < 1.
  Dataset prefetch(int buffer_size = 2) const;

  // Number of elements this dataset yields (after batching: number of batches), -1 if infinite.
  int64_t cardinality() const;
  // Number of tensors in one element.
  size_t num_components() const;
  // True after batch().
  bool is_batched() const;
  // The pipeline, e.g. "from_tensors(n=60000, components=2).shuffle(seed=1).batch(64)".
  std::string to_string() const;

  class Iterator {
   public:
    virtual ~Iterator() = default;
    // Replaces *out with the next element (num_components() tensors) and returns true, or
    // returns false at the end. Rethrows errors from prefetch threads.
    virtual bool next(std::vector<Tensor>* out) = 0;
  };
  // A fresh pass over the pipeline.
  std::unique_ptr<Iterator> make_iterator() const;

 private:
  friend struct detail::DatasetAccess;
  explicit Dataset(std::shared_ptr<const detail::DatasetNode> node) : node_(std::move(node)) {}
  std::shared_ptr<const detail::DatasetNode> node_;
};

}  // namespace dtrain
