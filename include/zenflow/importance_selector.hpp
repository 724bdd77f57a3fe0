// The importance selector: per-column gradient scores, top-k column selection per 2-D parameter,
// the refresh policy and the temporal-locality (overlap) figure. (The gradient statistics used for
// clipping and the skip check are gradient_stats.hpp's.)
//
// This header is the host backend and the exact reference the CUDA backend
// (`importance_selector.cuh`) is tested against. Everything here compiles with a plain C++20 host
// compiler and synchronizes with nothing (there is no device work).
//
// Definitions used everywhere below:
//   - score of column c = sum over rows r = 0, 1, ..., rows-1 (in that order) of |g(r, c)| (L1)
//     or g(r, c)^2 (L2 squared), each term and each addition in fp32, starting from +0. (The
//     CUDA backend sums in its own fixed order, warp by warp, and may fuse an L2 square into its
//     addition: its scores are deterministic and within 1e-5 relative of this reference, never
//     bit-equal to it; its top-k is exactly this top-k applied to its own scores.)
//   - k = max(1, floor(topk_ratio * cols)), a float ratio read as the decimal it prints as
//     (topk_count).
//   - the selection = the k columns with the largest scores; among equal scores (-0 == +0) the
//     lower column index wins; reported as ascending int32 column indices.
//   - overlap = |previous ∩ current| / |current| (0 when there is no previous selection).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "zenflow/concepts.hpp"
#include "zenflow/config.hpp"
#include "zenflow/detail/importance_selector/math.hpp"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

// --- reference functions ------------------------------------------------------------------------

/// Column scores of `grad` (host memory, any layout and dtype) into `scores` (size grad.cols), in
/// the documented fp32 order. Throws `zenflow::error` ("grad", "scores") for a malformed view, a
/// device view or a size mismatch. Synchronous (host only).
inline void column_scores(const_matrix_view grad, score_norm norm, std::span<float> scores);

/// k = max(1, floor(topk_ratio * cols)), in double. A ratio that is exactly a float (the options
/// hold it as one) counts as the shortest decimal that rounds to that float: 0.7f, which is
/// 0.69999998..., is 0.7, so 0.7 of 10 columns is 7 (as Python's int(0.7 * 10)), not 6. The
/// product is then the double one, as Python's: 0.29 of 100 columns is 28 (0.29 * 100 is
/// 28.999999999999996). Throws
/// ("topk_ratio") unless topk_ratio is finite and in (0, 1], and ("cols") unless 1 <= cols <=
/// INT32_MAX.
inline index_t topk_count(double topk_ratio, index_t cols);

/// The k largest scores' indices, ascending, ties to the lower index (the ranking uses
/// `orderable_key`, so -0 == +0). Throws ("k") unless 1 <= k <= scores.size(), ("out") unless
/// out.size() == k, ("scores") if a score is NaN or there are more than INT32_MAX scores. `out` is
/// written only after every check passed. O(n) expected (nth_element) plus O(k log k).
inline void topk_columns(std::span<const float> scores, index_t k, std::span<std::int32_t> out);

/// |previous ∩ current| / |current| for two ascending index lists; 0 when `previous` (or
/// `current`) is empty.
inline double selection_overlap(std::span<const std::int32_t> previous, std::span<const std::int32_t> current);

// --- communicator -------------------------------------------------------------------------------

/// score_communicator: reduces score vectors across data-parallel ranks so that every rank selects
/// the same columns from the global scores (cols floats per parameter, never gradients).
///    R1 `c.all_reduce_sum(std::span<float>)` — in-place elementwise sum over all ranks; every rank
///       must receive bitwise identical results.
///    R2 `c.world_size()` — the number of ranks (1: the reduction is skipped).
template <class C>
concept score_communicator = requires(C& c, const C& cc, std::span<float> values) {
  c.all_reduce_sum(values);
  { cc.world_size() } -> std::convertible_to<int>;
};

/// The single-process communicator: world size 1, the reduction is the identity. It also provides
/// the stream-ordered device overload the CUDA selector uses.
struct identity_communicator {
  void all_reduce_sum(std::span<float>) const noexcept {}
  template <class Stream>
  void all_reduce_sum(std::span<float>, Stream) const noexcept {}
  [[nodiscard]] int world_size() const noexcept { return 1; }
};
static_assert(score_communicator<identity_communicator>);

// --- refresh policy -----------------------------------------------------------------------------

/// When to re-select: at step 0 and then every `interval_steps()` steps, where the interval is
/// `zenflow_options::select_interval_steps()` (select_strategy step / epoch / auto resolved, with
/// `select_interval` "auto" meaning every epoch or every `auto_select_steps` steps).
class selection_policy {
 public:
  /// Throws `zenflow::error` naming the option if `options.validate()` fails.
  explicit selection_policy(const schedule_options& options)
      : strategy_((options.validate(), options.resolved_strategy())), interval_(options.select_interval_steps()) {}

