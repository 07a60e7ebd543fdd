// Elastic training (Horovod elastic, torchrun's rendezvous) for MultiWorkerMirroredStrategy: the
// job keeps going when workers leave or join.
//
//   dtrain-run --min-np 2 --max-np 4 -np 3 [--host-discovery-script S] -- ./train ...
//
// dtrain-run hosts a rendezvous (RendezvousServer) and starts each worker with DTRAIN_ELASTIC_*
// variables. A worker program:
//
//   dtrain::elastic::Job job;                                  // from those variables
//   dtrain::ClusterResolution cluster = job.join();            // first: token() belongs to the
//   round dtrain::MultiWorkerMirroredStrategy strategy(local, comm, cluster, job.token());
//   ... build the model and optimizer in strategy.scope() ...
//   dtrain::elastic::run(job, strategy, model, optimizer, [&](dtrain::Callback& elastic) {
//     options.callbacks.push_back(&elastic);
//     dtrain::fit(strategy, model, optimizer, train, test, options);
//   });
//
// What happens (Horovod's elastic.run with a KerasState and its commit callbacks):
//   - every `commit_every` batches and at each epoch's end, every worker commits: it keeps a
//     snapshot of the variables, the optimizer's state and the data position in memory, then asks
//     the rendezvous whether the membership is about to change (a worker waits to join, or one
//     left); all workers agree on the answer (a sum over the workers), and if so leave the step
//     together. Unsharded jobs keep the whole snapshot on every worker (any one survivor can
//     restore it); under MirroredOptions::sharding (ZeRO-1/2/3) each worker keeps 2/N of it (its
//     own piece of every entry and the next worker's), so any one worker may leave at a time; two
//     neighbours that leave together lose a piece, and the restore throws DataLoss saying so;
//   - when a collective fails (a worker died, hung or lost its link: Unavailable or
//     DeadlineExceeded), the survivors close their connections and go to the rendezvous;
//   - the rendezvous closes a round when every live worker has arrived (or after the settle time,
//     leaving out one that does not come), with at least --min-np and at most --max-np workers,
//     survivors first in their old order;
//   - the strategy reconnects to the new membership (MultiWorkerMirroredStrategy::reconnect); the
//     workers rebuild the newest commit they hold between them, one entry at a time (an
//     all-gather of its pieces, checked against a hash taken at commit), every worker (new ones
//     too) restores it, sharded slots and parameters re-cut for the new worker count, and fit()
//     resumes at the committed batch, as BackupAndRestore would.
// The global batch stays what the dataset says: each replica's share changes with the number of
// workers (96 rows: 32 each on 3 workers, 48 on 2), so the learning rate needs no change and the
// job computes the same steps as one that never lost a worker (up to summation order). A program
// that wants Horovod's convention instead (a fixed batch per worker, the rate scaled by the size)
// sets it in `on_reset`.
//
// Thread-safety: one Job per process, used from the training thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"
#include "dtrain/core/export.h"

