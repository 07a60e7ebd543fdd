#include "horovod/executor.h"

#include <algorithm>
#include <cstring>

#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/ops.h"

namespace dtrain::hvd::detail {
namespace {

ReduceOp reduce_op(Op op) {
  switch (op) {
    case Op::kMin:
      return ReduceOp::kMin;
    case Op::kMax:
      return ReduceOp::kMax;
    default:
      return ReduceOp::kSum;
  }
}

// The first dimension of `x`, which alltoall and reducescatter split into one equal block per rank.
int64_t check_equal_blocks(const ExecContext& c, const Desc& d, const Tensor& x) {
  const int64_t n = x.shape()[0];
  if (n % c.size != 0)
    throw InvalidArgument("hvd::" + std::string(kind_name(d[fKind])) + " '" + describe(d) +
                          "': the first dimension (" + std::to_string(n) + ") must divide into " +
                          std::to_string(c.size) +
                          " equal blocks, one per rank; pad or trim it to a multiple of " +
                          std::to_string(c.size));
  return n;
}

}  // namespace

// Runs the collective `d` (agreed by the active ranks) with this rank's host tensor `x`
// (zeros of the agreed shape when this rank has joined).
Tensor execute(const ExecContext& c, const Desc& d, Tensor x, const std::vector<int>& active,
               const std::vector<Desc>& ds, bool joined) {
  if (c.count_transfer) c.count_transfer();
  const int64_t kind = d[fKind];
  const Op op = static_cast<Op>(d[fOp]);
  const int n_active = static_cast<int>(active.size());
  const bool someone_joined = n_active < c.size;
  if (someone_joined && kind != kAllreduce && kind != kAllgather)
    throw FailedPrecondition(
        std::string("hvd::") + kind_name(kind) + " '" + describe(d) +
        "' was issued while a rank has joined; only allreduce and allgather run then");
  if (someone_joined && kind == kAllreduce && (op == Op::kMin || op == Op::kMax))
    throw FailedPrecondition(
        "hvd::allreduce with op min/max was issued while a rank has joined (its zeros would "
        "count)");
  switch (kind) {
    case kAllreduce: {
      const auto comp = static_cast<Compression>(d[fCompression]);
      const bool cast = comp != Compression::kNone && x.dtype() == DType::kFloat32;
      Tensor wire =
          cast ? ops::cast(x, comp == Compression::kFP16 ? DType::kFloat16 : DType::kBFloat16)
               : x.clone();
      if (c.comm) c.comm->allreduce(wire, reduce_op(op)).wait();
      Tensor out = cast ? ops::cast(wire, DType::kFloat32) : wire;
      if (op == Op::kAverage && n_active > 1) {
        if (out.dtype() == DType::kFloat32) {
          out = kernels_for(out).affine(out, 1.f / static_cast<float>(n_active), 0.f);
        } else if (out.dtype() == DType::kFloat64) {
          double* p = static_cast<double*>(out.raw_data());
          for (int64_t i = 0; i < out.numel(); ++i) p[i] /= n_active;
        } else if (out.dtype() == DType::kFloat16 || out.dtype() == DType::kBFloat16) {
          const DType dt = out.dtype();
          Tensor f = ops::cast(out, DType::kFloat32);
          out = ops::cast(kernels_for(f).affine(f, 1.f / static_cast<float>(n_active), 0.f), dt);
        } else {
          throw InvalidArgument("hvd::allreduce average needs a float tensor, got " +
                                std::string(dtype_name(out.dtype())) + "; use Op::kSum");
        }
      }
      return out;
    }
    case kAllgather: {
      int64_t most = 0;
      std::vector<int64_t> rows(static_cast<size_t>(c.size), 0);
      for (int q : active) rows[static_cast<size_t>(q)] = ds[static_cast<size_t>(q)][fDims];
      for (int64_t r : rows) most = std::max(most, r);
      Tensor padded = zeros_like_desc(d, most);
      if (!joined && x.nbytes() > 0) std::memcpy(padded.raw_data(), x.raw_data(), x.nbytes());
      std::vector<int64_t> dims = padded.shape().dims();
      dims[0] = most * c.size;
      Tensor all = Tensor::empty(Shape(dims), padded.dtype());
      if (c.comm)
        c.comm->allgather(padded, all).wait();
      else
        all = padded;
      std::vector<Tensor> parts;
      for (int q = 0; q < c.size; ++q)
        parts.push_back(all.slice_rows(q * most, q * most + rows[static_cast<size_t>(q)]));
      return concat_rows(parts, padded.shape());
    }
    case kBroadcast: {
      Tensor t = x.clone();
      if (c.comm) c.comm->broadcast(t, static_cast<int>(d[fRoot])).wait();
      return t;
    }
    case kAlltoall: {
      check_equal_blocks(c, d, x);
      Tensor out = Tensor::empty(x.shape(), x.dtype());
      if (c.comm)
        c.comm->alltoall(x, out).wait();  // pairwise: each block crosses one link once
      else
        out = x.clone();
      return out;
    }
    case kReducescatter: {
      const int64_t n = check_equal_blocks(c, d, x);
      std::vector<int64_t> dims = x.shape().dims();
      dims[0] = n / c.size;
      Tensor out = Tensor::empty(Shape(dims), x.dtype());
      if (c.comm)
        c.comm->reduce_scatter(x, out, reduce_op(op)).wait();
      else
        out = x.clone();
      if (op == Op::kAverage && c.size > 1)
        out = kernels_for(out).affine(out, 1.f / static_cast<float>(c.size), 0.f);
      return out;
    }
  }
  throw Internal("hvd: unknown collective kind " + std::to_string(kind));
}

// All-reduces a negotiated run (agreed[j] describes inputs[j]) in fused buffers, as Horovod's
// Tensor Fusion: the run's tensors of one dtype, op and compression (in run order) share buffers
// of at most the fusion threshold (a larger tensor goes alone), one data transfer per buffer.
// The grouping depends on the agreed descriptors only, so every rank builds the same buffers.
// Returns each tensor's result, in its shape.
std::vector<Tensor> execute_fused(const ExecContext& c, const std::vector<Desc>& agreed,
                                  const std::vector<Tensor>& inputs, const std::vector<int>& active,
                                  bool joined) {
  std::vector<Tensor> out(inputs.size());
  const size_t limit = std::max<size_t>(c.fusion_threshold, 1);
  std::vector<std::vector<size_t>> groups;  // by (dtype, op, compression), first appearance first
  for (size_t j = 0; j < inputs.size(); ++j) {
    auto same = [&](const std::vector<size_t>& g) {
      for (int f : {fDtype, fOp, fCompression})
        if (agreed[g.front()][f] != agreed[j][f]) return false;
      return true;
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end())
      groups.push_back({j});
    else
      it->push_back(j);
  }
  for (const std::vector<size_t>& g : groups) {
    size_t begin = 0;
    while (begin < g.size()) {
      size_t end = begin + 1, bytes = inputs[g[begin]].nbytes();
      while (end < g.size() && bytes + inputs[g[end]].nbytes() <= limit)
        bytes += inputs[g[end++]].nbytes();
      const size_t first = g[begin];
      if (end == begin + 1) {
        timeline::Span sp("hvd allreduce '" + describe_name(agreed[first]) + "'", "collective");
        out[first] = execute(c, agreed[first], inputs[first], active, {}, joined);
      } else {
        int64_t elements = 0;
        for (size_t i = begin; i < end; ++i) elements += inputs[g[i]].numel();
        timeline::Span sp("hvd allreduce fused " + std::to_string(end - begin) + " tensors ('" +
                              describe_name(agreed[first]) + "' ...)",
                          "collective");
        Tensor flat = Tensor::empty(Shape{elements}, inputs[first].dtype());
        char* dst = static_cast<char*>(flat.raw_data());
        for (size_t i = begin; i < end; ++i) {
          std::memcpy(dst, inputs[g[i]].raw_data(), inputs[g[i]].nbytes());
          dst += inputs[g[i]].nbytes();
        }
        Desc d = agreed[first];
        d[fNdim] = 1;
        d[fDims] = elements;
        const Tensor reduced = execute(c, d, flat, active, {}, joined);
        const char* src = static_cast<const char*>(reduced.raw_data());
        for (size_t i = begin; i < end; ++i) {
          Tensor t = Tensor::empty(inputs[g[i]].shape(), reduced.dtype());
          std::memcpy(t.raw_data(), src, t.nbytes());
          src += t.nbytes();
          out[g[i]] = std::move(t);
        }
      }
      begin = end;
    }
  }
  return out;
}

}  // namespace dtrain::hvd::detail
