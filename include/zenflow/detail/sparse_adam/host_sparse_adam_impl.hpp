// Definitions of host_sparse_adam and the host gather/scatter helpers (included by
// zenflow/sparse_adam.hpp; not a public header).
#pragma once

#include <algorithm>
#include <array>

#include "zenflow/detail/sparse_adam/checks.hpp"
#include "zenflow/detail/sparse_adam/element.hpp"
#include "zenflow/sparse_adam.hpp"

namespace zenflow {

inline host_sparse_adam::host_sparse_adam(const adam_options& options) : options_(options) {
  options_.validate();
}

inline const host_sparse_adam::entry& host_sparse_adam::at(std::size_t i, const char* argument) const {
  expects(i < entries_.size(), argument, "parameter index ", i, " out of range (", entries_.size(), " registered)");
  return entries_[i];
}
inline host_sparse_adam::entry& host_sparse_adam::at(std::size_t i, const char* argument) {
  return const_cast<entry&>(std::as_const(*this).at(i, argument));
}

inline std::size_t host_sparse_adam::add_entry(entry e, std::span<const float> packed) {
  const std::size_t n = static_cast<std::size_t>(e.rows) * e.selection.size();
  e.master.assign(n, 0.0f);
  e.exp_avg.assign(n, 0.0f);
  e.exp_avg_sq.assign(n, 0.0f);
  e.group_index = e.is_vector ? vectors_.size() : matrices_.size();
  e.options = options_;
  e.steps = step_;
  entries_.push_back(std::move(e));
  const std::size_t index = entries_.size() - 1;
  (entries_.back().is_vector ? vectors_ : matrices_).push_back(index);
  if (!entries_.back().is_vector) ++matrix_count_;
  if (!packed.empty()) import_state(index, packed);
  return index;
}

inline std::size_t host_sparse_adam::add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                                                std::span<const float> initial_state_packed) {
  detail::sparse_adam::check_param_matrix(param, memory_space::host, "param");
  detail::sparse_adam::check_selection(initial_selection, param.cols, "initial_selection");
  detail::sparse_adam::check_buffer(initial_state_packed.size(),
                                    3 * param.rows * static_cast<index_t>(initial_selection.size()),
                                    "initial_state_packed");
  entry e;
  e.param = param;
  e.selection.assign(initial_selection.begin(), initial_selection.end());
  e.rows = param.rows;
  e.state_row_major = detail::sparse_adam::state_row_major_for(param.row_stride, param.col_stride);
  return add_entry(std::move(e), initial_state_packed);
}

inline std::size_t host_sparse_adam::add_vector(vector_view param, std::span<const float> initial_master) {
  param.validate("param", memory_space::host);
  expects(param.size > 0, "param", "must not be empty");
  detail::sparse_adam::check_buffer(initial_master.size(), param.size, "initial_master");
  entry e;
  e.is_vector = true;
  e.param = matrix_view(param.data, param.size, 1, param.stride, 1, param.type, param.space);
  e.selection = {0};
  e.rows = param.size;
  const std::size_t index = add_entry(std::move(e), {});
  std::copy_n(initial_master.begin(), param.size, entries_[index].master.begin());
  return index;
}

inline bool host_sparse_adam::is_vector(std::size_t i) const {
  return at(i).is_vector;
}
inline index_t host_sparse_adam::rows(std::size_t i) const {
  return at(i).rows;
}
inline std::span<const std::int32_t> host_sparse_adam::selection(std::size_t i) const {
  return at(i).selection;
}
inline index_t host_sparse_adam::k(std::size_t i) const {
  return static_cast<index_t>(at(i).selection.size());
}

