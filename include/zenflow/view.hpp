// Non-owning views of the trainer's tensors (the host-framework contract).
//
// The trainer owns parameters and gradients; zenflow sees them through these views: a data
// pointer, extents, strides (in elements), an element type and a memory space. Nothing here
// allocates or assumes a framework.
//
// Matrices follow the `W[out, in]` convention of linear layers: `rows` = out features,
// `cols` = in features; a *column* (one input channel) is what the importance selector scores.
// Element (r, c) lives at `data + (r * row_stride + c * col_stride) * element_size`.
//   - row-major `W[out, in]`:           row_stride = cols, col_stride = 1 (a column is strided)
//   - column-contiguous (transposed):   row_stride = 1,    col_stride = rows
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "zenflow/config.hpp"
#include "zenflow/error.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

namespace detail {
/// Whether a view's byte span fits in index_t: the last element's offset, sum of (extent - 1) *
/// stride over its dimensions, plus one, times the element size (extents >= 1, strides >= 1).
inline bool view_span_fits(std::initializer_list<std::pair<index_t, index_t>> extents_strides,
                           std::size_t element_size) noexcept {
  index_t last = 0;
  for (const auto& [extent, stride] : extents_strides) {
    index_t step = 0;
    if (__builtin_mul_overflow(extent - 1, stride, &step) || __builtin_add_overflow(last, step, &last)) return false;
  }
  index_t bytes = 0;
  return !__builtin_add_overflow(last, index_t{1}, &last) &&
         !__builtin_mul_overflow(last, static_cast<index_t>(element_size), &bytes);
}
}  // namespace detail

/// A strided 1-D view. `Void` is `void` (mutable) or `const void` (read-only).
template <class Void>
struct basic_vector_view {
  static_assert(std::is_void_v<Void>);
  Void* data = nullptr;
  index_t size = 0;
  index_t stride = 1;
  dtype type = dtype::f32;
  memory_space space = memory_space::host;

  constexpr basic_vector_view() = default;
  constexpr basic_vector_view(Void* data_, index_t size_, dtype type_, memory_space space_ = memory_space::host,
                              index_t stride_ = 1)
      : data(data_), size(size_), stride(stride_), type(type_), space(space_) {}
  /// A mutable view converts to a read-only one.
  template <class Other>
    requires(std::is_const_v<Void> && !std::is_const_v<Other>)
  constexpr basic_vector_view(const basic_vector_view<Other>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data), size(o.size), stride(o.stride), type(o.type), space(o.space) {}

  [[nodiscard]] constexpr bool empty() const noexcept { return size == 0; }
  [[nodiscard]] constexpr bool contiguous() const noexcept { return stride == 1 || size <= 1; }
  [[nodiscard]] constexpr std::size_t element_size() const noexcept { return dtype_size(type); }
  /// Typed pointer; throws if T does not match the view's dtype.
  template <class T>
  [[nodiscard]] auto as(const char* argument = "view") const {
    expects(dtype_of_v<std::remove_const_t<T>> == type && is_element_type_v<std::remove_const_t<T>>, argument,
            "element type mismatch: the view holds ", std::string(dtype_name(type)));
    using P = std::conditional_t<std::is_const_v<Void>, const std::remove_const_t<T>, T>;
    return static_cast<P*>(data);
  }

  /// Throws `zenflow::error(argument, ...)` if the view is malformed: negative size, null data with
  /// nonzero size, stride < 1, unknown dtype, or data not aligned to the element size.
  void validate(const char* argument) const {
    expects(is_valid(type), argument, "unknown dtype value ", static_cast<int>(type));
    expects(size >= 0, argument, "size must be >= 0, got ", size);
    if (size == 0) return;
    expects(data != nullptr, argument, "data is null but size is ", size);
    expects(stride >= 1, argument, "stride must be >= 1, got ", stride);
    expects(detail::view_span_fits({{size, stride}}, element_size()), argument, "size ", size, " with stride ", stride,
            " spans more bytes than a 64-bit offset holds");
    expects(reinterpret_cast<std::uintptr_t>(data) % element_size() == 0, argument, "data is not aligned to its ",
            element_size(), "-byte element type");
  }
  /// validate(), and the memory space must be `expected`.
  void validate(const char* argument, memory_space expected) const {
    validate(argument);
    expects(space == expected, argument, "expected ", std::string(memory_space_name(expected)),
            " memory, got ", std::string(memory_space_name(space)));
  }
};

/// A strided 2-D view (rows x cols). `Void` is `void` or `const void`.
template <class Void>
struct basic_matrix_view {
  static_assert(std::is_void_v<Void>);
  Void* data = nullptr;
  index_t rows = 0;
  index_t cols = 0;
  index_t row_stride = 0;
  index_t col_stride = 1;
  dtype type = dtype::f32;
  memory_space space = memory_space::host;

