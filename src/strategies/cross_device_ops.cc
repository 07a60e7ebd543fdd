// Picks how replicas' tensors are combined, and says why in one log line.
#include "collectives/nccl/nccl_local.h"
#include "collectives/sync_collectives.h"
#include "dtrain/collectives/inproc.h"
#include "dtrain/core/logging.h"
#include "strategies/mirrored_impl.h"

namespace dtrain {
namespace {

// Reduction through host memory: each rank stages device tensors in host buffers and the ranks
// all-reduce those in place (a no-op staging for CPU tensors). Works for any device type.
class HostStagedCommunicator final : public SyncCollectives {
 public:
  explicit HostStagedCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void allreduce(Tensor& t, ReduceOp op) override {
    if (t.device().host_accessible()) return inner_->allreduce(t, op).wait();
    Tensor h = t.to(DeviceSpec::cpu());
    inner_->allreduce(h, op).wait();
    t.copy_from(h);
  }
  void allgather(const Tensor& in, Tensor& out) override {
    Tensor hi = in.to(DeviceSpec::cpu()), ho = Tensor::empty(out.shape(), out.dtype());
    inner_->allgather(hi, ho).wait();
    out.copy_from(ho);
  }
  void broadcast(Tensor& t, int root) override {
    Tensor h = t.to(DeviceSpec::cpu());
    inner_->broadcast(h, root).wait();
    if (!t.device().host_accessible()) t.copy_from(h);
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    if (t.device().host_accessible()) return inner_->reduce(t, root, op).wait();
    Tensor h = t.to(DeviceSpec::cpu());
    inner_->reduce(h, root, op).wait();
    if (inner_->rank() == root) t.copy_from(h);
  }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    Tensor hi = in.to(DeviceSpec::cpu()), ho = Tensor::empty(out.shape(), out.dtype());
    inner_->reduce_scatter(hi, ho, op).wait();
    out.copy_from(ho);
  }
  void barrier() override { inner_->barrier().wait(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<Communicator> inner_;
};

std::vector<std::unique_ptr<Communicator>> staged(int n, CollectiveOptions o) {
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& c : make_inproc_group(n, o))
    out.push_back(
        make_async_communicator(std::make_unique<HostStagedCommunicator>(std::move(c)), o.timeout));
  return out;
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_cross_device_group(
    const std::vector<DeviceSpec>& devices, CrossDeviceOps requested, CollectiveOptions options,
    CrossDeviceOps* chosen) {
  const int n = static_cast<int>(devices.size());
  bool all_cpu = true, all_gpu = true;
  for (const auto& d : devices) {
    all_cpu = all_cpu && d.type == DeviceType::kCPU;
    all_gpu = all_gpu && d.type == DeviceType::kCUDA;
  }
  switch (requested) {
    case CrossDeviceOps::kInproc:
      if (!all_cpu)
        throw InvalidArgument(
            "cross_device_ops=inproc needs CPU devices; use nccl or reduce_to_one_device for GPUs");
      *chosen = CrossDeviceOps::kInproc;
      return make_inproc_group(n, options);
    case CrossDeviceOps::kReduceToOneDevice:
      *chosen = CrossDeviceOps::kReduceToOneDevice;
      DTRAIN_LOG(INFO) << "cross-device ops: reduction through host memory (requested)";
      return staged(n, options);
    case CrossDeviceOps::kNccl:
      if (!all_gpu)
        throw InvalidArgument("cross_device_ops=nccl needs GPU devices (got a CPU device)");
      if (!nccl_available())
        throw Unavailable(
            "cross_device_ops=nccl requested but this build has no NCCL; rebuild with "
            "-DDTRAIN_WITH_NCCL=ON or use reduce_to_one_device");
      *chosen = CrossDeviceOps::kNccl;
      return make_nccl_local_group(devices, options);
    case CrossDeviceOps::kAuto:
      break;
  }
  if (all_cpu) {
    *chosen = CrossDeviceOps::kInproc;
    DTRAIN_LOG(INFO) << "cross-device ops: in-process shared-memory all-reduce (all " << n
                     << " devices are CPUs)";
    return make_inproc_group(n, options);
  }
  if (all_gpu && nccl_available()) {
    *chosen = CrossDeviceOps::kNccl;
    DTRAIN_LOG(INFO) << "cross-device ops: NCCL all-reduce (all " << n << " devices are GPUs)";
    return make_nccl_local_group(devices, options);
  }
  *chosen = CrossDeviceOps::kReduceToOneDevice;
  DTRAIN_LOG(WARNING) << "cross-device ops: falling back to reduction through host memory because "
                      << (all_gpu ? "this build has no NCCL" : "the devices mix CPUs and GPUs");
  return staged(n, options);
}

}  // namespace dtrain
