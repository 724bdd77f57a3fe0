// The ZenFlow options, with DeepSpeed's names and defaults, and their validation.
//
// Defaults follow DeepSpeed's `zenflow` config block (topk_ratio 0.1, select_strategy auto,
// select_interval auto, update_interval auto, full_warm_up_rounds 0) and torch.optim.AdamW
// (lr 1e-3, betas (0.9, 0.999), eps 1e-8). One deliberate difference: `overlap_step` defaults to
// true, because the asynchronous CPU update is the point of the method; set it to false for
// "ZenFlow sync".
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "zenflow/error.hpp"
#include "zenflow/hyper_parameters.hpp"

namespace zenflow {

/// When to re-select the important columns.
enum class selection_strategy : std::uint8_t {
  automatic,  ///< "auto": `epoch` when `steps_per_epoch` is set, else `step`.
  step,       ///< `select_interval` counts optimizer steps.
  epoch,      ///< `select_interval` counts epochs of `steps_per_epoch` steps.
};

/// Which method the coordinator runs; the comparison baselines are selectable by options alone.
enum class offload_mode : std::uint8_t {
  zenflow,  ///< the method: top-k columns on the GPU, the rest on the CPU (overlap_step picks sync/async)
  /// ZeRO-Offload: every column of every 2-D parameter updated on the CPU, every step,
  /// synchronously. The mode implies all of that: topk_ratio, the intervals, warm-up and
  /// overlap_step are not used.
  zero_offload,
  dense,  ///< no offload: every column on the GPU (the reference); topk_ratio and the intervals are not used
};

/// "auto", "step", "epoch" (DeepSpeed's spelling; "unknown" for any other value).
constexpr std::string_view selection_strategy_name(selection_strategy s) noexcept {
  switch (s) {
    case selection_strategy::automatic:
      return "auto";
    case selection_strategy::step:
      return "step";
    case selection_strategy::epoch:
      return "epoch";
  }
  return "unknown";
}

/// "zenflow", "zero_offload", "dense" ("unknown" for any other value).
constexpr std::string_view offload_mode_name(offload_mode m) noexcept {
  switch (m) {
    case offload_mode::zenflow:
      return "zenflow";
    case offload_mode::zero_offload:
      return "zero_offload";
    case offload_mode::dense:
      return "dense";
  }
  return "unknown";
}

/// A setting that is either "auto" or a fixed positive count.
struct interval_option {
  bool is_auto = true;
  std::int64_t value = 0;  ///< the fixed count when !is_auto

  static constexpr interval_option automatic() noexcept { return {true, 0}; }
  static constexpr interval_option fixed(std::int64_t n) noexcept { return {false, n}; }
  friend constexpr bool operator==(const interval_option&, const interval_option&) = default;
};

/// Adam / AdamW hyper-parameters (torch.optim.AdamW's names): the hyper-parameter type of cpu_adam
/// and of the sparse Adams (hyper_parameters.hpp).
struct adam_options {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw_mode = true;       ///< decoupled weight decay (AdamW); false: L2 added to the gradient
  bool bias_correction = true;  ///< divide by 1 - beta^t (computed in double each step)
  friend bool operator==(const adam_options&, const adam_options&) = default;

  /// The name printed before the fields (format.hpp) and in messages.
  static constexpr const char* name = "adam";
  /// Every field. Parameter groups and schedules may set lr, the betas, eps and weight_decay per
  /// parameter (torch.optim's AdamW keeps them per group: OneCycleLR cycles beta1); the Adam variant
  /// and the bias correction are one for every parameter of an optimizer.
  static constexpr std::array<hyper_parameter_field<adam_options>, 7> fields() noexcept {
    return {real_field("lr", &adam_options::lr, true),
            real_field("beta1", &adam_options::beta1, true),
            real_field("beta2", &adam_options::beta2, true),
            real_field("eps", &adam_options::eps, true),
            real_field("weight_decay", &adam_options::weight_decay, true),
            flag_field("adamw_mode", &adam_options::adamw_mode, false),
            flag_field("bias_correction", &adam_options::bias_correction, false)};
  }

