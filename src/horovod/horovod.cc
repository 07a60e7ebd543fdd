// dtrain::hvd: negotiated collectives on one background thread, over the TCP ring (or MPI).
#include "dtrain/horovod.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "collectives/mpi/mpi_communicator.h"
#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/collectives/tcp.h"
#include "dtrain/core/logging.h"
#include "dtrain/core/timeline.h"
#include "dtrain/devices/device.h"
#include "dtrain/model/layers.h"
#include "dtrain/model/ops.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain::hvd {

struct Handle::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Tensor result;
  std::exception_ptr error;
};

bool Handle::poll() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->done;
}

Tensor Handle::synchronize() const {
  if (!s_) throw FailedPrecondition("hvd::Handle::synchronize on an empty handle");
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->done; });
  if (s_->error) std::rethrow_exception(s_->error);
  return s_->result;
}

namespace {

enum Kind : int64_t { kAllreduce = 1, kAllgather, kBroadcast, kAlltoall, kReducescatter, kJoin };

const char* kind_name(int64_t k) {
  switch (k) {
    case kAllreduce: return "allreduce";
    case kAllgather: return "allgather";
    case kBroadcast: return "broadcast";
    case kAlltoall: return "alltoall";
    case kReducescatter: return "reducescatter";
    case kJoin: return "join";
  }
  return "?";
}

const char* op_name(int64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kAverage: return "average";
    case Op::kSum: return "sum";
    case Op::kMin: return "min";
    case Op::kMax: return "max";
  }
  return "?";
}

// One rank's description of the collective it is about to run: exchanged (allgather) before it.
constexpr int kDescLen = 32, kMaxRank = 8, kNameBytes = 128;
enum Field { fKind, fOp, fDtype, fNdim, fDims, fRoot = fDims + kMaxRank, fJoined, fCompression, fSeq, fName = 16 };

struct Request {
  int64_t kind = 0;
  Op op = Op::kAverage;
  Compression compression = Compression::kNone;
  int root = 0;
  std::string name;
  Tensor input;  // on the host
  DeviceSpec device;
  std::shared_ptr<Handle::State> state;
};

using Desc = std::vector<int64_t>;

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

// Whether two active ranks' descriptions agree (allgather: all but the first dimension).
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

// Concatenates host tensors along axis 0.
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

class Runtime {
 public:
  static Runtime& get() {
    static Runtime* r = new Runtime;  // never destroyed: its thread may outlive static destructors
    return *r;
  }

  void init(const InitOptions& o) {
    std::lock_guard<std::mutex> lock(mu_);
    if (initialized_) return;
    opts_ = o;
    if (const char* f = std::getenv("DTRAIN_FUSION_THRESHOLD"); f && *f) {
      char* end = nullptr;
      const long long v = std::strtoll(f, &end, 10);
      if (*end != '\0' || v < 0)
        throw InvalidArgument(std::string("DTRAIN_FUSION_THRESHOLD must be a byte count >= 0, got '") + f + "'");
      opts_.fusion_threshold_bytes = static_cast<size_t>(v);
    }
    if (const char* v = std::getenv("DTRAIN_STALL_CHECK_SECONDS"); v && *v) {
      char* end = nullptr;
      const long long secs = std::strtoll(v, &end, 10);
      if (*end != '\0' || secs < 0)
        throw InvalidArgument(std::string("DTRAIN_STALL_CHECK_SECONDS must be a number of seconds >= 0, got '") + v + "'");
      opts_.stall_warning = std::chrono::seconds(secs);
    }
    std::optional<ClusterResolution> c = resolve_cluster(false);
    bool mpi = false;
    if (!c && std::getenv("OMPI_COMM_WORLD_SIZE")) {
      c = resolve_cluster(true);
      mpi = true;
    }
    rank_ = 0;
    size_ = 1;
    local_rank_ = 0;
    local_size_ = 1;
    last_joined_ = 0;
    if (c) {
      if (!c->is_training_worker())
        throw FailedPrecondition("hvd::init() on task " + c->task_name() +
                                 ", which is not a training worker; Horovod ranks are the chief and the workers");
      rank_ = c->worker_rank();
      size_ = c->num_workers();
      local_rank_ = c->local_rank();
      local_size_ = c->local_size();
      CollectiveOptions co;
      co.timeout = o.timeout;
      if (size_ > 1 && c->has_addresses() && !mpi) {
        TcpGroupOptions t;
        t.rank = rank_;
        for (TaskType type : {TaskType::kChief, TaskType::kWorker})
          if (c->cluster().has_job(type))
            for (size_t i = 0; i < c->cluster().job_tasks(type).size(); ++i) {
              t.addresses.push_back(c->cluster().job_tasks(type)[i]);
              t.task_names.push_back("rank " + std::to_string(t.addresses.size() - 1));
            }
        t.token = resolve_job_token(o.token);
        t.connect_timeout = o.connect_timeout;
        t.collective = co;
        comm_ = connect_tcp_group(t);
      } else if (size_ > 1) {
        if (!mpi_available())
          throw FailedPrecondition("hvd::init() under mpirun needs dtrain built with OpenMPI (libopenmpi-dev); "
                                   "or start the job with dtrain-run -np N");
        comm_ = make_mpi_communicator(co);
      }
    }
    joined_.assign(static_cast<size_t>(size_), false);
    stopping_ = false;
    worker_ = std::thread([this] { loop(); });
    initialized_ = true;
  }

