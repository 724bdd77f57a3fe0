// What the ranks of a data-parallel coordinator compare before their first step and when they load
// checkpoints (docs/DATA_PARALLEL.md, "Agreement"): a record of fixed size, so that ranks that
// registered different parameters, or load checkpoints of different steps, still make the same
// collective (an all-gather of it) and fail with the reason instead of pairing unrelated buffers.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "zenflow/error.hpp"
#include "zenflow/hyper_parameters.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow::detail {

inline constexpr std::uint64_t fingerprint_basis = 14695981039346656037ull;

/// FNV-1a over the bytes of `value`, continuing `h`.
template <class T>
std::uint64_t fingerprint(std::uint64_t h, const T& value) noexcept {
  const auto* bytes = reinterpret_cast<const unsigned char*>(&value);
  for (std::size_t i = 0; i < sizeof(T); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return h;
}

/// `h` extended by the fields of hyper-parameters `hp` whose per_group flag is `per_group`, in
/// table order.
template <class HyperParameters>
std::uint64_t fingerprint_fields(std::uint64_t h, const HyperParameters& hp, bool per_group) noexcept {
  for_each_value(hp, per_group, [&](const auto& value) { h = fingerprint(h, value); });
  return h;
}

/// A fingerprint of values whatever their layout and dtype: the sum, over the elements, of a mix
/// of each element's position in row-major order and its fp32 bits. Feed it the elements in any
/// order (the sum commutes), e.g. in memory order: `add(row-major index, value)`.
struct values_fingerprint {
  std::uint64_t sum = 0;
  void add(std::uint64_t index, float value) noexcept {
    std::uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    std::uint64_t x = (index * 0x9e3779b97f4a7c15ull) ^ bits;  // splitmix64's finalizer
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    sum += x ^ (x >> 31);
  }
};

/// The values_fingerprint of a matrix's values (host memory, any layout and dtype), read in memory
/// order: by columns when they are contiguous, else by rows.
inline std::uint64_t values_fingerprint_of(const const_matrix_view& m) {
  values_fingerprint f;
  dispatch_dtype(m.type, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(m.data);
    const auto add = [&](index_t r, index_t c) {
      f.add(static_cast<std::uint64_t>(r * m.cols + c), to_float(src[m.offset(r, c)]));
    };
    if (m.row_stride == 1 && m.col_stride != 1) {
      for (index_t c = 0; c < m.cols; ++c)
        for (index_t r = 0; r < m.rows; ++r) add(r, c);
    } else {
      for (index_t r = 0; r < m.rows; ++r)
        for (index_t c = 0; c < m.cols; ++c) add(r, c);
    }
  });
  return f.sum;
}
/// The values_fingerprint of a vector of fp32 values.
inline std::uint64_t values_fingerprint_of(std::span<const float> v) {
  values_fingerprint f;
  for (std::size_t k = 0; k < v.size(); ++k) f.add(k, v[k]);
  return f.sum;
}

/// Where a coordinator's schedule stands (before its first step, or in the checkpoint it loads).
struct agreement_position {
  std::int64_t step = 0;
  bool started = false;
  std::int64_t interval = 0;
  std::int64_t interval_first_step = 0;
  std::int64_t interval_target = 1;
  std::int64_t pending_interval = -1;
  std::uint64_t selections = fingerprint_basis;        ///< every parameter's GPU columns
  std::uint64_t hyper_parameters = fingerprint_basis;  ///< every parameter's per-group hyper-parameters
  std::int64_t cpu_steps = 0;
  std::int64_t gpu_steps = 0;
  std::uint64_t parameter_steps = fingerprint_basis;  ///< every parameter's own CPU and GPU counts

  /// Adds the next parameter's GPU columns, per-group hyper-parameters (Adam: lr, beta1, beta2,
  /// eps, weight_decay) and own step counts.
  template <class Columns, class HyperParameters>
  void add(const Columns& selection, const HyperParameters& hp, std::int64_t cpu, std::int64_t gpu) noexcept {
    for (std::int32_t c : selection) selections = fingerprint(selections, c);
    selections = fingerprint(selections, std::int32_t{-1});
    hyper_parameters = fingerprint_fields(hyper_parameters, hp, true);
    parameter_steps = fingerprint(fingerprint(parameter_steps, cpu), gpu);
  }
};

