// Private to src/horovod: what every rank says about the collective it is about to run, and how two
// such descriptions are compared. A description is kDescLen int64 (fields below), exchanged by
// allgather before each collective (or run of fused all-reduces).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/horovod.h"

namespace dtrain::hvd::detail {

enum Kind : int64_t { kAllreduce = 1, kAllgather, kBroadcast, kAlltoall, kReducescatter, kJoin };
const char* kind_name(int64_t k);
const char* op_name(int64_t op);

// One rank's description of the collective it is about to run: exchanged (allgather) before it.
// fCount: how many fusible all-reduces this rank has ready in this cycle (this one first).
constexpr int kDescLen = 33, kMaxRank = 8, kNameBytes = 128;
enum Field {
  fKind,
  fOp,
  fDtype,
  fNdim,
  fDims,
  fRoot = fDims + kMaxRank,
  fJoined,
  fCompression,
  fSeq,
  fName = 16,
  fCount = fName + kNameBytes / 8
};
static_assert(fCount + 1 == kDescLen, "descriptor layout");
// The most all-reduces one cycle fuses (Horovod's cycles are bounded by the fusion buffer alone;
// this also bounds the second negotiation's message: 64 x 33 int64 per rank).
constexpr size_t kMaxBatch = 64;

using Desc = std::vector<int64_t>;

// "allreduce 'grad.0' float32 [3, 4] average"; "join()".
std::string describe(const Desc& d);
// The collective's name alone.
std::string describe_name(const Desc& d);
// Whether two active ranks' descriptions agree (allgather: all but the first dimension).
bool agree(const Desc& a, const Desc& b);
// The ranks that have not joined; throws FailedPrecondition (the same table of every rank's
// description, on every rank) when their descriptions differ. `seq` numbers the collective.
std::vector<int> active_ranks(const std::vector<Desc>& ds, uint64_t seq);
// The number of all-reduces of this cycle that every rank has ready: the smallest count among the
// ranks that have not joined (each announced its own in the first round).
size_t agreed_count(const std::vector<Desc>& ds);
// hvd::init's options as the environment changes them: DTRAIN_FUSION_THRESHOLD /
// HOROVOD_FUSION_THRESHOLD, DTRAIN_CYCLE_TIME / HOROVOD_CYCLE_TIME, DTRAIN_STALL_CHECK_SECONDS
// (InvalidArgument naming the variable on a malformed value).
void apply_environment(InitOptions& o);
// Zeros of the described shape and dtype (rows >= 0 replaces the first dimension).
Tensor zeros_like_desc(const Desc& d, int64_t rows);
// Concatenates host tensors along axis 0.
Tensor concat_rows(const std::vector<Tensor>& parts, const Shape& like);

}  // namespace dtrain::hvd::detail
