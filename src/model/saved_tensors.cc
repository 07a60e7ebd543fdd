// What ops keep for their backward pass under mixed_bfloat16 (op_util.h).
#include <array>
#include <cstdint>

#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "model/op_util.h"

namespace dtrain::ops {
namespace {
// The last few copies made on this thread, by the id of the tensor copied (ids are never reused):
// a ReLU's output is kept by the ReLU and by each convolution reading it (a residual block's
// first convolution and its projection shortcut), and they share one copy. Holding the copies
// here keeps at most kSlots of them a little longer than their tape.
constexpr int kSlots = 4;
struct Slot {
  uint64_t source_id = 0;
  Tensor copy;
};
thread_local std::array<Slot, kSlots> t_slots;
thread_local int t_next = 0;
}  // namespace

Tensor keep_for_backward(const Tensor& x) {
  if (!x.defined() || x.dtype() != DType::kFloat32 || x.device().type != DeviceType::kCPU ||
      precision_policy() != Precision::kMixedBFloat16 || x.numel() == 0)
    return x;
  for (const Slot& s : t_slots)
    if (s.source_id == x.id() && s.copy.defined() && s.copy.shape() == x.shape()) return s.copy;
  Tensor copy = kernels_for(x).cast(x, DType::kBFloat16);
  t_slots[t_next] = {x.id(), copy};
  t_next = (t_next + 1) % kSlots;
  return copy;
}

Tensor kept_value(const Tensor& kept) {
  if (!kept.defined() || kept.dtype() != DType::kBFloat16) return kept;
  return kernels_for(kept).cast(kept, DType::kFloat32);
}

}  // namespace dtrain::ops