  /// True when a selection is due before the optimizer step of training step `step` (0-based).
  /// Throws ("step") for a negative step.
  [[nodiscard]] bool should_select(std::int64_t step) const {
    expects(step >= 0, "step", "must be >= 0, got ", step);
    return step % interval_ == 0;
  }
  /// The resolved interval between selections, in steps (>= 1).
  [[nodiscard]] std::int64_t interval_steps() const noexcept { return interval_; }
  /// The strategy after resolving "auto".
  [[nodiscard]] selection_strategy strategy() const noexcept { return strategy_; }

 private:
  selection_strategy strategy_;
  std::int64_t interval_;
};

}  // namespace zenflow

#include "zenflow/detail/importance_selector/host_impl.hpp"

namespace zenflow {

// --- host selector ------------------------------------------------------------------------------

/// The host backend of the importance selector (models `zenflow::importance_selector`): owns the
/// scores and selections of every registered 2-D parameter. Not thread-safe; every call is
/// synchronous.
template <class Communicator = identity_communicator>
requires score_communicator<Communicator>
class host_importance_selector {
 public:
  /// Throws ("topk_ratio") unless it is finite and in (0, 1].
  explicit host_importance_selector(double topk_ratio, score_norm norm = score_norm::l1, Communicator comm = {})
      : state_(topk_ratio, norm), comm_(std::move(comm)) {}

  /// Registers a rows x cols parameter and returns its index. Throws ("rows" / "cols") unless
  /// rows >= 1 and 1 <= cols <= INT32_MAX. The new parameter has no selection until select().
  std::size_t add_parameter(index_t rows, index_t cols) { return state_.add_parameter(rows, cols); }

  [[nodiscard]] std::size_t parameter_count() const noexcept { return state_.parameter_count(); }
  [[nodiscard]] index_t k(std::size_t i) const { return state_.k(i); }
  [[nodiscard]] index_t rows(std::size_t i) const { return state_.rows(i); }
  [[nodiscard]] index_t cols(std::size_t i) const { return state_.cols(i); }
  [[nodiscard]] double topk_ratio() const noexcept { return state_.topk_ratio(); }
  [[nodiscard]] score_norm norm() const noexcept { return state_.norm(); }
  [[nodiscard]] const Communicator& communicator() const noexcept { return comm_; }

  /// Scores every registered parameter from `grads[i]` (host memory, any layout and dtype),
  /// all-reduces the scores through the communicator (one call over all parameters' scores), then
  /// selects the top k of each. Every view is validated first ("grads": count, shape, memory
  /// space); a NaN score throws ("grads") too. On any throw the scores, selections and overlap
  /// figures are unchanged. Synchronous.
  void select(std::span<const const_matrix_view> grads) {
    state_.validate_grads(grads, memory_space::host);
    std::vector<float> scores(state_.total_score_size(), 0.0f);
    for (std::size_t i = 0; i < grads.size(); ++i)
      column_scores(grads[i], state_.norm(), std::span<float>(scores).subspan(state_.score_offset(i), state_.cols(i)));
    if (comm_.world_size() > 1) comm_.all_reduce_sum(std::span<float>(scores));
    std::vector<std::int32_t> indices(state_.total_k());
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const auto s = std::span<const float>(scores).subspan(state_.score_offset(i), state_.cols(i));
      expects(std::none_of(s.begin(), s.end(), [](float x) { return x != x; }), "grads", "parameter ", i,
              " has NaN column scores (non-finite gradient)");
      topk_columns(s, state_.k(i), std::span<std::int32_t>(indices).subspan(state_.k_offset(i), state_.k(i)));
    }
    state_.commit(std::move(scores), indices);
  }

  /// True once every registered parameter has a selection (from select() or set_selection()).
  [[nodiscard]] bool has_selection() const noexcept { return state_.has_selection(); }
  /// Parameter i's selected columns, ascending (empty before its first selection).
  [[nodiscard]] std::span<const std::int32_t> selected(std::size_t i) const { return state_.selected(i); }
  /// The selection before the last select() (empty after the first one and after set_selection).
  [[nodiscard]] std::span<const std::int32_t> previous(std::size_t i) const { return state_.previous(i); }
  /// Parameter i's column scores from the last select() (after the cross-rank reduction).
  [[nodiscard]] std::span<const float> scores(std::size_t i) const { return state_.scores(i); }
  /// selection_overlap(previous(i), selected(i)) of the last select().
  [[nodiscard]] double overlap(std::size_t i) const { return state_.overlap(i); }

  /// Restores parameter i's selection (checkpoint resume). Throws ("i", "columns") unless i is
  /// registered and `columns` has k(i) strictly ascending indices in [0, cols(i)); nothing changes
  /// on a throw. Clears previous(i) and overlap(i).
  void set_selection(std::size_t i, std::span<const std::int32_t> columns) { state_.set_selection(i, columns); }

 private:
  detail::selector::selection_state state_;
  Communicator comm_;
};

static_assert(importance_selector<host_importance_selector<>>);

}  // namespace zenflow
