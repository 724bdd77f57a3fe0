// Compiler and platform configuration shared by every zenflow header.
#pragma once

#include "zenflow/version.hpp"

#if defined(__CUDACC__)
/// Marks a function callable from host and device code (plain inline on a host compiler).
#define ZENFLOW_HOST_DEVICE __host__ __device__
/// Marks a device-only function; only meaningful in `.cuh` headers.
#define ZENFLOW_DEVICE __device__
#define ZENFLOW_FORCEINLINE __forceinline__
#else
#define ZENFLOW_HOST_DEVICE
#define ZENFLOW_DEVICE
#if defined(__GNUC__) || defined(__clang__)
#define ZENFLOW_FORCEINLINE inline __attribute__((always_inline))
#else
#define ZENFLOW_FORCEINLINE inline
#endif
#endif

/// Defined to 1 while compiling device code (the `__CUDA_ARCH__` pass of nvcc).
#if defined(__CUDA_ARCH__)
#define ZENFLOW_IS_DEVICE_CODE 1
#else
#define ZENFLOW_IS_DEVICE_CODE 0
#endif

/// Defined to 1 when the translation unit is compiled by a CUDA compiler (host or device pass).
#if defined(__CUDACC__)
#define ZENFLOW_HAS_CUDA_COMPILER 1
#else
#define ZENFLOW_HAS_CUDA_COMPILER 0
#endif

#if !defined(ZENFLOW_IS_DEVICE_CODE) || (__cplusplus < 202002L && !defined(_MSVC_LANG))
#error "zenflow requires C++20"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ZENFLOW_RESTRICT __restrict__
#else
#define ZENFLOW_RESTRICT
#endif

namespace zenflow {
/// Signed index type used for extents, strides and element counts.
using index_t = long long;
}  // namespace zenflow