/// One rank's record: `count` fields, then a reason (a rejected checkpoint's error text).
struct agreement {
  enum field : std::size_t {
    kind,    // first_step or checkpoint
    status,  // 0, or 1: this rank rejected its checkpoint (reason)
    options,
    parameters,
    registration,
    hyper_parameters,
    initial_values,  // first_step only (a checkpoint brings its own values, or the trainer restores them)
    step,
    started,
    interval,
    interval_first_step,
    interval_target,
    pending_interval,
    selections,
    cpu_steps,
    gpu_steps,
    parameter_steps,
    count
  };
  static constexpr std::int64_t first_step = 1, checkpoint = 2;
  static constexpr std::size_t reason_words = 32;  // 256 bytes of text
  static constexpr std::size_t words = count + reason_words;
  std::array<std::int64_t, words> w{};

  /// Marks the record rejected with `text` (cut to 256 bytes).
  void reject(std::string_view text) noexcept {
    w[status] = 1;
    const std::size_t n = std::min(text.size(), reason_words * sizeof(std::int64_t));
    std::memcpy(w.data() + count, text.data(), n);
  }
  /// The reason of a record given as its `words` words.
  static std::string reason_of(std::span<const std::int64_t> record) {
    std::array<char, reason_words * sizeof(std::int64_t)> text{};
    std::memcpy(text.data(), record.data() + count, text.size());
    return std::string(text.data(), strnlen(text.data(), text.size()));
  }
  /// Why rank `r` differs from rank 0 in field `f` (f != status); `per_group`: the optimizer's
  /// per-group fields as prose (field_names), e.g. "lr, beta1, beta2, eps and weight_decay".
  static std::string disagreement(std::size_t f, int r, int ranks, std::int64_t first, std::int64_t other,
                                  const std::string& per_group) {
    const std::string who = concat("rank 0 and rank ", r, " of ", ranks);
    switch (f) {
      case kind:
        return concat(who, " are not doing the same: rank ", first == checkpoint ? 0 : r,
                      " loads a checkpoint while rank ", first == checkpoint ? r : 0,
                      " takes its first step (every rank loads its own checkpoint, or none does)");
      case options:
      case parameters:
      case registration:
      case hyper_parameters:
        return concat("the ranks registered different parameters or set different options: ", who, " differ in ",
                      f == options        ? "their options (zenflow options, shared hyper-parameters)"
                      : f == parameters   ? concat("the number of parameters (", first, " and ", other, ")")
                      : f == registration ? "their parameters' names, shapes or dtypes"
                                          : concat("their parameters' per-group hyper-parameters (", per_group, ")"),
                      "; every rank must build the same coordinator");
      case initial_values:
        return concat("the ranks registered different initial values: ", who,
                      " differ in their parameters' values (a fingerprint of all of them); every rank must start "
                      "from the same values (initialize from one seed, or broadcast rank 0's before registering)");
      default:
        return concat("the ranks' checkpoints are not from one save: ", who, " differ in ", name(f), " (", first,
                      " and ", other, "); resume every rank from the files one save_checkpoint wrote");
    }
  }
  static const char* name(std::size_t f) noexcept {
    constexpr const char* names[count] = {"kind",
                                          "status",
                                          "options",
                                          "parameters",
                                          "registration",
                                          "hyper-parameters",
                                          "initial values (their fingerprint)",
                                          "step",
                                          "started",
                                          "interval",
                                          "interval start",
                                          "interval target",
                                          "pending interval",
                                          "selection (its fingerprint)",
                                          "CPU step count",
                                          "GPU step count",
                                          "per-parameter step counts (their fingerprint)"};
    return f < count ? names[f] : "?";
  }
};

}  // namespace zenflow::detail
