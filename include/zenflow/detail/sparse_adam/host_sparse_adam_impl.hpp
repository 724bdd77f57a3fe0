// Definitions of host_sparse_adam and the host gather/scatter helpers (included by
// zenflow/sparse_adam.hpp; not a public header).
#pragma once

#include <algorithm>
#include <array>

#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/detail/host_device/columns.hpp"
#include "zenflow/detail/host_device/parallel.hpp"
#include "zenflow/detail/sparse_adam/checks.hpp"
#include "zenflow/detail/sparse_adam/element.hpp"
#include "zenflow/detail/sparse_adam/host_step.hpp"
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

namespace detail::sparse_adam {
/// Whether an f32 parameter's `selection` columns hold, bit for bit, the master part of `packed`
/// (3 * rows floats per column, the master first; for one column, a bare master does too).
inline bool holds_master(const matrix_view& param, std::span<const std::int32_t> selection,
                         std::span<const float> packed) {
  const auto* data = static_cast<const float*>(param.data);
  for (std::size_t j = 0; j < selection.size(); ++j)
    for (index_t r = 0; r < param.rows; ++r) {
      const float x = data[r * param.row_stride + selection[j] * param.col_stride];
      if (float_to_bits(x) !=
          float_to_bits(packed[j * part_count * static_cast<std::size_t>(param.rows) + static_cast<std::size_t>(r)]))
        return false;
    }
  return true;
}
}  // namespace detail::sparse_adam

inline std::size_t host_sparse_adam::add_entry(entry e, std::span<const float> packed, const host_execution& exec) {
  const std::size_t n = static_cast<std::size_t>(e.rows) * e.selection.size();
  if (!e.master_in_param()) e.master.assign(n, 0.0f);
  e.exp_avg.assign(n, 0.0f);
  e.exp_avg_sq.assign(n, 0.0f);
  e.group_index = e.is_vector ? vectors_.size() : matrices_.size();
  e.options = options_;
  e.steps = step_;
  entries_.push_back(std::move(e));
  const std::size_t index = entries_.size() - 1;
  (entries_.back().is_vector ? vectors_ : matrices_).push_back(index);
  if (!entries_.back().is_vector) ++matrix_count_;
  if (!packed.empty()) import_state(index, packed, exec);
  return index;
}

