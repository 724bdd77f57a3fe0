// The concepts that tie the components together, and the contract between the coordinator's
// schedule and its execution backends.
//
// Each component (a template or a class) models one of these, so a trainer can use a component
// alone, swap one for its own, or compose them through the coordinator. Requirements are numbered
// (R1, R2, ...) and each concept has a positive and a negative static_assert test in
// tests/unit/test_concepts.cpp. Requirements grow as the components land; a requirement is only
// added together with a model that satisfies it.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <ranges>
#include <span>

#include "zenflow/detail/coordinator/step_flags.hpp"
#include "zenflow/hyper_parameters.hpp"
#include "zenflow/optimizer_task.hpp"
#include "zenflow/options.hpp"
#include "zenflow/state_slots.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

// Vocabulary of the components that the requirements below name (declared here so that this
// header stays light; check a concept where the component's header is included).
struct cpu_adam_config;                        // cpu_adam.hpp
struct host_execution;                         // host_stream.hpp
enum class transfer_direction : std::uint8_t;  // transfer_queue.hpp

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

/// 9. optimizer_hyper_parameters: an optimizer's own hyper-parameter type, which the coordinator
///    stores per parameter, checks, saves in checkpoints and agrees on across ranks without
///    knowing its fields (hyper_parameters.hpp; adam_options is the library's model). Declared
///    here, before the optimizer concepts that require it.
///    H1 regular: default-constructible (the defaults), copyable, `==`.
///    H2 `validate()` — throws `zenflow::error` naming the first field out of range.
///    H3 `H::fields()` — every float and bool field as hyper_parameter_field<H> (a name, the member,
///       per_group): parameter groups may set the per_group fields per parameter; the others are
///       one value for every parameter of a coordinator. Checkpoints store them in table order.
///    H4 `H::name` — its name in messages, in formatted options and in checkpoints ("adam").
///    H5 The table is well formed, checked at compile time (`fields()` is constexpr): every entry
///       has a non-empty name, unique in the table, and exactly one member (a float or a bool).
template <class H>
concept optimizer_hyper_parameters = std::regular<H> && requires(const H& h) {
  h.validate();
  { H::name } -> std::convertible_to<const char*>;
  { H::fields() } -> std::ranges::range;
  requires std::same_as<std::ranges::range_value_t<decltype(H::fields())>, hyper_parameter_field<H>>;
} && detail::well_formed_fields<H>();

/// 3. host_optimizer: the CPU optimizer that owns the fp32 master and the rest of the state of
///    every column (cpu_adam, the CPU Adam/AdamW, is the library's model). The requirements are
///    exactly what basic_coordinator calls on it, so a type that models the concept can be plugged
///    into the coordinator (the coordinator's tests plug in wrappers that inject failures and
///    delays, and a second optimizer with hyper-parameters of its own).
///    R1 `O::hyper_parameters` — its hyper-parameter type (optimizer_hyper_parameters); `O(hp,
///       config)` — constructible from them and a cpu_adam_config (its cpu_threads, pin_threads
///       and cpu_state).
///    R2 `add_tensor(initial, rows, cols)` — registers a rows x cols tensor from its fp32 master
///       values, column-contiguous (column c at [c*rows, (c+1)*rows)), moments 0; returns its index.
///    R3 `O::slots_type` — its state_slots (state_slots.hpp: the master, then its own state);
///       `export_state(t, columns, out)` and `import_state(t, columns, in)` — the state of tensor
///       t's listed columns (ascending) as fp32, slot after slot (the host exchange layout of
///       state_slots.hpp): how state leaves and enters it on reselection, in checkpoints and when
///       the trainer edits its parameters, whatever and wherever the optimizer holds it (RAM, an
///       SSD; an import of an export leaves the state unchanged). An import checks every column
///       before it changes any. The coordinator never reads the state's storage itself, and
///       names no slot but the master.
///    R4 `step(tasks, grad_scale, check_finite)` — one step over a span of
///       optimizer_task<O::hyper_parameters> (optimizer_task.hpp: each tensor's CPU columns, its
///       compact gradient, its hyper-parameters, a compact copy-out in the parameter's dtype),
///       every gradient element multiplied by grad_scale. Synchronous.
///    R5 `step_count()` — the number of updates it has applied (64-bit); `set_step_count(n)`
///       restores it (checkpoints).
///    docs/OPTIMIZERS.md says what the coordinator hands a step (scales, layouts, counts) and when
///    it calls the optimizer.
///    The coordinator accumulates the offloaded gradients itself (into buffers it owns, with the
///    library's SIMD accumulate kernel, on its offload thread while this optimizer may be running
///    a step): accumulation is not part of the contract.
template <class O>
concept host_optimizer = optimizer_hyper_parameters<typename O::hyper_parameters> &&
    std::constructible_from<O, const typename O::hyper_parameters&, const cpu_adam_config&> &&
    requires(O& o, const O& co, std::span<const float> initial, index_t rows, index_t cols, std::size_t t,
             std::span<const std::int32_t> columns, std::span<float> out, std::span<const float> in,
             std::span<const optimizer_task<typename O::hyper_parameters>> tasks, float grad_scale, bool check_finite,
             std::int64_t n) {
  requires state_slots<typename O::slots_type>;
  { o.add_tensor(initial, rows, cols) } -> std::convertible_to<std::size_t>;
  co.export_state(t, columns, out);
  o.import_state(t, columns, in);
  o.step(tasks, grad_scale, check_finite);
  { co.step_count() } -> std::convertible_to<std::int64_t>;
  o.set_step_count(n);
};

