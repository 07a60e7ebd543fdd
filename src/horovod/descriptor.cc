#include "horovod/descriptor.h"

#include <cstring>

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

}  // namespace dtrain::hvd::detail
