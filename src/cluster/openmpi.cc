// OpenMPI: the process mpirun started. mpirun exports ranks and local placement but no addresses,
// so the rendezvous address comes from the caller and peers exchange theirs at the rendezvous.
#include "cluster/cluster_util.h"
#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain {

ClusterResolution resolve_openmpi(const std::string& rendezvous_address) {
  const std::string under_mpirun =
      "start the processes with mpirun (e.g. mpirun -np 4 ./train), or set TF_CONFIG instead";
  const auto rank = cluster_detail::env_int("OMPI_COMM_WORLD_RANK", 0, 1 << 24, under_mpirun);
  const auto size = cluster_detail::env_int("OMPI_COMM_WORLD_SIZE", 1, 1 << 24, under_mpirun);
  if (!rank || !size)
    throw FailedPrecondition(
        std::string("OpenMPI: ") + (!rank ? "OMPI_COMM_WORLD_RANK" : "OMPI_COMM_WORLD_SIZE") +
        " is unset, so this process was not started by OpenMPI's mpirun; " + under_mpirun);
  if (*rank >= *size)
    throw InvalidArgument("OpenMPI: OMPI_COMM_WORLD_RANK=" + std::to_string(*rank) +
                          " is not below OMPI_COMM_WORLD_SIZE=" + std::to_string(*size));
  if (rendezvous_address.empty())
    throw InvalidArgument(
        "OpenMPI: no rendezvous address; MPI does not say where rank 0 runs, so pass the "
        "host:port rank 0 listens on, e.g. resolve_openmpi(\"node01:23456\")");
  ClusterResolution r = ClusterResolution::from_ranks(*rank, *size, rendezvous_address, "OpenMPI");

  const auto local_rank =
      cluster_detail::env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, 1 << 24, under_mpirun);
  const auto local_size =
      cluster_detail::env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1 << 24, under_mpirun);
  if (local_rank && local_size) {
    if (*local_rank >= *local_size || *local_size > *size)
      throw InvalidArgument(
          "OpenMPI: OMPI_COMM_WORLD_LOCAL_RANK=" + std::to_string(*local_rank) +
          " and OMPI_COMM_WORLD_LOCAL_SIZE=" + std::to_string(*local_size) +
          " are inconsistent (with OMPI_COMM_WORLD_SIZE=" + std::to_string(*size) + ")");
    r.set_local_placement(*local_rank, *local_size);
  } else {
    DTRAIN_LOG(WARNING) << "OpenMPI: OMPI_COMM_WORLD_LOCAL_RANK/LOCAL_SIZE unset; assuming rank "
                        << *rank << " is alone on its machine (local rank 0 of 1)";
  }
  return r;
}

}  // namespace dtrain
