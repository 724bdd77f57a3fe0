// The multi-rank NCCL tests' communicator: one per test on this rank's GPU (GPU r for rank r),
// its id shared over MPI.
#pragma once

#include <zenflow/mpi_communicator.hpp>
#include <zenflow/nccl_communicator.cuh>

#include <cuda_runtime.h>

#include <chrono>

#include "mpi_doctest.hpp"

namespace zenflow_test {

inline zenflow::nccl_communicator make_communicator(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  ZENFLOW_CUDA_TRY(cudaSetDevice(world_rank()));
  zenflow::mpi_communicator host(MPI_COMM_WORLD);
  zenflow::nccl_communicator_options options;
  options.timeout = timeout;
  return zenflow::nccl_communicator(zenflow::shared_nccl_unique_id(host), host.rank(), host.size(), options);
}

}  // namespace zenflow_test
