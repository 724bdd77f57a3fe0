// Per-element math of the gradient statistics, shared by the host reference and the CUDA kernels.
#pragma once

#include <cstdint>

#include "zenflow/config.hpp"

namespace zenflow::detail::stats {

/// True when the float's bits encode +-infinity or a NaN.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE bool is_nonfinite_bits(std::uint32_t bits) noexcept {
  return (bits & 0x7f800000u) == 0x7f800000u;
}

}  // namespace zenflow::detail::stats
