// Host-side argument checks shared by host_sparse_adam and cuda_sparse_adam. Every check throws
// zenflow::error naming the argument before anything is modified.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "zenflow/error.hpp"
#include "zenflow/view.hpp"

namespace zenflow::detail::sparse_adam {

/// `selection` must be strictly ascending (sorted, no duplicates) and within [0, cols).
inline void check_sorted_columns(std::span<const std::int32_t> selection, index_t cols, const char* argument) {
  for (std::size_t i = 0; i < selection.size(); ++i) {
    expects(selection[i] >= 0 && selection[i] < cols, argument, "column index ", selection[i], " at position ", i,
            " is outside [0, ", cols, ")");
    // The message's arguments are evaluated even when i == 0: never form selection[-1].
    const std::size_t previous = i == 0 ? 0 : i - 1;
    expects(i == 0 || selection[previous] < selection[i], argument,
            "column indices must be strictly ascending: ", selection[previous], " then ", selection[i], " at position ",
            i);
  }
}

/// Every index within [0, cols) (any order, repeats allowed: gather/scatter lists).
inline void check_columns_in_range(std::span<const std::int32_t> columns, index_t cols, const char* argument) {
  for (std::size_t i = 0; i < columns.size(); ++i)
    expects(columns[i] >= 0 && columns[i] < cols, argument, "column index ", columns[i], " at position ", i,
            " is outside [0, ", cols, ")");
}

/// A selection for a parameter with `cols` columns: size in [1, cols], strictly ascending, in range.
inline void check_selection(std::span<const std::int32_t> selection, index_t cols, const char* argument) {
  expects(!selection.empty() && static_cast<index_t>(selection.size()) <= cols, argument, "k = ", selection.size(),
          " must be in [1, cols = ", cols, "]");
  check_sorted_columns(selection, cols, argument);
}

/// A parameter matrix: valid view in `space`, non-empty, column indices representable as int32.
inline void check_param_matrix(const_matrix_view param, memory_space space, const char* argument) {
  param.validate(argument, space);
  expects(!param.empty(), argument, "must not be empty, got ", param.rows, " x ", param.cols);
  expects(param.cols <= std::numeric_limits<std::int32_t>::max(), argument, "cols must fit int32, got ", param.cols);
}

/// A gradient for `param`: valid view in `space` with the same extents (any layout, any dtype).
inline void check_grad_matrix(const_matrix_view grad, const_matrix_view param, memory_space space,
                              const char* argument) {
  grad.validate(argument, space);
  expects(grad.rows == param.rows && grad.cols == param.cols, argument, "shape ", grad.rows, " x ", grad.cols,
          " does not match the parameter's ", param.rows, " x ", param.cols);
}

/// A buffer of `have` floats must hold at least `need`.
inline void check_buffer(std::size_t have, index_t need, const char* argument) {
  expects(static_cast<index_t>(have) >= need, argument, "holds ", have, " floats, needs ", need);
}

/// Columns of `old_selection` not in `new_selection` (both ascending): their count, and optionally
/// for each new slot the old slot holding the same column (or -1) and the old slots that leave.
inline index_t migration_plan(std::span<const std::int32_t> old_selection, std::span<const std::int32_t> new_selection,
                              std::vector<std::int32_t>* source_slot = nullptr,
                              std::vector<std::int32_t>* leaving_slots = nullptr) {
  if (source_slot) source_slot->assign(new_selection.size(), -1);
  if (leaving_slots) leaving_slots->clear();
  index_t leaving = 0;
  std::size_t a = 0, b = 0;
  while (a < old_selection.size() || b < new_selection.size()) {
    if (b == new_selection.size() || (a < old_selection.size() && old_selection[a] < new_selection[b])) {
      if (leaving_slots) leaving_slots->push_back(static_cast<std::int32_t>(a));
      ++leaving;
      ++a;
    } else if (a == old_selection.size() || new_selection[b] < old_selection[a]) {
      ++b;  // entering
    } else {
      if (source_slot) (*source_slot)[b] = static_cast<std::int32_t>(a);
      ++a;
      ++b;
    }
  }
  return leaving;
}

}  // namespace zenflow::detail::sparse_adam
