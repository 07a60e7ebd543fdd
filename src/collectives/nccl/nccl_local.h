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
std::vector<std::unique_ptr<Communicator>> make_nccl_local_group(const std::vector<DeviceSpec>& devices,
                                                                 CollectiveOptions options);

}  // namespace dtrain