/// 4. device_optimizer: the sparse-column optimizer that owns the compact state of the selected
///    columns (the sparse Adams are the library's models).
///    R1 `D::hyper_parameters` — its hyper-parameter type (optimizer_hyper_parameters);
///       `options()` — the ones in use.
///    R2 `step_count()` — the number of updates it has applied (64-bit).
///    R3 `parameter_count()` — number of registered parameters.
///    R4 `selection(i)` — the columns of parameter i it updates, ascending int32 in host memory.
///    R5 `k(i)` — how many columns of parameter i it updates.
template <class O>
concept device_optimizer = optimizer_hyper_parameters<typename O::hyper_parameters> &&
    requires(const O& co, std::size_t i) {
  { co.options() } -> std::convertible_to<const typename O::hyper_parameters&>;
  { co.step_count() } -> std::convertible_to<std::int64_t>;
  { co.parameter_count() } -> std::convertible_to<std::size_t>;
  { co.selection(i) } -> std::convertible_to<std::span<const std::int32_t>>;
  { co.k(i) } -> std::convertible_to<std::int64_t>;
};

/// 5. offload_coordinator: the bounded-async schedule a trainer drives once per step.
///    R1 `C::stream_type` — the trainer's stream type (cudaStream_t, host_stream*).
///    R2 `C::options_type` — its basic_zenflow_options; `options()` — the ones in use.
///    R3 `submit_gradient(i, grad, stream)` — hands over parameter i's gradient of this step.
///    R4 `step(stream)` — ends the current training step.
///    R5 `step_count()` — training steps completed.
///    R6 `metrics()` — what the last step did and cost.
template <class C>
concept offload_coordinator = requires(C& c, const C& cc, typename C::stream_type stream, std::size_t i,
                                       const_matrix_view grad) {
  typename C::stream_type;
  { cc.options() } -> std::convertible_to<const typename C::options_type&>;
  c.submit_gradient(i, grad, stream);
  c.step(stream);
  { cc.step_count() } -> std::convertible_to<std::int64_t>;
  cc.metrics();
};

