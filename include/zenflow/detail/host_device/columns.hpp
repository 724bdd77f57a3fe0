// Column copies of the host backend's "device" work, in parallel and cache-blocked: the column
// gathers and scatters of the coordinator and the packing of the sparse Adam's state for
// migration are all "element (r, i) of one strided matrix to element (r, i) of another", with a
// list of columns on either side. Not a public header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "zenflow/detail/host_device/line_kernels.hpp"
#include "zenflow/detail/host_device/parallel.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::host_device {

/// One side of a column copy: element (r, i) at data + r * row_stride + column(i) * col_stride
/// (elements of `type`), column(i) = columns ? columns[i] : i, every column(i) <= max_column.
struct column_side {
  const void* data = nullptr;
  dtype type = dtype::f32;
  index_t row_stride = 1;
  index_t col_stride = 1;
  const std::int32_t* columns = nullptr;
  index_t max_column = 0;
  [[nodiscard]] index_t column(index_t i) const noexcept { return columns != nullptr ? columns[i] : i; }
  [[nodiscard]] const std::byte* at(index_t r, index_t i) const noexcept {
    return static_cast<const std::byte*>(data) +
           static_cast<std::size_t>(r * row_stride + column(i) * col_stride) * dtype_size(type);
  }
};

/// The largest entry of a column list (0 for an empty one).
inline index_t max_column(std::span<const std::int32_t> columns) noexcept {
  std::int32_t m = 0;
  for (const std::int32_t c : columns) m = std::max(m, c);
  return m;
}

/// True when the list is strictly ascending (so no column repeats).
inline bool strictly_ascending(std::span<const std::int32_t> columns) noexcept {
  for (std::size_t i = 1; i < columns.size(); ++i)
    if (columns[i] <= columns[i - 1]) return false;
  return true;
}

/// dst(r, i) = D(src(r, i) * scale) (without the product when !scaled) for r < rows, i < n, on
/// exec's pool with the concrete path `isa`. Lines run along the rows of a column when either
/// side's columns are contiguous (tiles of 32 rows when the other side is strided, so that the
/// rows a tile reads or writes stay in cache from one column to the next), else along the listed
/// columns of a row. `ordered`: dst may list a column twice; every element is then written by
/// one task in list order (the later entry last).
inline void copy_columns(const column_side& src, const column_side& dst, index_t rows, index_t n, bool scaled,
                         float scale, const host_execution& exec, cpu_isa isa, bool ordered) {
  if (rows <= 0 || n <= 0) return;
  const auto extent = [rows](const column_side& x) { return (rows - 1) * x.row_stride + x.max_column * x.col_stride; };
  const bool simd = extent(src) < max_simd_offset && extent(dst) < max_simd_offset;
  const copy_line_fn copy = select_copy_line(isa, src.type, dst.type, scaled, simd);
  const auto out = [&dst](index_t r, index_t i) { return const_cast<std::byte*>(dst.at(r, i)); };
  if (src.row_stride == 1 || dst.row_stride == 1) {
    const bool both = src.row_stride == 1 && dst.row_stride == 1;
    const index_t tile_rows = std::min(rows, both ? light_task_elements : index_t{32});
    const index_t row_tiles = (rows + tile_rows - 1) / tile_rows;
    const index_t per_task = ordered ? n : std::max<index_t>(1, light_task_elements / tile_rows);
    const index_t column_tiles = (n + per_task - 1) / per_task;
    parallel_for(exec, static_cast<std::size_t>(row_tiles * column_tiles), [&](std::size_t t) {
      const index_t r0 = static_cast<index_t>(t) % row_tiles * tile_rows, r1 = std::min(rows, r0 + tile_rows);
      const index_t i0 = static_cast<index_t>(t) / row_tiles * per_task, i1 = std::min(n, i0 + per_task);
      for (index_t i = i0; i < i1; ++i)
        copy(src.at(r0, i), {nullptr, src.row_stride}, out(r0, i), {nullptr, dst.row_stride}, r1 - r0, scale);
    });
  } else {
    const index_t rows_per_task = std::max<index_t>(1, light_task_elements / n);
    parallel_for(exec, static_cast<std::size_t>((rows + rows_per_task - 1) / rows_per_task), [&](std::size_t t) {
      const index_t r0 = static_cast<index_t>(t) * rows_per_task, r1 = std::min(rows, r0 + rows_per_task);
      for (index_t r = r0; r < r1; ++r)  // the lists' columns are absolute: lines start at column 0
        copy(static_cast<const std::byte*>(src.data) +
                 static_cast<std::size_t>(r * src.row_stride) * dtype_size(src.type),
             {src.columns, src.col_stride},
             const_cast<std::byte*>(static_cast<const std::byte*>(dst.data)) +
                 static_cast<std::size_t>(r * dst.row_stride) * dtype_size(dst.type),
             {dst.columns, dst.col_stride}, n, scale);
    });
  }
}

}  // namespace zenflow::detail::host_device
