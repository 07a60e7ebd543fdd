// Collectives between processes: the algorithms (collectives/algorithms) over the TCP transport
// (tcp_transport.h). This file only checks arguments, numbers each collective (its fingerprint) and
// tells every peer when one fails.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "collectives/algorithms/algorithms.h"
#include "collectives/reduction.h"
#include "collectives/sync_collectives.h"
#include "collectives/tcp/tcp_environment.h"
#include "collectives/tcp/tcp_transport.h"
#include "dtrain/core/allocator.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

using collectives::Fingerprint;
using tcp::TcpTransport;

enum Op : uint16_t {
  kAllreduce = 1,
  kAllgather,
  kBroadcast,
  kReduce,
  kReduceScatter,
  kBarrier,
  kAlltoall
};

class TcpCollectives final : public SyncCollectives {
 public:
  TcpCollectives(TcpGroupOptions o, std::vector<tcp::Peer> peers)
      : t_(std::move(o), std::move(peers)) {}
  int rank() const override { return t_.rank(); }
  int size() const override { return t_.size(); }
  void set_progress_marker(int64_t marker) override { t_.set_progress_marker(marker); }
  std::vector<int64_t> peer_markers() const override { return t_.peer_markers(); }

  void allreduce(Tensor& t, ReduceOp op) override {
    require_host(t, "allreduce");
    const Fingerprint fp = begin(kAllreduce, t.dtype(), t.numel(), op);
    guarded([&] { collectives::allreduce(t_, t.raw_data(), t.numel(), t.dtype(), op, fp); });
  }

  void allgather(const Tensor& in, Tensor& out) override {
    require_host(in, "allgather");
    require_host(out, "allgather");
    if (out.numel() != in.numel() * size() || out.dtype() != in.dtype())
      throw InvalidArgument(
          "allgather: output must hold size * input.numel() elements of the input's dtype, got " +
          out.to_string());
    const Fingerprint fp = begin(kAllgather, in.dtype(), in.numel(), ReduceOp::kSum);
    guarded([&] {
      const size_t bytes = in.nbytes();
      std::memcpy(static_cast<char*>(out.raw_data()) + static_cast<size_t>(rank()) * bytes,
                  in.raw_data(), bytes);
      collectives::ring_allgather(t_, out.raw_data(), bytes, fp);
    });
  }

  void broadcast(Tensor& t, int root) override {
    require_host(t, "broadcast");
    if (root < 0 || root >= size())
      throw InvalidArgument("broadcast: root " + std::to_string(root) + " out of range");
    Fingerprint fp = begin(kBroadcast, t.dtype(), t.numel(), ReduceOp::kSum);
    fp.reduce =
        static_cast<uint8_t>(root);  // part of the fingerprint: all ranks must agree on root
    guarded([&] { collectives::star_broadcast(t_, t.raw_data(), t.nbytes(), root, fp); });
  }

  void reduce(Tensor& t, int root, ReduceOp op) override {
    require_host(t, "reduce");
    if (root < 0 || root >= size())
      throw InvalidArgument("reduce: root " + std::to_string(root) + " out of range");
    const Fingerprint fp = begin(kReduce, t.dtype(), t.numel(), op);
    guarded([&] {
      const auto block = host_allocator().allocate(t.nbytes(), DeviceSpec::cpu());  // as ring.cc
      char* const tmp = static_cast<char*>(block->data());
      std::memcpy(tmp, t.raw_data(), t.nbytes());
      collectives::allreduce(t_, tmp, t.numel(), t.dtype(), op, fp);
      if (rank() == root) std::memcpy(t.raw_data(), tmp, t.nbytes());
    });
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    check_reduce_scatter(in, out);
    // The ring reduces in a scratch copy of the input, a block of the host allocator's cache: a
    // fresh zeroed buffer per call cost a page fault per 4 KiB and a memset, half again the
    // collective's time for 4 MB gradient packs.
    const auto block = host_allocator().allocate(in.nbytes(), DeviceSpec::cpu());
    char* const tmp = static_cast<char*>(block->data());
    std::memcpy(tmp, in.raw_data(), in.nbytes());
    ring_reduce_scatter(tmp, in, out, op);
  }
  void reduce_scatter_in_place(Tensor& in, Tensor& out, ReduceOp op) override {
    check_reduce_scatter(in, out);
    ring_reduce_scatter(static_cast<char*>(in.raw_data()), in, out, op);
  }