namespace detail {
// coordinator_backend's requirements, one concept per group (declared first: the diagnostics of a
// backend that falls short name the group).

// R1
template <class B>
concept backend_stream = std::copyable<typename B::stream_type> && requires {
  { B::device_space } -> std::convertible_to<memory_space>;
};

// R2
template <class B>
concept backend_selector = importance_selector<typename B::selector_type> &&
    std::constructible_from<typename B::selector_type, float> &&
    requires(typename B::selector_type& s, const typename B::selector_type& cs, index_t n, std::size_t i) {
  { s.add_parameter(n, n) } -> std::convertible_to<std::size_t>;
  { cs.scores(i) } -> std::convertible_to<std::span<const float>>;
};

// R3
template <class D>
concept migratable_device_optimizer = device_optimizer<D> &&
    std::constructible_from<D, const typename D::hyper_parameters&> && state_slots<typename D::slots_type> &&
    requires(D& d, const D& cd, std::size_t i, std::span<float> out, std::span<const float> in, std::int64_t n) {
  cd.export_state(i, out);
  d.import_state(i, in);
  d.set_step_count(n);
  { cd.step_count(i) } -> std::convertible_to<std::int64_t>;
  d.set_step_count(i, n);
};
template <class B>
concept backend_device_optimizer = migratable_device_optimizer<typename B::device_optimizer_type>;

// R4
template <class B>
concept backend_queue = transfer_queue<typename B::queue_type> &&
    std::constructible_from<typename B::queue_type, transfer_direction, std::size_t, std::size_t> &&
    requires(typename B::queue_type& q, typename B::stream_type s, void* dst, const void* src, std::size_t bytes) {
  { B::queue_stream(s) } -> std::convertible_to<typename B::queue_type::stream_type>;
  pipelined_copy_to_device(q, dst, src, bytes, B::queue_stream(s));
};

// R5
template <class Buffer>
concept backend_buffer =
    std::default_initializable<Buffer> && std::movable<Buffer> && std::constructible_from<Buffer, std::size_t>;
template <class B>
concept backend_buffers = backend_buffer<typename B::device_buffer> && backend_buffer<typename B::host_buffer> &&
    requires(const typename B::device_buffer& d, typename B::host_buffer& h) {
  { d.data() } -> std::same_as<std::byte*>;
  { d.bytes() } -> std::convertible_to<std::size_t>;
  { h.data() } -> std::same_as<std::byte*>;
  { h.device_data() } -> std::same_as<std::byte*>;
};

// R6
template <class B>
concept host_events_are_queryable = B::device_space != memory_space::host || requires(typename B::event_type& e) {
  { e.query() } -> std::convertible_to<bool>;
};
template <class B>
concept backend_streams_and_events = std::default_initializable<typename B::owned_stream> &&
    std::default_initializable<typename B::event_type> && host_events_are_queryable<B> &&
    requires(typename B::owned_stream& owned, typename B::event_type& e, typename B::stream_type s) {
  { owned.get() } -> std::convertible_to<typename B::stream_type>;
  B::record(e, s);
  B::wait(s, e);
  B::synchronize(e);
  B::synchronize(s);
};

// R7, R8
template <class B>
concept backend_devices_and_copies = requires(typename B::stream_type s, void* dst, const void* src, std::size_t n) {
  { B::current_device() } -> std::convertible_to<int>;
  B::bind_device(0);
  B::copy_async(dst, src, n, s);
};

// R9, R10, R11, R12
template <class B>
concept backend_step_operations =
    requires(typename B::stream_type s, typename B::device_optimizer_type& opt, typename B::selector_type& selector,
             std::span<const const_matrix_view> matrices, std::span<const const_vector_view> vectors, float max_norm,
             step_flags* flags, const step_flags* const_flags, std::byte* scratch, std::size_t i,
             const typename B::device_optimizer_type::hyper_parameters& hp, matrix_view param, vector_view vector,
             const_matrix_view grad, std::span<const std::int32_t> columns, const std::int32_t* columns_dev,
             std::span<const float> packed, std::span<float> leaving, void* dst, const void* src, dtype type) {
  { B::statistics_scratch_bytes } -> std::convertible_to<std::size_t>;
  B::step_statistics(matrices, vectors, max_norm, flags, flags, scratch, s);
  B::device_step(opt, matrices, vectors, const_flags, s);
  B::set_options(opt, i, hp, s);
  { B::add_matrix(opt, param, columns, packed, s) } -> std::convertible_to<std::size_t>;
  { B::add_vector(opt, vector, packed) } -> std::convertible_to<std::size_t>;
  B::reselect(opt, i, columns, packed, leaving, s);
  B::gather(grad, columns, columns_dev, dst, type, const_flags, s);
  B::scatter(src, type, columns, columns_dev, param, s);
  B::select(selector, matrices, s);
};
}  // namespace detail

