// The transformer vocabulary: transpose, batched matmul, softmax / log_softmax, layer_norm, gelu,
// embedding_lookup, causal masks and the sequence cross-entropy. transpose, batched matmul and the
// embedding's gather/scatter-add differentiate to any order (their backward passes are made of
// each other); softmax, layer_norm and gelu to first order (a second derivative throws
// Unimplemented naming the op).
#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>

#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/model/ops.h"
#include "model/op_util.h"

namespace dtrain::ops {
namespace {

int axis_of(int axis, int rank, const char* op) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    throw InvalidArgument(std::string(op) + ": axis " + std::to_string(axis) +
                          " is out of range for rank " + std::to_string(rank));
  return a;
}

// The permutation that moves `axis` last (and back, inverted).
std::vector<int> axis_last(int axis, int rank) {
  std::vector<int> p;
  for (int i = 0; i < rank; ++i)
    if (i != axis) p.push_back(i);
  p.push_back(axis);
  return p;
}

std::vector<int> inverse(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[static_cast<size_t>(perm[i])] = static_cast<int>(i);
  return inv;
}

// op(a) @ op(b) on [B, ., .] operands, recorded with its gradient.
Tensor batch_matmul3(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  // The bfloat16 copies the kernel reads under mixed_bfloat16, kept for the backward pass.
  const auto [ka, kb] = product_operands(a, b);
  Tensor c = kernels_for(a).batch_matmul(ka, kb, ta, tb);
  if (tape::should_record({&a, &b})) {
    tape::record("batch_matmul", {a, b}, {c},
                 [a = ka, b = kb, ta, tb](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   const Tensor d = product_gradient(g[0], a, b);
                   if (!ta && !tb)
                     return {batch_matmul3(d, b, false, true), batch_matmul3(a, d, true, false)};
                   if (ta && !tb)
                     return {batch_matmul3(b, d, false, true), batch_matmul3(a, d, false, false)};
                   if (!ta && tb)
                     return {batch_matmul3(d, b, false, false), batch_matmul3(d, a, true, false)};
                   return {batch_matmul3(b, d, true, true), batch_matmul3(d, a, true, true)};
                 });
  }
  return c;
}

// Records y = softmax(x) (or log_softmax) on the tapes x is on: the gradient is softmax_backward's.
void record_softmax(const Tensor& x, const Tensor& y, bool log) {
  if (tape::should_record({&x})) {
    tape::record(log ? "log_softmax" : "softmax", {x}, {y},
                 [y, log](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   Tensor dx = kernels_for(y).softmax_backward(y, g[0], log);
                   if (tape::should_record({&g[0]}))
                     tape::record_nondifferentiable(log ? "log_softmax_grad" : "softmax_grad",
                                                    {g[0]}, {dx});
                   return {dx};
                 });
  }
}

Tensor softmax_last(const Tensor& x, bool log) {
  Tensor y = kernels_for(x).softmax(x, log);
  record_softmax(x, y, log);
  return y;
}

Tensor scatter_add_rows(const Tensor& dy, const Tensor& ids, int64_t rows);

Tensor gather_rows(const Tensor& table, const Tensor& ids) {
  Tensor y = kernels_for(table).gather_rows(table, ids);
  if (tape::should_record({&table})) {
    const int64_t rows = table.shape()[0];
    tape::record("embedding_lookup", {table, ids}, {y},
                 [ids, rows](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   return {scatter_add_rows(g[0], ids, rows), Tensor()};
                 });
  }
  return y;
}

Tensor scatter_add_rows(const Tensor& dy, const Tensor& ids, int64_t rows) {
  Tensor out = kernels_for(dy).scatter_add_rows(dy, ids, rows);
  if (tape::should_record({&dy}))
    tape::record("embedding_lookup_grad", {dy}, {out},
                 [ids](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   return {gather_rows(g[0], ids)};
                 });
  return out;
}

}  // namespace

