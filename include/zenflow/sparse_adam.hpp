// Sparse-column Adam/AdamW: the optimizer of the important columns (ZenFlow steps 2 and 5).
//
// It owns the fp32 master weights and Adam moments of the *selected* columns of each 2-D
// parameter (compact, k columns of `rows` values) and of every 1-D parameter (biases, norms:
// always fully updated here), and updates the model's parameters in place on exactly those
// columns, every step, from the current gradient. Columns that are not selected are never
// written (byte-for-byte unchanged): the CPU optimizer owns them.
//
// This header is the host backend (the "device memory" is host memory; plain C++20). The CUDA
// backend, with the same API plus streams, is `cuda_sparse_adam` in sparse_adam.cuh. The host
// backend's calls take a host_execution (host_stream.hpp): the thread pool they spread over (none:
// the calling thread) and the SIMD path (the CPU Adam's AVX-512 / AVX2 / scalar, chosen at run
// time); neither changes a bit of any result.
//
// Packed migration format (reselection, add_matrix, export/import_state): for n columns of a
// parameter with `rows` rows, for each column in list order,
//     [fp32 master (rows floats), exp_avg (rows floats), exp_avg_sq (rows floats)]
// i.e. 3 * rows floats per column, 3 * rows * n in all; value (column l, part p, row r) sits at
// (l * 3 + p) * rows + r. A 1-D parameter of size n is one column of n rows. This is the device
// exchange layout of state_slots.hpp for adam_state_slots, the host optimizer's slots.
//
// Parameter indices: add_matrix and add_vector return one index space, in order of
// registration. step() takes the gradients of the matrices in the order the matrices were
// added and those of the vectors in the order the vectors were added.
//
// An f32 parameter registered with its own values as its master (add_matrix's initial state,
// add_vector's initial master: bit for bit the parameter's selected columns, as a trainer whose
// parameters are their masters registers them) is its own fp32 master (this backend; the CUDA one
// keeps a copy): no separate master is held for it, only m and v (8 bytes per selected element
// instead of 12). Its master part in the packed format is read from the parameter's selected
// columns and written to them (import_state, reselect's entering columns), and an edit of those
// columns between steps is the master the next step starts from. Registered with another master
// (the trainer keeps one of its own), it keeps a copy, as a bf16/f16 parameter does. Registration
// never writes the parameter: its values stay the trainer's until the first step, as on the CUDA
// backend. Results are the same bits either way.
//
// Math: every element is adam_math.hpp's adam_update on the fp32 master, then the parameter is
// the master rounded to nearest even to its dtype. Step counts are 1-based as in
// make_adam_step_constants and count applied steps only. As torch keeps a `step` per parameter,
// each parameter has its own count (its bias correction): a step that has no gradient for a
// parameter (a view with data == nullptr: torch's `grad is None`) leaves that parameter, its state
// and its count untouched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "zenflow/adam_math.hpp"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"
#include "zenflow/options.hpp"
#include "zenflow/state_slots.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

/// Host backend of the sparse-column Adam; models `zenflow::device_optimizer`. Not thread-safe:
/// one caller at a time. Every call is synchronous; calls that take a host_execution spread their
/// work over its pool, all parameters of a step in one parallel pass, and throw
/// `zenflow::error` ("exec.isa") for a SIMD path this CPU lacks before changing anything.
class host_sparse_adam {
 public:
  /// Its state in fp32 slots (state_slots.hpp): master, exp_avg, exp_avg_sq; the packed format
  /// is their device exchange layout.
  using slots_type = adam_state_slots;
  /// Its hyper-parameters (hyper_parameters.hpp).
  using hyper_parameters = adam_options;

  /// Throws zenflow::error for invalid options.
  explicit host_sparse_adam(const adam_options& options);

