// dtrain::hvd — Horovod's API on dtrain's collectives. One process per rank, as Horovod runs:
//
//   dtrain::hvd::init();                                   // under dtrain-run, TF_CONFIG, mpirun
//   or srun DeviceSpec dev = has_gpus ? DeviceSpec::cuda(hvd::local_rank()) : DeviceSpec::cpu();
//   auto opt = hvd::DistributedOptimizer(std::make_unique<Adam>(1e-3f * hvd::size()));
//   hvd::BroadcastGlobalVariablesCallback bcast(0);        // everyone starts from rank 0's weights
//   ... fit(OneDeviceStrategy(dev), model, *opt, train.shard(hvd::size(), hvd::rank()), ...)
//
// Transport: the ranks meet like MultiWorkerMirrored's workers: over the TCP ring when the cluster
// lists addresses (dtrain-run, TF_CONFIG, srun), over MPI under mpirun (when dtrain is built with
// OpenMPI). Tensors on a GPU are staged through the host.
//
// Every collective is negotiated first: all ranks exchange what they are about to run (kind, name,
// dtype, shape, op, root). If any of it differs — another name, shape, dtype, op, or another order
// — every rank throws FailedPrecondition with a table of what each rank issued, instead of hanging
// or mixing up tensors. Ranks that called join() take part with zeros until every rank has joined.
//
// Thread-safety: collectives may be issued from any thread; they run in issue order on one
// background thread per process (issue them in the same order on every rank), all-reduces queued
// together fused (InitOptions::cycle_time, fusion_threshold_bytes).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/collectives/communicator.h"
#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"
#include "dtrain/model/gradient_tape.h"
#include "dtrain/nn/optimizers.h"
#include "dtrain/train/callbacks.h"

namespace dtrain::hvd {

enum class Op { kAverage, kSum, kMin, kMax };
// hvd.Compression: none, fp16, bf16 (collectives/communicator.h), shared with MultiWorkerMirrored.
using dtrain::Compression;
using dtrain::compression_name;
using dtrain::parse_compression;

struct DTRAIN_API InitOptions {
  // A collective's own bound (the negotiation and the data transfer each): DeadlineExceeded after
  // it.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  std::string token;  // the job token; default DTRAIN_JOB_TOKEN (dtrain-run sets it)
  // Tensor Fusion, as Horovod's: all-reduces queued within one cycle are negotiated together and
  // reduced in fused buffers of at most fusion_threshold_bytes (consecutive tensors of one dtype,
  // op and compression; a larger tensor goes alone; 0 turns fusion off). DistributedOptimizer packs
  // its gradients the same way. Default 128 MiB, Horovod's since 0.21. Env DTRAIN_FUSION_THRESHOLD
  // (bytes), else HOROVOD_FUSION_THRESHOLD, overrides.
  size_t fusion_threshold_bytes = size_t{128} << 20;
  // Horovod's cycle time: an all-reduce at the head of the queue waits up to this long for more to
  // queue behind it before the run is negotiated. The cycle ends early when the run fills the
  // fusion threshold, another kind of collective is queued, or a thread blocks on a result
  // (Handle::synchronize, or a synchronous call) — so a lone synchronous all-reduce pays no
  // cycle. Default 1 ms, Horovod's since 0.21; 0 turns the wait off. Env DTRAIN_CYCLE_TIME (in
  // milliseconds, e.g. 3.5), else HOROVOD_CYCLE_TIME, overrides.
  std::chrono::microseconds cycle_time{1000};
  // Horovod's stall inspector (HOROVOD_STALL_CHECK_TIME_SECONDS): a rank that has waited this long
  // for the other ranks to start a collective logs a WARNING naming the collective and the ranks
  // that have not reached it (they announce their progress in the TCP heartbeats), again each
  // period, until the collective runs or its timeout fails it. 0 turns it off; env
  // DTRAIN_STALL_CHECK_SECONDS overrides.
  std::chrono::seconds stall_warning{60};
};

// Resolves this process's rank (TF_CONFIG from dtrain-run, SLURM under srun, OpenMPI under mpirun;
// none: a job of one) and connects to the other ranks. A second call does nothing. Throws what the
// resolver or the connection throws (InvalidArgument for a malformed TF_CONFIG, DeadlineExceeded
// naming ranks that never showed up).
DTRAIN_API void init(const InitOptions& options = {});
// Closes the connections; collectives afterwards throw FailedPrecondition. Safe to call twice.
// init() and shutdown() may be called from any thread; concurrent calls run one after the other.
DTRAIN_API void shutdown();
DTRAIN_API bool is_initialized();
// FailedPrecondition before init().
DTRAIN_API int rank();
DTRAIN_API int size();
DTRAIN_API int local_rank();  // among the ranks on this machine
DTRAIN_API int local_size();
// This machine's index among the machines and their number, assuming every machine runs the same
// number of ranks, numbered contiguously (as dtrain-run -H and srun's block distribution do).
DTRAIN_API int cross_rank();
DTRAIN_API int cross_size();
DTRAIN_API size_t fusion_threshold_bytes();
DTRAIN_API std::chrono::microseconds cycle_time();

// What this rank's collectives cost so far: negotiation rounds, data transfers (one per fused
// buffer or unfused collective) and tensors completed. Fusion shows as transfers < tensors.
struct DTRAIN_API CollectiveStats {
  int64_t negotiations = 0, transfers = 0, tensors = 0;
};
DTRAIN_API CollectiveStats collective_stats();

// The pending result of an asynchronous collective (hvd.allreduce_async and friends).
class DTRAIN_API Handle {
 public:
  struct State;
  Handle() = default;
  explicit Handle(std::shared_ptr<State> s) : s_(std::move(s)) {}
  // Whether the result is ready (never blocks).
  bool poll() const;
  // Waits for the result (a new tensor; the input is never changed) and rethrows the
  // collective's error.
  Tensor synchronize() const;

