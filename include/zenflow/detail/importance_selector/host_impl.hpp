// Definitions of the importance selector's host reference functions and the bookkeeping shared by
// the host and CUDA selectors. Included by zenflow/importance_selector.hpp after its declarations.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

#include "zenflow/detail/importance_selector/math.hpp"
#include "zenflow/error.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

inline index_t topk_count(double topk_ratio, index_t cols) {
  expects(std::isfinite(topk_ratio) && topk_ratio > 0.0 && topk_ratio <= 1.0, "topk_ratio", "must be in (0, 1], got ",
          topk_ratio);
  expects(cols >= 1 && cols <= std::numeric_limits<std::int32_t>::max(), "cols", "must be in [1, INT32_MAX], got ",
          cols);
  double ratio = topk_ratio;
  if (const auto f = static_cast<float>(topk_ratio); static_cast<double>(f) == topk_ratio) {
    char text[32];  // the shortest decimal that reads back as f, read as a double
    const auto written = std::to_chars(text, text + sizeof(text), f);
    if (written.ec == std::errc{}) (void)std::from_chars(text, written.ptr, ratio);
  }
  const auto k = static_cast<index_t>(std::floor(ratio * static_cast<double>(cols)));
  return std::clamp<index_t>(k, 1, cols);
}

inline void column_scores(const_matrix_view grad, score_norm norm, std::span<float> scores) {
  grad.validate("grad", memory_space::host);
  expects(static_cast<index_t>(scores.size()) == grad.cols, "scores", "size must equal grad.cols (", grad.cols,
          "), got ", scores.size());
  expects(norm == score_norm::l1 || norm == score_norm::l2_squared, "norm", "must be l1 or l2_squared");
  std::fill(scores.begin(), scores.end(), 0.0f);
  if (grad.empty()) return;
  dispatch_dtype(grad.type, [&](auto tag) {
    using T = decltype(tag);
    const T* data = static_cast<const T*>(grad.data);
    // Every column sums its rows in ascending order; the loop nest only picks the cache-friendly
    // traversal, the result is the same bits either way.
    if (grad.row_stride <= grad.col_stride) {
      for (index_t c = 0; c < grad.cols; ++c) {
        float acc = 0.0f;
        for (index_t r = 0; r < grad.rows; ++r)
          acc += detail::selector::score_term(to_float(data[grad.offset(r, c)]), norm);
        scores[static_cast<std::size_t>(c)] = acc;
      }
    } else {
      for (index_t r = 0; r < grad.rows; ++r)
        for (index_t c = 0; c < grad.cols; ++c)
          scores[static_cast<std::size_t>(c)] += detail::selector::score_term(to_float(data[grad.offset(r, c)]), norm);
    }
  });
}

