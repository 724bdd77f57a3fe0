// fmt::formatter specializations for zenflow's printable types (opt-in: this header needs fmt).
//
// Nothing else in zenflow includes fmt: `zenflow::core` stays usable with a C++20 compiler alone.
// Include this header and link `zenflow::fmt` (zenflow::core + fmt::fmt) to print with fmt:
//
//   fmt::print("{}\n", options);               // {mode: zenflow, topk_ratio: 0.1, ...}
//   fmt::print("{:>6} {}\n", dtype::bf16, m);  // "  bf16 step 3 stall 0 ms ..."
//
// Formats:
// - enums (`dtype`, `memory_space`, `cpu_isa`, `selection_strategy`, `offload_mode`): their name,
//   as the library's messages spell it ("bf16", "device", "avx512", "auto", "zero_offload");
// - `bfloat16`, `float16`: the value as a float, with float format specs (`{:.3f}`);
// - `interval_option`: "auto" or the fixed count;
// - the option structs (`adam_options`, `zenflow_options`, `cpu_adam_config`,
//   `coordinator_config`): every field in declaration order, `{name: value, ...}`, with the
//   field names of the structs (DeepSpeed's names for the method's options); `nvme`: "none" or
//   the state file's settings (all but `bytes`, which the optimizer sizes, and the pin hook), the
//   engine's (its `threads` as engine_threads) and master_on_disk;
// - `step_metrics`: exactly what its `operator<<` writes (the formatter calls it).
// Every type but the two 16-bit floats takes the string format specs (fill, align, width:
// `{:<12}`); they apply to the whole text.
//
// Host code only (fmt 9 under nvcc in C++20 also needs FMT_USE_CONSTEXPR=1).
#pragma once

#include <iterator>
#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include "zenflow/coordinator.hpp"
#include "zenflow/cpu_adam.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::format {

constexpr std::string_view name(selection_strategy s) noexcept {
  return selection_strategy_name(s);
}
constexpr std::string_view name(offload_mode m) noexcept {
  return offload_mode_name(m);
}
constexpr std::string_view name(dtype t) noexcept {
  return dtype_name(t);
}
constexpr std::string_view name(memory_space s) noexcept {
  return memory_space_name(s);
}
constexpr std::string_view name(cpu_isa isa) noexcept {
  return cpu_isa_name(isa);
}

/// Appends the text of a value to `out` (the part of a formatter that does not pad).
inline void write(fmt::memory_buffer& out, interval_option v) {
  if (v.is_auto)
    fmt::format_to(fmt::appender(out), "auto");
  else
    fmt::format_to(fmt::appender(out), "{}", v.value);
}

/// Every field of an optimizer's hyper-parameters in table order (hyper_parameters.hpp).
template <optimizer_hyper_parameters H>
void write(fmt::memory_buffer& out, const H& h) {
  const char* separator = "{";
  for (const hyper_parameter_field<H>& f : H::fields()) {
    if (f.real != nullptr)
      fmt::format_to(fmt::appender(out), "{}{}: {}", separator, f.name, h.*f.real);
    else
      fmt::format_to(fmt::appender(out), "{}{}: {}", separator, f.name, h.*f.flag);
    separator = ", ";
  }
  fmt::format_to(fmt::appender(out), "}}");
}

template <class H>
void write(fmt::memory_buffer& out, const basic_zenflow_options<H>& o) {
  fmt::format_to(fmt::appender(out), "{{mode: {}, topk_ratio: {}, select_strategy: {}, select_interval: ", name(o.mode),
                 o.topk_ratio, name(o.select_strategy));
  write(out, o.select_interval);
  fmt::format_to(fmt::appender(out), ", update_interval: ");
  write(out, o.update_interval);
  fmt::format_to(fmt::appender(out),
                 ", full_warm_up_rounds: {}, overlap_step: {}, steps_per_epoch: {}, auto_select_steps: {}, "
                 "max_update_interval: {}, cover_cpu_update: {}, max_grad_norm: {}, {}: ",
                 o.full_warm_up_rounds, o.overlap_step, o.steps_per_epoch, o.auto_select_steps, o.max_update_interval,
                 o.cover_cpu_update, o.max_grad_norm, H::name);
  write(out, o.optimizer);
  fmt::format_to(fmt::appender(out), "}}");
}

