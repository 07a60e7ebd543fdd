// In-process collectives among the threads of one process (one rank per device/replica thread).
// Memory is shared, so an allreduce is one pass: rank r reduces slice r of every rank's buffer
// (vectorised, cache-blocked) and writes the result straight into slice r of every buffer —
// bandwidth-optimal (each byte read once and written once per rank), deterministic (each slice is
// summed in a fixed order), and results are bitwise identical on all ranks.
//
// Barriers spin briefly when there are at least as many cores as ranks, then sleep; every wait
// has the group's timeout and fails fast when another rank aborts the group, except a
// collective's closing one: once every rank has started it, the ranks finish their copies into
// one another's buffers, and the abort fails the next collective.
#pragma once

#include <memory>
#include <vector>

#include "dtrain/collectives/communicator.h"
#include "dtrain/core/export.h"

namespace dtrain {

// One Communicator per rank; rank r must only be used by one thread at a time. The group lives
// until every communicator is destroyed.
DTRAIN_API std::vector<std::unique_ptr<Communicator>> make_inproc_group(
    int size, CollectiveOptions options = {});

}  // namespace dtrain
