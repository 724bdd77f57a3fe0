// zenflow.torch's CUDA backend: cuda_coordinator behind the handle interface. Compiled by nvcc
// only when it matches torch's CUDA version (CMakeLists.txt); includes no torch header.
#include <memory>

#include "coordinator_handle.hpp"
#include "zenflow/coordinator.cuh"

namespace zenflow_torch {

std::unique_ptr<handle> make_cuda_handle(const zenflow::zenflow_options& options,
                                         const zenflow::coordinator_config& config) {
  return std::make_unique<coordinator_handle<zenflow::cuda_coordinator>>(options, config);
}

}  // namespace zenflow_torch