/// 7. coordinator_backend: what basic_coordinator's schedule needs from an execution backend — its
///    component types, its memory, streams and events, and the "device" operations of a step
///    (host_backend in detail/coordinator/host_backend.hpp: host memory, a host_stream plays the GPU
///    stream; cuda_backend in detail/coordinator/cuda_backend.cuh). Every operation is a static
///    member; a "device" operation is enqueued on the stream it takes and returns without waiting
///    for it, unless its requirement says it synchronizes.
///    R1 `B::stream_type` — the trainer's stream handle (copyable, passed by value);
///       `B::device_space` — the memory_space of the parameters, gradients and device buffers.
///    R2 `B::selector_type` — an importance_selector constructible from topk_ratio, with
///       `add_parameter(rows, cols)` (returns the index) and `scores(i)` (the last selection's
///       column scores, host memory).
///    R3 `B::device_optimizer_type` — a device_optimizer constructible from its hyper_parameters, with
///       `slots_type` (state_slots.hpp; the host optimizer's, which basic_coordinator checks),
///       `export_state(i, out)` and `import_state(i, in)` (every slot of parameter i's columns in
///       the device exchange layout of state_slots.hpp, host spans) and
///       `set_step_count(n)` (checkpoints), and per parameter `step_count(i)` /
///       `set_step_count(i, n)` (a parameter's bias-correction count, which stops while it gets
///       no gradient; checkpoints).
///    R4 `B::queue_type` — a transfer_queue constructible from (direction, slot_bytes, slot_count);
///       `B::queue_stream(stream)` — the stream argument the queue's submissions take;
///       `pipelined_copy_to_device(queue, dst, src, bytes, queue_stream(stream))` (found by ADL)
///       copies host memory to the device through the queue's slots and returns once done.
///    R5 `B::device_buffer` — an owning allocation in device_space: default-constructible,
///       movable, `device_buffer(bytes)`, `data()` (std::byte*, also on a const buffer), `bytes()`.
///       `B::host_buffer` — host memory that device work writes into: default-constructible,
///       movable, `host_buffer(bytes)`, `data()` for the host, `device_data()` for device work.
///    R6 Streams and events: `B::owned_stream` (default-constructible, `get()` gives its
///       stream_type); `B::event_type` (default-constructible); `record(event, stream)`;
///       `wait(stream, event)` (the stream's later work waits for the event; the caller does not);
///       `synchronize(event)` and `synchronize(stream)` (the caller waits). When device_space is
///       host, `event.query()` says whether the event completed (the stream-order check).
///    R7 `current_device()` — the calling thread's device; `bind_device(device)` makes it a worker
///       thread's. Optional: `B::device_scope`, constructible from a device, makes it the calling
///       thread's for its scope and restores the previous one (every public call of the
///       coordinator runs under the device current at its construction).
///    R8 `copy_async(dst, src, bytes, stream)` — a copy between host and device memory, either way.
///    R9 `B::statistics_scratch_bytes` and `step_statistics(matrices, vectors, max_norm, flags,
///       flags_host, scratch, stream)` — the global statistics of the step's gradients turned into
///       its step_flags (make_step_flags), written to `flags` (device memory) and `flags_host` (a
///       host_buffer's device_data()); `scratch` is a device buffer of statistics_scratch_bytes.
///    R10 The device update: `device_step(opt, matrices, vectors, flags, stream)` (the sparse Adam
///        step of the selected columns and the 1-D parameters, gradients multiplied by
///        flags->scale, nothing done when flags->skip); `set_options(opt, i, hp, stream)` (for the
///        steps enqueued after it); `add_matrix(opt, param, selection, packed, stream)` and
///        `add_vector(opt, param, initial)` (register, return the index; the input may be freed on
///        return); `reselect(opt, i, selection, entering, leaving, stream)` (moves state in and out;
///        synchronizes: `leaving` is filled on return).
///    R11 Columns: `gather(grad, columns, columns_dev, dst, dst_type, flags, stream)` (dst = the
///        listed columns of grad times flags->scale, compact, in dst_type) and `scatter(src,
///        src_type, columns, columns_dev, param, stream)` (the listed columns of param = the compact
///        src, converted to param's dtype); `columns` lists them on the host, `columns_dev` is the
///        same list in device memory.
///    R12 `select(selector, grads, stream)` — scores the step's gradients and selects; the
///        selection is readable on the host on return.
///    R13 Optional: `B::accumulates_on_stream` (a constexpr bool), true when work on the stream
///        can accumulate into host memory itself (host_backend: its device memory is host
///        memory). A coordinator of one process then offloads each step's CPU columns at step(),
///        with the step's flags, through `gather_accumulate(grad, columns, acc, accumulated,
///        flags, stream)`: unless flags->skip, the fp32 host accumulator `acc` += gather's result
///        (as R11 writes it, in grad's dtype), stored instead when *accumulated == 0, then
///        ++*accumulated; no staging, no copy. With no columns it only counts the step (unless
///        flags->skip): a step whose CPU update reads the gradient where it is.
///    R14 Optional: `B::copies_out_in_place` (a constexpr bool; default: device_space is host),
///        true when the CPU update may write the updated columns straight into the device
///        buffers the write-back reads. Else the CPU update writes them into a host window of
///        coordinator_config::copy_out_window_bytes, a wave of columns at a time, and each wave is
///        uploaded through the queue (R4) before the next one is computed.
template <class B>
concept coordinator_backend =
    detail::backend_stream<B> && detail::backend_selector<B> && detail::backend_device_optimizer<B> &&
    detail::backend_queue<B> && detail::backend_buffers<B> && detail::backend_streams_and_events<B> &&
    detail::backend_devices_and_copies<B> && detail::backend_step_operations<B>;

