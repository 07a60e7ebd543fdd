// NCCL among the GPUs of one process (one communicator per GPU, from ncclCommInitAll). Built only
// with NCCL (DTRAIN_HAVE_NCCL); otherwise nccl_available() is false and the factory throws.
#pragma once

#include <memory>
#include <vector>

#include "dtrain/collectives/communicator.h"

namespace dtrain {

bool nccl_available();
// One communicator per device (all GPUs), rank i = devices[i]. Collectives run on a dedicated
// stream per GPU after the device's queued kernels (the device is synchronised first).
std::vector<std::unique_ptr<Communicator>> make_nccl_local_group(
    const std::vector<DeviceSpec>& devices, CollectiveOptions options);
// One rank per process on `device` (a GPU): rank and size are bootstrap's, and rank 0's NCCL unique
// id reaches the others through bootstrap.broadcast (the job's authenticated TCP group). Init is
// non-blocking and bounded by options.timeout. Throws InvalidArgument for a non-GPU device,
// Unavailable when NCCL is not built in or fails, DeadlineExceeded when a peer never joins.
std::unique_ptr<Communicator> make_nccl_process_group(DeviceSpec device, Communicator& bootstrap,
                                                      CollectiveOptions options);

}  // namespace dtrain