  /// Throws `zenflow::error` naming the field: lr < 0 or not finite, betas outside [0, 1),
  /// eps <= 0 or not finite, weight_decay < 0 or not finite.
  void validate() const {
    expects(std::isfinite(lr) && lr >= 0.0f, "lr", "must be finite and >= 0, got ", lr);
    expects(beta1 >= 0.0f && beta1 < 1.0f, "beta1", "must be in [0, 1), got ", beta1);
    expects(beta2 >= 0.0f && beta2 < 1.0f, "beta2", "must be in [0, 1), got ", beta2);
    expects(std::isfinite(eps) && eps > 0.0f, "eps", "must be finite and > 0, got ", eps);
    expects(std::isfinite(weight_decay) && weight_decay >= 0.0f, "weight_decay", "must be finite and >= 0, got ",
            weight_decay);
  }
};

/// The method's schedule options, whatever the optimizer (basic_zenflow_options adds its
/// hyper-parameters). Field names follow DeepSpeed's `zenflow` block.
struct schedule_options {
  offload_mode mode = offload_mode::zenflow;
  /// Fraction of each 2-D parameter's columns updated on the GPU: k = max(1, floor(topk_ratio * cols)),
  /// the ratio read as the decimal it prints as and multiplied in double, as Python does (topk_count:
  /// 0.7 of 10 columns is 7, 0.29 of 100 is 28).
  float topk_ratio = 0.1f;
  selection_strategy select_strategy = selection_strategy::automatic;
  /// How often to re-select (steps, or epochs with the epoch strategy). "auto": every epoch with
  /// the epoch strategy, every `auto_select_steps` steps with the step strategy.
  interval_option select_interval = interval_option::automatic();
  /// How often the CPU updates the unimportant columns. "auto": when the accumulated unimportant
  /// gradient mass per column reaches the important mass per column, within [1, max_update_interval].
  interval_option update_interval = interval_option::automatic();
  /// The first N steps run full synchronous CPU updates of every column.
  std::int64_t full_warm_up_rounds = 0;
  /// true: the CPU update of interval i runs while interval i+1 trains and is written back at its
  /// end at the latest. false: it is applied synchronously at the end of interval i.
  bool overlap_step = true;
  /// Steps per epoch; required by the epoch strategy (0 = unknown).
  std::int64_t steps_per_epoch = 0;
  /// Step strategy with select_interval "auto": re-select every this many steps.
  std::int64_t auto_select_steps = 100;
  /// Upper bound of an "auto" update interval. A reselection ends an interval anyway, so the
  /// bound in effect is min(max_update_interval, the selection interval in steps).
  std::int64_t max_update_interval = 16;
  /// With update_interval "auto" and overlap_step: every interval is also long enough for the
  /// CPU update (its NVMe state file's reads and writes included) to finish within the next one,
  /// as measured: at least ceil(cpu_update_headroom * the last completed CPU update's seconds /
  /// the ended interval's seconds per step, stalls excluded), within [1, max_update_interval].
  /// Opt-in because it depends on timing: two runs may end their intervals at different steps
  /// (the mass rule alone is reproducible). Data-parallel ranks take the largest length any rank
  /// asks for (one all-reduce per interval). Ignored by the zero_offload and dense modes.
  bool cover_cpu_update = false;
  /// The margin cover_cpu_update adds to the measured CPU update time.
  static constexpr double cpu_update_headroom = 1.1;
  /// The bound an "auto" update interval is held to (see max_update_interval).
  [[nodiscard]] std::int64_t effective_max_update_interval() const noexcept {
    return std::min(max_update_interval, select_interval_steps());
  }
  /// Clip the global gradient norm (both paths together) to this value; 0 disables clipping.
  float max_grad_norm = 0.0f;
  /// The strategy after resolving "auto".
  [[nodiscard]] selection_strategy resolved_strategy() const noexcept {
    if (select_strategy != selection_strategy::automatic) return select_strategy;
    return steps_per_epoch > 0 ? selection_strategy::epoch : selection_strategy::step;
  }
  /// The selection interval in steps after resolving "auto" and the epoch strategy (validate()
  /// rejects options whose select_interval * steps_per_epoch does not fit in 64 bits).
  [[nodiscard]] std::int64_t select_interval_steps() const noexcept {
    const bool epochs = resolved_strategy() == selection_strategy::epoch;
    if (select_interval.is_auto) return epochs ? steps_per_epoch : auto_select_steps;
    return epochs ? select_interval.value * steps_per_epoch : select_interval.value;
  }