inline std::size_t host_sparse_adam::add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                                                std::span<const float> initial_state_packed,
                                                const host_execution& exec) {
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
  e.own_master =
      param.type == dtype::f32 && detail::sparse_adam::holds_master(param, e.selection, initial_state_packed);
  (void)detail::host_device::checked_isa(exec, "exec.isa");
  return add_entry(std::move(e), initial_state_packed, exec);
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
  e.own_master = param.type == dtype::f32 && detail::sparse_adam::holds_master(e.param, e.selection, initial_master);
  const std::size_t index = add_entry(std::move(e), {}, {});
  entry& added = entries_[index];
  if (!added.master_in_param()) std::copy_n(initial_master.begin(), param.size, added.master.begin());
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
  const char* field = shared_field_mismatch(options, options_);
  expects(field == nullptr, field ? field : "options", "must be as in options(): ", per_group_rule<adam_options>());
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

namespace detail::sparse_adam {
/// Entry `e`'s part in a host step with gradient `g` (see host_step.hpp).
inline host_step_item make_host_step_item(float* master, float* m, float* v, std::span<const std::int32_t> selection,
                                          index_t rows, bool state_row_major, const matrix_view& param,
                                          const const_matrix_view& g, cpu_isa isa, const adam_step_constants& c) {
  const auto k = static_cast<index_t>(selection.size());
  // One slot or one row: both layouts list the state in the same order; take the longer lines.
  const bool row_major = k == 1 ? false : rows == 1 ? true : state_row_major;
  host_step_item it;
  it.master = master;
  it.m = m;
  it.v = v;
  it.g = static_cast<const std::byte*>(g.data);
  it.g_size = dtype_size(g.type);
  it.p = static_cast<std::byte*>(param.data);
  it.p_size = dtype_size(param.type);
  if (row_major) {  // line a = row a, position b = slot b (column selection[b])
    it.lines = rows, it.line_len = k;
    it.g_lines = {nullptr, g.row_stride}, it.g_pos = {selection.data(), g.col_stride};
    it.p_lines = {nullptr, param.row_stride}, it.p_pos = {selection.data(), param.col_stride};
  } else {  // line a = slot a (column selection[a]), position b = row b
    it.lines = k, it.line_len = rows;
    it.g_lines = {selection.data(), g.col_stride}, it.g_pos = {nullptr, g.row_stride};
    it.p_lines = {selection.data(), param.col_stride}, it.p_pos = {nullptr, param.row_stride};
  }
  if (it.g_pos.stride == 1 && it.p_pos.stride == 1) {
    it.runs.push_back(0);
    if (it.g_pos.index != nullptr)  // runs of consecutive columns
      for (index_t b = 1; b < it.line_len; ++b)
        if (selection[static_cast<std::size_t>(b)] != selection[static_cast<std::size_t>(b - 1)] + 1)
          it.runs.push_back(b);
    it.runs.push_back(it.line_len);
    // Short runs cost a kernel call each: gather them instead.
    it.direct = it.line_len >= 16 * static_cast<index_t>(it.runs.size() - 1);
  }
  const index_t last = it.line_len - 1;
  const bool g_simd = it.g_pos.offset(last) < host_device::max_simd_offset;
  const bool p_simd = it.p_pos.offset(last) < host_device::max_simd_offset;
  it.c = c;
  // master == nullptr: the f32 parameter is the master (no copy-out; read from it when gathered).
  it.adam_direct = select_adam_range(isa, g.type, master != nullptr, param.type);
  it.scan_direct = select_nonfinite_range(isa, g.type);
  it.gather_g = host_device::select_copy_line(isa, g.type, dtype::f32, false, g_simd);
  if (master == nullptr) it.gather_p = host_device::select_copy_line(isa, dtype::f32, dtype::f32, false, p_simd);
  it.scatter_p = host_device::select_copy_line(isa, dtype::f32, param.type, false, p_simd);
  // A row's listed columns on a contiguous row (a row-major gradient's or parameter's selection):
  // chunk copies where the path has them and the columns are dense enough. A chunk costs about
  // what a gather instruction's 16 lanes do (measured on Zen 4): chunks win from 1.5 columns per
  // chunk on (2.4x at 5 per chunk), gathers below.
  const bool g_rows = it.g_pos.index != nullptr && it.g_pos.stride == 1;
  const bool p_rows = it.p_pos.index != nullptr && it.p_pos.stride == 1;
  const host_device::chunk_copy_fn gather_g = host_device::select_chunk_copy(isa, g.type, true);
  if (!it.direct && (g_rows || p_rows) && gather_g != nullptr) {  // nullptr: no chunk copies on this path
    auto chunks = host_device::make_line_chunks(selection.data(), k);
    if (2 * k >= 3 * static_cast<index_t>(chunks.size())) {
      it.chunks = std::move(chunks);
      if (g_rows) it.gather_g_chunks = gather_g;
      if (p_rows && master == nullptr) it.gather_p_chunks = host_device::select_chunk_copy(isa, dtype::f32, true);
      if (p_rows) it.scatter_p_chunks = host_device::select_chunk_copy(isa, param.type, false);
    }
  }
  return it;
}

/// The compact state of `rows` x `k` slots as one side of a column copy.
inline host_device::column_side state_side(const float* data, index_t rows, index_t k, bool row_major,
                                           const std::int32_t* slots = nullptr, index_t max_slot = -1) {
  return {data, dtype::f32, row_major ? k : 1, row_major ? 1 : rows, slots, slots != nullptr ? max_slot : k - 1};
}
/// Columns `columns` of a parameter as one side of a column copy (the master of an f32 parameter,
/// which is its own).
inline host_device::column_side param_side(const matrix_view& param, std::span<const std::int32_t> columns) {
  return {param.data, param.type, param.row_stride, param.col_stride, columns.data(), host_device::max_column(columns)};
}
/// Part `part` of a packed buffer of n columns as one side of a column copy.
inline host_device::column_side packed_side(const float* packed, index_t rows, int part, index_t n) {
  return {packed + static_cast<std::size_t>(part) * static_cast<std::size_t>(rows),
          dtype::f32,
          1,
          part_count * rows,
          nullptr,
          n - 1};
}
}  // namespace detail::sparse_adam

inline bool host_sparse_adam::step(std::span<const const_matrix_view> matrix_grads,
                                   std::span<const const_vector_view> vector_grads, float grad_scale,
                                   const float* scale_ptr, const int* skip_flag, bool check_finite,
                                   const host_execution& exec) {
  namespace sa = detail::sparse_adam;
  expects(matrix_grads.size() == matrices_.size(), "matrix_grads", "has ", matrix_grads.size(),
          " views, expected one per matrix parameter (", matrices_.size(), ")");
  expects(vector_grads.size() == vectors_.size(), "vector_grads", "has ", vector_grads.size(),
          " views, expected one per vector parameter (", vectors_.size(), ")");
  expects(is_finite_bits(grad_scale) && grad_scale >= 0.0f, "grad_scale", "must be finite and >= 0, got ", grad_scale);
  const cpu_isa isa = detail::host_device::checked_isa(exec, "exec.isa");
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

  // Every parameter with a gradient in one pass (its constants from its own step count).
  std::vector<sa::host_step_item> items;
  std::size_t total = 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    entry& e = entries_[i];
    if (grads[i].data == nullptr) continue;  // no gradient: untouched, its count stays
    items.push_back(sa::make_host_step_item(e.master_in_param() ? nullptr : e.master.data(), e.exp_avg.data(),
                                            e.exp_avg_sq.data(), e.selection, e.rows, e.state_row_major, e.param,
                                            grads[i], isa, make_adam_step_constants(e.options, e.steps + 1, scale)));
    items.back().begin = total;
    total += items.back().size();
  }
  const sa::host_step_kernels kernels{detail::select_adam_range(isa, dtype::f32, false, dtype::f32),
                                      detail::select_nonfinite_range(isa, dtype::f32)};
  // The scaled value, as the CPU Adam checks it: a finite gradient that overflows when scaled
  // skips the step too. A read-only pass first: nothing changes when it finds one.
  if (check_finite && sa::run_host_step(items, kernels, /*scan=*/true, scale, exec)) return false;
  sa::run_host_step(items, kernels, /*scan=*/false, scale, exec);
  for (std::size_t i = 0; i < entries_.size(); ++i)
    if (grads[i].data != nullptr) ++entries_[i].steps;
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
                                       std::span<const float> entering_in, std::span<float> leaving_out,
                                       const host_execution& exec) {
  namespace sa = detail::sparse_adam;
  namespace hd = detail::host_device;
  entry& e = at(i);
  expects(!e.is_vector, "i", "parameter ", i, " is a vector: it has no selection to change");
  sa::check_selection(new_selection, e.param.cols, "new_selection");
  expects(new_selection.size() == e.selection.size(), "new_selection", "has ", new_selection.size(),
          " columns, expected k = ", e.selection.size());
  const cpu_isa isa = hd::checked_isa(exec, "exec.isa");
  std::vector<std::int32_t> source, leaving;
  const index_t moved = sa::migration_plan(e.selection, new_selection, &source, &leaving);
  sa::check_buffer(entering_in.size(), 3 * e.rows * moved, "entering_in");
  sa::check_buffer(leaving_out.size(), 3 * e.rows * moved, "leaving_out");

  const auto k = static_cast<index_t>(new_selection.size());
  std::vector<std::int32_t> kept_slots, kept_from, entering_slots;
  for (index_t j = 0; j < k; ++j) {
    const std::int32_t from = source[static_cast<std::size_t>(j)];
    if (from >= 0) {
      kept_slots.push_back(static_cast<std::int32_t>(j));
      kept_from.push_back(from);
    } else {
      entering_slots.push_back(static_cast<std::int32_t>(j));
    }
  }
  const auto kept = static_cast<index_t>(kept_slots.size());
  std::array<std::vector<float>*, 3> old_parts{&e.master, &e.exp_avg, &e.exp_avg_sq};
  std::array<std::vector<float>, 3> new_parts;
  // The parameter as its own master: kept columns keep their values where they are; the entering
  // columns' masters go straight from entering_in into the parameter (before leaving_out, which may
  // alias it, is written), and the leaving ones are read from it (other columns: no overlap).
  const int first_part = e.master_in_param() ? 1 : 0;
  std::vector<std::int32_t> leaving_columns, entering_columns;
  if (e.master_in_param()) {
    for (const std::int32_t slot : leaving) leaving_columns.push_back(e.selection[static_cast<std::size_t>(slot)]);
    for (const std::int32_t slot : entering_slots)
      entering_columns.push_back(new_selection[static_cast<std::size_t>(slot)]);
    hd::copy_columns(sa::packed_side(entering_in.data(), e.rows, 0, moved), sa::param_side(e.param, entering_columns),
                     e.rows, moved, false, 1.0f, exec, isa, false);
  }
  // The new state: kept slots from the old state, entering ones from entering_in (read whole
  // before leaving_out, which may alias it, is written).
  for (int p = first_part; p < 3; ++p) {
    new_parts[p].resize(old_parts[p]->size());
    const float* old_state = old_parts[p]->data();
    hd::copy_columns(
        sa::state_side(old_state, e.rows, k, e.state_row_major, kept_from.data(), hd::max_column(kept_from)),
        sa::state_side(new_parts[p].data(), e.rows, k, e.state_row_major, kept_slots.data(),
                       hd::max_column(kept_slots)),
        e.rows, kept, false, 1.0f, exec, isa, false);
    hd::copy_columns(sa::packed_side(entering_in.data(), e.rows, p, moved),
                     sa::state_side(new_parts[p].data(), e.rows, k, e.state_row_major, entering_slots.data(),
                                    hd::max_column(entering_slots)),
                     e.rows, moved, false, 1.0f, exec, isa, false);
  }
  for (int p = 0; p < 3; ++p)
    hd::copy_columns(p < first_part ? sa::param_side(e.param, leaving_columns)
                                    : sa::state_side(old_parts[p]->data(), e.rows, k, e.state_row_major, leaving.data(),
                                                     hd::max_column(leaving)),
                     sa::packed_side(leaving_out.data(), e.rows, p, moved), e.rows, moved, false, 1.0f, exec, isa,
                     false);
  for (int p = first_part; p < 3; ++p) old_parts[p]->swap(new_parts[p]);
  e.selection.assign(new_selection.begin(), new_selection.end());
}

