// NCCL communicators: among the GPUs of one process (ncclCommInitAll), and one GPU per process
// across processes (ncclCommInitRank with a unique id sent over the job's TCP rendezvous). Each
// rank drives its communicator on a dedicated stream; waits poll the stream against the group's
// deadline and abort the NCCL communicator (ncclCommAbort) instead of hanging when a peer never
// arrives.
#include "collectives/nccl/nccl_local.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "collectives/sync_collectives.h"
#include "dtrain/core/logging.h"
#include "dtrain/devices/device.h"

namespace dtrain {
namespace {

void check_nccl(ncclResult_t r, const char* call) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw Unavailable(std::string(call) + " failed: " + ncclGetErrorString(r));
}

void check_cuda(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw Unavailable(std::string(call) + " failed: " + cudaGetErrorString(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMean:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

struct Shared {
  std::vector<ncclComm_t> comms;
  std::vector<int> gpus;
  CollectiveOptions options;
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::string reason;
  ~Shared() {
    for (auto c : comms)
      if (c) ncclCommDestroy(c);
  }
};

// Rank `rank` of `size`, driving comms[index] on gpus[index] of the shared state (index == rank
// for a local group, 0 for one GPU per process).
class NcclCommunicator final : public SyncCollectives {
 public:
  NcclCommunicator(std::shared_ptr<Shared> s, int index, int rank, int size)
      : s_(std::move(s)), index_(index), rank_(rank), size_(size) {
    check_cuda(cudaSetDevice(gpu()), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    cudaSetDevice(gpu());
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void allreduce(Tensor& t, ReduceOp op) override {
    prepare(t, "allreduce");
    check_nccl(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()),
                             nccl_type(t.dtype()), nccl_op(op), comm(), stream_),
               "ncclAllReduce");
    wait("allreduce");
  }
  void allgather(const Tensor& in, Tensor& out) override {
    prepare(in, "allgather");
    check_nccl(ncclAllGather(in.raw_data(), out.raw_data(), static_cast<size_t>(in.numel()),
                             nccl_type(in.dtype()), comm(), stream_),
               "ncclAllGather");
    wait("allgather");
  }
  void broadcast(Tensor& t, int root) override {
    prepare(t, "broadcast");
    check_nccl(ncclBroadcast(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()),
                             nccl_type(t.dtype()), root, comm(), stream_),
               "ncclBroadcast");
    wait("broadcast");
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    prepare(t, "reduce");
    check_nccl(ncclReduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()),
                          nccl_type(t.dtype()), nccl_op(op), root, comm(), stream_),
               "ncclReduce");
    wait("reduce");
  }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    prepare(in, "reduce_scatter");
    check_nccl(ncclReduceScatter(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                                 nccl_type(in.dtype()), nccl_op(op), comm(), stream_),
               "ncclReduceScatter");
    wait("reduce_scatter");
  }
  void barrier() override {
    Tensor one = Tensor::zeros(Shape{1}, DType::kInt32, DeviceSpec::gpu(gpu()));
    allreduce(one, ReduceOp::kSum);
  }
  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (s_->reason.empty()) s_->reason = reason;
    }
    s_->aborted = true;
  }

 private:
  int gpu() const { return s_->gpus[static_cast<size_t>(index_)]; }
  ncclComm_t comm() const { return s_->comms[static_cast<size_t>(index_)]; }

  void prepare(const Tensor& t, const char* what) {
    if (t.device() != DeviceSpec::gpu(gpu()))
      throw InvalidArgument(std::string("NCCL ") + what + " on rank " + std::to_string(rank_) +
                            " needs a tensor on GPU:" + std::to_string(gpu()) + ", got " +
                            t.to_string());
    throw_if_aborted();
    // Kernels that produced `t` run on the device's own stream: finish them first.
    get_device(t.device()).synchronize();
    check_cuda(cudaSetDevice(gpu()), "cudaSetDevice");
  }

  void throw_if_aborted() {
    if (s_->aborted) {
      std::lock_guard<std::mutex> lock(s_->mu);
      throw Unavailable("NCCL group aborted: " + s_->reason);
    }
  }

  // Polls instead of blocking so that a dead peer or an abort cannot hang this thread.
  void wait(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + s_->options.timeout;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) check_cuda(q, "cudaStreamQuery");
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm(), &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        ncclCommAbort(comm());
        s_->comms[static_cast<size_t>(index_)] = nullptr;
        throw Unavailable(std::string("NCCL ") + what + " failed on rank " + std::to_string(rank_) +
                          ": " + ncclGetErrorString(async));
      }
      if (s_->aborted || std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm());
        s_->comms[static_cast<size_t>(index_)] = nullptr;
        if (s_->aborted) throw_if_aborted();
        throw DeadlineExceeded(std::string("NCCL ") + what + " on rank " + std::to_string(rank_) +
                               " did not finish within " +
                               std::to_string(s_->options.timeout.count()) +
                               " ms; another replica did not join the collective");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  std::shared_ptr<Shared> s_;
  int index_, rank_, size_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