Tensor transpose(const Tensor& x, std::vector<int> perm) {
  const int r = x.rank();
  if (perm.empty())  // numpy: reverse the axes
    for (int i = r - 1; i >= 0; --i) perm.push_back(i);
  std::vector<bool> seen(static_cast<size_t>(r), false);
  bool ok = static_cast<int>(perm.size()) == r;
  for (int& p : perm) {
    if (!ok) break;
    if (p < 0) p += r;
    ok = p >= 0 && p < r && !seen[static_cast<size_t>(p)];
    if (ok) seen[static_cast<size_t>(p)] = true;
  }
  if (!ok) {
    std::string s;
    for (int p : perm) s += (s.empty() ? "" : ", ") + std::to_string(p);
    throw InvalidArgument("transpose of " + x.to_string() + ": perm [" + s +
                          "] is not a permutation of its " + std::to_string(r) + " axes");
  }
  std::vector<int> identity(static_cast<size_t>(r));
  std::iota(identity.begin(), identity.end(), 0);
  if (perm == identity) return x;
  Tensor y = kernels_for(x).permute(x, perm);
  if (tape::should_record({&x})) {
    const std::vector<int> inv = inverse(perm);
    tape::record("transpose", {x}, {y}, [inv](const std::vector<Tensor>& g) -> std::vector<Tensor> {
      return {transpose(g[0], inv)};
    });
  }
  return y;
}

Tensor batch_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  same_device("matmul", a, b);
  if (a.rank() < 3 || b.rank() != a.rank())
    throw InvalidArgument("matmul: batched operands must have equal rank >= 3, got " +
                          a.to_string() + " and " + b.to_string());
  const int r = a.rank();
  int64_t batch = 1;
  for (int i = 0; i < r - 2; ++i) {
    if (a.shape()[i] != b.shape()[i])
      throw InvalidArgument("matmul: batch dimensions differ: " + a.shape().to_string() + " and " +
                            b.shape().to_string());
    batch *= a.shape()[i];
  }
  const Tensor c = batch_matmul3(reshape(a, Shape{batch, a.shape()[-2], a.shape()[-1]}),
                                 reshape(b, Shape{batch, b.shape()[-2], b.shape()[-1]}), ta, tb);
  std::vector<int64_t> d(a.shape().dims().begin(), a.shape().dims().end() - 2);
  d.push_back(c.shape()[1]);
  d.push_back(c.shape()[2]);
  return reshape(c, Shape(d));
}

Tensor softmax(const Tensor& x, int axis) {
  const int a = axis_of(axis, x.rank(), "softmax");
  if (a == x.rank() - 1) return softmax_last(x, false);
  const std::vector<int> p = axis_last(a, x.rank());
  return transpose(softmax_last(transpose(x, p), false), inverse(p));
}

Tensor log_softmax(const Tensor& x, int axis) {
  const int a = axis_of(axis, x.rank(), "log_softmax");
  if (a == x.rank() - 1) return softmax_last(x, true);
  const std::vector<int> p = axis_last(a, x.rank());
  return transpose(softmax_last(transpose(x, p), true), inverse(p));
}

Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float epsilon) {
  same_device("layer_norm", x, gamma);
  same_device("layer_norm", x, beta);
  const LayerNormForward f = kernels_for(x).layer_norm(x, gamma, beta, epsilon);
  if (tape::should_record({&x, &gamma, &beta})) {
    const Tensor mean = f.mean, var = f.var;
    tape::record(
        "layer_norm", {x, gamma, beta}, {f.y},
        [x, gamma, mean, var, epsilon](const std::vector<Tensor>& g) -> std::vector<Tensor> {
          const LayerNormBackward b =
              kernels_for(x).layer_norm_backward(g[0], x, gamma, mean, var, epsilon);
          if (tape::should_record({&g[0]}))
            tape::record_nondifferentiable("layer_norm_grad", {g[0]}, {b.dx, b.dgamma, b.dbeta});
          return {b.dx, b.dgamma, b.dbeta};
        });
  }
  return f.y;
}

Tensor gelu(const Tensor& x, bool approximate) {
  const UnaryOp op = approximate ? UnaryOp::kGeluTanh : UnaryOp::kGeluErf;
  Tensor y = kernels_for(x).unary(op, x);
  if (tape::should_record({&x}))
    tape::record("gelu", {x}, {y}, [x, op](const std::vector<Tensor>& g) -> std::vector<Tensor> {
      Tensor dx = kernels_for(x).activation_backward(op, x, g[0]);
      if (tape::should_record({&g[0]})) tape::record_nondifferentiable("gelu_grad", {g[0]}, {dx});
      return {dx};
    });
  return y;
}