inline void host_sparse_adam::export_state(std::size_t i, std::span<float> packed_out,
                                           const host_execution& exec) const {
  namespace sa = detail::sparse_adam;
  const entry& e = at(i);
  const auto k = static_cast<index_t>(e.selection.size());
  sa::check_buffer(packed_out.size(), 3 * e.rows * k, "packed_out");
  const cpu_isa isa = detail::host_device::checked_isa(exec, "exec.isa");
  const std::array<const std::vector<float>*, 3> parts{&e.master, &e.exp_avg, &e.exp_avg_sq};
  for (int p = 0; p < 3; ++p)
    detail::host_device::copy_columns(
        p == 0 && e.master_in_param() ? sa::param_side(e.param, e.selection)
                                      : sa::state_side(parts[p]->data(), e.rows, k, e.state_row_major),
        sa::packed_side(packed_out.data(), e.rows, p, k), e.rows, k, false, 1.0f, exec, isa, false);
}

inline void host_sparse_adam::import_state(std::size_t i, std::span<const float> packed_in,
                                           const host_execution& exec) {
  namespace sa = detail::sparse_adam;
  entry& e = at(i);
  const auto k = static_cast<index_t>(e.selection.size());
  sa::check_buffer(packed_in.size(), 3 * e.rows * k, "packed_in");
  const cpu_isa isa = detail::host_device::checked_isa(exec, "exec.isa");
  const std::array<std::vector<float>*, 3> parts{&e.master, &e.exp_avg, &e.exp_avg_sq};
  for (int p = 0; p < 3; ++p)
    detail::host_device::copy_columns(sa::packed_side(packed_in.data(), e.rows, p, k),
                                      p == 0 && e.master_in_param()
                                          ? sa::param_side(e.param, e.selection)
                                          : sa::state_side(parts[p]->data(), e.rows, k, e.state_row_major),
                                      e.rows, k, false, 1.0f, exec, isa, false);
}

