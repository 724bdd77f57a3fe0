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
#include "zenflow/view.hpp"

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

/// 2. transfer_queue: N >= 2 fixed-size slots moving bytes in one direction (transfer_queue.hpp:
///    host_transfer_queue; transfer_queue.cuh: cuda_transfer_queue).
///    R1 `Q::slot_type` — a handle to one slot; `Q::stream_type` — the caller's stream handle.
///    R2 `slot_count()`, `slot_bytes()` — the queue's geometry; `direction()` — which way it moves.
///    R3 `acquire()` blocks until a slot is free; `try_acquire()` returns std::nullopt instead.
///    R4 `release(slot)` hands the slot back to the producer side.
///    R5 `submit_device_to_host(slot, src, bytes, stream)` / `submit_host_to_device(slot, dst,
///       bytes, stream)` — enqueue the slot's copy, ordered through events on `stream`.
///    R6 `next()` waits for the oldest submitted slot's copy; `try_next()` returns std::nullopt
///       instead; `drain()` waits for every submitted copy.
///    R7 `counters()` — `.bytes` and `.transfers` submitted in the queue's direction.
template <class Q>
concept transfer_queue = requires(Q& q, const Q& cq, typename Q::slot_type slot, typename Q::stream_type stream,
                                  void* dst, const void* src, std::size_t bytes) {
  typename Q::slot_type;
  typename Q::stream_type;
  { cq.slot_count() } -> std::convertible_to<std::size_t>;
  { cq.slot_bytes() } -> std::convertible_to<std::size_t>;
  cq.direction();
  { q.acquire() } -> std::same_as<typename Q::slot_type>;
  { q.try_acquire() } -> std::same_as<std::optional<typename Q::slot_type>>;
  q.release(slot);
  q.submit_device_to_host(slot, src, bytes, stream);
  q.submit_host_to_device(slot, dst, bytes, stream);
  { q.next() } -> std::same_as<typename Q::slot_type>;
  { q.try_next() } -> std::same_as<std::optional<typename Q::slot_type>>;
  q.drain();
  { cq.counters().bytes } -> std::convertible_to<std::uint64_t>;
  { cq.counters().transfers } -> std::convertible_to<std::uint64_t>;
};

/// 3. host_optimizer: the CPU Adam/AdamW that owns fp32 master, m, v of every column.
///    R1 `options()` — the Adam hyper-parameters in use.
///    R2 `step_count()` — the number of updates it has applied (64-bit).
///    R3 `tensor_count()` — number of registered tensors.
///    R4 `params(t)` — tensor t's fp32 master parameters, column-contiguous (column c of a
///       rows x cols tensor at [c*rows, (c+1)*rows)), readable on the host.
///    R5 `set_step_count(n)` — restores the counter (checkpoints).
template <class O>
concept host_optimizer = requires(O& o, const O& co, std::size_t t, std::int64_t n) {
  { co.options() } -> std::convertible_to<const adam_options&>;
  { co.step_count() } -> std::convertible_to<std::int64_t>;
  { co.tensor_count() } -> std::convertible_to<std::size_t>;
  { co.params(t) } -> std::convertible_to<std::span<const float>>;
  o.set_step_count(n);
};

/// 4. device_optimizer: the sparse-column Adam that owns the compact state of the selected columns.
///    R1 `options()` — the Adam hyper-parameters in use.
///    R2 `step_count()` — the number of updates it has applied (64-bit).
///    R3 `parameter_count()` — number of registered parameters.
///    R4 `selection(i)` — the columns of parameter i it updates, ascending int32 in host memory.
///    R5 `k(i)` — how many columns of parameter i it updates.
template <class O>
concept device_optimizer = requires(const O& co, std::size_t i) {
  { co.options() } -> std::convertible_to<const adam_options&>;
  { co.step_count() } -> std::convertible_to<std::int64_t>;
  { co.parameter_count() } -> std::convertible_to<std::size_t>;
  { co.selection(i) } -> std::convertible_to<std::span<const std::int32_t>>;
  { co.k(i) } -> std::convertible_to<std::int64_t>;
};

/// 5. offload_coordinator: the bounded-async schedule a trainer drives once per step.
///    R1 `C::stream_type` — the trainer's stream type (cudaStream_t, host_stream*).
///    R2 `options()` — the zenflow options in use.
///    R3 `submit_gradient(i, grad, stream)` — hands over parameter i's gradient of this step.
///    R4 `step(stream)` — ends the current training step.
///    R5 `step_count()` — training steps completed.
///    R6 `metrics()` — what the last step did and cost.
template <class C>
concept offload_coordinator = requires(C& c, const C& cc, typename C::stream_type stream, std::size_t i,
                                       const_matrix_view grad) {
  typename C::stream_type;
  { cc.options() } -> std::convertible_to<const zenflow_options&>;
  c.submit_gradient(i, grad, stream);
  c.step(stream);
  { cc.step_count() } -> std::convertible_to<std::int64_t>;
  cc.metrics();
};

}  // namespace zenflow