Tensor embedding_lookup(const Tensor& table, const Tensor& ids) {
  same_device("embedding_lookup", table, ids);
  if (table.rank() != 2)
    throw InvalidArgument("embedding_lookup: the table must be [vocabulary, dim], got " +
                          table.to_string());
  if (ids.dtype() != DType::kInt32)
    throw InvalidArgument(std::string("embedding_lookup: ids must be int32, got ") +
                          dtype_name(ids.dtype()) +
                          "; cast them with ops::cast(ids, DType::kInt32)");
  return gather_rows(table, ids);
}

namespace {
// The [t, s] mask on `device`, made once per (t, s, device) and kept: a GPT asks for the same one
// in every layer of every step, and making it on the host and copying it to a GPU each time (a
// copy from host memory, which waits for the GPU's queue to drain) stalled the GPU once a layer.
// Query i sees keys j <= i, aligned at the first position, as Keras' MultiHeadAttention
// (_compute_causal_mask: row index >= column index) and PyTorch's is_causal do, for t != s too.
// (It was aligned at the last position, j <= i + s - t: with more queries than keys the first
// t - s saw none and attended uniformly to every key, future ones included.) At most 64 masks are
// kept, the oldest dropped first; the mask is made and copied outside the lock (two threads may
// both make a new one; the first kept wins).
Tensor causal_mask_values(int64_t t, int64_t s, DeviceSpec device) {
  using Key = std::tuple<int64_t, int64_t, int, int>;
  struct Cache {
    std::mutex mu;
    std::map<Key, Tensor> masks;
    std::deque<Key> order;  // insertion order, for dropping the oldest
  };
  static auto* cache = new Cache();  // leaked: its tensors outlive main's return
  const Key key{t, s, static_cast<int>(device.type), device.index};
  {
    std::lock_guard<std::mutex> lock(cache->mu);
    if (auto it = cache->masks.find(key); it != cache->masks.end()) return it->second;
  }
  std::vector<float> m(static_cast<size_t>(t * s), 0.f);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = i + 1; j < s; ++j) m[static_cast<size_t>(i * s + j)] = kMaskValue;
  Tensor mask = Tensor::from_vector(m, Shape{t, s}).to(device);
  std::lock_guard<std::mutex> lock(cache->mu);
  auto [it, fresh] = cache->masks.emplace(key, mask);
  if (fresh) {
    cache->order.push_back(key);
    if (cache->order.size() > 64) {
      cache->masks.erase(cache->order.front());
      cache->order.pop_front();
    }
  }
  return it->second;
}
}  // namespace

Tensor causal_mask(const Tensor& scores) {
  if (scores.rank() < 2)
    throw InvalidArgument("causal_mask: scores must be [..., T, S], got " + scores.to_string());
  const int64_t t = scores.shape()[-2], s = scores.shape()[-1];
  return add(scores, causal_mask_values(t, s, scores.device()));
}

Tensor causal_softmax(const Tensor& scores) {
  if (scores.rank() < 2)
    throw InvalidArgument("causal_softmax: scores must be [..., T, S], got " + scores.to_string());
  Kernels& k = kernels_for(scores);
  if (!k.fuses_causal_softmax()) return softmax_last(causal_mask(scores), false);
  // The mask's add passes its gradient through, so softmax's is the whole gradient.
  Tensor y = k.causal_softmax(scores, kMaskValue);
  record_softmax(scores, y, false);
  return y;
}

Tensor sequence_cross_entropy(const Tensor& logits, const Tensor& labels) {
  if (logits.rank() < 2 || labels.shape().rank() != logits.rank() - 1)
    throw InvalidArgument("sequence_cross_entropy: logits [..., V] and labels [...], got " +
                          logits.to_string() + " and " + labels.to_string());
  for (int i = 0; i < labels.rank(); ++i)
    if (labels.shape()[i] != logits.shape()[i])
      throw InvalidArgument("sequence_cross_entropy: labels " + labels.shape().to_string() +
                            " do not match logits " + logits.shape().to_string());
  const int64_t v = logits.shape()[-1];
  const Tensor flat = sparse_softmax_cross_entropy(reshape(logits, Shape{-1, v}),
                                                   reshape(labels, Shape{labels.numel()}));
  return reshape(flat, labels.shape());
}

}  // namespace dtrain::ops
