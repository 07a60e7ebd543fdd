// SyncCollectives: what a collective backend implements (in-process, TCP, NCCL, MPI, hierarchical):
// blocking collectives, every wait bounded by the group's timeout. make_async_communicator() turns
// one into the public, asynchronous Communicator: its collectives run in order on a communication
// thread of their own and complete the Work the caller waits on. Private to src/collectives.
//
// Thread-safety: the communication thread alone calls the collectives; abort() may come from any
// thread at any time and must make a running collective fail fast (one that only waits on memory
// copies the other ranks are making into its buffers finishes them first).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/collectives/communicator.h"

namespace dtrain {

class SyncCollectives {
 public:
  virtual ~SyncCollectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The semantics of the Communicator method of the same name; each returns once the result is in
  // place.
  virtual void allreduce(Tensor& tensor, ReduceOp op) = 0;
  virtual void allgather(const Tensor& input, Tensor& output) = 0;
  virtual void broadcast(Tensor& tensor, int root) = 0;
  virtual void reduce(Tensor& tensor, int root, ReduceOp op) = 0;
  virtual void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  // Communicator::reduce_scatter_in_place: input may be overwritten.
  virtual void reduce_scatter_in_place(Tensor& input, Tensor& output, ReduceOp op) {
    reduce_scatter(input, output, op);
  }
  virtual void barrier() = 0;
  // Communicator::alltoall. The default gathers every rank's whole input and keeps the blocks meant
  // for this rank (size() times the bytes); the TCP and MPI backends exchange blocks pairwise.
  virtual void alltoall(const Tensor& input, Tensor& output);
  // InvalidArgument unless input and output hold the same number of elements of one dtype,
  // divisible into `size` blocks (every backend's alltoall checks this first).
  static void check_alltoall(const Tensor& input, const Tensor& output, int size);
  // Communicator::reduce_scatter_concat. The default packs the inputs into one zero-padded buffer
  // and calls reduce_scatter; the in-process backend reads them where they lie.
  virtual void reduce_scatter_concat(const std::vector<Tensor>& inputs, Tensor& output,
                                     ReduceOp op);
  // InvalidArgument unless every input is of output's dtype and they fit in output.numel() * size
  // elements; returns their total element count.
  static int64_t check_reduce_scatter_concat(const std::vector<Tensor>& inputs,
                                             const Tensor& output, int size);
  // The inputs end to end, zero-padded to output.numel() * size elements.
  static Tensor pack_for_reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output,
                                        int size);
  virtual void abort(const std::string& reason) = 0;
  // Communicator::set_progress_marker / peer_markers (backends with heartbeats).
  virtual void set_progress_marker(int64_t /*marker*/) {}
  virtual std::vector<int64_t> peer_markers() const { return {}; }
};

// The public face of a backend: collectives return at once with a Work completed by the
// communicator's communication thread (FIFO, so every rank's order is kept). A wait() whose timeout
// is at least `collective_timeout` (the backend's own bound on one collective) may run the next
// collective on the waiting thread instead; a shorter wait always waits for the thread, so that its
// timeout holds.
std::unique_ptr<Communicator> make_async_communicator(std::unique_ptr<SyncCollectives> backend,
                                                      std::chrono::milliseconds collective_timeout);

}  // namespace dtrain
