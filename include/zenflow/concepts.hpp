// The concepts that tie the five components together.
//
// Each component is a template that models one of these, so a trainer can use a component alone,
// swap one for its own, or compose all five through the coordinator. Requirements are numbered
// (R1, R2, ...) and each concept has a positive and a negative static_assert test in
// tests/unit/test_concepts.cpp. Requirements grow as the components land; a requirement is only
// added together with a model that satisfies it.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "zenflow/options.hpp"

namespace zenflow {

/// 1. importance_selector: owns column scores and the current selection of every registered
///    2-D parameter.
///    R1 `parameter_count()` — number of registered parameters.
///    R2 `selected(i)` — the selected columns of parameter i, ascending, as int32 indices in host
///       memory (a copy the host can read without synchronizing).
///    R3 `k(i)` — how many columns are selected for parameter i.
///    R4 `rows(i)`, `cols(i)` — the registered shape of parameter i.
///    R5 `has_selection()` — whether every registered parameter has a selection.
///    R6 `previous(i)`, `overlap(i)` — the selection before the last refresh (ascending, host) and
///       the fraction of the current selection that was already selected (temporal locality).
///    R7 `set_selection(i, columns)` — restores a selection (checkpoint resume).
template <class S>
concept importance_selector = requires(S& s, const S& cs, std::size_t i, std::span<const std::int32_t> columns) {
  { cs.parameter_count() } -> std::convertible_to<std::size_t>;
  { cs.selected(i) } -> std::convertible_to<std::span<const std::int32_t>>;
  { cs.k(i) } -> std::convertible_to<std::int64_t>;
  { cs.rows(i) } -> std::convertible_to<std::int64_t>;
  { cs.cols(i) } -> std::convertible_to<std::int64_t>;
  { cs.has_selection() } -> std::convertible_to<bool>;
  { cs.previous(i) } -> std::convertible_to<std::span<const std::int32_t>>;
  { cs.overlap(i) } -> std::convertible_to<double>;
  s.set_selection(i, columns);
};

/// 2. transfer_queue: N >= 2 fixed-size slots moving bytes in one direction.
///    R1 `Q::slot_type` — a handle to one slot.
///    R2 `slot_count()`, `slot_bytes()` — the queue's geometry.
///    R3 `acquire()` blocks until a slot is free; `try_acquire()` returns std::nullopt instead.
///    R4 `release(slot)` hands the slot back to the producer side.
template <class Q>
concept transfer_queue = requires(Q& q, const Q& cq, typename Q::slot_type slot) {
  typename Q::slot_type;
  { cq.slot_count() } -> std::convertible_to<std::size_t>;
  { cq.slot_bytes() } -> std::convertible_to<std::size_t>;
  { q.acquire() } -> std::same_as<typename Q::slot_type>;
  { q.try_acquire() } -> std::same_as<std::optional<typename Q::slot_type>>;
  q.release(slot);
};

/// 3. host_optimizer: the CPU Adam/AdamW that owns fp32 master, m, v of every column.
///    R1 `options()` — the Adam hyper-parameters in use.
///    R2 `step_count()` — the number of updates it has applied (64-bit).
template <class O>
concept host_optimizer = requires(const O& co) {
  { co.options() } -> std::convertible_to<const adam_options&>;
  { co.step_count() } -> std::convertible_to<std::int64_t>;
};

/// 4. device_optimizer: the sparse-column Adam that owns the compact state of the selected columns.
///    R1 `options()` — the Adam hyper-parameters in use.
///    R2 `step_count()` — the number of updates it has applied (64-bit).
///    R3 `parameter_count()` — number of registered parameters.
template <class O>
concept device_optimizer = requires(const O& co) {
  { co.options() } -> std::convertible_to<const adam_options&>;
  { co.step_count() } -> std::convertible_to<std::int64_t>;
  { co.parameter_count() } -> std::convertible_to<std::size_t>;
};

/// 5. offload_coordinator: the bounded-async schedule a trainer drives once per step.
///    R1 `options()` — the zenflow options in use.
///    R2 `step()` — ends the current training step.
///    R3 `step_count()` — training steps completed.
template <class C>
concept offload_coordinator = requires(C& c, const C& cc) {
  { cc.options() } -> std::convertible_to<const zenflow_options&>;
  c.step();
  { cc.step_count() } -> std::convertible_to<std::int64_t>;
};

}  // namespace zenflow
