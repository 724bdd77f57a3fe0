// Per-element pieces of the sparse-column Adam shared by the host backend and the CUDA kernels:
// the compact state layout, the packed migration format, dtype-generic loads and stores, and the
// per-element update (which is adam_math.hpp's adam_update, nothing else).
#pragma once

#include <cmath>
#include <cstdint>

#include "zenflow/adam_math.hpp"
#include "zenflow/config.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow::detail::sparse_adam {

/// Which of the three state arrays a packed value belongs to.
enum state_part : int { part_master = 0, part_exp_avg = 1, part_exp_avg_sq = 2, part_count = 3 };

/// Compact state of `k` selected columns of a `rows`-row parameter: `rows * k` floats per part.
/// The order follows the parameter's layout so that the kernel's accesses to the parameter, the
/// gradient and the state all advance together:
///   - columns closer in memory than rows (row-major W[out, in]): state is [rows][k] (row r,
///     slot j at r * k + j): consecutive threads take consecutive selected columns of one row.
///   - otherwise (column-contiguous): state is [k][rows] (slot j, row r at j * rows + r).
struct state_layout {
  index_t rows = 0;
  index_t k = 0;
  bool row_major = false;

  ZENFLOW_HOST_DEVICE constexpr index_t size() const noexcept { return rows * k; }
  ZENFLOW_HOST_DEVICE constexpr index_t index(index_t r, index_t j) const noexcept {
    return row_major ? r * k + j : j * rows + r;
  }
  ZENFLOW_HOST_DEVICE constexpr index_t row_of(index_t e) const noexcept { return row_major ? e / k : e % rows; }
  ZENFLOW_HOST_DEVICE constexpr index_t slot_of(index_t e) const noexcept { return row_major ? e % k : e / rows; }
};

/// The state layout for a parameter with these strides (see state_layout).
constexpr bool state_row_major_for(index_t row_stride, index_t col_stride) noexcept {
  return col_stride < row_stride;
}

/// Packed migration format: for each column in list order, [master (rows), exp_avg (rows),
/// exp_avg_sq (rows)]: value (list position l, part, row r) at this index.
ZENFLOW_HOST_DEVICE constexpr index_t packed_index(index_t rows, index_t l, int part, index_t r) noexcept {
  return (l * part_count + part) * rows + r;
}

/// Reads element `offset` (in elements) of a buffer of type `t` as float (exact).
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float load_as_float(const void* base, dtype t, index_t offset) noexcept {
  switch (t) {
    case dtype::bf16:
      return to_float(static_cast<const bfloat16*>(base)[offset]);
    case dtype::f16:
      return to_float(static_cast<const float16*>(base)[offset]);
    default:
      return static_cast<const float*>(base)[offset];
  }
}

/// Writes `x` rounded to nearest even to element `offset` of a buffer of type `t`.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE void store_from_float(void* base, dtype t, index_t offset, float x) noexcept {
  switch (t) {
    case dtype::bf16:
      static_cast<bfloat16*>(base)[offset] = to_bfloat16(x);
      break;
    case dtype::f16:
      static_cast<float16*>(base)[offset] = to_float16(x);
      break;
    default:
      static_cast<float*>(base)[offset] = x;
      break;
  }
}

/// One element of the sparse update: Adam on the fp32 master, then the model's copy rounded once.
template <class TParam>
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE void update_element(TParam& param, float& master, float& m, float& v,
                                                            float g_raw, const adam_step_constants& c) noexcept {
  adam_update(master, g_raw, m, v, c);
  param = from_float<TParam>(master);
}

/// The effective gradient scale of a step: grad_scale times the device/host factor, if any.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float effective_scale(float grad_scale, const float* scale_ptr) noexcept {
  return scale_ptr != nullptr ? detail::mul_rn(grad_scale, *scale_ptr) : grad_scale;
}

/// A step is applied only with a finite, non-negative effective scale.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE bool usable_scale(float s) noexcept {
  return is_finite_bits(s) && s >= 0.0f;
}

/// gather's per-element value: src * scale, rounded to the destination type by the caller.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float scaled(float x, float scale) noexcept {
  return detail::mul_rn(x, scale);
}

}  // namespace zenflow::detail::sparse_adam
