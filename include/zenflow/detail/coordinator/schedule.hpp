// The coordinator's schedule: the decisions of ZenFlow's timeline, apart from the work they start.
// Warm-up, when a selection is due (and what a skipped step postpones), how long an update
// interval is (fixed, or "auto" from the last selection's gradient masses), when an interval ends,
// which interval's CPU update awaits its write-back, and which positions a checkpoint may hold.
// It knows steps and intervals only, no backend, no parameter and no optimizer state, so it is
// tested alone (tests/unit/test_schedule.cpp); basic_coordinator asks it and does the work.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "zenflow/error.hpp"
#include "zenflow/importance_selector.hpp"
#include "zenflow/options.hpp"

namespace zenflow::detail {

/// Where the schedule stands between two steps: what a checkpoint holds of it and what the ranks
/// of a data-parallel group compare.
struct schedule_position {
  bool started = false;       ///< the first step has begun
  std::int64_t interval = 0;  ///< the current update interval
  std::int64_t interval_first_step = 0;
  std::int64_t interval_steps = 0;  ///< its steps handed over so far
  std::int64_t target = 1;          ///< the step count at which it ends
  std::int64_t pending = -1;        ///< the interval whose CPU update awaits its write-back, or -1
  bool selection_due = false;       ///< a selection fell on a skipped step: the next step selects
};

/// The gradient masses (L1 of the selection's scores) of the columns a selection put on the GPU
/// and of the rest, and how many columns each side has: the "auto" interval's inputs.
struct interval_masses {
  double important = 0.0;
  double unimportant = 0.0;
  std::int64_t gpu_columns = 0;
  std::int64_t cpu_columns = 0;
};

/// What the coordinator knows about its parameters when it asks whether a step selects.
struct selection_facts {
  bool has_matrices = false;      ///< some parameter is 2-D (vectors are never selected)
  bool any_selection = false;     ///< some 2-D parameter has GPU columns
  bool dense_unselected = false;  ///< dense mode: some 2-D parameter has none yet
};

class schedule {
 public:
  /// `options` validated (the coordinator's).
  explicit schedule(const schedule_options& options)
      : mode_(options.mode),
        warm_up_(options.full_warm_up_rounds),
        overlap_(options.overlap_step),
        update_interval_(options.update_interval),
        covers_(options.cover_cpu_update && options.mode == offload_mode::zenflow),
        bound_(options.effective_max_update_interval()),
        policy_(options) {}

  [[nodiscard]] const schedule_position& position() const noexcept { return at_; }
  [[nodiscard]] bool started() const noexcept { return at_.started; }
  [[nodiscard]] std::int64_t interval() const noexcept { return at_.interval; }
  [[nodiscard]] std::int64_t interval_steps() const noexcept { return at_.interval_steps; }
  [[nodiscard]] std::int64_t target() const noexcept { return at_.target; }
  [[nodiscard]] std::optional<std::int64_t> pending() const noexcept {
    return at_.pending >= 0 ? std::optional<std::int64_t>(at_.pending) : std::nullopt;
  }

  /// Every step of ZeRO-Offload, and the first full_warm_up_rounds steps otherwise: all columns on
  /// the CPU, an update every step.
  [[nodiscard]] bool in_warm_up(std::int64_t step) const noexcept {
    return mode_ == offload_mode::zero_offload || step < warm_up_;
  }
  /// The CPU update of an interval runs while the next one trains (overlap_step, after warm-up).
  [[nodiscard]] bool overlapped(std::int64_t step) const noexcept { return overlap_ && !in_warm_up(step); }

  /// The first step begins: interval 0 from step 0, one step long in warm-up (and until the first
  /// selection sets an "auto" length), else update_interval.
  void start(std::int64_t step) noexcept {
    at_.started = true;
    at_.interval = at_.interval_first_step = at_.interval_steps = 0;
    at_.target = !in_warm_up(step) && !update_interval_.is_auto ? update_interval_.value : 1;
  }