/// "none", or the state file's settings, the engine's and master_on_disk.
inline void write(fmt::memory_buffer& out, const std::optional<nvme_state_config>& n) {
  if (!n) {
    fmt::format_to(fmt::appender(out), "none");
    return;
  }
  const state_file_config& f = n->file;
  fmt::format_to(fmt::appender(out),
                 "{{directory: {}, file_name: {}, rank: {}, block_bytes: {}, read_ahead: {}, write_behind: {}, "
                 "direct: {}, allow_memory_backed: {}, keep_file: {}, pin: {}, engine: {}, queue_depth: {}, "
                 "engine_threads: {}, master_on_disk: {}}}",
                 f.directory.string(), f.file_name, f.rank, f.block_bytes, f.read_ahead, f.write_behind,
                 f.direct == direct_io::required ? "required" : "fallback_to_buffered", f.allow_memory_backed,
                 f.keep_file, pin_policy_name(f.pin), io_engine_kind_name(n->engine.kind), n->engine.queue_depth,
                 n->engine.threads, n->master_on_disk);
}

inline void write(fmt::memory_buffer& out, const cpu_adam_config& c) {
  fmt::format_to(fmt::appender(out),
                 "{{threads: {}, pin_to_cores: {}, isa: {}, chunk_elements: {}, cpu_state: {}, seed: {:#x}, nvme: ",
                 c.threads, c.pin_to_cores, name(c.isa), c.chunk_elements, cpu_state_format_name(c.cpu_state), c.seed);
  write(out, c.nvme);
  fmt::format_to(fmt::appender(out), ", cpus: [{}]}}", fmt::join(c.cpus, ", "));
}

inline void write(fmt::memory_buffer& out, const coordinator_config& c) {
  fmt::format_to(fmt::appender(out),
                 "{{cpu_threads: {}, pin_threads: {}, reserved_cpus: {}, cpu_state: {}, nvme: ", c.cpu_threads,
                 c.pin_threads, c.reserved_cpus, cpu_state_format_name(c.cpu_state));
  write(out, c.nvme);
  fmt::format_to(fmt::appender(out),
                 ", d2h_slot_bytes: {}, d2h_slots: {}, h2d_slot_bytes: {}, h2d_slots: {}, copy_out_window_bytes: {}, "
                 "record_trace: {}, check_stream_order: {}}}",
                 c.d2h_slot_bytes, c.d2h_slots, c.h2d_slot_bytes, c.h2d_slots, c.copy_out_window_bytes, c.record_trace,
                 c.check_stream_order);
}

/// `text` padded and aligned by the string format specs that `f` parsed.
template <class FormatContext>
auto pad(const fmt::formatter<fmt::string_view>& f, std::string_view text, FormatContext& ctx) {
  return f.format(fmt::string_view(text.data(), text.size()), ctx);
}

/// `write(out, value)`'s text padded and aligned by the string format specs that `f` parsed.
template <class T, class FormatContext>
auto pad_text(const fmt::formatter<fmt::string_view>& f, const T& value, FormatContext& ctx) {
  fmt::memory_buffer text;
  zenflow::detail::format::write(text, value);
  return f.format(fmt::string_view(text.data(), text.size()), ctx);
}

}  // namespace zenflow::detail::format

// The specializations, in fmt's namespace.
namespace fmt {

/// "f32", "bf16", "f16".
template <>
struct formatter<zenflow::dtype> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(zenflow::dtype value, FormatContext& ctx) const {
    return zenflow::detail::format::pad(*this, zenflow::detail::format::name(value), ctx);
  }
};

