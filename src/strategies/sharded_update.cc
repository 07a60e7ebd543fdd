// The collectives of a sharded update (MirroredOptions::sharding, ZeRO): gradients reduce-scattered
// and parameters all-gathered in the layout of the fixed partition, where block r of a buffer holds
// part r (partition_range) of every tensor end to end. A replica's part of a variable is then where
// its optimizer slots are, whatever the packing of the step.
#include <algorithm>

#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"
#include "strategies/mirrored_variables.h"

namespace dtrain {
namespace {

// For tensors of `counts` elements split among n parts: at[r][i] is where tensor i's part r
// starts within block r, and every block holds `block` elements (whole 64-byte lines).
struct PartLayout {
  int64_t block = 0;
  std::vector<std::vector<int64_t>> at;
  int64_t length(int64_t count, int r, int n) const {
    const auto [b, e] = partition_range(count, r, n);
    return e - b;
  }
};

PartLayout part_layout(const std::vector<int64_t>& counts, int n) {
  PartLayout l;
  l.at.resize(static_cast<size_t>(n));
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    int64_t off = 0;
    for (int64_t c : counts) {
      l.at[static_cast<size_t>(r)].push_back(off);
      off += l.length(c, r, n);
    }
    longest = std::max(longest, off);
  }
  l.block = std::max<int64_t>(16, (longest + 15) / 16 * 16);
  return l;
}

Tensor flat(const Tensor& t) { return t.view(Shape{t.numel()}); }

// Block r of `buf` (n blocks): part r of every tensor, then zeros to the block's end.
void pack_block(Tensor& buf, int64_t block_start, const std::vector<Tensor>& values,
                const PartLayout& l, int r, int n) {
  int64_t end = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const auto [b, e] = partition_range(values[i].numel(), r, n);
    const int64_t at = block_start + l.at[static_cast<size_t>(r)][i];
    if (e > b) buf.slice_rows(at, at + e - b).copy_from(flat(values[i]).slice_rows(b, e));
    end = l.at[static_cast<size_t>(r)][i] + e - b;
  }
  if (end < l.block)
    buf.slice_rows(block_start + end, block_start + l.block)
        .copy_from(Tensor::zeros(Shape{l.block - end}, buf.dtype(), buf.device()));
}

}  // namespace

Sharding MirroredReplicaContext::sharding() const { return impl_->options.sharding; }

std::future<ScatteredSum> MirroredReplicaContext::reduce_scatter_partitioned_async(
    std::vector<Tensor> values, bool deferred, std::vector<bool> release) {
  const int n = impl_->global_replicas, me = replica_id_in_sync_group();
  std::vector<int64_t> counts;
  for (const auto& v : values) {
    DTRAIN_CHECK(v.dtype() == DType::kFloat32, "reduce_scatter_partitioned takes float32");
    counts.push_back(v.numel());
  }
  if (n == 1) {  // the sum is the gradient itself: no buffer, no copy (and nothing to release)
    ScatteredSum s;
    s.partitioned = true;
    for (const auto& v : values) {
      s.slices.push_back(flat(v));
      s.offsets.push_back(0);
    }
    std::promise<ScatteredSum> done;
    done.set_value(std::move(s));
    return done.get_future();
  }
  const PartLayout l = part_layout(counts, n);
  const DeviceSpec dev = device();
  auto pack = [values, l, n, dev] {
    timeline::Span span("pack by part", "collective");
    Tensor buf = Tensor::empty(Shape{l.block * n}, DType::kFloat32, dev);
    for (int r = 0; r < n; ++r) pack_block(buf, l.block * r, values, l, r, n);
    return buf;
  };
  bool any = false;
  for (bool r : release) any = any || r;
  Tensor packed;
  if (any) {  // packed here, so that the released gradients are never read again
    packed = pack();
    for (size_t i = 0; i < values.size() && i < release.size(); ++i)
      if (release[i]) values[i].release_memory();
  }
  auto body = [this, pack, packed, counts, l, n, me, dev, size = values.size()] {
    timeline::Span whole("reduce-scatter " + std::to_string(size) + " tensor(s) by part",
                         "collective");
    Tensor buf = packed.defined() ? packed : pack();
    ScatteredSum s;
    s.partitioned = true;
    s.padded = l.block * n;
    s.shard = Tensor::empty(Shape{l.block}, DType::kFloat32, dev);
    {
      timeline::Span reduce("reduce-scatter " + std::to_string(l.block * n * 4 / 1024) + " KiB",
                            "collective");
      impl_->comms[static_cast<size_t>(replica_)]
          ->reduce_scatter_in_place(buf, s.shard, ReduceOp::kSum)
          .wait();
    }
    for (size_t i = 0; i < counts.size(); ++i) {
      const auto [b, e] = partition_range(counts[i], me, n);
      const int64_t at = l.at[static_cast<size_t>(me)][i];
      s.starts.push_back(at);
      s.slices.push_back(s.shard.slice_rows(at, at + e - b));
      s.offsets.push_back(b);
    }
    return s;
  };
  return on_comm_thread(std::move(body), deferred);
}

