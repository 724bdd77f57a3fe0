// What nccl_communicator builds on: NCCL's names for zenflow's element types and reductions,
// NCCL's error text, and a scope that makes the communicator's device current.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "zenflow/communicator.hpp"
#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/error.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

namespace detail::nccl {

template <class T>
constexpr ncclDataType_t datatype() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>)
    return ncclFloat64;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return ncclInt64;
  else if constexpr (std::is_same_v<T, bfloat16>)
    return ncclBfloat16;
  else
    return ncclFloat16;
}

inline ncclRedOp_t reduction(reduce_op op) noexcept {
  return op == reduce_op::sum ? ncclSum : op == reduce_op::max ? ncclMax : ncclMin;
}

/// "<NCCL's name for the result> (<its last error message>)".
inline std::string result_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') text += detail::concat(" (", last, ")");
  }
  return text;
}

/// Makes `device` current for its scope; restores the previous device.
using device_guard = detail::cuda_device_scope;

}  // namespace detail::nccl

}  // namespace zenflow
