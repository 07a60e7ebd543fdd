#include "collectives/hierarchical/hierarchical_communicator.h"

#include "collectives/reduction.h"
#include "collectives/sync_collectives.h"
#include "dtrain/core/error.h"
#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

Tensor to_host(const Tensor& t) {
  return t.device().host_accessible() ? t : t.to(DeviceSpec::cpu());
}

// Local shared-memory reduction, then local replica 0 across workers, then local broadcast. A
// worker with one replica skips the local stages: two hand-offs to the local group's thread for
// nothing (11 and 22 us per step in the timeline of two single-replica workers).
class HierarchicalCommunicator final : public SyncCollectives {
 public:
  HierarchicalCommunicator(std::unique_ptr<Communicator> local,
                           std::shared_ptr<CrossWorkerCommunicators> cross, int local_size)
      : local_(std::move(local)), cross_(std::move(cross)), local_size_(local_size) {}
  int rank() const override { return cross_->host->rank() * local_size_ + local_->rank(); }
  int size() const override { return cross_->workers * local_size_; }

  void allreduce(Tensor& t, ReduceOp op) override {
    guarded([&] { local_then_across(t, op); });
  }
  void barrier() override {
    guarded([&] {
      local_->barrier().wait();
      if (local_->rank() == 0) cross_->host->barrier().wait();
      local_->barrier().wait();
    });
  }
  void broadcast(Tensor& t, int root) override {
    guarded([&] { broadcast_from(t, root); });
  }
  void allgather(const Tensor& in, Tensor& out) override {
    guarded([&] { gather(in, out); });
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    if (root != 0) throw Unimplemented("hierarchical reduce supports root 0");
    Tensor copy = t.clone();
    allreduce(copy, op);
    if (rank() == 0) t.copy_from(copy);
  }
  // Summed within the worker first (whole buffer), then reduce-scattered across workers in blocks
  // of L x n, each local replica keeping its n. Compression applies as in allreduce.
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    guarded([&] { reduce_scatter_impl(const_cast<Tensor&>(in), out, op, /*scratch=*/false); });
  }
  void reduce_scatter_in_place(Tensor& in, Tensor& out, ReduceOp op) override {
    guarded([&] { reduce_scatter_impl(in, out, op, /*scratch=*/true); });
  }
  void abort(const std::string& reason) override {
    local_->abort(reason);
    cross_->host->abort(reason);
    if (cross_->device) cross_->device->abort(reason);
  }

 private:
  void local_then_across(Tensor& t, ReduceOp op) {
    const ReduceOp partial = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    if (local_->size() > 1) {
      timeline::Span s("all-reduce stage 1: within the worker", "collective");
      local_->allreduce(t, partial).wait();
    }
    if (local_->rank() == 0) {
      timeline::Span s(std::string("all-reduce stage 2: across workers (") +
                           (cross_->device && !t.device().host_accessible() ? "NCCL" : "ring") +
                           (cross_->compression != Compression::kNone
                                ? std::string(", ") + compression_name(cross_->compression)
                                : std::string()) +
                           ")",
                       "collective");
      const bool compress =
          cross_->compression != Compression::kNone && t.dtype() == DType::kFloat32;
      const DType wire =
          cross_->compression == Compression::kBF16 ? DType::kBFloat16 : DType::kFloat16;
      if (cross_->device && !t.device().host_accessible()) {
        if (compress) {
          Tensor c = kernels_for(t).cast(t, wire);
          cross_->device->allreduce(c, partial).wait();
          t.copy_from(kernels_for(c).cast(c, DType::kFloat32));
        } else {
          cross_->device->allreduce(t, partial).wait();
        }
      } else {
        Tensor h = to_host(t);
        if (compress) {
          Tensor c = kernels_for(h).cast(h, wire);
          cross_->host->allreduce(c, partial).wait();
          h = kernels_for(c).cast(c, DType::kFloat32);
        } else {
          cross_->host->allreduce(h, partial).wait();
        }
        if (h.raw_data() != t.raw_data()) t.copy_from(h);
      }
    }
    if (local_->size() > 1) {
      timeline::Span s("all-reduce stage 3: within the worker", "collective");
      local_->broadcast(t, 0).wait();
    }
    if (op == ReduceOp::kMean) {
      if (t.device().host_accessible()) {
        collectives::scale_for_mean(t.raw_data(), static_cast<size_t>(t.numel()), t.dtype(),
                                    size());
      } else {
        t.copy_from(kernels_for(t).affine(t, 1.f / static_cast<float>(size()), 0.f));
      }
    }
  }
  void broadcast_from(Tensor& t, int root) {
    if (root != 0)
      throw Unimplemented("hierarchical broadcast supports root 0 (the chief's first replica)");
    if (local_->rank() == 0) {
      if (cross_->device && !t.device().host_accessible()) {
        cross_->device->broadcast(t, 0).wait();
      } else {
        Tensor h = to_host(t);
        cross_->host->broadcast(h, 0).wait();
        if (h.raw_data() != t.raw_data()) t.copy_from(h);
      }
    }
    if (local_->size() > 1) local_->broadcast(t, 0).wait();
  }
  // Worker w's replicas hold global ranks [w L, (w + 1) L): the workers gather blocks of L x n.
  void gather(const Tensor& in, Tensor& out) {
    const int64_t n = in.numel(), local = local_->size();
    if (out.numel() != n * size() || out.dtype() != in.dtype())
      throw InvalidArgument(
          "allgather: output must hold size() x input.numel() = " + std::to_string(n * size()) +
          " elements of the input's dtype, got " + out.to_string());
    Tensor mine = in;
    if (local > 1) {
      mine = Tensor::empty(Shape{n * local}, in.dtype(), in.device());
      local_->allgather(in, mine).wait();
    }
    if (local_->rank() == 0) {
      timeline::Span s("all-gather across workers", "collective");
      if (cross_->device && !in.device().host_accessible()) {
        cross_->device->allgather(mine, out).wait();
      } else {
        Tensor h = to_host(mine), o = to_host(out);
        cross_->host->allgather(h, o).wait();
        if (o.raw_data() != out.raw_data()) out.copy_from(o);
      }
    }
    if (local > 1) local_->broadcast(out, 0).wait();
  }
  // A collective that fails on one replica of this worker (its stage across workers: a worker died
  // or hung; an allocation; a wrong argument) leaves the other local replicas waiting in a local
  // stage for it: the local group is aborted with the error, so they fail with it (not after the
  // collective timeout, nor with a "collective mismatch" against this replica's next collective,
  // which hid a dead worker), then it is rethrown.
  template <typename F>
  void guarded(F&& collective) {
    try {
      collective();
    } catch (const std::exception& e) {
      if (local_->size() > 1) {
        try {
          local_->abort(e.what());
        } catch (...) {  // the first error is the one to report
        }
      }
      throw;
    }
  }
  // With `scratch`, `in` may be overwritten (then it is never copied); without, it is only read.
  void reduce_scatter_impl(Tensor& in, Tensor& out, ReduceOp op, bool scratch) {
    const int64_t n = out.numel(), local = local_->size();
    if (in.numel() != n * size() || out.dtype() != in.dtype())
      throw InvalidArgument(
          "reduce_scatter: input must hold size() x output.numel() elements of one dtype, got " +
          in.to_string() + " and " + out.to_string());
    const ReduceOp partial = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    Tensor summed = in;
    if (local > 1) {
      if (!scratch) summed = in.clone();
      local_->allreduce(summed, partial).wait();
    }
    const bool own = scratch || local > 1;  // summed may be overwritten
    Tensor block = local > 1 ? Tensor::empty(Shape{n * local}, in.dtype(), in.device()) : out;
    if (local_->rank() == 0) {
      timeline::Span s("reduce-scatter across workers", "collective");
      const bool compress =
          cross_->compression != Compression::kNone && in.dtype() == DType::kFloat32;
      const DType wire =
          cross_->compression == Compression::kBF16 ? DType::kBFloat16 : DType::kFloat16;
      const bool nccl = cross_->device && !in.device().host_accessible();
      Communicator& c = nccl ? *cross_->device : *cross_->host;
      Tensor src = nccl ? summed : to_host(summed);
      Tensor dst = nccl ? block : to_host(block);
      if (compress) {
        Tensor cs = kernels_for(src).cast(src, wire);
        Tensor cd = Tensor::empty(dst.shape(), wire, dst.device());
        c.reduce_scatter_in_place(cs, cd, partial).wait();
        dst.copy_from(kernels_for(cd).cast(cd, DType::kFloat32));
      } else if (own || src.raw_data() != summed.raw_data()) {  // ours, or a host copy
        c.reduce_scatter_in_place(src, dst, partial).wait();
      } else {
        c.reduce_scatter(src, dst, partial).wait();
      }
      if (dst.raw_data() != block.raw_data()) block.copy_from(dst);
    }
    if (local > 1) {
      local_->broadcast(block, 0).wait();
      out.copy_from(block.slice_rows(n * local_->rank(), n * (local_->rank() + 1)));
    }
    if (op == ReduceOp::kMean) {
      if (out.device().host_accessible()) {
        collectives::scale_for_mean(out.raw_data(), static_cast<size_t>(out.numel()), out.dtype(),
                                    size());
      } else {
        out.copy_from(kernels_for(out).affine(out, 1.f / static_cast<float>(size()), 0.f));
      }
    }
  }
  std::unique_ptr<Communicator> local_;
  std::shared_ptr<CrossWorkerCommunicators> cross_;
  int local_size_;
};

}  // namespace

std::unique_ptr<Communicator> make_hierarchical_communicator(
    std::unique_ptr<Communicator> local, std::shared_ptr<CrossWorkerCommunicators> cross,
    int local_size) {
  const std::chrono::milliseconds bound = cross->timeout;
  return make_async_communicator(
      std::make_unique<HierarchicalCommunicator>(std::move(local), std::move(cross), local_size),
      bound);
}

}  // namespace dtrain
