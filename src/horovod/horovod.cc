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
#include "dtrain/model/ops.h"
#include "dtrain/nn/layers.h"
#include "dtrain/strategies/strategy.h"
#include "horovod/descriptor.h"
#include "horovod/executor.h"

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

namespace {
void request_flush();  // ends the background thread's fusion cycle now (defined with the Runtime)
}  // namespace

Tensor Handle::synchronize() const {
  if (!s_) throw FailedPrecondition("hvd::Handle::synchronize on an empty handle");
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->done) {
      if (s_->error) std::rethrow_exception(s_->error);
      return s_->result;
    }
  }
  request_flush();  // a caller blocked on a result adds nothing more to this cycle: run it now
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->done; });
  if (s_->error) std::rethrow_exception(s_->error);
  return s_->result;
}

namespace {

using namespace detail;

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

class Runtime {
 public:
  static Runtime& get() {
    static Runtime* r = new Runtime;  // never destroyed: its thread may outlive static destructors
    return *r;
  }

  void init(const InitOptions& o) {
    std::lock_guard<std::mutex> life(life_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    if (initialized_) return;
    opts_ = o;
    apply_environment(opts_);
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
        throw FailedPrecondition(
            "hvd::init() on task " + c->task_name() +
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
          throw FailedPrecondition(
              "hvd::init() under mpirun needs dtrain built with OpenMPI (libopenmpi-dev); "
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
    std::lock_guard<std::mutex> life(life_mu_);
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
  // A field init() sets, read under the lock init() writes it under.
  template <typename T>
  T read(const T& field) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_) throw FailedPrecondition("call dtrain::hvd::init() first");
    return field;
  }
  int rank() { return read(rank_); }
  int size() { return read(size_); }
  int local_rank() { return read(local_rank_); }
  int local_size() { return read(local_size_); }
  size_t fusion() { return read(opts_.fusion_threshold_bytes); }
  std::chrono::microseconds cycle() { return read(opts_.cycle_time); }
  CollectiveStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  Handle submit(int64_t kind, const Tensor& t, std::string name, Op op, Compression comp,
                int root) {
    require();
    if (kind != kJoin) {
      if (!t.defined())
        throw InvalidArgument(std::string("hvd::") + kind_name(kind) + ": the tensor is undefined");
      if (t.shape().rank() > kMaxRank)
        throw InvalidArgument(std::string("hvd::") + kind_name(kind) +
                              ": tensors of rank > 8 are not supported");
      if ((kind == kAllgather || kind == kAlltoall || kind == kReducescatter) &&
          t.shape().rank() == 0)
        throw InvalidArgument(std::string("hvd::") + kind_name(kind) +
                              " needs a tensor of rank >= 1");
      if (const int n = kind == kBroadcast ? size() : 0;
          kind == kBroadcast && (root < 0 || root >= n))
        throw InvalidArgument("hvd::broadcast: root_rank " + std::to_string(root) +
                              " is not in [0, " + std::to_string(n) + ")");
    }
    Request r;
    r.kind = kind;
    r.op = op;
    r.compression = comp;
    r.root = root;
    r.state = std::make_shared<Handle::State>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!initialized_)
        throw FailedPrecondition("hvd: a collective was issued after hvd::shutdown()");
      if (name.empty())
        name = std::string(kind_name(kind)) + "." + std::to_string(counters_[kind]++);
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
  // The background thread. An all-reduce at the head of the queue opens a fusion cycle (Horovod's
  // cycle time): the thread waits up to cycle_time for more all-reduces to queue behind it, until
  // they fill the fusion threshold, something else is queued, or a caller blocks on a result. It
  // then negotiates the whole run at once and reduces it in fused buffers (run_batch).
  void loop() {
    timeline::set_thread_name("hvd collectives");
    for (;;) {
      std::vector<Request> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        if (fusible(queue_.front()) && opts_.cycle_time.count() > 0) {
          const auto deadline = std::chrono::steady_clock::now() + opts_.cycle_time;
          cv_.wait_until(lock, deadline,
                         [&] { return stopping_ || flush_ || !cycle_open_locked(); });
        }
        flush_ = false;
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
        while (fusible(batch.front()) && !queue_.empty() && fusible(queue_.front()) &&
               batch.size() < kMaxBatch) {
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
      }
      if (batch.front().kind == kJoin) {
        complete(batch.front(), [&] { return run_join(); });
        continue;
      }
      run_batch(batch);
    }
  }

  static bool fusible(const Request& r) { return r.kind == kAllreduce; }

  // Whether waiting longer may still add to the cycle's run of all-reduces.
  bool cycle_open_locked() const {
    size_t bytes = 0, n = 0;
    for (const Request& r : queue_) {
      if (!fusible(r)) return false;
      bytes += r.input.nbytes();
      if (++n >= kMaxBatch) return false;
    }
    return bytes < opts_.fusion_threshold_bytes;
  }

 public:
  void flush() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      flush_ = true;
    }
    cv_.notify_all();
  }

