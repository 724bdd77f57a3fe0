// Column copies of the host backend's "device" work, in parallel and cache-blocked: the column
// gathers and scatters of the coordinator and the packing of the sparse Adam's state for
// migration are all "element (r, i) of one strided matrix to element (r, i) of another", with a
// list of columns on either side. Not a public header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

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

/// Copies rows [r0, r1) x positions [i0, i1) line by line along the rows of each position.
inline void copy_column_lines(const column_side& src, const column_side& dst, copy_line_fn copy, index_t r0, index_t r1,
                              index_t i0, index_t i1, float scale) {
  if (r1 <= r0) return;
  for (index_t i = i0; i < i1; ++i)
    copy(src.at(r0, i), {nullptr, src.row_stride}, const_cast<std::byte*>(dst.at(r0, i)), {nullptr, dst.row_stride},
         r1 - r0, scale);
}

/// dst(r, i) = D(src(r, i) * scale) (without the product when !scaled) for r < rows, i < n, on
/// exec's pool with the concrete path `isa`, in tasks of rows x positions blocks. Three shapes:
///   - one side's positions contiguous along a row (col_stride 1, a list of columns allowed), the
///     other's rows contiguous along a column (row_stride 1, no list): a transposition, in SIMD
///     tiles (transpose_tiles) with line copies for the edges;
///   - else, either side's rows contiguous: lines along the rows of each position, in tiles of 32
///     rows when the other side is strided (its rows stay in cache from one column to the next);
///   - else lines along the listed columns of each row.
/// `ordered`: dst may list a column twice; every element is then written by one task, in list
/// order (the later entry last).
inline void copy_columns(const column_side& src, const column_side& dst, index_t rows, index_t n, bool scaled,
                         float scale, const host_execution& exec, cpu_isa isa, bool ordered) {
  if (rows <= 0 || n <= 0) return;
  const auto extent = [rows](const column_side& x) { return (rows - 1) * x.row_stride + x.max_column * x.col_stride; };
  const bool simd = extent(src) < max_simd_offset && extent(dst) < max_simd_offset;
  const copy_line_fn copy = select_copy_line(isa, src.type, dst.type, scaled, simd);
  const index_t tile = simd ? transpose_tile(isa) : 0;
  const bool row_to_column = src.col_stride == 1 && dst.row_stride == 1 && dst.columns == nullptr;
  const bool column_to_row = src.row_stride == 1 && src.columns == nullptr && dst.col_stride == 1;
  const std::size_t ssz = dtype_size(src.type), dsz = dtype_size(dst.type);
  if (tile > 0 && (row_to_column || column_to_row) && rows >= tile && n >= tile) {
    const transpose_tiles_fn tiles = select_transpose_tiles(isa, src.type, dst.type, scaled);
    // Square-ish tasks (256 x 256 of a large matrix): both sides' pages stay few per task.
    const index_t per_task = ordered ? n : std::max(tile, std::min(n, index_t{256}) / tile * tile);
    const index_t rows_per_task =
        std::max(tile, std::min(rows, light_task_elements / std::min(n, per_task)) / tile * tile);
    const index_t row_tasks = (rows + rows_per_task - 1) / rows_per_task, column_tasks = (n + per_task - 1) / per_task;
    parallel_for(exec, static_cast<std::size_t>(row_tasks * column_tasks), [&](std::size_t t) {
      const index_t r0 = static_cast<index_t>(t) % row_tasks * rows_per_task, r1 = std::min(rows, r0 + rows_per_task);
      const index_t i0 = static_cast<index_t>(t) / row_tasks * per_task, i1 = std::min(n, i0 + per_task);
      const index_t r_full = r0 + (r1 - r0) / tile * tile, i_full = i0 + (i1 - i0) / tile * tile;
      const auto* s = static_cast<const std::byte*>(src.data);
      auto* d = const_cast<std::byte*>(static_cast<const std::byte*>(dst.data));
      if (row_to_column)  // source (row a, position b) -> destination (position b, row a)
        tiles(s + static_cast<std::size_t>(r0 * src.row_stride + (src.columns ? 0 : i0)) * ssz, src.row_stride,
              src.columns ? src.columns + i0 : nullptr, d + static_cast<std::size_t>(i0 * dst.col_stride + r0) * dsz,
              dst.col_stride, nullptr, r_full - r0, i_full - i0, scale);
      else  // source (position a, row b) -> destination (row b, position a)
        tiles(s + static_cast<std::size_t>(i0 * src.col_stride + r0) * ssz, src.col_stride, nullptr,
              d + static_cast<std::size_t>(r0 * dst.row_stride + (dst.columns ? 0 : i0)) * dsz, dst.row_stride,
              dst.columns ? dst.columns + i0 : nullptr, i_full - i0, r_full - r0, scale);
      // The edges, after the tiles they follow in list order.
      copy_column_lines(src, dst, copy, r_full, r1, i0, i_full, scale);
      copy_column_lines(src, dst, copy, r0, r1, i_full, i1, scale);
    });
  } else if (src.row_stride == 1 || dst.row_stride == 1) {
    const bool both = src.row_stride == 1 && dst.row_stride == 1;
    const index_t tile_rows = std::min(rows, both ? light_task_elements : index_t{32});
    const index_t row_tiles = (rows + tile_rows - 1) / tile_rows;
    const index_t per_task = ordered ? n : std::max<index_t>(1, light_task_elements / tile_rows);
    const index_t column_tiles = (n + per_task - 1) / per_task;
    parallel_for(exec, static_cast<std::size_t>(row_tiles * column_tiles), [&](std::size_t t) {
      const index_t r0 = static_cast<index_t>(t) % row_tiles * tile_rows, r1 = std::min(rows, r0 + tile_rows);
      const index_t i0 = static_cast<index_t>(t) / row_tiles * per_task, i1 = std::min(n, i0 + per_task);
      copy_column_lines(src, dst, copy, r0, r1, i0, i1, scale);
    });
  } else {
    const index_t rows_per_task = std::max<index_t>(1, light_task_elements / n);
    parallel_for(exec, static_cast<std::size_t>((rows + rows_per_task - 1) / rows_per_task), [&](std::size_t t) {
      const index_t r0 = static_cast<index_t>(t) * rows_per_task, r1 = std::min(rows, r0 + rows_per_task);
      for (index_t r = r0; r < r1; ++r)  // the lists' columns are absolute: lines start at column 0
        copy(static_cast<const std::byte*>(src.data) + static_cast<std::size_t>(r * src.row_stride) * ssz,
             {src.columns, src.col_stride},
             const_cast<std::byte*>(static_cast<const std::byte*>(dst.data)) +
                 static_cast<std::size_t>(r * dst.row_stride) * dsz,
             {dst.columns, dst.col_stride}, n, scale);
    });
  }
}