inline void host_sparse_adam::set_options(const adam_options& options) {
  options.validate();
  options_ = options;
  for (auto& e : entries_) e.options = options;
}
inline const adam_options& host_sparse_adam::options(std::size_t i) const {
  return at(i).options;
}
inline void host_sparse_adam::set_options(std::size_t i, const adam_options& options) {
  entry& e = at(i);
  options.validate();
  const char* field = options.differs_beyond_lr_and_weight_decay(options_);
  expects(field == nullptr, field ? field : "options", "parameter groups differ in lr and weight_decay only");
  e.options = options;
}
inline std::int64_t host_sparse_adam::step_count(std::size_t i) const {
  return at(i).steps;
}
inline void host_sparse_adam::set_step_count(std::int64_t step) {
  expects(step >= 0, "step", "must be >= 0, got ", step);
  step_ = step;
  for (auto& e : entries_) e.steps = step;
}
inline void host_sparse_adam::set_step_count(std::size_t i, std::int64_t step) {
  entry& e = at(i);
  expects(step >= 0, "step", "must be >= 0, got ", step);
  e.steps = step;
}

inline bool host_sparse_adam::step(std::span<const const_matrix_view> matrix_grads,
                                   std::span<const const_vector_view> vector_grads, float grad_scale,
                                   const float* scale_ptr, const int* skip_flag, bool check_finite) {
  namespace sa = detail::sparse_adam;
  expects(matrix_grads.size() == matrices_.size(), "matrix_grads", "has ", matrix_grads.size(),
          " views, expected one per matrix parameter (", matrices_.size(), ")");
  expects(vector_grads.size() == vectors_.size(), "vector_grads", "has ", vector_grads.size(),
          " views, expected one per vector parameter (", vectors_.size(), ")");
  expects(is_finite_bits(grad_scale) && grad_scale >= 0.0f, "grad_scale", "must be finite and >= 0, got ", grad_scale);
  // Each parameter's gradient, as a matrix view (a vector is one column).
  std::vector<const_matrix_view> grads(entries_.size());
  // A view with data == nullptr: no gradient for that parameter this step.
  for (std::size_t g = 0; g < matrices_.size(); ++g) {
    if (matrix_grads[g].data == nullptr) continue;
    sa::check_grad_matrix(matrix_grads[g], entries_[matrices_[g]].param, memory_space::host, "matrix_grads");
    grads[matrices_[g]] = matrix_grads[g];
  }
  for (std::size_t g = 0; g < vectors_.size(); ++g) {
    const auto& v = vector_grads[g];
    if (v.data == nullptr) continue;
    v.validate("vector_grads", memory_space::host);
    expects(v.size == entries_[vectors_[g]].rows, "vector_grads", "size ", v.size, " does not match the parameter's ",
            entries_[vectors_[g]].rows);
    grads[vectors_[g]] = const_matrix_view(v.data, v.size, 1, v.stride, 1, v.type, v.space);
  }
  if (entries_.empty()) return false;  // as the device backend: nothing to step, the count stays
  if (skip_flag != nullptr && *skip_flag != 0) return false;
  const float scale = sa::effective_scale(grad_scale, scale_ptr);
  if (!sa::usable_scale(scale)) return false;

  // Visits (state index, parameter offset, gradient value) of every updated element, in the
  // order of the compact state (rows inner for the column layout, slots inner for the row one).
  auto for_each_element = [&](std::size_t i, auto&& f) {
    const entry& e = entries_[i];
    const const_matrix_view& g = grads[i];
    const sa::state_layout layout{e.rows, static_cast<index_t>(e.selection.size()), e.state_row_major};
    const index_t outer = layout.row_major ? layout.rows : layout.k;
    const index_t inner = layout.row_major ? layout.k : layout.rows;
    for (index_t a = 0; a < outer; ++a)
      for (index_t b = 0; b < inner; ++b) {
        const index_t r = layout.row_major ? a : b;
        const index_t j = layout.row_major ? b : a;
        const index_t c = e.selection[static_cast<std::size_t>(j)];
        f(layout.index(r, j), e.param.offset(r, c), sa::load_as_float(g.data, g.type, g.offset(r, c)));
      }
  };
  if (check_finite)
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (grads[i].data == nullptr) continue;
      bool finite = true;
      // The scaled value, as the CPU Adam checks it: a finite gradient that overflows when scaled
      // skips the step too.
      for_each_element(i, [&](index_t, index_t, float g) { finite &= is_finite_bits(sa::scaled(g, scale)); });
      if (!finite) return false;
    }

  for (std::size_t i = 0; i < entries_.size(); ++i) {
    entry& e = entries_[i];
    if (grads[i].data == nullptr) continue;  // no gradient: untouched, its count stays
    const adam_step_constants c = make_adam_step_constants(e.options, e.steps + 1, scale);
    dispatch_dtype(e.param.type, [&](auto tag) {
      using T = decltype(tag);
      T* p = static_cast<T*>(e.param.data);
      for_each_element(i, [&](index_t s, index_t offset, float g) {
        sa::update_element(p[offset], e.master[s], e.exp_avg[s], e.exp_avg_sq[s], g, c);
      });
    });
    ++e.steps;
  }
  ++step_;
  return true;
}