  /// Whether step `step` selects before its GPU update. Never in warm-up; a selection postponed by a
  /// skipped step first; dense mode once, while a 2-D parameter has no GPU columns; otherwise the
  /// first step after warm-up until a selection happened (not decided by which gradients arrived,
  /// so that a caller can tell a selection step beforehand), then as the selection policy says,
  /// counting from the end of warm-up. `facts()` returns the selection_facts; it is asked only
  /// after warm-up (this runs at every gradient submission).
  template <class Facts>
  [[nodiscard]] bool selects(std::int64_t step, const Facts& facts) const {
    if (in_warm_up(step)) return false;
    if (at_.selection_due) return true;
    const selection_facts f = facts();
    if (mode_ == offload_mode::dense) return f.dense_unselected;
    if (!f.any_selection && f.has_matrices) return true;
    return policy_.should_select(step - warm_up_);
  }
  /// The selection step's gradients were not finite: it selects at the next step instead.
  void postpone_selection() noexcept { at_.selection_due = true; }
  /// Whether a selection needs interval_masses (the "auto" interval).
  [[nodiscard]] bool wants_masses() const noexcept { return update_interval_.is_auto; }
  /// A selection happened: the intervals from now on are update_interval long, or "auto" (the
  /// masses' length, and no shorter than the CPU update's floor with cover_cpu_update).
  void selected(const interval_masses& masses) noexcept {
    at_.selection_due = false;
    if (!update_interval_.is_auto) {
      at_.target = update_interval_.value;
      return;
    }
    mass_target_ = auto_length(masses, bound_);
    at_.target = std::max(mass_target_, floor_);
  }

  /// cover_cpu_update is in effect: after warm-up, ZenFlow's overlapped updates (validate() admits
  /// the option with "auto" intervals only).
  [[nodiscard]] bool covers_cpu_update(std::int64_t step) const noexcept { return covers_ && overlapped(step); }
  /// cover_cpu_update, as an interval begins (before its first step): the CPU update needs
  /// `steps` steps of training to finish within an interval (0: nothing measured, the floor
  /// stays). The interval is the selection's "auto" length or that, whichever is longer, within
  /// [1, bound]; a selection's own length keeps the floor. Only once a selection set a length.
  void cover(std::int64_t steps) noexcept {
    if (steps > 0) floor_ = std::clamp<std::int64_t>(steps, 1, bound_);
    if (mass_target_ > 0) at_.target = std::max(mass_target_, floor_);
  }
  /// The floor cover() holds the "auto" interval to (0: none yet).
  [[nodiscard]] std::int64_t cpu_update_floor() const noexcept { return floor_; }
  /// The steps an update of `update_seconds` needs at `step_seconds` per step, with the headroom
  /// (0 when either is not a positive time); at most the bound.
  [[nodiscard]] std::int64_t steps_for_update(double update_seconds, double step_seconds) const noexcept {
    if (!(update_seconds > 0.0) || !(step_seconds > 0.0)) return 0;
    const double steps = std::ceil(zenflow_options::cpu_update_headroom * update_seconds / step_seconds);
    return std::isfinite(steps) ? std::clamp<std::int64_t>(static_cast<std::int64_t>(std::min(steps, 1e9)), 1, bound_)
                                : bound_;
  }

  /// "auto": the interval ends when the unimportant gradient mass accumulated per CPU column
  /// reaches the important mass per GPU column. With the selection's scores as the per-step masses
  /// (the method's premise is that they change slowly) that is ceil(important per GPU column /
  /// unimportant per CPU column), in [1, bound]. No unimportant mass, no CPU or no GPU columns:
  /// the bound.
  [[nodiscard]] static std::int64_t auto_length(const interval_masses& m, std::int64_t bound) noexcept {
    if (m.gpu_columns == 0 || m.cpu_columns == 0 || !(m.unimportant > 0.0)) return bound;
    const double ratio =
        (m.important / static_cast<double>(m.gpu_columns)) / (m.unimportant / static_cast<double>(m.cpu_columns));
    const double steps = std::ceil(ratio);
    return std::clamp<std::int64_t>(std::isfinite(steps) ? static_cast<std::int64_t>(std::min(steps, 1e9)) : 1, 1,
                                    bound);
  }