/// The host backend's offload of a step's CPU columns in one pass: acc(r, i) = fma(scale,
/// src(r, i), acc(r, i)) in fp32 (overwrite: acc(r, i) = fma(scale, src(r, i), +0)) for r < rows,
/// i < n, acc compact (column i at i * rows): the clip factor applies in fp32, never rounded to
/// src's dtype (a bf16/fp16 gradient keeps its small components). The same bits as copy_columns
/// into a compact buffer of src's dtype, unscaled, followed by the accumulate kernel with `scale`
/// (the coordinator's gather, then the offload worker's accumulate), without the buffer. Blocks are
/// whole columns when a column's rows are contiguous in src (or the rows of one column, when a
/// column alone is longer than a block), else 256 rows by 256 columns (a transposition: each
/// source row of the block is read as one run; taller blocks measured slower). On AVX-512 a
/// block's whole 16 x 16 tiles of a row-major src are transposed and accumulated in registers
/// (select_transpose_accumulate); a src whose columns' rows are contiguous is accumulated from
/// src itself, a column at a time; everything else (the edges of a block, other paths and layouts)
/// is gathered into a scratch of the task's thread, which stays in cache, and accumulated from
/// there. On exec's pool, a task per block.
inline void gather_accumulate(const column_side& src, index_t rows, index_t n, float scale, float* acc, bool overwrite,
                              const host_execution& exec, cpu_isa isa) {
  if (rows <= 0 || n <= 0) return;
  const accumulate_range_fn add = select_accumulate_range(isa, src.type, overwrite);
  const std::size_t ssz = dtype_size(src.type);
  constexpr index_t square = 256;
  const index_t block_rows = std::min(rows, src.row_stride == 1 ? light_task_elements : square);
  const index_t row_blocks = (rows + block_rows - 1) / block_rows;
  const index_t block_columns =
      src.row_stride == 1 && row_blocks > 1 ? 1 : std::max<index_t>(1, light_task_elements / block_rows);
  const index_t column_blocks = (n + block_columns - 1) / block_columns;
  const host_execution serial{nullptr, isa};
  // The one-pass transposition: a row-major src whose offsets fit the SIMD kernels (copy_columns' rule).
  const index_t tile = transpose_tile(isa);
  const transpose_accumulate_fn fused =
      src.col_stride == 1 && src.row_stride > 1 && (rows - 1) * src.row_stride + src.max_column < max_simd_offset
          ? select_transpose_accumulate(isa, src.type, overwrite)
          : nullptr;
  // src from row r0 and position i0 on (w positions) at (0, 0).
  const auto origin = [&](index_t r0, index_t i0, index_t w) {
    column_side from = src;
    if (src.columns != nullptr) {
      from.data = static_cast<const std::byte*>(src.data) + static_cast<std::size_t>(r0 * src.row_stride) * ssz;
      from.columns = src.columns + i0;
    } else {
      from.data = src.at(r0, i0);
      from.max_column = w - 1;
    }
    return from;
  };
  // Rows [r0, r1) x positions [i0, i1): gathered into the scratch, accumulated from it.
  const auto staged = [&](index_t r0, index_t r1, index_t i0, index_t i1) {
    const index_t h = r1 - r0, w = i1 - i0;
    if (h <= 0 || w <= 0) return;
    if (src.row_stride == 1) {  // each column's rows are contiguous: accumulated from src itself
      for (index_t i = i0; i < i1; ++i)
        (void)add(acc + static_cast<std::size_t>(i * rows + r0), src.at(r0, i), static_cast<std::size_t>(h), scale);
      return;
    }
    thread_local std::vector<std::byte> scratch;
    if (scratch.size() < static_cast<std::size_t>(h * w) * ssz) scratch.resize(static_cast<std::size_t>(h * w) * ssz);
    copy_columns(origin(r0, i0, w), {scratch.data(), src.type, 1, h, nullptr, w - 1}, h, w, false, 1.0f, serial, isa,
                 false);
    if (h == rows) {  // whole columns: one contiguous range of acc
      (void)add(acc + static_cast<std::size_t>(i0 * rows), scratch.data(), static_cast<std::size_t>(h * w), scale);
      return;
    }
    for (index_t i = 0; i < w; ++i)
      (void)add(acc + static_cast<std::size_t>((i0 + i) * rows + r0),
                scratch.data() + static_cast<std::size_t>(i * h) * ssz, static_cast<std::size_t>(h), scale);
  };
  parallel_for(exec, static_cast<std::size_t>(row_blocks * column_blocks), [&](std::size_t t) {
    const index_t r0 = static_cast<index_t>(t) % row_blocks * block_rows, r1 = std::min(rows, r0 + block_rows);
    const index_t i0 = static_cast<index_t>(t) / row_blocks * block_columns, i1 = std::min(n, i0 + block_columns);
    const index_t r_full = fused != nullptr ? r0 + (r1 - r0) / tile * tile : r0;
    const index_t i_full = fused != nullptr ? i0 + (i1 - i0) / tile * tile : i0;
    if (fused == nullptr || r_full == r0 || i_full == i0) return staged(r0, r1, i0, i1);
    const column_side from = origin(r0, i0, i1 - i0);
    fused(from.data, src.row_stride, from.columns, acc + static_cast<std::size_t>(i0 * rows + r0), rows, r_full - r0,
          i_full - i0, scale);
    staged(r_full, r1, i0, i_full);  // the edges
    staged(r0, r1, i_full, i1);
  });
}

}  // namespace zenflow::detail::host_device