  void shutdown() {
    std::thread t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!initialized_) return;
      stopping_ = true;
      initialized_ = false;
      t = std::move(worker_);
    }
    cv_.notify_all();
    if (t.joinable()) t.join();
    comm_.reset();
  }

  bool initialized() {
    std::lock_guard<std::mutex> lock(mu_);
    return initialized_;
  }
  void require() {
    if (!initialized()) throw FailedPrecondition("call dtrain::hvd::init() first");
  }
  int rank() { return require(), rank_; }
  int size() { return require(), size_; }
  int local_rank() { return require(), local_rank_; }
  int local_size() { return require(), local_size_; }
  size_t fusion() { return require(), opts_.fusion_threshold_bytes; }

  Handle submit(int64_t kind, const Tensor& t, std::string name, Op op, Compression comp, int root) {
    require();
    if (kind != kJoin) {
      if (!t.defined()) throw InvalidArgument(std::string("hvd::") + kind_name(kind) + ": the tensor is undefined");
      if (t.shape().rank() > kMaxRank)
        throw InvalidArgument(std::string("hvd::") + kind_name(kind) + ": tensors of rank > 8 are not supported");
      if ((kind == kAllgather || kind == kAlltoall || kind == kReducescatter) && t.shape().rank() == 0)
        throw InvalidArgument(std::string("hvd::") + kind_name(kind) + " needs a tensor of rank >= 1");
      if (kind == kBroadcast && (root < 0 || root >= size_))
        throw InvalidArgument("hvd::broadcast: root_rank " + std::to_string(root) + " is not in [0, " +
                              std::to_string(size_) + ")");
    }
    Request r;
    r.kind = kind;
    r.op = op;
    r.compression = comp;
    r.root = root;
    r.state = std::make_shared<Handle::State>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!initialized_) throw FailedPrecondition("hvd: a collective was issued after hvd::shutdown()");
      if (name.empty()) name = std::string(kind_name(kind)) + "." + std::to_string(counters_[kind]++);
      if (name.size() > kNameBytes) name = name.substr(0, kNameBytes);
      r.name = std::move(name);
      if (t.defined()) {
        r.device = t.device();
        r.input = t.to(DeviceSpec::cpu()).clone();  // the caller may change its tensor meanwhile
      }
      Handle h(r.state);
      queue_.push_back(std::move(r));
      cv_.notify_all();
      return h;
    }
  }

 private:
  void loop() {
    timeline::set_thread_name("hvd collectives");
    for (;;) {
      Request r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        r = std::move(queue_.front());
        queue_.pop_front();
      }
      Tensor result;
      std::exception_ptr error;
      try {
        result = r.kind == kJoin ? run_join() : run(r);
        if (result.defined() && r.device.type != DeviceType::kCPU) result = result.to(r.device);
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(r.state->mu);
        r.state->result = std::move(result);
        r.state->error = error;
        r.state->done = true;
      }
      r.state->cv.notify_all();
    }
  }

  Desc descriptor(const Request& r, bool joined) {
    Desc d(kDescLen, 0);
    d[fKind] = r.kind;
    d[fOp] = static_cast<int64_t>(r.op);
    d[fDtype] = r.input.defined() ? static_cast<int64_t>(r.input.dtype()) : -1;
    d[fNdim] = r.input.defined() ? r.input.shape().rank() : 0;
    for (int64_t i = 0; i < d[fNdim]; ++i) d[fDims + i] = r.input.shape()[static_cast<int>(i)];
    d[fRoot] = r.root;
    d[fJoined] = joined ? 1 : 0;
    d[fCompression] = static_cast<int64_t>(r.compression);
    d[fSeq] = static_cast<int64_t>(seq_);
    std::memcpy(&d[fName], r.name.data(), std::min<size_t>(r.name.size(), kNameBytes));
    return d;
  }

  std::vector<Desc> exchange(const Desc& mine) {
    ++seq_;
    if (!comm_) return {mine};
    Tensor in = Tensor::from_vector<int64_t>(mine, Shape{kDescLen});
    Tensor out = Tensor::empty(Shape{static_cast<int64_t>(size_) * kDescLen}, DType::kInt64);
    comm_->set_progress_marker(static_cast<int64_t>(seq_));  // "I have entered collective #seq_"
    wait_reporting_stalls(comm_->allgather(in, out), mine);
    const std::vector<int64_t> all = out.to_vector<int64_t>();
    std::vector<Desc> ds(static_cast<size_t>(size_));
    for (int q = 0; q < size_; ++q) ds[static_cast<size_t>(q)].assign(all.begin() + q * kDescLen, all.begin() + (q + 1) * kDescLen);
    for (int q = 0; q < size_; ++q)
      if (ds[static_cast<size_t>(q)][fJoined] && !joined_[static_cast<size_t>(q)]) {
        joined_[static_cast<size_t>(q)] = true;
        last_joined_ = q;
      }
    return ds;
  }

  // Waits for the negotiation; every stall_warning seconds without it, names the ranks that have not
  // reached this collective (from their heartbeats' progress markers).
  void wait_reporting_stalls(const Work& w, const Desc& mine) {
    const auto period = std::chrono::duration_cast<std::chrono::milliseconds>(opts_.stall_warning);
    if (period.count() <= 0 || period >= opts_.timeout) {
      w.wait();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    while (!w.wait_for(period)) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const std::vector<int64_t> markers = comm_->peer_markers();
      std::string missing;
      for (size_t q = 0; q < markers.size(); ++q) {
        if (static_cast<int>(q) == rank_ || markers[q] >= static_cast<int64_t>(seq_)) continue;
        missing += (missing.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) +
                   (markers[q] < 0 ? " (no collective yet)" : " (at #" + std::to_string(markers[q]) + ")");
      }
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%.1f", waited);
      DTRAIN_LOG(WARNING) << "hvd stall: rank " << rank_ << " has waited " << secs << " s for collective #" << seq_
                          << ", " << describe(mine) << "; "
                          << (markers.empty() ? std::string("this transport cannot tell which ranks are missing")
                              : missing.empty() ? std::string("every rank has reached it; its data is still moving")
                                                : "not reached by: " + missing)
                          << ". It fails after " << opts_.timeout.count() / 1000 << " s (InitOptions::timeout)";
    }
    w.wait();
  }

  // The descriptions of the ranks that have not joined; throws on every rank when they differ.
  std::vector<int> check(const std::vector<Desc>& ds) {
    std::vector<int> active;
    for (int q = 0; q < size_; ++q)
      if (!ds[static_cast<size_t>(q)][fJoined]) active.push_back(q);
    for (int q : active)
      if (!agree(ds[static_cast<size_t>(q)], ds[static_cast<size_t>(active[0])])) {
        std::string table;
        for (int p = 0; p < size_; ++p) table += "\n  rank " + std::to_string(p) + ": " + describe(ds[static_cast<size_t>(p)]);
        throw FailedPrecondition("hvd: the ranks issued different collectives (collective #" + std::to_string(seq_) +
                                 " of this job); every rank must issue the same collectives, with the same name, "
                                 "dtype, shape and op, in the same order:" + table);
      }
    return active;
  }

  ReduceOp reduce_op(Op op) {
    switch (op) {
      case Op::kMin: return ReduceOp::kMin;
      case Op::kMax: return ReduceOp::kMax;
      default: return ReduceOp::kSum;
    }
  }

  // Runs the collective `d` (agreed by the active ranks) with this rank's host tensor `x`
  // (zeros of the agreed shape when this rank has joined).
  Tensor execute(const Desc& d, Tensor x, const std::vector<int>& active, const std::vector<Desc>& ds, bool joined) {
    const int64_t kind = d[fKind];
    const Op op = static_cast<Op>(d[fOp]);
    const int n_active = static_cast<int>(active.size());
    const bool someone_joined = n_active < size_;
    if (someone_joined && kind != kAllreduce && kind != kAllgather)
      throw FailedPrecondition(std::string("hvd::") + kind_name(kind) + " '" + describe(d) +
                               "' was issued while a rank has joined; only allreduce and allgather run then");
    if (someone_joined && kind == kAllreduce && (op == Op::kMin || op == Op::kMax))
      throw FailedPrecondition("hvd::allreduce with op min/max was issued while a rank has joined (its zeros would count)");
    switch (kind) {
      case kAllreduce: {
        const auto comp = static_cast<Compression>(d[fCompression]);
        const bool cast = comp != Compression::kNone && x.dtype() == DType::kFloat32;
        Tensor wire = cast ? ops::cast(x, comp == Compression::kFP16 ? DType::kFloat16 : DType::kBFloat16) : x.clone();
        if (comm_) comm_->allreduce(wire, reduce_op(op)).wait();
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
            throw InvalidArgument("hvd::allreduce average needs a float tensor, got " + std::string(dtype_name(out.dtype())) +
                                  "; use Op::kSum");
          }
        }
        return out;
      }
      case kAllgather: {
        int64_t most = 0;
        std::vector<int64_t> rows(static_cast<size_t>(size_), 0);
        for (int q : active) rows[static_cast<size_t>(q)] = ds[static_cast<size_t>(q)][fDims];
        for (int64_t r : rows) most = std::max(most, r);
        Tensor padded = zeros_like_desc(d, most);
        if (!joined && x.nbytes() > 0) std::memcpy(padded.raw_data(), x.raw_data(), x.nbytes());
        std::vector<int64_t> dims = padded.shape().dims();
        dims[0] = most * size_;
        Tensor all = Tensor::empty(Shape(dims), padded.dtype());
        if (comm_) comm_->allgather(padded, all).wait();
        else all = padded;
        std::vector<Tensor> parts;
        for (int q = 0; q < size_; ++q)
          parts.push_back(all.slice_rows(q * most, q * most + rows[static_cast<size_t>(q)]));
        return concat_rows(parts, padded.shape());
      }
      case kBroadcast: {
        Tensor t = x.clone();
        if (comm_) comm_->broadcast(t, static_cast<int>(d[fRoot])).wait();
        return t;
      }
      case kAlltoall: {
        const int64_t n = x.shape()[0];
        if (n % size_ != 0)
          throw InvalidArgument("hvd::alltoall '" + describe(d) + "': the first dimension (" + std::to_string(n) +
                                ") must divide into " + std::to_string(size_) + " equal blocks");
        std::vector<int64_t> dims = x.shape().dims();
        dims[0] = n * size_;
        Tensor all = Tensor::empty(Shape(dims), x.dtype());
        if (comm_) comm_->allgather(x, all).wait();
        else all = x.clone();
        const int64_t b = n / size_;
        std::vector<Tensor> parts;
        for (int q = 0; q < size_; ++q) parts.push_back(all.slice_rows(q * n + rank_ * b, q * n + (rank_ + 1) * b));
        return concat_rows(parts, x.shape());
      }
      case kReducescatter: {
        const int64_t n = x.shape()[0];
        if (n % size_ != 0)
          throw InvalidArgument("hvd::reducescatter '" + describe(d) + "': the first dimension (" + std::to_string(n) +
                                ") must divide into " + std::to_string(size_) + " equal blocks");
        std::vector<int64_t> dims = x.shape().dims();
        dims[0] = n / size_;
        Tensor out = Tensor::empty(Shape(dims), x.dtype());
        if (comm_) comm_->reduce_scatter(x, out, reduce_op(op)).wait();
        else out = x.clone();
        if (op == Op::kAverage && size_ > 1) out = kernels_for(out).affine(out, 1.f / static_cast<float>(size_), 0.f);
        return out;
      }
    }
    throw Internal("hvd: unknown collective kind " + std::to_string(kind));
  }

  Tensor run(const Request& r) {
    std::vector<Desc> ds;
    {
      timeline::Span s("hvd negotiate '" + r.name + "'", "collective");
      ds = exchange(descriptor(r, false));
    }
    const std::vector<int> active = check(ds);
    timeline::Span s(std::string("hvd ") + kind_name(r.kind) + " '" + r.name + "'", "collective");
    return execute(ds[static_cast<size_t>(rank_)], r.input, active, ds, false);
  }

  Tensor run_join() {
    Request me;
    me.kind = kJoin;
    for (;;) {
      const std::vector<Desc> ds = exchange(descriptor(me, true));
      const std::vector<int> active = check(ds);
      if (active.empty()) {
        const int last = last_joined_;
        std::fill(joined_.begin(), joined_.end(), false);
        return Tensor::from_vector<int64_t>({last}, Shape{1});
      }
      const Desc& d = ds[static_cast<size_t>(active[0])];
      execute(d, d[fKind] == kAllgather ? zeros_like_desc(d, 0) : zeros_like_desc(d, -1), active, ds, true);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool initialized_ = false, stopping_ = false;
  InitOptions opts_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::unique_ptr<Communicator> comm_;
  std::thread worker_;
  std::deque<Request> queue_;
  std::map<int64_t, int64_t> counters_;
  // Worker-thread state.
  uint64_t seq_ = 0;
  std::vector<bool> joined_;  // per rank, sized by init()
  int last_joined_ = 0;

};

}  // namespace