  /// Whether the current interval ends with step `step` once that step is counted.
  [[nodiscard]] bool ends_with(std::int64_t step) const noexcept {
    return in_warm_up(step) || at_.interval_steps + 1 >= at_.target;
  }
  /// Step `step` handed its gradients over: true when the interval ends with it.
  [[nodiscard]] bool count_step(std::int64_t step) noexcept {
    const bool ends = ends_with(step);
    ++at_.interval_steps;
    return ends;
  }
  /// Interval `index` begins with step `first_step`.
  void begin_interval(std::int64_t index, std::int64_t first_step) noexcept {
    at_.interval = index;
    at_.interval_first_step = first_step;
    at_.interval_steps = 0;
  }
  /// The CPU update of interval `index` was launched; its write-back comes later (overlap).
  void awaits_write_back(std::int64_t index) noexcept { at_.pending = index; }
  /// Interval `index`'s result is in the parameters.
  void written_back(std::int64_t index) noexcept {
    if (at_.pending == index) at_.pending = -1;
  }
  /// Step `next_step` comes next: leaving warm-up, the next interval follows update_interval
  /// (unless "auto", whose length the first selection sets).
  void step_done(std::int64_t next_step) noexcept {
    if (!in_warm_up(next_step) && !update_interval_.is_auto && at_.interval_steps == 0)
      at_.target = update_interval_.value;
  }

  /// Rejects a position no run of these options can be in between two steps, naming what is
  /// inconsistent ("checkpoint", before anything changes). `current_count` and `pending_count`:
  /// the accumulated steps of the current and of the pending interval; `host_steps` and
  /// `device_steps`: the CPU and GPU optimizers' step counts.
  void check(const schedule_position& at, std::int64_t step, std::int64_t current_count, std::int64_t pending_count,
             std::int64_t host_steps, std::int64_t device_steps) const {
    // Nothing has happened before the first step; every interval spans at least one step, and
    // the current one began `interval_steps` steps ago.
    expects(step >= 0 && (at.started || step == 0) && at.interval >= 0 && at.interval_first_step >= at.interval &&
                at.interval_first_step <= step && at.interval_steps == step - at.interval_first_step,
            "checkpoint", "holds an inconsistent position: step ", step, ", interval ", at.interval, " begun at step ",
            at.interval_first_step, " with ", at.interval_steps, " steps");
    // An interval ends when it reaches its target: 1 in warm-up and before the first step, else the
    // fixed update_interval, or with "auto" a count in [1, max_update_interval].
    const std::int64_t max_target = update_interval_.is_auto ? bound_ : update_interval_.value;
    expects(
        at.target >= 1 && at.target <= max_target && at.interval_steps < at.target && (at.started || at.target == 1),
        "checkpoint", "holds an update interval target of ", at.target, " with ", at.interval_steps,
        " steps done (options allow 1 to ", max_target, ")");
    // Only the interval before the current one can await its write-back, and only when ZenFlow
    // overlaps the CPU update.
    const bool overlapping = mode_ == offload_mode::zenflow && overlap_;
    expects(at.pending == -1 || (overlapping && at.pending == at.interval - 1), "checkpoint", "holds pending interval ",
            at.pending, " in interval ", at.interval, overlapping ? "" : " (these options never leave one pending)");
    // Counts never exceed what they count: non-skipped steps of an interval, one CPU update per
    // ended interval, one GPU update per step.
    expects(current_count >= 0 && current_count <= at.interval_steps && pending_count >= 0 &&
                (at.pending >= 0 ? pending_count <= at.interval_first_step : pending_count == 0),
            "checkpoint", "holds accumulated step counts ", current_count, " and ", pending_count,
            " inconsistent with its interval position");
    expects(host_steps >= 0 && host_steps <= at.interval && device_steps >= 0 && device_steps <= step, "checkpoint",
            "holds optimizer step counts ", host_steps, " (CPU) and ", device_steps, " (GPU) for ", at.interval,
            " intervals and ", step, " steps");
  }
  /// Takes over a position check() accepted. A position holds the interval's length, not how it
  /// came about: with "auto", the length saved stands until the next selection (cover_cpu_update
  /// measures its floor again from the next interval on).
  void restore(const schedule_position& at) noexcept {
    at_ = at;
    mass_target_ = update_interval_.is_auto && at.started && !in_warm_up(at.interval_first_step) ? at.target : 0;
    floor_ = 0;
  }

 private:
  offload_mode mode_;
  std::int64_t warm_up_;
  bool overlap_;
  interval_option update_interval_;
  bool covers_;
  std::int64_t bound_;
  std::int64_t mass_target_ = 0;  // the last selection's "auto" length (0: none yet)
  std::int64_t floor_ = 0;        // cover_cpu_update's floor (0: none yet)
  selection_policy policy_;
  schedule_position at_{};
};

}  // namespace zenflow::detail