  /// Registers a 2-D parameter (rows x cols, any layout, f32/bf16/f16, host memory) updated in
  /// place on its selected columns only. `initial_selection`: k in [1, cols] column indices,
  /// strictly ascending. `initial_state_packed`: the packed state of those columns (at least
  /// 3 * rows * k floats, normally from the CPU master). Returns the parameter's index.
  std::size_t add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                         std::span<const float> initial_state_packed, const host_execution& exec = {});
  /// Registers a 1-D parameter, always fully updated here, with its fp32 master (size floats);
  /// moments start at 0. Returns the parameter's index.
  std::size_t add_vector(vector_view param, std::span<const float> initial_master);

  [[nodiscard]] std::size_t parameter_count() const noexcept { return entries_.size(); }
  [[nodiscard]] std::size_t matrix_count() const noexcept { return matrix_count_; }
  [[nodiscard]] std::size_t vector_count() const noexcept { return entries_.size() - matrix_count_; }
  [[nodiscard]] bool is_vector(std::size_t i) const;
  /// Rows of parameter i (a vector's size).
  [[nodiscard]] index_t rows(std::size_t i) const;
  /// Selected columns of parameter i, ascending ({0} for a vector).
  [[nodiscard]] std::span<const std::int32_t> selection(std::size_t i) const;
  /// Number of selected columns of parameter i (1 for a vector).
  [[nodiscard]] index_t k(std::size_t i) const;

  [[nodiscard]] const adam_options& options() const noexcept { return options_; }
  /// Validates, then replaces the hyper-parameters of every parameter for the next steps.
  void set_options(const adam_options& options);
  /// Parameter i's hyper-parameters (options() unless set_options(i, ...) changed them).
  [[nodiscard]] const adam_options& options(std::size_t i) const;
  /// Parameter groups: parameter i's hyper-parameters for the next steps. They may differ from
  /// options() in the per-group fields only (lr, beta1, beta2, eps, weight_decay; throws naming the
  /// first other field that differs).
  void set_options(std::size_t i, const adam_options& options);
  /// Number of applied steps (skipped steps do not count).
  [[nodiscard]] std::int64_t step_count() const noexcept { return step_; }
  /// Number of applied steps that had a gradient for parameter i: its next step uses
  /// t = step_count(i) + 1 for its bias correction. A parameter starts from step_count() as it was
  /// when the parameter was added.
  [[nodiscard]] std::int64_t step_count(std::size_t i) const;
  /// Sets the step count and every parameter's (checkpoint restore); must be >= 0.
  void set_step_count(std::int64_t step);
  /// Sets parameter i's step count (checkpoint restore); must be >= 0.
  void set_step_count(std::size_t i, std::int64_t step);

  /// One Adam/AdamW step of every parameter: selected columns of every matrix, all of every
  /// vector, from the current gradients (host views with the parameters' shapes, any layout and
  /// dtype; a view with data == nullptr: no gradient for that parameter this step, which is left
  /// as it is and does not count the step). Effective gradient scale = grad_scale * (*scale_ptr if scale_ptr). Nothing
  /// is modified and the step count does not advance (returns false) if `skip_flag` points to a nonzero value, if the
  /// effective scale is not finite or negative, or, with `check_finite`, if any gradient value the step reads is NaN or
  /// infinite once scaled (as the CPU Adam checks: a finite value that overflows when scaled skips too). Returns
  /// whether the step was applied. With no parameter registered there is nothing to step: returns false, the count
  /// stays.
  bool step(std::span<const const_matrix_view> matrix_grads, std::span<const const_vector_view> vector_grads,
            float grad_scale = 1.0f, const float* scale_ptr = nullptr, const int* skip_flag = nullptr,
            bool check_finite = false, const host_execution& exec = {});

  /// How many columns leave (= how many enter) when parameter i moves to `new_selection`.
  [[nodiscard]] index_t migration_count(std::size_t i, std::span<const std::int32_t> new_selection) const;
  /// Reselection with state migration. `new_selection`: k columns, strictly ascending, in range.
  /// Columns leaving (old \ new) write their packed state to `leaving_out` (in ascending column
  /// order); columns entering (new \ old) take theirs from `entering_in` (ascending order); kept
  /// columns keep their state. Both buffers hold at least 3 * rows * migration_count floats; they
  /// may alias (entering_in is fully read before leaving_out is written). Nothing is zeroed or
  /// truncated. Validates everything first.
  void reselect(std::size_t i, std::span<const std::int32_t> new_selection, std::span<const float> entering_in,
                std::span<float> leaving_out, const host_execution& exec = {});

  /// Packed state of the current selection of parameter i (at least 3 * rows * k floats).
  void export_state(std::size_t i, std::span<float> packed_out, const host_execution& exec = {}) const;
  /// Replaces the state of the current selection of parameter i from packed form. Writes the
  /// parameter only where it is its own master (f32: the master part goes to its selected columns);
  /// otherwise the next step does.
  void import_state(std::size_t i, std::span<const float> packed_in, const host_execution& exec = {});

 private:
  struct entry {
    bool is_vector = false;
    matrix_view param;  // a vector is one column of `size` rows
    std::vector<std::int32_t> selection;
    index_t rows = 0;
    bool state_row_major = false;
    std::vector<float> master, exp_avg, exp_avg_sq;
    std::size_t group_index = 0;  // position among matrices or among vectors
    adam_options options;         // this parameter's hyper-parameters
    std::int64_t steps = 0;       // applied steps that had a gradient for it
    /// An f32 parameter registered with its own values as master: its selected columns are the
    /// master (`master` stays empty).
    bool own_master = false;
    [[nodiscard]] bool master_in_param() const noexcept { return own_master; }
  };
  const entry& at(std::size_t i, const char* argument = "i") const;
  entry& at(std::size_t i, const char* argument = "i");
  std::size_t add_entry(entry e, std::span<const float> packed, const host_execution& exec);

  adam_options options_;
  std::int64_t step_ = 0;
  std::vector<entry> entries_;
  std::vector<std::size_t> matrices_, vectors_;  // global indices in group order
  std::size_t matrix_count_ = 0;
};

/// Gathers columns of `src` (host) into a compact column-contiguous buffer: the i-th listed
/// column goes to dst + i * rows (elements of `dst_type`), each value src * scale rounded to
/// nearest even. `columns` may be in any order; each index must be in [0, cols). Synchronous; on
/// exec's pool.
void gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                    float scale = 1.0f, const host_execution& exec = {});
/// Scatters a compact column-contiguous buffer (i-th listed column at src + i * rows, elements of
/// `src_type`) into columns `columns` of `dst` (host), converted to dst's dtype rounding to
/// nearest even. Other columns are untouched. A column listed twice is written twice, the later
/// entry last (cuda_scatter_columns leaves the winner unspecified: list each column once). Synchronous;
/// on exec's pool.
void scatter_columns(const void* src, dtype src_type, std::span<const std::int32_t> columns, matrix_view dst,
                     const host_execution& exec = {});
/// The columns of [0, cols) not in `selection` (strictly ascending, in range), ascending.
std::vector<std::int32_t> complement_columns(std::span<const std::int32_t> selection, index_t cols);

}  // namespace zenflow

#include "zenflow/detail/sparse_adam/host_sparse_adam_impl.hpp"