  /// Throws `zenflow::error` naming the first field that is out of range or contradicts another.
  void validate() const {
    expects(mode == offload_mode::zenflow || mode == offload_mode::zero_offload || mode == offload_mode::dense, "mode",
            "must be zenflow, zero_offload or dense");
    expects(std::isfinite(topk_ratio) && topk_ratio > 0.0f && topk_ratio <= 1.0f, "topk_ratio",
            "must be in (0, 1], got ", topk_ratio);
    expects(select_strategy == selection_strategy::automatic || select_strategy == selection_strategy::step ||
                select_strategy == selection_strategy::epoch,
            "select_strategy", "must be auto, step or epoch");
    expects(select_interval.is_auto || select_interval.value >= 1, "select_interval", "must be auto or >= 1, got ",
            select_interval.value);
    expects(update_interval.is_auto || update_interval.value >= 1, "update_interval", "must be auto or >= 1, got ",
            update_interval.value);
    expects(full_warm_up_rounds >= 0, "full_warm_up_rounds", "must be >= 0, got ", full_warm_up_rounds);
    expects(steps_per_epoch >= 0, "steps_per_epoch", "must be >= 0, got ", steps_per_epoch);
    expects(select_strategy != selection_strategy::epoch || steps_per_epoch >= 1, "steps_per_epoch",
            "must be >= 1 with select_strategy epoch");
    // The epoch strategy counts select_interval epochs of steps_per_epoch steps: the product must
    // be a step count (a wrapped product would select at a wrong step, or divide by zero).
    expects(resolved_strategy() != selection_strategy::epoch || select_interval.is_auto ||
                select_interval.value <= std::numeric_limits<std::int64_t>::max() / steps_per_epoch,
            "select_interval", "times steps_per_epoch (", steps_per_epoch,
            ") must fit in a 64-bit step count (at most ", std::numeric_limits<std::int64_t>::max(), " steps), got ",
            select_interval.value, " epochs");
    expects(auto_select_steps >= 1, "auto_select_steps", "must be >= 1, got ", auto_select_steps);
    expects(max_update_interval >= 1, "max_update_interval", "must be >= 1, got ", max_update_interval);
    expects(update_interval.is_auto || select_interval_steps() >= update_interval.value, "select_interval",
            "must not be smaller than update_interval (", update_interval.value, " steps), got ",
            select_interval_steps(), " steps");
    expects(!cover_cpu_update || mode != offload_mode::zenflow || update_interval.is_auto, "cover_cpu_update",
            "lengthens \"auto\" update intervals only, but update_interval is fixed at ", update_interval.value,
            " steps");
    expects(!cover_cpu_update || mode != offload_mode::zenflow || overlap_step, "cover_cpu_update",
            "needs overlap_step (without it every CPU update runs synchronously at its interval's end, whatever "
            "the interval's length)");
    expects(std::isfinite(max_grad_norm) && max_grad_norm >= 0.0f, "max_grad_norm",
            "must be finite and >= 0 (0 disables clipping), got ", max_grad_norm);
  }
};

/// Every option of the method: the schedule's, and the hyper-parameters of its optimizer
/// (HyperParameters: a type modelling optimizer_hyper_parameters, see hyper_parameters.hpp).
/// `zenflow_options` is the one for Adam; `with_optimizer` gives the same schedule to another
/// optimizer.
template <class HyperParameters>
struct basic_zenflow_options : schedule_options {
  using hyper_parameters = HyperParameters;
  /// The optimizer's hyper-parameters: every parameter's until a parameter group sets its own
  /// per-group fields (basic_coordinator::set_hyper_parameters).
  HyperParameters optimizer{};

  /// ZeRO-Offload: every column on the CPU, updated every step, synchronously, with `optimizer`'s
  /// hyper-parameters (default: the type's defaults). The same as
  /// setting `mode = offload_mode::zero_offload` on any options (the mode implies the rest); the
  /// other fields are set to what the mode runs so that the options read as what happens.
  static basic_zenflow_options zero_offload(const HyperParameters& optimizer = {}) {
    basic_zenflow_options o;
    o.optimizer = optimizer;
    o.mode = offload_mode::zero_offload;
    o.update_interval = interval_option::fixed(1);
    o.overlap_step = false;
    return o;
  }
  /// Dense: every column on the GPU, no offload (the no-offload reference), with `optimizer`'s
  /// hyper-parameters. The same as setting
  /// `mode = offload_mode::dense` on any options.
  static basic_zenflow_options dense(const HyperParameters& optimizer = {}) {
    basic_zenflow_options o;
    o.optimizer = optimizer;
    o.mode = offload_mode::dense;
    o.topk_ratio = 1.0f;
    return o;
  }

  /// These schedule options with another optimizer's hyper-parameters.
  template <class Other>
  [[nodiscard]] basic_zenflow_options<Other> with_optimizer(const Other& hp) const {
    basic_zenflow_options<Other> o;
    static_cast<schedule_options&>(o) = *this;
    o.optimizer = hp;
    return o;
  }

  /// Throws `zenflow::error` naming the first field that is out of range or contradicts another
  /// (the schedule's first, then the hyper-parameters').
  void validate() const {
    schedule_options::validate();
    optimizer.validate();
  }
};

/// The options of a coordinator whose optimizers are Adam/AdamW (cpu_adam and the sparse Adams).
using zenflow_options = basic_zenflow_options<adam_options>;

}  // namespace zenflow
