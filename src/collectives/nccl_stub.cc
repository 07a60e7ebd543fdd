// Built when NCCL is not compiled in.
#include "collectives/nccl/nccl_local.h"

namespace dtrain {

bool nccl_available() { return false; }

std::vector<std::unique_ptr<Communicator>> make_nccl_local_group(const std::vector<DeviceSpec>&,
                                                                 CollectiveOptions) {
  throw Unavailable(
      "this dtrain build has no NCCL; rebuild with -DDTRAIN_WITH_NCCL=ON (NCCL found) or use "
      "cross_device_ops=reduce_to_one_device");
}

std::unique_ptr<Communicator> make_nccl_process_group(DeviceSpec, Communicator&,
                                                      CollectiveOptions) {
  throw Unavailable(
      "this dtrain build has no NCCL, so workers cannot all-reduce over NCCL; rebuild with "
      "-DDTRAIN_WITH_NCCL=ON (NCCL found) or use the TCP ring (DTRAIN_COLLECTIVE=ring)");
}

}  // namespace dtrain