inline void topk_columns(std::span<const float> scores, index_t k, std::span<std::int32_t> out) {
  const auto n = static_cast<index_t>(scores.size());
  expects(n <= std::numeric_limits<std::int32_t>::max(), "scores", "more than INT32_MAX scores: ", n);
  expects(k >= 1 && k <= n, "k", "must be in [1, ", n, "], got ", k);
  expects(static_cast<index_t>(out.size()) == k, "out", "size must equal k (", k, "), got ", out.size());
  std::vector<std::uint64_t> ranked(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) {
    expects(scores[i] == scores[i], "scores", "score ", i, " is NaN");
    // Larger key first, then lower index first: sort ascending on (~key, index).
    ranked[i] = (static_cast<std::uint64_t>(~detail::selector::orderable_key(scores[i])) << 32) | i;
  }
  const auto kth = ranked.begin() + static_cast<std::ptrdiff_t>(k);
  if (kth != ranked.end()) std::nth_element(ranked.begin(), kth - 1, ranked.end());
  for (index_t j = 0; j < k; ++j) out[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(ranked[j] & 0xffffffffu);
  std::sort(out.begin(), out.end());
}

inline double selection_overlap(std::span<const std::int32_t> previous, std::span<const std::int32_t> current) {
  if (previous.empty() || current.empty()) return 0.0;
  std::size_t common = 0;
  for (std::size_t a = 0, b = 0; a < previous.size() && b < current.size();) {
    if (previous[a] < current[b]) {
      ++a;
    } else if (current[b] < previous[a]) {
      ++b;
    } else {
      ++common, ++a, ++b;
    }
  }
  return static_cast<double>(common) / static_cast<double>(current.size());
}

namespace detail::selector {

/// Registration, selections, scores and overlap figures of a selector: the state both backends
/// keep on the host. Every mutating call validates fully before it changes anything.
class selection_state {
 public:
  selection_state(double topk_ratio, score_norm norm) : topk_ratio_(topk_ratio), norm_(norm) {
    (void)topk_count(topk_ratio, 1);  // validates the ratio
    expects(norm == score_norm::l1 || norm == score_norm::l2_squared, "norm", "must be l1 or l2_squared");
  }

  std::size_t add_parameter(index_t rows, index_t cols) {
    expects(rows >= 1, "rows", "must be >= 1, got ", rows);
    const index_t k = topk_count(topk_ratio_, cols);  // validates cols
    params_.push_back({rows, cols, k, total_score_, total_k_});
    total_score_ += (cols + 3) / 4 * 4;  // 16-byte aligned per-parameter score slices
    total_k_ += k;
    selected_.emplace_back();
    previous_.emplace_back();
    overlap_.push_back(0.0);
    scores_.resize(static_cast<std::size_t>(total_score_), 0.0f);
    return params_.size() - 1;
  }

  [[nodiscard]] std::size_t parameter_count() const noexcept { return params_.size(); }
  [[nodiscard]] double topk_ratio() const noexcept { return topk_ratio_; }
  [[nodiscard]] score_norm norm() const noexcept { return norm_; }
  [[nodiscard]] index_t rows(std::size_t i) const { return at(i).rows; }
  [[nodiscard]] index_t cols(std::size_t i) const { return at(i).cols; }
  [[nodiscard]] index_t k(std::size_t i) const { return at(i).k; }
  /// Offset of parameter i's scores in the concatenated (16-byte aligned slices) score buffer.
  [[nodiscard]] index_t score_offset(std::size_t i) const { return at(i).score_offset; }
  /// Offset of parameter i's indices in the concatenated index buffer.
  [[nodiscard]] index_t k_offset(std::size_t i) const { return at(i).k_offset; }
  [[nodiscard]] index_t total_score_size() const noexcept { return total_score_; }
  [[nodiscard]] index_t total_k() const noexcept { return total_k_; }

  [[nodiscard]] bool has_selection() const noexcept {
    return !params_.empty() &&
           std::all_of(selected_.begin(), selected_.end(), [](const auto& s) { return !s.empty(); });
  }
  [[nodiscard]] std::span<const std::int32_t> selected(std::size_t i) const { return (void)at(i), selected_[i]; }
  [[nodiscard]] std::span<const std::int32_t> previous(std::size_t i) const { return (void)at(i), previous_[i]; }
  [[nodiscard]] double overlap(std::size_t i) const { return (void)at(i), overlap_[i]; }
  [[nodiscard]] std::span<const float> scores(std::size_t i) const {
    return std::span<const float>(scores_).subspan(static_cast<std::size_t>(at(i).score_offset),
                                                   static_cast<std::size_t>(at(i).cols));
  }
  /// The whole concatenated score buffer (for backends that fill it in place).
  [[nodiscard]] std::span<float> mutable_scores() noexcept { return scores_; }

  /// Throws ("grads") unless there is one well-formed view in `space` per parameter with the
  /// registered shape.
  void validate_grads(std::span<const const_matrix_view> grads, memory_space space) const {
    expects(grads.size() == params_.size(), "grads", "expected one gradient per registered parameter (", params_.size(),
            "), got ", grads.size());
    for (std::size_t i = 0; i < grads.size(); ++i) {
      grads[i].validate("grads", space);
      expects(grads[i].rows == params_[i].rows && grads[i].cols == params_[i].cols, "grads", "gradient ", i, " is ",
              grads[i].rows, " x ", grads[i].cols, " but the parameter was registered as ", params_[i].rows, " x ",
              params_[i].cols);
    }
  }

  /// Throws ("i", "columns") unless `columns` is a valid selection of parameter i.
  void validate_selection(std::size_t i, std::span<const std::int32_t> columns) const {
    const auto& p = at(i);
    expects(static_cast<index_t>(columns.size()) == p.k, "columns", "expected k = ", p.k, " indices, got ",
            columns.size());
    for (std::size_t j = 0; j < columns.size(); ++j) {
      expects(columns[j] >= 0 && columns[j] < p.cols, "columns", "index ", columns[j], " at position ", j,
              " is outside [0, ", p.cols, ")");
      expects(j == 0 || columns[j - 1] < columns[j], "columns", "indices must be strictly ascending (unique); ",
              "position ", j, " holds ", columns[j], " after ", j == 0 ? 0 : columns[j - 1]);
    }
  }

  /// Installs a new selection for every parameter (concatenated `indices`, k(i) each, already
  /// valid) and optionally new scores; the current selections become the previous ones.
  void commit(std::vector<float>&& scores, std::span<const std::int32_t> indices) {
    if (!scores.empty()) scores_ = std::move(scores);
    commit_indices(indices);
  }
  void commit_indices(std::span<const std::int32_t> indices) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto fresh =
          indices.subspan(static_cast<std::size_t>(params_[i].k_offset), static_cast<std::size_t>(params_[i].k));
      std::swap(previous_[i], selected_[i]);
      selected_[i].assign(fresh.begin(), fresh.end());
      overlap_[i] = selection_overlap(previous_[i], selected_[i]);
    }
  }

  void set_selection(std::size_t i, std::span<const std::int32_t> columns) {
    validate_selection(i, columns);
    selected_[i].assign(columns.begin(), columns.end());
    previous_[i].clear();
    overlap_[i] = 0.0;
  }

 private:
  struct param {
    index_t rows, cols, k, score_offset, k_offset;
  };
  [[nodiscard]] const param& at(std::size_t i) const {
    expects(i < params_.size(), "i", "parameter index ", i, " out of range (", params_.size(), " registered)");
    return params_[i];
  }

  double topk_ratio_;
  score_norm norm_;
  std::vector<param> params_;
  index_t total_score_ = 0;
  index_t total_k_ = 0;
  std::vector<std::vector<std::int32_t>> selected_, previous_;
  std::vector<double> overlap_;
  std::vector<float> scores_;
};

}  // namespace detail::selector
}  // namespace zenflow
