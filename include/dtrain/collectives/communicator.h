// Communicator: a group of `size` ranks that run collectives together (gloo / c10d style).
// Implementations are transports: in-process threads (inproc), TCP, NCCL, MPI. Every rank must
// issue the same collectives in the same order; each call carries a fingerprint (sequence number,
// op, dtype, count) that peers check, and a finite timeout.
//
// Collectives are asynchronous: they return at once with a Work (nodiscard: wait on it before using
// the result or dropping the tensors), completed by the communicator's
// communication thread (in issue order); wait() blocks (with a timeout) until the result is in
// place and rethrows any error. Tensors passed in must stay alive and untouched until wait()
// returns. Thread-safety: one thread per rank issues collectives; Work may be waited on from any
// thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

enum class ReduceOp { kSum, kMean, kMax, kMin };
DTRAIN_API const char* reduce_op_name(ReduceOp op);

// Gradient compression for cross-worker all-reduce (Horovod's hvd.Compression): float32 tensors are
// cast to the 16-bit type before they go on the wire (half the bytes), reduced pairwise in float32
// (rounded to 16 bits between hops), and cast back to float32 at the end.
enum class Compression { kNone, kFP16, kBF16 };
// "none", "fp16", "bf16"; InvalidArgument naming the accepted values otherwise.
DTRAIN_API Compression parse_compression(const std::string& name);
DTRAIN_API const char* compression_name(Compression c);

struct DTRAIN_API CollectiveOptions {
  // Every blocking step of a collective gives up after this long with DeadlineExceeded naming
  // the op and the ranks that did not arrive.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// The pending result of an asynchronous collective. The communicator's communication thread runs
// collectives in the order they were issued and completes their Work; a wait() on a collective that
// has not started yet (and is next in line) runs it on the waiting thread instead, when the wait's
// timeout is at least the collective's own bound, so a caller that waits at once pays no hand-off.
// A Work is a handle (copies refer to the same collective) and may outlive its communicator.
class DTRAIN_API Work {
 public:
  // How a communicator tracks its collectives; one per communicator, shared by its Works.
  class Tracker {
   public:
    virtual ~Tracker() = default;
    virtual bool done(uint64_t id) const = 0;
    // Waits (possibly running the collective on this thread) until `id` is done or `timeout` has
    // passed (milliseconds::max(): no limit); returns whether it is done.
    virtual bool wait(uint64_t id, std::chrono::milliseconds timeout) = 0;
    // Aborts the communicator (with `reason`) and waits until collective `id` has ended.
    virtual void abort_and_drain(uint64_t id, const std::string& reason) = 0;
    // Rethrows the error collective `id` ended with, if any.
    virtual void rethrow(uint64_t id) const = 0;
    // "allreduce on rank 0 of 2", for messages.
    virtual std::string describe(uint64_t id) const = 0;
  };

  Work() = default;  // an already completed collective
  Work(std::shared_ptr<Tracker> tracker, uint64_t id) : tracker_(std::move(tracker)), id_(id) {}
  // Blocks until the collective is done (by default as long as it runs: its communicator's own
  // collective timeout bounds it) and rethrows its error, on every wait. When `timeout` passes
  // first, the communicator is aborted (every pending collective of the group fails fast, as when
  // the collective times out itself), the collective is waited out, so that nothing touches the
  // caller's tensors any more, and DeadlineExceeded names it.
  void wait(std::chrono::milliseconds timeout = std::chrono::milliseconds::max()) const;
  // Waits up to `timeout` and says whether the collective is done; on false nothing is aborted (the
  // collective goes on; wait() later). Errors are rethrown by wait(), not here.
  bool wait_for(std::chrono::milliseconds timeout) const;
  // Whether the collective has completed (without waiting): poll().
  bool ready() const;
  static Work completed();

 private:
  std::shared_ptr<Tracker> tracker_;
  uint64_t id_ = 0;
};

class DTRAIN_API Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: every rank's `tensor` becomes op(all ranks' tensors). Same shape/dtype on all ranks.
  [[nodiscard]] virtual Work allreduce(Tensor& tensor, ReduceOp op) = 0;
  // output[r * n : (r + 1) * n] = rank r's input (n = input.numel()); output has size * n elements.
  [[nodiscard]] virtual Work allgather(const Tensor& input, Tensor& output) = 0;
  // Every rank's tensor becomes root's.
  [[nodiscard]] virtual Work broadcast(Tensor& tensor, int root) = 0;
  // Reduce to one: root's tensor becomes op(all ranks' tensors); the others' are left unchanged.
  [[nodiscard]] virtual Work reduce(Tensor& tensor, int root, ReduceOp op) = 0;
  // output (n / size elements) = rank's slice of op(all inputs) (n divisible by size).
  [[nodiscard]] virtual Work reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  // reduce_scatter that may use `input` as its working space: input's contents are unspecified
  // once wait() returns. The TCP transport then reduces in it instead of in a copy (one pass over
  // the bytes fewer). The default calls reduce_scatter.
  [[nodiscard]] virtual Work reduce_scatter_in_place(Tensor& input, Tensor& output, ReduceOp op) {
    return reduce_scatter(input, output, op);
  }
  [[nodiscard]] virtual Work barrier() = 0;
  // input and output: n elements each (n divisible by size), seen as size() blocks; output's block
  // j becomes rank j's input block rank(). The TCP and MPI transports exchange blocks pairwise
  // (each block crosses one link once); the default gathers everything and keeps this rank's
  // blocks.
  [[nodiscard]] virtual Work alltoall(const Tensor& input, Tensor& output);
  // reduce_scatter of `inputs` laid end to end and zero-padded to output.numel() * size() elements:
  // output = this rank's block of op(every rank's concatenation). Every rank passes tensors of the
  // same sizes and of output's dtype (else InvalidArgument on every rank); the caller keeps them
  // alive and untouched until wait() returns. The in-process transport reads the inputs where they
  // lie (no packing copy); the others pack them into one buffer first, and the default here does so
  // and waits.
  [[nodiscard]] virtual Work reduce_scatter_concat(const std::vector<Tensor>& inputs,
                                                   Tensor& output, ReduceOp op);
  // Makes every pending and future collective of the group fail fast with `reason` (used when one
  // rank has failed, so the others do not wait for it). A collective whose ranks are all past its
  // start and only copying memory between them (in-process) finishes first: no rank returns while
  // another still uses its buffers.
  virtual void abort(const std::string& reason) = 0;
  // Progress markers, for stall reports (hvd's stall inspector): this rank announces `marker` (e.g.
  // the number of the collective it has entered) to every peer with its heartbeats, and
  // peer_markers()[r] is the last marker heard from rank r (-1: none yet; empty: this backend has
  // no heartbeats). Markers travel only while a collective is waiting for peers, which is when they
  // matter.
  virtual void set_progress_marker(int64_t /*marker*/) {}
  virtual std::vector<int64_t> peer_markers() const { return {}; }
};

}  // namespace dtrain
