// The MPI backend: collectives through OpenMPI when the job was launched by mpirun and asked for
// it. Built when MPI is found (DTRAIN_HAVE_MPI); otherwise mpi_available() is false.
#pragma once

#include <memory>

#include "dtrain/collectives/communicator.h"

namespace dtrain {

bool mpi_available();
// MPI_COMM_WORLD as a Communicator (initialises MPI with MPI_THREAD_SERIALIZED if needed).
// Collectives are non-blocking MPI calls polled against the timeout; on a timeout or abort() the
// job is ended with MPI_Abort, since MPI cannot cancel a collective.
std::unique_ptr<Communicator> make_mpi_communicator(CollectiveOptions options);

}  // namespace dtrain