 private:
  // Runs `f` for request `r` and completes its handle with the result (moved back to the caller's
  // device) or the error.
  template <typename F>
  void complete(Request& r, F f) {
    Tensor result;
    std::exception_ptr error;
    try {
      result = f();
      if (result.defined() && r.device.type != DeviceType::kCPU) result = result.to(r.device);
    } catch (...) {
      error = std::current_exception();
    }
    finish(r, std::move(result), error);
  }

  void finish(Request& r, Tensor result, std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.tensors;  // counted before the caller can see the result
    }
    {
      std::lock_guard<std::mutex> lock(r.state->mu);
      r.state->result = std::move(result);
      r.state->error = error;
      r.state->done = true;
    }
    r.state->cv.notify_all();
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

  // The second round of a fused cycle: every rank's descriptors of positions 1..m of the run (m
  // agreed in the first round); result[q][j] is rank q's j-th.
  std::vector<std::vector<Desc>> exchange_many(const std::vector<Desc>& mine) {
    ++seq_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.negotiations;
    }
    const size_t m = mine.size();
    if (!comm_) return {mine};
    std::vector<int64_t> flat;
    for (const Desc& d : mine) flat.insert(flat.end(), d.begin(), d.end());
    Tensor in = Tensor::from_vector<int64_t>(flat, Shape{static_cast<int64_t>(flat.size())});
    Tensor out = Tensor::empty(Shape{static_cast<int64_t>(size_ * flat.size())}, DType::kInt64);
    comm_->set_progress_marker(static_cast<int64_t>(seq_));
    wait_reporting_stalls(comm_->allgather(in, out), mine.front());
    const std::vector<int64_t> all = out.to_vector<int64_t>();
    std::vector<std::vector<Desc>> ds(static_cast<size_t>(size_), std::vector<Desc>(m));
    for (size_t q = 0; q < static_cast<size_t>(size_); ++q)
      for (size_t j = 0; j < m; ++j) {
        const auto b = all.begin() + static_cast<std::ptrdiff_t>((q * m + j) * kDescLen);
        ds[q][j].assign(b, b + kDescLen);
      }
    return ds;
  }

