// A communicator over every replica of a multi-worker job, made of a local group (the replicas of
// one process) and a cross-worker one (one rank per process): reduce locally, the first local
// replica crosses workers, then broadcast locally. Private to src.
//
// Thread-safety: as Communicator; each local replica calls its own instance, in the same order.
// Only local replica 0 touches the cross-worker communicators during a collective.
#pragma once

#include <chrono>
#include <memory>

#include "dtrain/collectives/communicator.h"

namespace dtrain {

struct CrossWorkerCommunicators {
  std::unique_ptr<Communicator> host;    // TCP ring or MPI between the workers (host tensors)
  std::unique_ptr<Communicator> device;  // NCCL between the workers' first GPUs; null when absent
  int workers = 1;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // one collective's bound
  Compression compression = Compression::kNone;  // float32 all-reduces between the workers
};

// rank = cross rank x local size + local rank; size = workers x local size.
std::unique_ptr<Communicator> make_hierarchical_communicator(
    std::unique_ptr<Communicator> local, std::shared_ptr<CrossWorkerCommunicators> cross,
    int local_size);

}  // namespace dtrain