inline index_t host_sparse_adam::migration_count(std::size_t i, std::span<const std::int32_t> new_selection) const {
  const entry& e = at(i);
  expects(!e.is_vector, "i", "parameter ", i, " is a vector: it has no selection to change");
  detail::sparse_adam::check_selection(new_selection, e.param.cols, "new_selection");
  return detail::sparse_adam::migration_plan(e.selection, new_selection);
}

inline void host_sparse_adam::reselect(std::size_t i, std::span<const std::int32_t> new_selection,
                                       std::span<const float> entering_in, std::span<float> leaving_out) {
  namespace sa = detail::sparse_adam;
  entry& e = at(i);
  expects(!e.is_vector, "i", "parameter ", i, " is a vector: it has no selection to change");
  sa::check_selection(new_selection, e.param.cols, "new_selection");
  expects(new_selection.size() == e.selection.size(), "new_selection", "has ", new_selection.size(),
          " columns, expected k = ", e.selection.size());
  std::vector<std::int32_t> source, leaving;
  const index_t moved = sa::migration_plan(e.selection, new_selection, &source, &leaving);
  sa::check_buffer(entering_in.size(), 3 * e.rows * moved, "entering_in");
  sa::check_buffer(leaving_out.size(), 3 * e.rows * moved, "leaving_out");

  const index_t k = static_cast<index_t>(new_selection.size());
  const sa::state_layout layout{e.rows, k, e.state_row_major};
  std::array<std::vector<float>*, 3> old_parts{&e.master, &e.exp_avg, &e.exp_avg_sq};
  std::array<std::vector<float>, 3> new_parts;
  index_t entering = 0;
  for (int p = 0; p < 3; ++p) new_parts[p].resize(old_parts[p]->size());
  for (index_t j = 0; j < k; ++j) {
    const std::int32_t from = source[static_cast<std::size_t>(j)];
    for (int p = 0; p < 3; ++p)
      for (index_t r = 0; r < e.rows; ++r)
        new_parts[p][layout.index(r, j)] =
            from >= 0 ? (*old_parts[p])[layout.index(r, from)] : entering_in[sa::packed_index(e.rows, entering, p, r)];
    if (from < 0) ++entering;
  }
  for (std::size_t l = 0; l < leaving.size(); ++l)
    for (int p = 0; p < 3; ++p)
      for (index_t r = 0; r < e.rows; ++r)
        leaving_out[sa::packed_index(e.rows, static_cast<index_t>(l), p, r)] =
            (*old_parts[p])[layout.index(r, leaving[l])];
  for (int p = 0; p < 3; ++p) old_parts[p]->swap(new_parts[p]);
  e.selection.assign(new_selection.begin(), new_selection.end());
}

