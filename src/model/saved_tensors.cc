// What ops keep for their backward pass under mixed_bfloat16 (op_util.h).
#include <array>
#include <cstdint>

#include "dtrain/core/precision.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/gradient_tape.h"
#include "model/op_util.h"

namespace dtrain::ops {
namespace {
// The last few copies made on this thread, by the id of the tensor copied (ids are never reused):
// a ReLU's output is kept by the ReLU and by each convolution reading it (a residual block's
// first convolution and its projection shortcut), and they share one copy. The slots are emptied
// when a backward pass starts, when a tape is dropped without one, and when a step's first tape
// is made (forget_kept_copies), so they hold no copy beyond its tape: a weight updated in place
// keeps its id, and a copy of it from before would be stale.
constexpr int kSlots = 4;
struct Slot {
  uint64_t source_id = 0;
  Tensor copy;
};
thread_local std::array<Slot, kSlots> t_slots;
thread_local int t_next = 0;
}  // namespace

namespace {
bool rounds(const Tensor& x) {
  return x.defined() && x.dtype() == DType::kFloat32 &&
         precision_policy() == Precision::kMixedBFloat16 && x.numel() > 0;
}
// Kept copies are bfloat16 on devices whose kernels read them (Kernels::hands_off_bfloat16: the
// CPU's, and CUDA's from compute capability 8.0); elsewhere x itself is kept and the kernels round
// it at each use.
bool compacts(const Tensor& x) { return rounds(x) && kernels_for(x).hands_off_bfloat16(); }
}  // namespace

Tensor rounded_under_policy(const Tensor& x) {
  if (!rounds(x)) return x;
  Kernels& k = kernels_for(x);
  return k.cast(k.cast(x, DType::kBFloat16), DType::kFloat32);
}

Tensor keep_for_backward(const Tensor& x) { return keep_for_backward(x, Tensor()); }

Tensor keep_for_backward(const Tensor& x, const Tensor& made) {
  if (!compacts(x)) return x;
  if (Tensor kept = kept_copy_if_made(x); kept.dtype() == DType::kBFloat16) return kept;
  const bool given =
      made.defined() && made.dtype() == DType::kBFloat16 && made.shape() == x.shape();
  Tensor copy = given ? made : kernels_for(x).cast(x, DType::kBFloat16);
  t_slots[t_next] = {x.id(), copy};
  t_next = (t_next + 1) % kSlots;
  return copy;
}

bool bf16_activations(const Tensor& x) {
  return x.defined() && precision_policy() == Precision::kMixedBFloat16 &&
         (x.dtype() == DType::kFloat32 || x.dtype() == DType::kBFloat16) &&
         kernels_for(x).hands_off_bfloat16();
}

Tensor kernel_copy(const Tensor& x) {
  return compacts(x) ? kernels_for(x).cast(x, DType::kBFloat16) : x;
}

std::pair<Tensor, Tensor> product_operands(const Tensor& a, const Tensor& b, const Tensor& made_a) {
  if (!tape::should_record({&a, &b}) || tape::recording_tapes({&a, &b}) != 1) return {a, b};
  // (made_a is the copy of another tensor, which holds its slot: a itself takes none.)
  return {made_a.defined() ? made_a : keep_for_backward(a), keep_for_backward(b)};
}

Tensor product_gradient(const Tensor& g, const Tensor& ka, const Tensor& kb) {
  return tape::should_record({&g, &ka, &kb}) ? g : kernel_copy(g);
}

Tensor kept_copy_if_made(const Tensor& x) {
  if (!x.defined() || precision_policy() != Precision::kMixedBFloat16) return x;
  for (const Slot& s : t_slots)
    if (s.source_id == x.id() && s.copy.defined() && s.copy.shape() == x.shape()) return s.copy;
  return x;
}

void forget_kept_copies() {
  for (Slot& s : t_slots) s = Slot{};
}

}  // namespace dtrain::ops
