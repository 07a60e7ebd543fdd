#include "collectives/mpi/mpi_communicator.h"

#include <mpi.h>

#include <chrono>
#include <thread>
#include <vector>

#include "collectives/reduction.h"
#include "collectives/sync_collectives.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

// float16 / bfloat16: MPI has no such types, so they travel as 2-byte opaque elements and reduce
// with user-defined operations that widen to float32 (collectives/reduction), created once after
// MPI_Init: [0] float16, [1] bfloat16, each for sum, max, min.
struct HalfTypes {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op ops[2][3] = {};
};

template <DType D, ReduceOp O>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  collectives::reduce_into(inout, in, static_cast<size_t>(*len), D,
                           O);  // commutative: inout = inout op in
}

const HalfTypes& half_types() {
  static const HalfTypes h = [] {
    HalfTypes t;
    MPI_Type_contiguous(2, MPI_BYTE, &t.type);
    MPI_Type_commit(&t.type);
    MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kSum>, 1, &t.ops[0][0]);
    MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kMax>, 1, &t.ops[0][1]);
    MPI_Op_create(&half_reduce<DType::kFloat16, ReduceOp::kMin>, 1, &t.ops[0][2]);
    MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kSum>, 1, &t.ops[1][0]);
    MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kMax>, 1, &t.ops[1][1]);
    MPI_Op_create(&half_reduce<DType::kBFloat16, ReduceOp::kMin>, 1, &t.ops[1][2]);
    return t;
  }();
  return h;
}

bool is_half(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }

MPI_Datatype mpi_type(DType t, const char* op) {
  switch (t) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kFloat64:
      return MPI_DOUBLE;
    case DType::kInt32:
      return MPI_INT32_T;
    case DType::kInt64:
      return MPI_INT64_T;
    case DType::kFloat16:
    case DType::kBFloat16:
      return half_types().type;
  }
  throw Unimplemented(std::string("MPI ") + op + " of " + dtype_name(t));
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  const int k = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  if (is_half(t)) return half_types().ops[t == DType::kFloat16 ? 0 : 1][k];
  return k == 1 ? MPI_MAX : k == 2 ? MPI_MIN : MPI_SUM;
}

class MpiCommunicator final : public SyncCollectives {
 public:
  explicit MpiCommunicator(CollectiveOptions o) : o_(o) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      if (provided < MPI_THREAD_SERIALIZED)
        throw Unavailable(
            "this MPI library does not support MPI_THREAD_SERIALIZED, which dtrain needs");
      owns_ = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiCommunicator() override {
    if (owns_) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void allreduce(Tensor& t, ReduceOp op) override {
    host(t, "allreduce");
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, t.raw_data(), count(t), mpi_type(t.dtype(), "allreduce"),
                   mpi_op(op, t.dtype()), MPI_COMM_WORLD, &req);
    wait(req, "allreduce");
    if (op == ReduceOp::kMean)
      collectives::scale_for_mean(t.raw_data(), static_cast<size_t>(t.numel()), t.dtype(), size_);
  }
  void allgather(const Tensor& in, Tensor& out) override {
    host(in, "allgather");
    MPI_Request req;
    const MPI_Datatype dt = mpi_type(in.dtype(), "allgather");
    MPI_Iallgather(in.raw_data(), count(in), dt, out.raw_data(), count(in), dt, MPI_COMM_WORLD,
                   &req);
    wait(req, "allgather");
  }
  void broadcast(Tensor& t, int root) override {
    host(t, "broadcast");
    MPI_Request req;
    MPI_Ibcast(t.raw_data(), count(t), mpi_type(t.dtype(), "broadcast"), root, MPI_COMM_WORLD,
               &req);
    wait(req, "broadcast");
  }
  void reduce(Tensor& t, int root, ReduceOp op) override {
    host(t, "reduce");
    MPI_Request req;
    MPI_Ireduce(rank_ == root ? MPI_IN_PLACE : t.raw_data(), rank_ == root ? t.raw_data() : nullptr,
                count(t), mpi_type(t.dtype(), "reduce"), mpi_op(op, t.dtype()), root,
                MPI_COMM_WORLD, &req);
    wait(req, "reduce");
    if (op == ReduceOp::kMean && rank_ == root)
      collectives::scale_for_mean(t.raw_data(), static_cast<size_t>(t.numel()), t.dtype(), size_);
  }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    host(in, "reduce_scatter");
    MPI_Request req;
    MPI_Ireduce_scatter_block(in.raw_data(), out.raw_data(), count(out),
                              mpi_type(in.dtype(), "reduce_scatter"), mpi_op(op, in.dtype()),
                              MPI_COMM_WORLD, &req);
    wait(req, "reduce_scatter");
    if (op == ReduceOp::kMean)
      collectives::scale_for_mean(out.raw_data(), static_cast<size_t>(out.numel()), in.dtype(),
                                  size_);
  }
  void alltoall(const Tensor& in, Tensor& out) override {
    host(in, "alltoall");
    check_alltoall(in, out, size_);
    MPI_Request req;
    const MPI_Datatype dt = mpi_type(in.dtype(), "alltoall");
    const int block = static_cast<int>(in.numel() / size_);
    MPI_Ialltoall(in.raw_data(), block, dt, out.raw_data(), block, dt, MPI_COMM_WORLD, &req);
    wait(req, "alltoall");
  }
  void barrier() override {
    MPI_Request req;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    wait(req, "barrier");
  }
  void abort(const std::string& reason) override {
    // MPI cannot cancel a collective another rank is blocked in: end the whole job, loudly.
    DTRAIN_LOG(ERROR) << "MPI rank " << rank_ << " aborts the job: " << reason;
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

 private:
  static int count(const Tensor& t) {
    if (t.numel() > (1LL << 31) - 1)
      throw InvalidArgument("MPI collectives take at most 2^31-1 elements, got " + t.to_string());
    return static_cast<int>(t.numel());
  }
  static void host(const Tensor& t, const char* op) {
    if (!t.device().host_accessible())
      throw InvalidArgument(std::string("MPI ") + op + ": host tensors only, got " + t.to_string());
  }
  // Polls the request against the timeout (MPI has no timed wait).
  void wait(MPI_Request& req, const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + o_.timeout;
    int done = 0;
    for (int spins = 0;; ++spins) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (std::chrono::steady_clock::now() > deadline)
        abort(std::string(op) + " did not complete within " + std::to_string(o_.timeout.count()) +
              " ms: another rank is stuck or gone");
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  CollectiveOptions o_;
  int rank_ = 0, size_ = 1;
  bool owns_ = false;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(CollectiveOptions options) {
  return make_async_communicator(std::make_unique<MpiCommunicator>(options), options.timeout);
}

}  // namespace dtrain