void init(const InitOptions& options) { Runtime::get().init(options); }
void shutdown() { Runtime::get().shutdown(); }
bool is_initialized() { return Runtime::get().initialized(); }
int rank() { return Runtime::get().rank(); }
int size() { return Runtime::get().size(); }
int local_rank() { return Runtime::get().local_rank(); }
int local_size() { return Runtime::get().local_size(); }
int cross_size() { return std::max(1, size() / std::max(1, local_size())); }
int cross_rank() { return rank() / std::max(1, local_size()); }
size_t fusion_threshold_bytes() { return Runtime::get().fusion(); }

Handle allreduce_async(const Tensor& t, const std::string& name, Op op, Compression c) {
  return Runtime::get().submit(kAllreduce, t, name, op, c, 0);
}
Tensor allreduce(const Tensor& t, const std::string& name, Op op, Compression c) {
  return allreduce_async(t, name, op, c).synchronize();
}
Handle allgather_async(const Tensor& t, const std::string& name) {
  return Runtime::get().submit(kAllgather, t, name, Op::kSum, Compression::kNone, 0);
}
Tensor allgather(const Tensor& t, const std::string& name) { return allgather_async(t, name).synchronize(); }
Handle broadcast_async(const Tensor& t, int root, const std::string& name) {
  return Runtime::get().submit(kBroadcast, t, name, Op::kSum, Compression::kNone, root);
}
Tensor broadcast(const Tensor& t, int root, const std::string& name) { return broadcast_async(t, root, name).synchronize(); }
Handle alltoall_async(const Tensor& t, const std::string& name) {
  return Runtime::get().submit(kAlltoall, t, name, Op::kSum, Compression::kNone, 0);
}
Tensor alltoall(const Tensor& t, const std::string& name) { return alltoall_async(t, name).synchronize(); }
Handle reducescatter_async(const Tensor& t, const std::string& name, Op op) {
  return Runtime::get().submit(kReducescatter, t, name, op, Compression::kNone, 0);
}
Tensor reducescatter(const Tensor& t, const std::string& name, Op op) {
  return reducescatter_async(t, name, op).synchronize();
}

int join() {
  const Tensor last = Runtime::get().submit(kJoin, Tensor(), "join", Op::kSum, Compression::kNone, 0).synchronize();
  return static_cast<int>(last.to_vector<int64_t>()[0]);
}

}  // namespace dtrain::hvd