  constexpr basic_matrix_view() = default;
  constexpr basic_matrix_view(Void* data_, index_t rows_, index_t cols_, index_t row_stride_, index_t col_stride_,
                              dtype type_, memory_space space_)
      : data(data_), rows(rows_), cols(cols_), row_stride(row_stride_), col_stride(col_stride_), type(type_),
        space(space_) {}
  template <class Other>
    requires(std::is_const_v<Void> && !std::is_const_v<Other>)
  constexpr basic_matrix_view(const basic_matrix_view<Other>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data), rows(o.rows), cols(o.cols), row_stride(o.row_stride), col_stride(o.col_stride), type(o.type),
        space(o.space) {}

  /// Row-major `W[rows, cols]` (PyTorch's nn.Linear weight layout): a column is strided.
  static constexpr basic_matrix_view row_major(Void* data, index_t rows, index_t cols, dtype type,
                                               memory_space space = memory_space::host) {
    return {data, rows, cols, cols, 1, type, space};
  }
  /// Column-contiguous (the transposed layout): column c is `rows` consecutive elements.
  static constexpr basic_matrix_view column_contiguous(Void* data, index_t rows, index_t cols, dtype type,
                                                       memory_space space = memory_space::host) {
    return {data, rows, cols, 1, rows, type, space};
  }

  [[nodiscard]] constexpr index_t size() const noexcept { return rows * cols; }
  [[nodiscard]] constexpr bool empty() const noexcept { return rows == 0 || cols == 0; }
  [[nodiscard]] constexpr std::size_t element_size() const noexcept { return dtype_size(type); }
  [[nodiscard]] constexpr bool is_row_major() const noexcept { return col_stride == 1 && row_stride == cols; }
  [[nodiscard]] constexpr bool is_column_contiguous() const noexcept { return row_stride == 1 && col_stride == rows; }
  /// Offset in elements of (r, c).
  [[nodiscard]] constexpr index_t offset(index_t r, index_t c) const noexcept { return r * row_stride + c * col_stride; }
  /// Span in elements from the first to one past the last element.
  [[nodiscard]] constexpr index_t extent() const noexcept {
    return empty() ? 0 : (rows - 1) * row_stride + (cols - 1) * col_stride + 1;
  }
  template <class T>
  [[nodiscard]] auto as(const char* argument = "view") const {
    expects(dtype_of_v<std::remove_const_t<T>> == type && is_element_type_v<std::remove_const_t<T>>, argument,
            "element type mismatch: the view holds ", std::string(dtype_name(type)));
    using P = std::conditional_t<std::is_const_v<Void>, const std::remove_const_t<T>, T>;
    return static_cast<P*>(data);
  }

  /// Throws `zenflow::error(argument, ...)` if the view is malformed: negative extents, null data
  /// with elements, strides < 1, a layout in which two elements share an address, unknown dtype or
  /// data not aligned to the element size.
  void validate(const char* argument) const {
    expects(is_valid(type), argument, "unknown dtype value ", static_cast<int>(type));
    expects(rows >= 0 && cols >= 0, argument, "extents must be >= 0, got ", rows, " x ", cols);
    if (empty()) return;
    expects(data != nullptr, argument, "data is null but extents are ", rows, " x ", cols);
    expects(row_stride >= 1 && col_stride >= 1, argument, "strides must be >= 1, got row_stride ", row_stride,
            ", col_stride ", col_stride);
    expects(detail::view_span_fits({{rows, row_stride}, {cols, col_stride}}, element_size()), argument, "extents ",
            rows, " x ", cols, " with strides (", row_stride, ", ", col_stride,
            ") span more bytes than a 64-bit offset holds");
    // Non-overlapping: the larger stride must step over the whole extent of the smaller one.
    const bool rows_inner = row_stride <= col_stride;
    const index_t inner_stride = rows_inner ? row_stride : col_stride;
    const index_t inner_extent = rows_inner ? rows : cols;
    const index_t outer_stride = rows_inner ? col_stride : row_stride;
    const index_t outer_extent = rows_inner ? cols : rows;
    expects(outer_extent == 1 || inner_extent == 1 || outer_stride >= inner_stride * inner_extent, argument,
            "strides (", row_stride, ", ", col_stride, ") make elements overlap for extents ", rows, " x ", cols);
    expects(reinterpret_cast<std::uintptr_t>(data) % element_size() == 0, argument, "data is not aligned to its ",
            element_size(), "-byte element type");
  }
  void validate(const char* argument, memory_space expected) const {
    validate(argument);
    expects(space == expected, argument, "expected ", std::string(memory_space_name(expected)),
            " memory, got ", std::string(memory_space_name(space)));
  }
};

using vector_view = basic_vector_view<void>;
using const_vector_view = basic_vector_view<const void>;
using matrix_view = basic_matrix_view<void>;
using const_matrix_view = basic_matrix_view<const void>;

}  // namespace zenflow
