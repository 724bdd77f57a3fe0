// The multi-rank NCCL tests' communicator: one per test on this rank's GPU (GPU r for rank r),
// its id shared over MPI; the MPI communicator of that bootstrap stays on as the NCCL
// communicator's abort channel (a failing rank's reason reaches the others at once).
#pragma once

#include <zenflow/mpi_communicator.hpp>
#include <zenflow/nccl_communicator.cuh>

#include <cuda_runtime.h>

#include <chrono>
#include <memory>

#include "mpi_doctest.hpp"

namespace zenflow_test {

inline zenflow::nccl_communicator make_communicator(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  ZENFLOW_CUDA_TRY(cudaSetDevice(world_rank()));
  auto host = std::make_unique<zenflow::mpi_communicator>(MPI_COMM_WORLD);
  const ncclUniqueId id = zenflow::shared_nccl_unique_id(*host);
  const int rank = host->rank(), size = host->size();
  zenflow::nccl_communicator_options options;
  options.timeout = timeout;
  options.abort_channel = std::make_shared<zenflow::host_abort_channel<zenflow::mpi_communicator>>(std::move(host));
  return zenflow::nccl_communicator(id, rank, size, options);
}

}  // namespace zenflow_test