  std::vector<Desc> exchange(const Desc& mine) {
    ++seq_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.negotiations;
    }
    if (!comm_) return {mine};
    Tensor in = Tensor::from_vector<int64_t>(mine, Shape{kDescLen});
    Tensor out = Tensor::empty(Shape{static_cast<int64_t>(size_) * kDescLen}, DType::kInt64);
    comm_->set_progress_marker(static_cast<int64_t>(seq_));  // "I have entered collective #seq_"
    wait_reporting_stalls(comm_->allgather(in, out), mine);
    const std::vector<int64_t> all = out.to_vector<int64_t>();
    std::vector<Desc> ds(static_cast<size_t>(size_));
    for (int q = 0; q < size_; ++q)
      ds[static_cast<size_t>(q)].assign(all.begin() + q * kDescLen,
                                        all.begin() + (q + 1) * kDescLen);
    for (int q = 0; q < size_; ++q)
      if (ds[static_cast<size_t>(q)][fJoined] && !joined_[static_cast<size_t>(q)]) {
        joined_[static_cast<size_t>(q)] = true;
        last_joined_ = q;
      }
    return ds;
  }

  // Waits for the negotiation; every stall_warning seconds without it, names the ranks that have
  // not reached this collective (from their heartbeats' progress markers).
  void wait_reporting_stalls(const Work& w, const Desc& mine) {
    const auto period = std::chrono::duration_cast<std::chrono::milliseconds>(opts_.stall_warning);
    if (period.count() <= 0 || period >= opts_.timeout) {
      w.wait();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    while (!w.wait_for(period)) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const std::vector<int64_t> markers = comm_->peer_markers();
      std::string missing;
      for (size_t q = 0; q < markers.size(); ++q) {
        if (static_cast<int>(q) == rank_ || markers[q] >= static_cast<int64_t>(seq_)) continue;
        missing +=
            (missing.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) +
            (markers[q] < 0 ? " (no collective yet)" : " (at #" + std::to_string(markers[q]) + ")");
      }
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%.1f", waited);
      DTRAIN_LOG(WARNING)
          << "hvd stall: rank " << rank_ << " has waited " << secs << " s for collective #" << seq_
          << ", " << describe(mine) << "; "
          << (markers.empty()   ? std::string("this transport cannot tell which ranks are missing")
              : missing.empty() ? std::string("every rank has reached it; its data is still moving")
                                : "not reached by: " + missing)
          << ". It fails after " << opts_.timeout.count() / 1000 << " s (InitOptions::timeout)";
    }
    w.wait();
  }

  // The ranks that have not joined; throws on every rank when their descriptions differ.
  std::vector<int> check(const std::vector<Desc>& ds) const { return active_ranks(ds, seq_); }

  // A fused cycle's second round: checks positions 1..k-1 like the first (the same table on every
  // rank when any differs) and returns the agreed descriptors of the whole run.
  std::vector<Desc> negotiate_rest(const std::vector<Desc>& first_round,
                                   std::vector<Desc> mine_rest, const std::vector<int>& active) {
    const std::vector<std::vector<Desc>> rest = exchange_many(mine_rest);
    std::vector<Desc> agreed{first_round[static_cast<size_t>(active[0])]};
    for (size_t j = 0; j < mine_rest.size(); ++j) {
      std::vector<Desc> at_j(static_cast<size_t>(size_));
      for (int q = 0; q < size_; ++q) {
        at_j[static_cast<size_t>(q)] = rest[static_cast<size_t>(q)][j];
        at_j[static_cast<size_t>(q)][fJoined] = first_round[static_cast<size_t>(q)][fJoined];
      }
      check(at_j);
      agreed.push_back(at_j[static_cast<size_t>(active[0])]);
    }
    return agreed;
  }

  // One cycle: negotiates the run (one round for a lone collective; two for a fused run of k
  // all-reduces, k agreed by every rank), executes it and completes every handle. All-reduces this
  // rank had ready beyond k go back to the head of the queue for the next cycle. A disagreement
  // fails the whole run on every rank.
  void run_batch(std::vector<Request>& batch) {
    Desc mine = descriptor(batch[0], false);
    mine[fCount] = static_cast<int64_t>(batch.size());
    std::vector<Desc> ds;
    try {
      timeline::Span sp(
          "hvd negotiate '" + batch[0].name + "'" +
              (batch.size() > 1 ? " +" + std::to_string(batch.size() - 1) : std::string()),
          "collective");
      ds = exchange(mine);
    } catch (...) {
      const std::exception_ptr e = std::current_exception();
      for (Request& r : batch) finish(r, Tensor(), e);
      return;
    }
    const size_t k = std::min(batch.size(), agreed_count(ds));
    if (k < batch.size()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t j = batch.size(); j-- > k;) queue_.push_front(std::move(batch[j]));
      batch.resize(k);
    }
    std::vector<Tensor> results;
    try {
      const std::vector<int> active = check(ds);
      if (k == 1) {
        timeline::Span sp(
            std::string("hvd ") + kind_name(batch[0].kind) + " '" + batch[0].name + "'",
            "collective");
        results.push_back(
            execute(exec(), ds[static_cast<size_t>(rank_)], batch[0].input, active, ds, false));
      } else {
        std::vector<Desc> rest;
        for (size_t j = 1; j < k; ++j) rest.push_back(descriptor(batch[j], false));
        const std::vector<Desc> agreed = negotiate_rest(ds, std::move(rest), active);
        std::vector<Tensor> inputs;
        for (const Request& r : batch) inputs.push_back(r.input);
        results = execute_fused(exec(), agreed, inputs, active, false);
      }
    } catch (...) {
      const std::exception_ptr e = std::current_exception();
      for (Request& r : batch) finish(r, Tensor(), e);
      return;
    }
    for (size_t j = 0; j < k; ++j) complete(batch[j], [&] { return results[j]; });
  }

  ExecContext exec() {
    ExecContext c;
    c.comm = comm_.get();
    c.size = size_;
    c.fusion_threshold = opts_.fusion_threshold_bytes;
    c.count_transfer = [this] {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.transfers;
    };
    return c;
  }

  Tensor run_join() {
    Request me;
    me.kind = kJoin;
    for (;;) {
      Desc mine = descriptor(me, true);
      mine[fCount] = static_cast<int64_t>(kMaxBatch);  // a joined rank never limits a cycle
      const std::vector<Desc> ds = exchange(mine);
      const std::vector<int> active = check(ds);
      if (active.empty()) {
        const int last = last_joined_;
        std::fill(joined_.begin(), joined_.end(), false);
        return Tensor::from_vector<int64_t>({last}, Shape{1});
      }
      const Desc& d = ds[static_cast<size_t>(active[0])];
      const size_t k = agreed_count(ds);
      if (k == 1) {
        execute(exec(), d, d[fKind] == kAllgather ? zeros_like_desc(d, 0) : zeros_like_desc(d, -1),
                active, ds, true);
        continue;
      }
      // A fused run of k all-reduces: take part with zeros of each agreed shape.
      const std::vector<Desc> agreed = negotiate_rest(ds, std::vector<Desc>(k - 1, mine), active);
      std::vector<Tensor> zeros;
      for (const Desc& a : agreed) zeros.push_back(zeros_like_desc(a, -1));
      execute_fused(exec(), agreed, zeros, active, true);
    }
  }

  // init() and shutdown() whole, one at a time: a shutdown joins the background thread and frees
  // the group outside mu_, and an init() between would have started a second thread on the same
  // state (and had its group freed).
  std::mutex life_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool initialized_ = false, stopping_ = false;
  InitOptions opts_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::unique_ptr<Communicator> comm_;
  std::thread worker_;
  std::deque<Request> queue_;
  bool flush_ = false;  // a caller blocks on a result: end the fusion cycle now
  CollectiveStats stats_;
  std::map<int64_t, int64_t> counters_;
  // Worker-thread state.
  uint64_t seq_ = 0;
  std::vector<bool> joined_;  // per rank, sized by init()
  int last_joined_ = 0;
};

