// Gradient element loads for kernels (nvcc only): one f32 / bf16 / f16 value widened exactly to
// float, or 16 aligned bytes at once, all through the read-only path (ld.global.nc). Shared by the
// importance selector's score kernel and the gradient statistics. Not a public header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "zenflow/config.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

ZENFLOW_DEVICE ZENFLOW_FORCEINLINE float element_to_float(float x) {
  return x;
}
ZENFLOW_DEVICE ZENFLOW_FORCEINLINE float element_to_float(bfloat16 x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}
ZENFLOW_DEVICE ZENFLOW_FORCEINLINE float element_to_float(float16 x) {
  float f;  // hardware conversion; exact, like zenflow::to_float(float16)
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <class T>
ZENFLOW_DEVICE ZENFLOW_FORCEINLINE float load_element(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return __ldg(p);
  else
    return element_to_float(T{__ldg(reinterpret_cast<const unsigned short*>(p))});
}

template <class T>
inline constexpr int vec_elems = 16 / static_cast<int>(sizeof(T));

/// Loads 16 aligned bytes (4 floats or 8 half-width values) and widens them to float.
template <class T>
ZENFLOW_DEVICE ZENFLOW_FORCEINLINE void load_vec16(const T* p, float (&x)[vec_elems<T>]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      x[i] = __uint_as_float(w[i]);
    } else {
      x[2 * i] = element_to_float(T{static_cast<std::uint16_t>(w[i] & 0xffffu)});
      x[2 * i + 1] = element_to_float(T{static_cast<std::uint16_t>(w[i] >> 16)});
    }
  }
}

}  // namespace zenflow::detail
