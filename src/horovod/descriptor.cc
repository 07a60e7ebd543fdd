#include "horovod/descriptor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "dtrain/core/error.h"

namespace dtrain::hvd::detail {

const char* kind_name(int64_t k) {
  switch (k) {
    case kAllreduce:
      return "allreduce";
    case kAllgather:
      return "allgather";
    case kBroadcast:
      return "broadcast";
    case kAlltoall:
      return "alltoall";
    case kReducescatter:
      return "reducescatter";
    case kJoin:
      return "join";
  }
  return "?";
}

const char* op_name(int64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kAverage:
      return "average";
    case Op::kSum:
      return "sum";
    case Op::kMin:
      return "min";
    case Op::kMax:
      return "max";
  }
  return "?";
}

std::string describe(const Desc& d) {
  std::string name(reinterpret_cast<const char*>(&d[fName]), kNameBytes);
  name = name.substr(0, name.find('\0'));
  if (d[fKind] == kJoin) return "join()";
  std::string s = std::string(kind_name(d[fKind])) + " '" + name + "' ";
  s += d[fDtype] >= 0 ? dtype_name(static_cast<DType>(d[fDtype])) : "?";
  s += " [";
  for (int64_t i = 0; i < d[fNdim]; ++i) s += (i ? ", " : "") + std::to_string(d[fDims + i]);
  s += "]";
  if (d[fKind] == kAllreduce || d[fKind] == kReducescatter) s += std::string(" ") + op_name(d[fOp]);
  if (d[fKind] == kBroadcast) s += " root " + std::to_string(d[fRoot]);
  return s;
}

bool agree(const Desc& a, const Desc& b) {
  for (int f : {fKind, fOp, fDtype, fNdim, fRoot, fCompression})
    if (a[f] != b[f]) return false;
  for (int64_t i = a[fKind] == kAllgather ? 1 : 0; i < a[fNdim]; ++i)
    if (a[fDims + i] != b[fDims + i]) return false;
  return std::memcmp(&a[fName], &b[fName], kNameBytes) == 0;
}

Tensor zeros_like_desc(const Desc& d, int64_t rows) {
  std::vector<int64_t> dims(d.begin() + fDims, d.begin() + fDims + d[fNdim]);
  if (!dims.empty() && rows >= 0) dims[0] = rows;
  return Tensor::zeros(Shape(dims), static_cast<DType>(d[fDtype]));
}

Tensor concat_rows(const std::vector<Tensor>& parts, const Shape& like) {
  std::vector<int64_t> dims = like.dims();
  dims[0] = 0;
  for (const Tensor& p : parts) dims[0] += p.shape()[0];
  Tensor out = Tensor::empty(Shape(dims), parts.empty() ? DType::kFloat32 : parts[0].dtype());
  char* dst = static_cast<char*>(out.raw_data());
  for (const Tensor& p : parts) {
    std::memcpy(dst, p.raw_data(), p.nbytes());
    dst += p.nbytes();
  }
  return out;
}

std::string describe_name(const Desc& d) {
  std::string name(reinterpret_cast<const char*>(&d[fName]), kNameBytes);
  return name.substr(0, name.find('\0'));
}

std::vector<int> active_ranks(const std::vector<Desc>& ds, uint64_t seq) {
  std::vector<int> active;
  for (size_t q = 0; q < ds.size(); ++q)
    if (!ds[q][fJoined]) active.push_back(static_cast<int>(q));
  for (int q : active)
    if (!agree(ds[static_cast<size_t>(q)], ds[static_cast<size_t>(active[0])])) {
      std::string table;
      for (size_t p = 0; p < ds.size(); ++p)
        table += "\n  rank " + std::to_string(p) + ": " + describe(ds[p]);
      throw FailedPrecondition(
          "hvd: the ranks issued different collectives (collective #" + std::to_string(seq) +
          " of this job); every rank must issue the same collectives, with the same name, "
          "dtype, shape and op, in the same order:" +
          table);
    }
  return active;
}

size_t agreed_count(const std::vector<Desc>& ds) {
  int64_t k = static_cast<int64_t>(kMaxBatch);
  for (const Desc& d : ds)
    if (!d[fJoined]) k = std::min(k, std::max<int64_t>(d[fCount], 1));
  return static_cast<size_t>(std::max<int64_t>(k, 1));
}

void apply_environment(InitOptions& o) {
  // Horovod's own variables work too, for scripts that set them; dtrain's win when both are set.
  auto env = [](const char* dtrain_name,
                const char* horovod_name) -> std::pair<const char*, const char*> {
    for (const char* n : {dtrain_name, horovod_name})
      if (const char* v = std::getenv(n); v && *v) return {n, v};
    return {nullptr, nullptr};
  };
  if (auto [name, f] = env("DTRAIN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"); f) {
    char* end = nullptr;
    const long long v = std::strtoll(f, &end, 10);
    if (*end != '\0' || v < 0)
      throw InvalidArgument(std::string(name) + " must be a byte count >= 0, got '" + f + "'");
    o.fusion_threshold_bytes = static_cast<size_t>(v);
  }
  if (auto [name, f] = env("DTRAIN_CYCLE_TIME", "HOROVOD_CYCLE_TIME"); f) {
    char* end = nullptr;
    const double ms = std::strtod(f, &end);
    if (*end != '\0' || !(ms >= 0) || ms > 60000)
      throw InvalidArgument(std::string(name) +
                            " must be milliseconds in [0, 60000] (e.g. 1 or 3.5), got '" + f + "'");
    o.cycle_time = std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
  }
  if (const char* v = std::getenv("DTRAIN_STALL_CHECK_SECONDS"); v && *v) {
    char* end = nullptr;
    const long long secs = std::strtoll(v, &end, 10);
    if (*end != '\0' || secs < 0)
      throw InvalidArgument(
          std::string("DTRAIN_STALL_CHECK_SECONDS must be a number of seconds >= 0, got '") + v +
          "'");
    o.stall_warning = std::chrono::seconds(secs);
  }
}

}  // namespace dtrain::hvd::detail