std::vector<Tensor> MirroredReplicaContext::gather_sums(const ScatteredSum& s,
                                                        const std::vector<Tensor>& like) {
  timeline::Span span("all-gather of the sums", "collective");
  if (s.partitioned && impl_->global_replicas == 1) {  // the slices are the sums, whole
    std::vector<Tensor> out;
    for (size_t i = 0; i < like.size(); ++i)
      out.push_back(s.slices[i].clone().view(like[i].shape()));
    return out;
  }
  Tensor full = Tensor::empty(Shape{s.padded}, DType::kFloat32, device());
  impl_->comms[static_cast<size_t>(replica_)]->allgather(s.shard, full).wait();
  std::vector<Tensor> out;
  if (!s.partitioned) {
    for (size_t i = 0; i < like.size(); ++i)
      out.push_back(
          full.slice_rows(s.starts[i], s.starts[i] + like[i].numel()).view(like[i].shape()));
    return out;
  }
  const int n = impl_->global_replicas;
  std::vector<int64_t> counts;
  for (const auto& t : like) counts.push_back(t.numel());
  const PartLayout l = part_layout(counts, n);
  for (size_t i = 0; i < like.size(); ++i) {
    Tensor t = Tensor::empty(Shape{counts[i]}, DType::kFloat32, device());
    for (int r = 0; r < n; ++r) {
      const auto [b, e] = partition_range(counts[i], r, n);
      const int64_t at = l.block * r + l.at[static_cast<size_t>(r)][i];
      if (e > b) t.slice_rows(b, e).copy_from(full.slice_rows(at, at + e - b));
    }
    out.push_back(t.view(like[i].shape()));
  }
  return out;
}