/// "host", "device".
template <>
struct formatter<zenflow::memory_space> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(zenflow::memory_space value, FormatContext& ctx) const {
    return zenflow::detail::format::pad(*this, zenflow::detail::format::name(value), ctx);
  }
};

/// "automatic", "scalar", "avx2", "avx512".
template <>
struct formatter<zenflow::cpu_isa> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(zenflow::cpu_isa value, FormatContext& ctx) const {
    return zenflow::detail::format::pad(*this, zenflow::detail::format::name(value), ctx);
  }
};

/// "auto", "step", "epoch".
template <>
struct formatter<zenflow::selection_strategy> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(zenflow::selection_strategy value, FormatContext& ctx) const {
    return zenflow::detail::format::pad(*this, zenflow::detail::format::name(value), ctx);
  }
};

/// "zenflow", "zero_offload", "dense".
template <>
struct formatter<zenflow::offload_mode> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(zenflow::offload_mode value, FormatContext& ctx) const {
    return zenflow::detail::format::pad(*this, zenflow::detail::format::name(value), ctx);
  }
};

/// The value as a float: `fmt::format("{:.2f}", zenflow::to_bfloat16(1.5f))` is "1.50".
template <>
struct formatter<zenflow::bfloat16> : fmt::formatter<float> {
  template <class FormatContext>
  auto format(zenflow::bfloat16 value, FormatContext& ctx) const {
    return fmt::formatter<float>::format(zenflow::to_float(value), ctx);
  }
};

/// The value as a float, as for bfloat16.
template <>
struct formatter<zenflow::float16> : fmt::formatter<float> {
  template <class FormatContext>
  auto format(zenflow::float16 value, FormatContext& ctx) const {
    return fmt::formatter<float>::format(zenflow::to_float(value), ctx);
  }
};

/// "auto" or the fixed count.
template <>
struct formatter<zenflow::interval_option> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(const zenflow::interval_option& value, FormatContext& ctx) const {
    return zenflow::detail::format::pad_text(*this, value, ctx);
  }
};

/// Any optimizer's hyper-parameters, every field in table order; adam_options:
/// `{lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-08, weight_decay: 0, adamw_mode: true, bias_correction: true}`.
template <class H>
requires zenflow::optimizer_hyper_parameters<H>
struct formatter<H> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(const H& value, FormatContext& ctx) const {
    return zenflow::detail::format::pad_text(*this, value, ctx);
  }
};

/// Every field in declaration order, the hyper-parameters under their type's name:
/// `{mode: zenflow, topk_ratio: 0.1, ..., adam: {lr: 0.001, ...}}`.
template <class H>
struct formatter<zenflow::basic_zenflow_options<H>> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(const zenflow::basic_zenflow_options<H>& value, FormatContext& ctx) const {
    return zenflow::detail::format::pad_text(*this, value, ctx);
  }
};

/// `{threads: 0, pin_to_cores: false, isa: automatic, chunk_elements: 32768}`.
template <>
struct formatter<zenflow::cpu_adam_config> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(const zenflow::cpu_adam_config& value, FormatContext& ctx) const {
    return zenflow::detail::format::pad_text(*this, value, ctx);
  }
};

/// Every field in declaration order: `{cpu_threads: 0, pin_threads: false, d2h_slot_bytes: 4194304, ...}`.
template <>
struct formatter<zenflow::coordinator_config> : fmt::formatter<fmt::string_view> {
  template <class FormatContext>
  auto format(const zenflow::coordinator_config& value, FormatContext& ctx) const {
    return zenflow::detail::format::pad_text(*this, value, ctx);
  }
};

/// Exactly what `operator<<(std::ostream&, const step_metrics&)` writes: the formatter calls it, so
/// the two never differ.
template <>
struct formatter<zenflow::step_metrics> : ostream_formatter {};

}  // namespace fmt
