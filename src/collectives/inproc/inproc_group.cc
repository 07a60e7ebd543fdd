#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/reduction.h"
#include "collectives/sync_collectives.h"
#include "dtrain/collectives/inproc.h"

namespace dtrain {
namespace {

enum class Op : int {
  kAllreduce = 1,
  kAllgather,
  kBroadcast,
  kReduce,
  kReduceScatter,
  kBarrier,
  kReduceScatterConcat
};
const char* op_name(Op op) {
  switch (op) {
    case Op::kAllreduce:
      return "allreduce";
    case Op::kAllgather:
      return "allgather";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kReduce:
      return "reduce";
    case Op::kReduceScatter:
      return "reduce_scatter";
    case Op::kBarrier:
      return "barrier";
    case Op::kReduceScatterConcat:
      return "reduce_scatter_concat";
  }
  return "?";
}

// What each rank posts before the first barrier of a collective.
struct Slot {
  uint64_t seq = 0;
  Op op = Op::kBarrier;
  DType dtype = DType::kFloat32;
  int64_t count = 0;
  int reduce = 0;
  int root = 0;
  const void* in = nullptr;
  void* out = nullptr;
};

constexpr size_t kBlockBytes = 64 * 1024;  // cache block for the reduce-then-scatter pass

class Group {
 public:
  Group(int size, CollectiveOptions opts)
      : size_(size),
        opts_(opts),
        slots_(static_cast<size_t>(size)),
        arrived_(static_cast<size_t>(size)) {
    spin_ = static_cast<unsigned>(size) <= std::max(1u, std::thread::hardware_concurrency());
    for (auto& a : arrived_) a.store(0);
  }

  int size() const { return size_; }
  Slot& slot(int r) { return slots_[static_cast<size_t>(r)]; }