std::future<std::vector<Tensor>> MirroredReplicaContext::gather_parameters_async(
    std::vector<Tensor> parts, std::vector<Shape> shapes, bool deferred) {
  auto body = [this, parts = std::move(parts), shapes = std::move(shapes)] {
    const int n = impl_->global_replicas, me = replica_id_in_sync_group();
    std::vector<Tensor> out(parts.size());
    if (n == 1) {  // the part is the whole value: no copy
      for (size_t i = 0; i < parts.size(); ++i) out[i] = parts[i].view(shapes[i]);
      return out;
    }
    timeline::Span span("all-gather of " + std::to_string(parts.size()) + " parameter(s)",
                        "collective");
    Communicator& comm = *impl_->comms[static_cast<size_t>(replica_)];
    std::vector<bool> done(parts.size(), false);
    for (size_t first = 0; first < parts.size(); ++first) {  // one all-gather per dtype
      if (done[first]) continue;
      const DType dt = parts[first].dtype();
      std::vector<size_t> idx;
      std::vector<int64_t> counts;
      for (size_t i = first; i < parts.size(); ++i)
        if (!done[i] && parts[i].dtype() == dt) {
          idx.push_back(i);
          counts.push_back(shapes[i].numel());
          done[i] = true;
        }
      const PartLayout l = part_layout(counts, n);
      Tensor mine = Tensor::empty(Shape{l.block}, dt, device());
      for (size_t k = 0; k < idx.size(); ++k) {
        const Tensor& p = parts[idx[k]];
        const int64_t at = l.at[static_cast<size_t>(me)][k];
        if (p.numel() != l.length(counts[k], me, n))
          throw Internal("a parameter part of " + std::to_string(p.numel()) +
                         " elements; the partition gives " +
                         std::to_string(l.length(counts[k], me, n)));
        if (p.numel() > 0) mine.slice_rows(at, at + p.numel()).copy_from(p);
      }
      Tensor full = Tensor::empty(Shape{l.block * n}, dt, device());
      comm.allgather(mine, full).wait();
      for (size_t k = 0; k < idx.size(); ++k) {
        Tensor whole = Tensor::empty(Shape{counts[k]}, dt, device());
        for (int r = 0; r < n; ++r) {
          const auto [b, e] = partition_range(counts[k], r, n);
          const int64_t at = l.block * r + l.at[static_cast<size_t>(r)][k];
          if (e > b) whole.slice_rows(b, e).copy_from(full.slice_rows(at, at + e - b));
        }
        out[idx[k]] = whole.view(shapes[idx[k]]);
      }
    }
    return out;
  };
  return on_comm_thread(std::move(body), deferred);
}

bool MirroredReplicaContext::comm_idle() const {
  return packer_.idle() && !(impl_->params && impl_->params->pending(replica_));
}

void MirroredReplicaContext::gather_parts(const std::vector<std::shared_ptr<Variable>>& all) {
  const int n = impl_->global_replicas, me = replica_id_in_sync_group();
  if (n < 2) return;
  std::vector<std::shared_ptr<Variable>> vars;  // kParameters: a layer gathers its own when it runs
  for (const auto& v : all)
    if (const auto* mv = dynamic_cast<const MirroredVariable*>(v.get()); !mv || !mv->managed())
      vars.push_back(v);
  timeline::Span span("all-gather of the updated parts", "collective");
  Communicator& comm = *impl_->comms[static_cast<size_t>(replica_)];
  size_t i = 0;
  while (i < vars.size()) {
    // A chunk of about bytes_per_pack of one dtype, so the gather buffers stay bounded (4 MiB up to
    // 8 workers, at most 64 MiB with more: fewer collectives, each paying the ring latency once).
    std::vector<Tensor> values;
    size_t bytes = 0;
    const DType dt = vars[i]->dtype();
    while (i < vars.size() && vars[i]->dtype() == dt &&
           (values.empty() || bytes < bytes_per_pack())) {
      values.push_back(vars[i]->value());
      bytes += values.back().nbytes();
      ++i;
    }
    std::vector<int64_t> counts;
    for (const auto& v : values) counts.push_back(v.numel());
    const PartLayout l = part_layout(counts, n);
    Tensor mine = Tensor::empty(Shape{l.block}, dt, device());
    pack_block(mine, 0, values, l, me, n);
    Tensor full = Tensor::empty(Shape{l.block * n}, dt, device());
    comm.allgather(mine, full).wait();
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      for (size_t k = 0; k < values.size(); ++k) {
        const auto [b, e] = partition_range(counts[k], r, n);
        const int64_t at = l.block * r + l.at[static_cast<size_t>(r)][k];
        if (e > b) flat(values[k]).slice_rows(b, e).copy_from(full.slice_rows(at, at + e - b));
      }
    }
  }
}

}  // namespace dtrain