inline void gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                           float scale, const host_execution& exec) {
  namespace hd = detail::host_device;
  src.validate("src", memory_space::host);
  detail::sparse_adam::check_columns_in_range(columns, src.cols, "columns");
  expects(is_valid(dst_type), "dst_type", "unknown dtype value ", static_cast<int>(dst_type));
  expects(dst != nullptr || columns.empty() || src.rows == 0, "dst", "is null");
  expects(is_finite_bits(scale), "scale", "must be finite, got ", scale);
  const cpu_isa isa = hd::checked_isa(exec, "exec.isa");
  const auto n = static_cast<index_t>(columns.size());
  hd::copy_columns({src.data, src.type, src.row_stride, src.col_stride, columns.data(), hd::max_column(columns)},
                   {dst, dst_type, 1, src.rows, nullptr, n - 1}, src.rows, n, true, scale, exec, isa, false);
}

inline void scatter_columns(const void* src, dtype src_type, std::span<const std::int32_t> columns, matrix_view dst,
                            const host_execution& exec) {
  namespace hd = detail::host_device;
  dst.validate("dst", memory_space::host);
  detail::sparse_adam::check_columns_in_range(columns, dst.cols, "columns");
  expects(is_valid(src_type), "src_type", "unknown dtype value ", static_cast<int>(src_type));
  expects(src != nullptr || columns.empty() || dst.rows == 0, "src", "is null");
  const cpu_isa isa = hd::checked_isa(exec, "exec.isa");
  const auto n = static_cast<index_t>(columns.size());
  hd::copy_columns({src, src_type, 1, dst.rows, nullptr, n - 1},
                   {dst.data, dst.type, dst.row_stride, dst.col_stride, columns.data(), hd::max_column(columns)},
                   dst.rows, n, false, 1.0f, exec, isa, /*ordered=*/!hd::strictly_ascending(columns));
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
