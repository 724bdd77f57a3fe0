// How the host backend's "device" work uses a host_execution: the SIMD path it names (checked)
// and its pool (one parallel pass per call; a single task runs on the calling thread, so small
// work never wakes the pool). Not a public header.
#pragma once

#include <cstddef>
#include <functional>

#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"
#include "zenflow/thread_pool.hpp"

namespace zenflow::detail::host_device {

/// The concrete SIMD path of `exec` (automatic: the detected one). Throws `zenflow::error`
/// naming `argument` for a path this CPU lacks or an unknown value.
inline cpu_isa checked_isa(const host_execution& exec, const char* argument) {
  expects(exec.isa == cpu_isa::automatic || exec.isa == cpu_isa::scalar || exec.isa == cpu_isa::avx2 ||
              exec.isa == cpu_isa::avx512,
          argument, "unknown value ", static_cast<int>(exec.isa));
  expects(cpu_isa_supported(exec.isa), argument, "this CPU does not support ", cpu_isa_name(exec.isa),
          " (best: ", cpu_isa_name(detect_cpu_isa()), ")");
  return resolve_isa(exec.isa);
}

/// Runs fn(i) for i in [0, tasks) on exec's pool (the calling thread takes part), or on the calling
/// thread alone when there is no pool or one task. Synchronizes; rethrows a task's exception.
inline void parallel_for(const host_execution& exec, std::size_t tasks, const std::function<void(std::size_t)>& fn) {
  if (exec.pool == nullptr || tasks <= 1) {
    for (std::size_t i = 0; i < tasks; ++i) fn(i);
    return;
  }
  exec.pool->parallel_for(tasks, fn);
}

/// Elements per task of the light streams (statistics, gathers, scatters, state copies): a task
/// of this size takes tens of microseconds, more than waking a pool thread costs.
inline constexpr index_t light_task_elements = index_t{1} << 16;
/// Elements per task of the sparse Adam step (the CPU Adam's default chunk).
inline constexpr index_t adam_task_elements = index_t{1} << 15;

}  // namespace zenflow::detail::host_device