  // Generation barrier: spins (when cores allow), then sleeps; honours the timeout, and an abort
  // unless `closing` (a collective's closing barrier: every rank has passed its opening one and
  // will arrive once its body's memory copies are done; leaving on an abort before then would let
  // the caller free or reuse buffers that slower ranks still read and write).
  // The generation and the count of ranks arrived at it are one atomic word, so arriving and
  // leaving without the others (abort, timeout) exclude each other without a lock: a rank that
  // leaves takes its arrival back unless the barrier completed first, and a rank arriving later
  // cannot complete it alone (it would run the collective on the buffers of a rank that had left,
  // then wait in the closing barrier). A lock there made the fastest of ten 4 KB all-reduce runs
  // of 2 ranks 1.1 us instead of 0.7 (`dtrain-bench allreduce --sizes 4K --iters 20000`).
  void barrier(int rank, const char* what, bool closing = false) {
    if (!closing && aborted_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      throw Unavailable(abort_reason_);
    }
    uint64_t s = state_.load(std::memory_order_acquire);
    uint32_t g;
    for (;;) {
      g = generation(s);
      const uint32_t arrived = static_cast<uint32_t>(s) + 1;
      const bool last = arrived == static_cast<uint32_t>(size_);
      arrived_[static_cast<size_t>(rank)].store(g + 1u, std::memory_order_relaxed);
      const uint64_t next = last ? word(g + 1u, 0) : word(g, arrived);
      if (!state_.compare_exchange_weak(s, next, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      if (last) {
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
        return;
      }
      break;
    }
    const auto passed = [&] { return generation(state_.load(std::memory_order_acquire)) != g; };
    if (spin_) {
      // ~50 us of spinning (pause is ~140 cycles on recent cores), then sleep: a longer spin
      // steals the core from the input pipeline and makes the late rank later still.
      for (int i = 0; i < 1000; ++i) {
        if (passed()) return;
        _mm_pause();
      }
    } else {
      // More ranks than cores: hand the core to a rank that still has to arrive.
      for (int i = 0; i < 2000; ++i) {
        if (passed()) return;
        std::this_thread::yield();
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    const bool done = cv_.wait_for(lock, opts_.timeout,
                                   [&] { return passed() || (!closing && aborted_.load()); });
    if (passed()) return;
    if (closing) {
      // Timed out waiting for a rank still in the body: this rank's arrival stays, so that rank
      // completes the barrier when it comes and fails with this failure rather than waiting a
      // timeout of its own for a rank that had arrived.
      const std::string msg = std::string(what) + " (its closing barrier) on rank " +
                              std::to_string(rank) + ": " + missing_ranks(g, rank) +
                              " did not finish within " + std::to_string(opts_.timeout.count()) +
                              " ms";
      if (!failed_.exchange(true)) failure_ = msg;
      abort_locked(msg);
      throw DeadlineExceeded(msg);
    }
    // Leaving without the others: take this rank's arrival back, unless the barrier completed.
    s = state_.load(std::memory_order_acquire);
    for (;;) {
      if (generation(s) != g) return;
      if (state_.compare_exchange_weak(s, s - 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        break;
    }
    arrived_[static_cast<size_t>(rank)].store(g, std::memory_order_relaxed);
    if (done) throw Unavailable(abort_reason_);  // woken by an abort
    const std::string msg = std::string(what) + " on rank " + std::to_string(rank) + ": " +
                            missing_ranks(g, rank) + " did not arrive within " +
                            std::to_string(opts_.timeout.count()) +
                            " ms; every replica must issue the same collectives in the same order";
    abort_locked(msg);
    throw DeadlineExceeded(msg);
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    abort_locked(reason);
  }

  // A collective's body failed on some rank: recorded before the collective's closing barrier and
  // read by every rank after it.
  void note_failure(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.exchange(true)) failure_ = reason;
  }
  bool failed() const { return failed_.load(); }
  std::string failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

 private:
  void abort_locked(const std::string& reason) {
    if (!aborted_.exchange(true)) abort_reason_ = "collective group aborted: " + reason;
    cv_.notify_all();
  }

  const int size_;
  const CollectiveOptions opts_;
  bool spin_;
  std::vector<Slot> slots_;
  // "rank(s) 1, 3": those other than `rank` not arrived at generation g.
  std::string missing_ranks(uint32_t g, int rank) const {
    std::string missing;
    for (int r = 0; r < size_; ++r)
      if (r != rank && arrived_[static_cast<size_t>(r)].load() != g + 1u)
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    return "rank(s) " + missing;
  }
  static uint32_t generation(uint64_t state) { return static_cast<uint32_t>(state >> 32); }
  static uint64_t word(uint32_t generation, uint32_t arrived) {
    return uint64_t{generation} << 32 | arrived;
  }
  std::vector<std::atomic<uint32_t>> arrived_;  // per rank: the generation it last arrived for + 1
  std::atomic<uint64_t> state_{0};  // the barrier's generation << 32 | ranks arrived at it
  std::atomic<bool> aborted_{false};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::string abort_reason_, failure_;
};

class InprocCommunicator final : public SyncCollectives {
 public:
  InprocCommunicator(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }

  void allreduce(Tensor& t, ReduceOp op) override {
    require_host(t, "allreduce");
    post(Op::kAllreduce, t.dtype(), t.numel(), static_cast<int>(op), 0, t.raw_data(), t.raw_data());
    run("allreduce", [&] {
      const int n = size();
      const size_t esize = dtype_size(t.dtype());
      const int64_t count = t.numel();
      const int64_t begin = count * rank_ / n, end = count * (rank_ + 1) / n;
      const int64_t block = std::max<int64_t>(1, static_cast<int64_t>(kBlockBytes / esize));
      char* own = static_cast<char*>(t.raw_data());
      // Every slice is reduced in rank order, whichever rank reduces it, so the result is bitwise
      // that of reduce_scatter and of any other rank-ordered reduction. Ranks 0 and 1 can start
      // from their own values (x1 + x0 == x0 + x1); a later rank sums into a block-sized scratch
      // first.
      static thread_local std::vector<char> scratch;
      if (rank_ >= 2) scratch.resize(static_cast<size_t>(block) * esize);
      for (int64_t b = begin; b < end; b += block) {
        const size_t m = static_cast<size_t>(std::min(block, end - b));
        char* mine = own + static_cast<size_t>(b) * esize;
        auto in = [&](int r) {
          return static_cast<const char*>(g_->slot(r).in) + static_cast<size_t>(b) * esize;
        };
        if (rank_ < 2) {
          for (int r = 0; r < n; ++r)
            if (r != rank_) collectives::reduce_into(mine, in(r), m, t.dtype(), op);
        } else {
          collectives::reduce_pair(scratch.data(), in(0), in(1), m, t.dtype(), op);
          for (int r = 2; r < n; ++r)
            collectives::reduce_into(scratch.data(), in(r), m, t.dtype(), op);
          std::memcpy(mine, scratch.data(), m * esize);
        }
        if (op == ReduceOp::kMean) collectives::scale_for_mean(mine, m, t.dtype(), n);
        for (int r = 0; r < n; ++r)
          if (r != rank_)
            std::memcpy(static_cast<char*>(g_->slot(r).out) + static_cast<size_t>(b) * esize, mine,
                        m * esize);
      }
    });
  }

  void allgather(const Tensor& in, Tensor& out) override {
    require_host(in, "allgather");
    require_host(out, "allgather");
    if (out.numel() != in.numel() * size() || out.dtype() != in.dtype())
      throw InvalidArgument("allgather: output must hold size * input.numel() = " +
                            std::to_string(in.numel() * size()) +
                            " elements of the input's dtype, got " + out.to_string());
    post(Op::kAllgather, in.dtype(), in.numel(), 0, 0, in.raw_data(), out.raw_data());
    run("allgather", [&] {
      const size_t bytes = in.nbytes();
      for (int r = 0; r < size(); ++r)
        std::memcpy(static_cast<char*>(out.raw_data()) + static_cast<size_t>(r) * bytes,
                    g_->slot(r).in, bytes);
    });
  }

  void broadcast(Tensor& t, int root) override {
    require_host(t, "broadcast");
    if (root < 0 || root >= size())
      throw InvalidArgument("broadcast: root " + std::to_string(root) + " out of range");
    post(Op::kBroadcast, t.dtype(), t.numel(), 0, root, t.raw_data(), t.raw_data());
    run("broadcast", [&] {
      if (rank_ != root) std::memcpy(t.raw_data(), g_->slot(root).in, t.nbytes());
    });
  }

  void reduce(Tensor& t, int root, ReduceOp op) override {
    require_host(t, "reduce");
    if (root < 0 || root >= size())
      throw InvalidArgument("reduce: root " + std::to_string(root) + " out of range");
    post(Op::kReduce, t.dtype(), t.numel(), static_cast<int>(op), root, t.raw_data(), t.raw_data());
    run("reduce", [&] {
      // Each rank reduces its slice of every rank's buffer into root's buffer: the work is spread
      // over all ranks, and only root's memory is written.
      const int n = size();
      const size_t esize = dtype_size(t.dtype());
      const int64_t begin = t.numel() * rank_ / n, end = t.numel() * (rank_ + 1) / n;
      char* dst = static_cast<char*>(g_->slot(root).out) + static_cast<size_t>(begin) * esize;
      for (int r = 0; r < n; ++r)
        if (r != root)
          collectives::reduce_into(
              dst, static_cast<const char*>(g_->slot(r).in) + static_cast<size_t>(begin) * esize,
              static_cast<size_t>(end - begin), t.dtype(), op);
      if (op == ReduceOp::kMean)
        collectives::scale_for_mean(dst, static_cast<size_t>(end - begin), t.dtype(), n);
    });
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    require_host(in, "reduce_scatter");
    const int n = size();
    if (in.numel() % n != 0 || out.numel() != in.numel() / n || out.dtype() != in.dtype())
      throw InvalidArgument("reduce_scatter: input of " + std::to_string(in.numel()) +
                            " elements must split evenly into " + std::to_string(n) +
                            " outputs of the same dtype, got " + out.to_string());
    post(Op::kReduceScatter, in.dtype(), in.numel(), static_cast<int>(op), 0, in.raw_data(),
         out.raw_data());
    run("reduce_scatter", [&] {
      const size_t m = static_cast<size_t>(out.numel()),
                   off = m * static_cast<size_t>(rank_) * dtype_size(in.dtype());
      collectives::reduce_pair(out.raw_data(), static_cast<const char*>(g_->slot(0).in) + off,
                               static_cast<const char*>(g_->slot(n > 1 ? 1 : 0).in) + off,
                               n > 1 ? m : 0, in.dtype(), op);
      if (n == 1)
        std::memcpy(out.raw_data(), static_cast<const char*>(g_->slot(0).in) + off, out.nbytes());
      for (int r = 2; r < n; ++r)
        collectives::reduce_into(out.raw_data(), static_cast<const char*>(g_->slot(r).in) + off, m,
                                 in.dtype(), op);
      if (op == ReduceOp::kMean) collectives::scale_for_mean(out.raw_data(), m, in.dtype(), n);
    });
  }

  // As reduce_scatter over the inputs end to end, read where they lie: the block of this rank is
  // summed piece by piece straight from every rank's tensors, in rank order as reduce_scatter does
  // (so bitwise the same result), and the zero padding past the inputs is written as zeros.
  void reduce_scatter_concat(const std::vector<Tensor>& inputs, Tensor& out, ReduceOp op) override {
    const int n = size();
    const int64_t total = check_reduce_scatter_concat(inputs, out, n);
    require_host(out, "reduce_scatter_concat");
    for (const Tensor& t : inputs) require_host(t, "reduce_scatter_concat");
    post(Op::kReduceScatterConcat, out.dtype(), out.numel() * n, static_cast<int>(op), 0, &inputs,
         out.raw_data());
    run("reduce_scatter_concat", [&] {
      auto list = [&](int r) -> const std::vector<Tensor>& {
        return *static_cast<const std::vector<Tensor>*>(g_->slot(r).in);
      };
      for (int r = 0; r < n;
           ++r) {  // every rank checks every layout against rank 0's: all refuse alike
        const std::vector<Tensor>& o = list(r);
        bool same = o.size() == list(0).size();
        for (size_t i = 0; same && i < o.size(); ++i) same = o[i].numel() == list(0)[i].numel();
        if (!same)
          throw InvalidArgument("reduce_scatter_concat: rank " + std::to_string(r) + " passed " +
                                std::to_string(o.size()) + " inputs of other sizes than rank 0's " +
                                std::to_string(list(0).size()) +
                                "; every rank must pass tensors of the same sizes");
      }
      const size_t esize = dtype_size(out.dtype());
      const int64_t m = out.numel(), begin = m * rank_, end = begin + m;
      char* dst = static_cast<char*>(out.raw_data());
      int64_t start = 0;  // of input i in the concatenation
      const std::vector<Tensor>& mine = list(rank_);
      for (size_t i = 0; i < mine.size() && start < end; start += mine[i].numel(), ++i) {
        const int64_t lo = std::max(begin, start), hi = std::min(end, start + mine[i].numel());
        if (lo >= hi) continue;
        const size_t count = static_cast<size_t>(hi - lo),
                     skip = static_cast<size_t>(lo - start) * esize;
        auto in = [&](int r) { return static_cast<const char*>(list(r)[i].raw_data()) + skip; };
        char* d = dst + static_cast<size_t>(lo - begin) * esize;
        if (n == 1)
          std::memcpy(d, in(0), count * esize);
        else
          collectives::reduce_pair(d, in(0), in(1), count, out.dtype(), op);
        for (int r = 2; r < n; ++r) collectives::reduce_into(d, in(r), count, out.dtype(), op);
        if (op == ReduceOp::kMean) collectives::scale_for_mean(d, count, out.dtype(), n);
      }
      const int64_t pad_from = std::max(begin, std::min(end, total));
      std::memset(dst + static_cast<size_t>(pad_from - begin) * esize, 0,
                  static_cast<size_t>(end - pad_from) * esize);
    });
  }

  void barrier() override {
    post(Op::kBarrier, DType::kFloat32, 0, 0, 0, nullptr, nullptr);
    // As every collective: matched against the others' slots, and a closing barrier (a rank
    // returning after the opening one alone could post its next collective into the slot that
    // another rank, in a collective, is still comparing).
    run("barrier", [] {});
  }

  void abort(const std::string& reason) override { g_->abort(reason); }

 private:
  static void require_host(const Tensor& t, const char* op) {
    if (!t.device().host_accessible())
      throw InvalidArgument(std::string(op) +
                            ": the in-process transport works on host memory, got " +
                            t.to_string() + "; use the NCCL backend for GPU tensors");
  }

  void post(Op op, DType dtype, int64_t count, int reduce, int root, const void* in, void* out) {
    Slot& s = g_->slot(rank_);
    s = Slot{++seq_, op, dtype, count, reduce, root, in, out};
  }

  // Barrier, fingerprint check against every rank, body, barrier (so buffers stay valid until all
  // ranks are done with them; an abort meanwhile fails the next collective, not this one's closing
  // barrier). A body that fails on any rank still reaches the closing barrier (a rank that left at
  // once would free its buffers while a slower one still read them: the segfault of
  // reduce_scatter_concat's refusal); after it every rank aborts the group and fails, the failing
  // ranks with their own error, the others with the first failure's.
  template <typename F>
  void run(const char* what, F&& body) {
    g_->barrier(rank_, what);
    std::exception_ptr error;
    // Every rank compares every slot, so a mismatch is found on all of them; it fails like a body
    // (through the closing barrier): a rank that left at once could post its next collective into
    // its slot while the others still compare it.
    const std::string mismatch = check_slots();
    if (!mismatch.empty()) {
      error = std::make_exception_ptr(InvalidArgument(mismatch));
      g_->note_failure(mismatch);
    } else {
      try {
        body();
      } catch (const std::exception& e) {
        error = std::current_exception();
        g_->note_failure(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                         e.what());
      }
    }
    g_->barrier(rank_, what, /*closing=*/true);
    if (g_->failed()) {
      g_->abort(g_->failure());
      if (error) std::rethrow_exception(error);
      throw Unavailable("collective group aborted: " + g_->failure());
    }
  }

  // "" when every rank posted the same collective as this one; else what differs.
  std::string check_slots() const {
    const Slot& me = g_->slot(rank_);
    for (int r = 0; r < size(); ++r) {
      const Slot& o = g_->slot(r);
      if (o.seq != me.seq || o.op != me.op || o.dtype != me.dtype || o.count != me.count ||
          o.reduce != me.reduce || o.root != me.root)
        return detail::str_cat(
            "collective mismatch: rank ", rank_, " issued #", me.seq, " ", op_name(me.op), "(",
            dtype_name(me.dtype), " x", me.count, ", ",
            reduce_op_name(static_cast<ReduceOp>(me.reduce)), ") but rank ", r, " issued #", o.seq,
            " ", op_name(o.op), "(", dtype_name(o.dtype), " x", o.count, ", ",
            reduce_op_name(static_cast<ReduceOp>(o.reduce)),
            "); every replica must run the same collectives on tensors of the same shape, in the "
            "same order");
    }
    return "";
  }

  std::shared_ptr<Group> g_;
  int rank_;
  uint64_t seq_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_inproc_group(int size, CollectiveOptions options) {
  if (size < 1)
    throw InvalidArgument("an in-process group needs at least one rank, got " +
                          std::to_string(size));
  auto g = std::make_shared<Group>(size, options);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r)
    out.push_back(
        make_async_communicator(std::make_unique<InprocCommunicator>(g, r), options.timeout));
  return out;
}

}  // namespace dtrain
