// An optimizer's state as named slots of fp32 values per element, as torch.optim keeps
// state[p]["exp_avg"]: how state moves between the CPU optimizer and the device optimizer on a
// reselection, into a checkpoint and back, and when the trainer edits its parameters, without the
// coordinator naming a slot.
//
// Slot 0 is the fp32 master weights, in every optimizer; slots 1 .. count - 1 are the optimizer's
// own state (Adam's exp_avg and exp_avg_sq). An optimizer holds its state however it likes (fp32,
// bf16 or 8-bit codes, in RAM or on an SSD); the slots are its fp32 exchange form. The host
// optimizer and the device optimizer of one coordinator name the same slots type (basic_coordinator
// checks it at compile time), so one's export is the other's import.
//
// Exchange layouts, for n listed columns of `rows` values:
// - a host_optimizer's export_state / import_state: slot after slot, each the listed columns in
//   list order; value (slot s, column j, row r) at s * n * rows + j * rows + r. A slot of all the
//   columns is one contiguous span (what a checkpoint writes, what a state file reads in one pass);
// - a device optimizer's export_state / import_state, add_matrix and reselect: column after column,
//   each its slots in order; value (column j, slot s, row r) at (j * count + s) * rows + r. A
//   column is one contiguous span (what a reselection moves). A 1-D parameter is one column.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>

#include "zenflow/adam_math.hpp"

namespace zenflow {

/// Adam's and AdamW's state (cpu_adam in every cpu_state format, host_sparse_adam,
/// cuda_sparse_adam).
struct adam_state_slots {
  static constexpr std::array<std::string_view, 3> names{"master", "exp_avg", "exp_avg_sq"};
  static constexpr std::size_t count = names.size();
  /// The optimizer's own state (slots 1 ..), in words.
  static constexpr std::string_view what = "moments";
  /// What valid() requires of it, in words.
  static constexpr std::string_view rule = "exp_avg finite, exp_avg_sq finite and >= 0";
  /// Whether one element's own state (count - 1 values, slot 1 first) is state Adam can hold.
  static bool valid(const float* own) noexcept {
    return is_finite_bits(own[0]) && is_finite_bits(own[1]) && own[1] >= 0.0f;
  }
};

/// What a slots type provides: at least the master, a name per slot, and the check an import
/// makes of an element's own state.
template <class S>
concept state_slots = requires(const float* own) {
  { S::count } -> std::convertible_to<std::size_t>;
  requires S::count >= 1 && S::names.size() == S::count;
  { S::names[0] } -> std::convertible_to<std::string_view>;
  { S::what } -> std::convertible_to<std::string_view>;
  { S::rule } -> std::convertible_to<std::string_view>;
  { S::valid(own) } -> std::convertible_to<bool>;
};

static_assert(state_slots<adam_state_slots>);

/// The slots' names in order, as a checkpoint records them: "master, exp_avg, exp_avg_sq".
template <state_slots S>
[[nodiscard]] std::string slot_names() {
  std::string out;
  for (std::string_view name : S::names) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

}  // namespace zenflow
