// Built when MPI is not compiled in.
#include "collectives/mpi/mpi_communicator.h"

namespace dtrain {

bool mpi_available() { return false; }

std::unique_ptr<Communicator> make_mpi_communicator(CollectiveOptions) {
  throw Unavailable(
      "this dtrain build has no MPI backend: install libopenmpi-dev and rebuild "
      "(DTRAIN_WITH_MPI=AUTO "
      "or ON), or use the TCP ring (unset DTRAIN_COLLECTIVE)");
}

}  // namespace dtrain