inline void host_sparse_adam::export_state(std::size_t i, std::span<float> packed_out) const {
  namespace sa = detail::sparse_adam;
  const entry& e = at(i);
  const index_t k = static_cast<index_t>(e.selection.size());
  sa::check_buffer(packed_out.size(), 3 * e.rows * k, "packed_out");
  const sa::state_layout layout{e.rows, k, e.state_row_major};
  const std::array<const std::vector<float>*, 3> parts{&e.master, &e.exp_avg, &e.exp_avg_sq};
  for (index_t j = 0; j < k; ++j)
    for (int p = 0; p < 3; ++p)
      for (index_t r = 0; r < e.rows; ++r)
        packed_out[sa::packed_index(e.rows, j, p, r)] = (*parts[p])[layout.index(r, j)];
}

inline void host_sparse_adam::import_state(std::size_t i, std::span<const float> packed_in) {
  namespace sa = detail::sparse_adam;
  entry& e = at(i);
  const index_t k = static_cast<index_t>(e.selection.size());
  sa::check_buffer(packed_in.size(), 3 * e.rows * k, "packed_in");
  const sa::state_layout layout{e.rows, k, e.state_row_major};
  const std::array<std::vector<float>*, 3> parts{&e.master, &e.exp_avg, &e.exp_avg_sq};
  for (index_t j = 0; j < k; ++j)
    for (int p = 0; p < 3; ++p)
      for (index_t r = 0; r < e.rows; ++r)
        (*parts[p])[layout.index(r, j)] = packed_in[sa::packed_index(e.rows, j, p, r)];
}

inline void gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                           float scale) {
  namespace sa = detail::sparse_adam;
  src.validate("src", memory_space::host);
  detail::sparse_adam::check_columns_in_range(columns, src.cols, "columns");
  expects(is_valid(dst_type), "dst_type", "unknown dtype value ", static_cast<int>(dst_type));
  expects(dst != nullptr || columns.empty() || src.rows == 0, "dst", "is null");
  expects(is_finite_bits(scale), "scale", "must be finite, got ", scale);
  const index_t n = static_cast<index_t>(columns.size());
  // Row blocks keep a row-major source's reads within a few cache lines per row.
  constexpr index_t block = 64;
  for (index_t r0 = 0; r0 < src.rows; r0 += block)
    for (index_t i = 0; i < n; ++i)
      for (index_t r = r0; r < std::min(src.rows, r0 + block); ++r)
        sa::store_from_float(dst, dst_type, i * src.rows + r,
                             sa::scaled(sa::load_as_float(src.data, src.type, src.offset(r, columns[i])), scale));
}

inline void scatter_columns(const void* src, dtype src_type, std::span<const std::int32_t> columns, matrix_view dst) {
  namespace sa = detail::sparse_adam;
  dst.validate("dst", memory_space::host);
  detail::sparse_adam::check_columns_in_range(columns, dst.cols, "columns");
  expects(is_valid(src_type), "src_type", "unknown dtype value ", static_cast<int>(src_type));
  expects(src != nullptr || columns.empty() || dst.rows == 0, "src", "is null");
  const index_t n = static_cast<index_t>(columns.size());
  constexpr index_t block = 64;
  for (index_t r0 = 0; r0 < dst.rows; r0 += block)
    for (index_t i = 0; i < n; ++i)
      for (index_t r = r0; r < std::min(dst.rows, r0 + block); ++r)
        sa::store_from_float(dst.data, dst.type, dst.offset(r, columns[i]),
                             sa::load_as_float(src, src_type, i * dst.rows + r));
}

inline std::vector<std::int32_t> complement_columns(std::span<const std::int32_t> selection, index_t cols) {
  expects(cols >= 0 && cols <= std::numeric_limits<std::int32_t>::max(), "cols", "must be in [0, 2^31), got ", cols);
  detail::sparse_adam::check_sorted_columns(selection, cols, "selection");
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(cols) - selection.size());
  std::size_t s = 0;
  for (std::int32_t c = 0; c < cols; ++c) {
    if (s < selection.size() && selection[s] == c)
      ++s;
    else
      out.push_back(c);
  }
  return out;
}

}  // namespace zenflow