  void barrier() override {
    // One element per rank so that every ring step moves data (a true rendezvous).
    std::vector<int32_t> v(static_cast<size_t>(size()), 1);
    const Fingerprint fp = begin(kBarrier, DType::kInt32, size(), ReduceOp::kSum);
    guarded([&] {
      collectives::ring_allreduce(t_, v.data(), size(), DType::kInt32, ReduceOp::kSum, fp);
    });
  }

  void alltoall(const Tensor& in, Tensor& out) override {
    require_host(in, "alltoall");
    require_host(out, "alltoall");
    const int n = size();
    check_alltoall(in, out, n);
    const Fingerprint fp = begin(kAlltoall, in.dtype(), in.numel(), ReduceOp::kSum);
    guarded([&] {
      collectives::pairwise_alltoall(t_, in.raw_data(), out.raw_data(),
                                     in.nbytes() / static_cast<size_t>(n), fp);
    });
  }

  void abort(const std::string& reason) override { t_.abort(reason); }
  bool uses_shared_memory() const { return t_.uses_shared_memory(); }

 private:
  void check_reduce_scatter(const Tensor& in, const Tensor& out) const {
    require_host(in, "reduce_scatter");
    require_host(out, "reduce_scatter");
    if (in.numel() % size() != 0 || out.numel() != in.numel() / size() || out.dtype() != in.dtype())
      throw InvalidArgument(
          "reduce_scatter: input must split evenly into size() outputs of the same dtype, got " +
          out.to_string());
  }
  // Reduces `in`'s values, already in `work`, over the ring (work is overwritten); out = this
  // rank's chunk.
  void ring_reduce_scatter(char* work, const Tensor& in, Tensor& out, ReduceOp op) {
    const Fingerprint fp = begin(kReduceScatter, in.dtype(), in.numel(), op);
    guarded([&] {
      // Shifted ring so that rank r ends with chunk r fully reduced.
      collectives::ring_reduce_scatter(t_, work, in.numel(), in.dtype(), op, fp, -1);
      const size_t cb = out.nbytes();
      std::memcpy(out.raw_data(), work + static_cast<size_t>(rank()) * cb, cb);
      if (op == ReduceOp::kMean)
        collectives::scale_for_mean(out.raw_data(), static_cast<size_t>(out.numel()), in.dtype(),
                                    size());
    });
  }
  static void require_host(const Tensor& t, const char* op) {
    if (!t.device().host_accessible())
      throw InvalidArgument(std::string(op) + ": the TCP transport moves host memory; got " +
                            t.to_string() + " (stage GPU tensors through the host or use NCCL)");
  }

  Fingerprint begin(uint16_t op, DType dtype, int64_t count, ReduceOp red) {
    t_.check_not_aborted();
    Fingerprint fp;
    fp.seq = ++seq_;
    fp.op = op;
    fp.dtype = dtype;
    fp.reduce = static_cast<uint8_t>(red);
    fp.count = static_cast<uint64_t>(count);
    return fp;
  }

  // Runs a collective; on failure tells every peer (ABORT) before rethrowing.
  template <typename F>
  void guarded(F&& body) {
    try {
      body();
    } catch (const Error& e) {
      t_.abort(e.what());
      throw;
    }
  }

  TcpTransport t_;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> connect_tcp_group(const TcpGroupOptions& given) {
  const TcpGroupOptions options = tcp::apply_tcp_environment(given);
  std::vector<tcp::Peer> peers = tcp::build_mesh(options);
  auto collectives = std::make_unique<TcpCollectives>(options, std::move(peers));
  DTRAIN_LOG(INFO) << "TCP group of " << options.addresses.size()
                   << " tasks connected and authenticated"
                   << (collectives->uses_shared_memory()
                           ? "; collective data through shared memory (one host)"
                           : "");
  return make_async_communicator(std::move(collectives), options.collective.timeout);
}

}  // namespace dtrain
