// The CUDA instantiation of the bounded-async coordinator: cuda_coordinator.
//
// The schedule is basic_coordinator's (coordinator.hpp); cuda_backend
// (detail/coordinator/cuda_backend.cuh) maps its "device" operations onto the CUDA components. No
// call synchronizes the device; the trainer's stream is only synchronized at selection boundaries,
// finish() and checkpoints.
#pragma once

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/cuda_backend.cuh"

namespace zenflow {

/// The real thing: ZenFlow's bounded-async schedule on a CUDA GPU.
using cuda_coordinator = basic_coordinator<cuda_backend>;

/// One rank of a data-parallel group on the CUDA backend (docs/DATA_PARALLEL.md); the
/// communicator runs on CUDA streams: nccl_communicator (nccl_communicator.cuh).
template <class Communicator>
using data_parallel_cuda_coordinator = basic_coordinator<cuda_backend, cpu_adam, Communicator>;

}  // namespace zenflow
