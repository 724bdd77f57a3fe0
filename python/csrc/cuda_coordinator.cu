// zenflow.torch's CUDA backend: cuda_coordinator behind the handle interface, and with NCCL
// (zenflow::nccl) one rank of a data-parallel group on nccl_communicator. Compiled by nvcc only
// when it matches torch's CUDA version (CMakeLists.txt); includes no torch header. The
// coordinator keeps the device current when it was made (the parameters'): every later call runs
// on it, whatever device torch has made current meanwhile.
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coordinator_handle.hpp"
#include "zenflow/coordinator.cuh"
#ifdef ZENFLOW_TORCH_WITH_NCCL
#include "zenflow/nccl_communicator.cuh"
#endif

namespace zenflow_torch {

std::unique_ptr<handle> make_cuda_handle(const zenflow::zenflow_options& options,
                                         const zenflow::coordinator_config& config) {
  return std::make_unique<coordinator_handle<zenflow::cuda_coordinator>>(options, config);
}

#ifdef ZENFLOW_TORCH_WITH_NCCL
std::vector<std::byte> make_nccl_unique_id() {
  const auto bytes = zenflow::nccl_unique_id_bytes();
  return {bytes.begin(), bytes.end()};
}

std::unique_ptr<handle> make_cuda_data_parallel_handle(const zenflow::zenflow_options& options,
                                                       const zenflow::coordinator_config& config,
                                                       std::span<const std::byte> nccl_id, int rank, int ranks,
                                                       std::chrono::milliseconds timeout,
                                                       std::shared_ptr<zenflow::abort_channel> abort_channel) {
  zenflow::nccl_communicator_options o;
  o.timeout = timeout;  // o.device: the current device (the parameters'), the coordinator's too
  o.abort_channel = std::move(abort_channel);
  auto communicator =
      std::make_unique<zenflow::nccl_communicator>(zenflow::nccl_unique_id_from_bytes(nccl_id), rank, ranks, o);
  using dp = zenflow::data_parallel_cuda_coordinator<zenflow::nccl_communicator>;
  return std::make_unique<coordinator_handle<dp, zenflow::nccl_communicator>>(std::move(communicator), options, config);
}
#else
std::vector<std::byte> make_nccl_unique_id() {
  throw zenflow::error("process_group", std::string("zenflow.torch's CUDA backend was built without NCCL: ") +
                                            ZENFLOW_TORCH_NCCL_REASON);
}

std::unique_ptr<handle> make_cuda_data_parallel_handle(const zenflow::zenflow_options&,
                                                       const zenflow::coordinator_config&, std::span<const std::byte>,
                                                       int, int, std::chrono::milliseconds,
                                                       std::shared_ptr<zenflow::abort_channel>) {
  (void)make_nccl_unique_id();  // throws
  return nullptr;
}
#endif

}  // namespace zenflow_torch