bool nccl_available() { return true; }

std::vector<std::unique_ptr<Communicator>> make_nccl_local_group(
    const std::vector<DeviceSpec>& devices, CollectiveOptions options) {
  auto s = std::make_shared<Shared>();
  s->options = options;
  for (const auto& d : devices) {
    if (d.type != DeviceType::kCUDA)
      throw InvalidArgument("NCCL needs GPU devices, got " + d.to_string());
    get_device(d);  // creates the device (and its CUDA context) first
    s->gpus.push_back(d.index);
  }
  s->comms.resize(devices.size());
  check_nccl(ncclCommInitAll(s->comms.data(), static_cast<int>(devices.size()), s->gpus.data()),
             "ncclCommInitAll");
  int version = 0;
  ncclGetVersion(&version);
  DTRAIN_LOG(INFO) << "NCCL " << version << " communicators for " << devices.size() << " GPU(s)";
  std::vector<std::unique_ptr<Communicator>> out;
  for (size_t r = 0; r < devices.size(); ++r)
    out.push_back(make_async_communicator(
        std::make_unique<NcclCommunicator>(s, static_cast<int>(r), static_cast<int>(r),
                                           static_cast<int>(devices.size())),
        options.timeout));
  return out;
}

std::unique_ptr<Communicator> make_nccl_process_group(DeviceSpec device, Communicator& bootstrap,
                                                      CollectiveOptions options) {
  if (device.type != DeviceType::kCUDA)
    throw InvalidArgument("cross-process NCCL needs a GPU device, got " + device.to_string() +
                          "; use the TCP ring (implementation RING) for CPU devices");
  get_device(device);
  const int rank = bootstrap.rank(), size = bootstrap.size();
  // NCCL refuses two ranks on one GPU with a bare "invalid usage" at init. Compare the GPUs' UUIDs
  // first (every rank sees the same list, so every rank fails alike) and say what to do instead.
  {
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device.index), "cudaGetDeviceProperties");
    static_assert(sizeof(prop.uuid) == 2 * sizeof(int64_t), "cudaUUID_t size");
    Tensor mine = Tensor::zeros(Shape{2}, DType::kInt64);
    std::memcpy(mine.raw_data(), &prop.uuid, sizeof(prop.uuid));
    Tensor all = Tensor::zeros(Shape{2 * static_cast<int64_t>(size)}, DType::kInt64);
    bootstrap.allgather(mine, all).wait(options.timeout);
    const auto* u = static_cast<const int64_t*>(all.raw_data());
    for (int a = 0; a < size; ++a)
      for (int b = a + 1; b < size; ++b)
        if (u[2 * a] == u[2 * b] && u[2 * a + 1] == u[2 * b + 1])
          throw InvalidArgument(
              "cross-process NCCL needs a GPU of its own for every worker, but workers " +
              std::to_string(a) + " and " + std::to_string(b) +
              " are on the same GPU; give each worker its own GPU (CUDA_VISIBLE_DEVICES) "
              "or use the TCP ring (DTRAIN_COLLECTIVE=ring)");
  }
  // Rank 0 makes the unique id; the job's authenticated TCP group carries it to everyone.
  ncclUniqueId id{};
  static_assert(sizeof(ncclUniqueId) % sizeof(int64_t) == 0, "ncclUniqueId size");
  Tensor box = Tensor::zeros(Shape{static_cast<int64_t>(sizeof(ncclUniqueId) / sizeof(int64_t))},
                             DType::kInt64);
  if (rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(box.raw_data(), &id, sizeof(id));
  }
  bootstrap.broadcast(box, 0).wait(options.timeout);
  std::memcpy(&id, box.raw_data(), sizeof(id));

  auto s = std::make_shared<Shared>();
  s->options = options;
  s->gpus = {device.index};
  s->comms.resize(1);
  check_cuda(cudaSetDevice(device.index), "cudaSetDevice");
  // Non-blocking init, polled against the deadline: a peer that never calls it cannot hang us.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  check_nccl(ncclCommInitRankConfig(&s->comms[0], size, id, rank, &config),
             "ncclCommInitRankConfig");
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    ncclCommGetAsyncError(s->comms[0], &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress || std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(s->comms[0]);
      s->comms[0] = nullptr;
      if (state != ncclInProgress)
        throw Unavailable(std::string("NCCL init across processes failed: ") +
                          ncclGetErrorString(state));
      throw DeadlineExceeded(
          "NCCL init across " + std::to_string(size) + " processes did not finish within " +
          std::to_string(options.timeout.count()) + " ms on rank " + std::to_string(rank) +
          "; is every worker's GPU reachable (NCCL_DEBUG=INFO says why)?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  DTRAIN_LOG(INFO) << "NCCL communicator rank " << rank << " of " << size << " on "
                   << device.to_string();
  return make_async_communicator(std::make_unique<NcclCommunicator>(s, 0, rank, size),
                                 options.timeout);
}

}  // namespace dtrain