void request_flush() { Runtime::get().flush(); }

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
std::chrono::microseconds cycle_time() { return Runtime::get().cycle(); }
CollectiveStats collective_stats() { return Runtime::get().stats(); }

Handle allreduce_async(const Tensor& t, const std::string& name, Op op, Compression c) {
  return Runtime::get().submit(kAllreduce, t, name, op, c, 0);
}
Tensor allreduce(const Tensor& t, const std::string& name, Op op, Compression c) {
  return allreduce_async(t, name, op, c).synchronize();
}
Handle allgather_async(const Tensor& t, const std::string& name) {
  return Runtime::get().submit(kAllgather, t, name, Op::kSum, Compression::kNone, 0);
}
Tensor allgather(const Tensor& t, const std::string& name) {
  return allgather_async(t, name).synchronize();
}
Handle broadcast_async(const Tensor& t, int root, const std::string& name) {
  return Runtime::get().submit(kBroadcast, t, name, Op::kSum, Compression::kNone, root);
}
Tensor broadcast(const Tensor& t, int root, const std::string& name) {
  return broadcast_async(t, root, name).synchronize();
}
Handle alltoall_async(const Tensor& t, const std::string& name) {
  return Runtime::get().submit(kAlltoall, t, name, Op::kSum, Compression::kNone, 0);
}
Tensor alltoall(const Tensor& t, const std::string& name) {
  return alltoall_async(t, name).synchronize();
}
Handle reducescatter_async(const Tensor& t, const std::string& name, Op op) {
  return Runtime::get().submit(kReducescatter, t, name, op, Compression::kNone, 0);
}
Tensor reducescatter(const Tensor& t, const std::string& name, Op op) {
  return reducescatter_async(t, name, op).synchronize();
}

int join() {
  const Tensor last =
      Runtime::get().submit(kJoin, Tensor(), "join", Op::kSum, Compression::kNone, 0).synchronize();
  return static_cast<int>(last.to_vector<int64_t>()[0]);
}

}  // namespace dtrain::hvd