 private:
  std::shared_ptr<State> s_;
};

// Named collectives; `name` identifies the tensor in negotiation errors (default: "<kind>.<n>",
// the n-th such call on this rank). Inputs may live on any device; results come back on it.
DTRAIN_API Handle allreduce_async(const Tensor& tensor, const std::string& name = "",
                                  Op op = Op::kAverage,
                                  Compression compression = Compression::kNone);
DTRAIN_API Tensor allreduce(const Tensor& tensor, const std::string& name = "",
                            Op op = Op::kAverage, Compression compression = Compression::kNone);
// Concatenation along axis 0; the first dimension may differ between ranks, the rest may not.
DTRAIN_API Handle allgather_async(const Tensor& tensor, const std::string& name = "");
DTRAIN_API Tensor allgather(const Tensor& tensor, const std::string& name = "");
DTRAIN_API Handle broadcast_async(const Tensor& tensor, int root_rank,
                                  const std::string& name = "");
DTRAIN_API Tensor broadcast(const Tensor& tensor, int root_rank, const std::string& name = "");
// Rank r's result is the concatenation of block r of every rank's tensor (axis 0 split into size()
// equal blocks; InvalidArgument unless divisible). A pairwise exchange over the TCP mesh
// (MPI_Alltoall under mpirun): each block crosses one link once.
DTRAIN_API Handle alltoall_async(const Tensor& tensor, const std::string& name = "");
DTRAIN_API Tensor alltoall(const Tensor& tensor, const std::string& name = "");
// op over all ranks, then rank r keeps block r of axis 0 (InvalidArgument unless divisible).
DTRAIN_API Handle reducescatter_async(const Tensor& tensor, const std::string& name = "",
                                      Op op = Op::kAverage);
DTRAIN_API Tensor reducescatter(const Tensor& tensor, const std::string& name = "",
                                Op op = Op::kAverage);

// Sets every variable to root_rank's value (hvd.broadcast_variables).
DTRAIN_API void broadcast_variables(const std::vector<std::shared_ptr<Variable>>& variables,
                                    int root_rank);
// root_rank's bytes, on every rank (hvd.broadcast_object for serialised small state).
DTRAIN_API std::string broadcast_object(const std::string& bytes, int root_rank,
                                        const std::string& name = "");
// For a rank that has run out of data: takes part in the other ranks' collectives with zeros
// (all-reduce; Average then divides by the ranks that contributed) until every rank has joined;
// returns the rank that joined last. allgather takes nothing from a joined rank; broadcast,
// alltoall and reducescatter issued while a rank has joined fail on every rank.
DTRAIN_API int join();

// hvd.DistributedOptimizer: returns `optimizer` itself, set to all-reduce its gradients over the
// ranks (the average by default) before it applies them, packed into buffers of at most
// fusion_threshold_bytes, with optional compression. backward_passes_per_step = k: the gradients of
// k apply_gradients() calls are summed locally and one all-reduce of their mean is applied on the
// k-th call (the others apply nothing and leave iterations() alone), as Horovod does. Everything
// else (slots, iteration count, schedule, checkpoints) is the optimizer's own.
DTRAIN_API std::unique_ptr<Optimizer> DistributedOptimizer(
    std::unique_ptr<Optimizer> optimizer, Compression compression = Compression::kNone,
    int backward_passes_per_step = 1, Op op = Op::kAverage);

// hvd.DistributedGradientTape: gradient() returns the gradients all-reduced over the ranks.
class DTRAIN_API DistributedGradientTape {
 public:
  explicit DistributedGradientTape(Compression compression = Compression::kNone,
                                   Op op = Op::kAverage, bool persistent = false);
  std::vector<Tensor> gradient(const Tensor& target,
                               const std::vector<std::shared_ptr<Variable>>& sources);
  GradientTape& tape() { return tape_; }

 private:
  GradientTape tape_;
  Compression compression_;
  Op op_;
};

// All-reduces `grads` (undefined ones skipped) packed into fused buffers; what DistributedOptimizer
// and DistributedGradientTape use.
DTRAIN_API std::vector<Tensor> allreduce_gradients(const std::vector<Tensor>& grads,
                                                   Op op = Op::kAverage,
                                                   Compression compression = Compression::kNone,
                                                   const std::string& name = "gradients");

// hvd.callbacks.BroadcastGlobalVariablesCallback: at train begin, the model's variables and the
// optimizer's slots and iteration count become root_rank's.
class DTRAIN_API BroadcastGlobalVariablesCallback : public Callback {
 public:
  explicit BroadcastGlobalVariablesCallback(int root_rank = 0) : root_(root_rank) {}
  void on_train_begin(const TrainLogs& logs) override;
  bool must_run_on_every_worker() const override { return true; }  // collective

 private:
  int root_;
};

// hvd.callbacks.MetricAverageCallback: at each epoch end, every log value becomes its average
// over the ranks (put it first in the callback list, so the others see the averages).
class DTRAIN_API MetricAverageCallback : public Callback {
 public:
  void on_epoch_end(const TrainLogs& logs) override;
  bool must_run_on_every_worker() const override { return true; }  // collective
};

// hvd.callbacks.LearningRateWarmupCallback: dtrain::LearningRateWarmup over hvd::size() ranks.
class DTRAIN_API LearningRateWarmupCallback : public LearningRateWarmup {
 public:
  explicit LearningRateWarmupCallback(double warmup_epochs = 5, int verbose = 0);
};

}  // namespace dtrain::hvd