namespace dtrain {

class Callback;
class MultiWorkerMirroredStrategy;
class Optimizer;
class Model;

namespace elastic {

// Thrown out of fit() by the commit after which the membership changes, on every worker at the same
// commit. elastic::run catches it.
class DTRAIN_API HostsUpdated : public Error {
 public:
  explicit HostsUpdated(const std::string& msg) : Error("HostsUpdated: " + msg) {}
};

// One round of the rendezvous: the workers that train together until the next change.
struct DTRAIN_API Membership {
  int generation = 0;                  // 1 for the first round, then +1 per change
  int rank = 0;                        // this worker's rank in it
  std::vector<std::string> addresses;  // every worker's "host:port", in rank order
  std::vector<int> ids;                // their launcher ids (DTRAIN_ELASTIC_ID), in rank order
};

// This worker's side of the rendezvous, from the variables dtrain-run sets:
//   DTRAIN_ELASTIC_RENDEZVOUS  host:port of the rendezvous
//   DTRAIN_ELASTIC_ID          this worker's launcher id (0..kMaxWorkers-1, never reused in a job)
//   DTRAIN_ELASTIC_ADDRESS     host:port this worker listens on for the other workers
//   DTRAIN_JOB_TOKEN           the job token
//   DTRAIN_ELASTIC_TIMEOUT     seconds a round may take to form (default 300)
class DTRAIN_API Job {
 public:
  static constexpr int kMaxWorkers = 64;  // workers started over a job's life
  // Whether DTRAIN_ELASTIC_RENDEZVOUS is set (the process was started by an elastic dtrain-run).
  static bool in_elastic_job();
  // Connects to the rendezvous. Throws InvalidArgument naming the missing or malformed variable
  // (and that `dtrain-run --min-np N --max-np M` sets them), DeadlineExceeded / PermissionDenied
  // when the rendezvous cannot be reached or refuses the token.
  Job();
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Waits for the next round and returns this worker's place in it as a ClusterResolution (task
  // `worker:<rank>`, every member's address). Throws DeadlineExceeded when no round with --min-np
  // workers forms within the timeout (the message says how many came), Unavailable when the
  // rendezvous is gone (the launcher ended the job), FailedPrecondition when every worker that held
  // the job's state has gone (a round of newcomers only would silently start over).
  ClusterResolution join();
  const Membership& membership() const { return membership_; }
  // The token this round's connections authenticate with (the job token bound to the generation, so
  // that a straggler of an old round cannot connect into a new one). Throws FailedPrecondition
  // before the first join().
  std::string token() const;
  // Asks the rendezvous whether the membership is about to change. Throws Unavailable when it is
  // gone.
  bool membership_changing();
  int id() const { return id_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Membership membership_;
  int id_ = -1;
};

struct DTRAIN_API RunOptions {
  int64_t commit_every = 10;  // batches between commits (every epoch's end commits too)
  // Called after every change of membership on every worker of the new round (survivors and
  // newcomers), once the committed state is restored and before training resumes (rank, size,
  // ...). What it throws ends the run, except Unavailable and DeadlineExceeded (a worker lost
  // during a collective it runs), which make another round. The commit holds the learning rate in
  // effect (when it is a constant, as LearningRateScheduler sets it), so a rate set here is the one
  // training resumes with (until a LearningRateScheduler sets its own at the next epoch's start,
  // the resumed one included).
  std::function<void(const Membership&)> on_reset;
  int max_resets = 100;  // more changes than this fail the job (a crash loop)
};

struct DTRAIN_API RunReport {
  int resets = 0;           // membership changes survived
  int generation = 0;       // of the round that finished training
  int workers = 0;          // in that round
  int64_t rolled_back = 0;  // batches computed again after failures (summed over resets)
};

// Runs `train` (which calls fit() with the callback it is given) until it returns, surviving
// changes of membership as described above. Rethrows anything else `train` throws, and the
// rendezvous' errors. `model` and `optimizer` are what is committed and broadcast. Throws
// FailedPrecondition before any collective when the strategy broadcasts initial values
// (CommunicationOptions::broadcast_initial_values must be false) or the model is not built.
DTRAIN_API RunReport run(Job& job, MultiWorkerMirroredStrategy& strategy, Model& model,
                         Optimizer& optimizer, const std::function<void(Callback& elastic)>& train,
                         const RunOptions& options = {});

// The rendezvous, hosted by dtrain-run. Workers are known by their launcher id; the launcher tells
// it which it has started (expect) and which have exited (lost). A round closes when at least
// min_np workers wait and either every started worker waits or `settle` has passed since the first
// arrived; at most max_np are taken, survivors of the last round first.
struct DTRAIN_API RendezvousOptions {
  std::string address;  // host:port to listen on
  std::string token;    // the job token (>= 16 bytes)
  int min_np = 1, max_np = 1;
  std::chrono::milliseconds settle{std::chrono::seconds(10)};
};

class DTRAIN_API RendezvousServer {
 public:
  // Throws Unavailable when the address cannot be bound, InvalidArgument for bad options.
  explicit RendezvousServer(RendezvousOptions options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;
  void expect(int id);  // the launcher started worker `id`
  void lost(int id);    // worker `id` exited
  int generation() const;
  // The last round's size, 0 before the first; its workers' ids in rank order.
  int workers() const;
  std::vector<int> members() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace elastic
}  // namespace dtrain