namespace detail {
/// R13: whether B accumulates a step's CPU columns on its stream.
template <class B>
inline constexpr bool accumulates_on_stream = requires {
  requires B::accumulates_on_stream;
};

/// R14: whether B's CPU updates write the device buffers themselves.
template <class B>
inline constexpr bool copies_out_in_place = [] {
  if constexpr (requires { B::copies_out_in_place; })
    return static_cast<bool>(B::copies_out_in_place);
  else
    return B::device_space == memory_space::host;
}();

/// A score communicator for checking D1 (the selector of a data-parallel coordinator reduces its
/// scores through one; see importance_selector.hpp).
struct any_score_communicator {
  void all_reduce_sum(std::span<float>) const {}
  template <class Stream>
  void all_reduce_sum(std::span<float>, Stream) const {}
  [[nodiscard]] int world_size() const { return 1; }
};
}  // namespace detail

/// 8. data_parallel_backend: a coordinator_backend that can also run the data-parallel schedule
///    (basic_coordinator with a communicator; docs/DATA_PARALLEL.md).
///    D1 `B::selector_with<C>` — the backend's selector reducing its column scores through the
///       score communicator C before top-k (every rank selects the same columns).
///    D2 `partial_statistics(matrices, vectors, out, scratch, stream)` — this rank's share of the
///       step's statistics: out[0] = sum of squares, out[1] = non-finite count, two doubles in
///       device memory (then summed over the ranks by an all_reduce).
///    D3 `mean_step_flags(stats, ranks, max_norm, flags, flags_host, stream)` — the step's
///       step_flags (make_mean_step_flags) from the summed statistics, written as R9 writes them.
template <class B>
concept data_parallel_backend = coordinator_backend<B> &&
    requires(typename B::template selector_with<detail::any_score_communicator>& selector,
             std::span<const const_matrix_view> matrices, std::span<const const_vector_view> vectors, double* out,
             const double* stats, int ranks, float max_norm, step_flags* flags, std::byte* scratch,
             typename B::stream_type stream) {
  B::partial_statistics(matrices, vectors, out, scratch, stream);
  B::mean_step_flags(stats, ranks, max_norm, flags, flags, stream);
  B::select(selector, matrices, stream);
};

/// 10. host_column_optimizer: the sparse-column optimizer that basic_host_backend runs on the host
///    (host_sparse_adam is the library's model; another optimizer brings its own twin of its GPU
///    kernel: tests/unit/test_coordinator_sgd.cpp, docs/OPTIMIZERS.md). Besides R3 of
///    coordinator_backend (a migratable device_optimizer), what the backend calls on its stream:
///    C1 `step(matrices, vectors, grad_scale, scale, skip, check_finite, exec)` — one step of every
///       parameter (sparse_adam.hpp: a gradient view without data leaves its parameter as it is;
///       the effective scale is grad_scale * *scale; nothing changes while *skip != 0).
///    C2 `set_options(i, hp)` — parameter i's hyper-parameters for the next steps.
///    C3 `reselect(i, selection, entering, leaving, exec)` — a new selection with state migration
///       in the device exchange layout.
///    C4 `add_matrix(param, selection, packed, exec)` and `add_vector(param, initial)` — register
///       a parameter (returns its index).
template <class D>
concept host_column_optimizer = detail::migratable_device_optimizer<D> &&
    requires(D& d, std::span<const const_matrix_view> matrices, std::span<const const_vector_view> vectors,
             float grad_scale, const float* scale, const int* skip, bool check_finite, const host_execution& exec,
             std::size_t i, const typename D::hyper_parameters& hp, std::span<const std::int32_t> selection,
             std::span<const float> in, std::span<float> out, matrix_view param, vector_view vector) {
  d.step(matrices, vectors, grad_scale, scale, skip, check_finite, exec);
  d.set_options(i, hp);
  d.reselect(i, selection, in, out, exec);
  { d.add_matrix(param, selection, in, exec) } -> std::convertible_to<std::size_t>;
  { d.add_vector(vector, in) } -> std::convertible_to<std::size_t>;
};

}  // namespace zenflow
