// The data-parallel parts of basic_coordinator (docs/DATA_PARALLEL.md): the column ownership of
// each rank, the agreement checks, the gradient reductions of a step and the reduced statistics.
// With single_process as the communicator none of this communicates: a rank owns every column.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/agreement.hpp"
#include "zenflow/detail/coordinator/checkpoint_format.hpp"
#include "zenflow/detail/coordinator/checkpoint_io.hpp"
#include "zenflow/detail/coordinator/checkpoint_reader.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"

namespace zenflow {

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
int basic_coordinator<Backend, HostOptimizer, Communicator>::rank() const noexcept {
  return rank_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
int basic_coordinator<Backend, HostOptimizer, Communicator>::ranks() const noexcept {
  return ranks_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
column_range basic_coordinator<Backend, HostOptimizer, Communicator>::owned_columns(std::size_t i) const {
  return at(i).owned;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::size_t basic_coordinator<Backend, HostOptimizer, Communicator>::owned_piece_elements(
    const parameter& p) const noexcept {
  return (p.pieces[rank_ + 1] - p.pieces[rank_]) * static_cast<std::size_t>(p.matrix.rows);
}

// A failed rank tells the others at once (their collectives fail instead of waiting for the
// timeout): every rank of a failed step fails.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::fail_peers(const std::exception_ptr& e) noexcept {
  if constexpr (data_parallel) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      comm_->abort(x.what());
    } catch (...) {
      comm_->abort("unknown error");
    }
  } else {
    (void)e;
  }
}

// values summed (or min/max) over the ranks, on the host: on the coordinator's own control stream,
// after the collectives enqueued on the trainer's stream so far (collectives_enqueued), never
// behind the trainer's other work. Synchronizes with the control stream only.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
template <class T>
std::vector<T> basic_coordinator<Backend, HostOptimizer, Communicator>::all_reduce_to_host(std::span<const T> values,
                                                                                           reduce_op op) {
  std::vector<T> out(values.begin(), values.end());
  if constexpr (data_parallel) {
    on_control_stream(values.size_bytes(), [&](std::byte* device, std::byte* host, stream_type control) {
      const std::span<T> on_device(reinterpret_cast<T*>(device), values.size());
      std::memcpy(host, values.data(), values.size_bytes());
      Backend::copy_async(device, host, values.size_bytes(), control);
      comm_->all_reduce(std::span<const T>(on_device), on_device, op, control);
      Backend::copy_async(host, device, values.size_bytes(), control);
    });
    std::memcpy(out.data(), agreement_host_.data(), values.size_bytes());
  }
  return out;
}

// Runs `enqueue(device, host, control)` on the control stream with a device buffer and a pinned
// host buffer of `bytes` each (kept between calls: no allocation per step, and no copy through
// pageable memory), after the collectives enqueued on the trainer's stream so far, then waits for
// the control stream and checks the communicator. The host buffer holds the result on return.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
template <class Enqueue>
void basic_coordinator<Backend, HostOptimizer, Communicator>::on_control_stream(std::size_t bytes, Enqueue&& enqueue) {
  if constexpr (data_parallel) {
    const stream_type control = control_stream_->get();
    if (agreement_buffer_.bytes() < bytes) {  // none in flight: every call synchronizes
      agreement_buffer_ = device_buffer(bytes);
      agreement_host_ = typename Backend::host_buffer(bytes);
    }
    detail::synchronize_on_unwind<Backend> guard(control);
    Backend::wait(control, collectives_done_);
    enqueue(agreement_buffer_.data(), agreement_host_.data(), control);
    Backend::synchronize(control);
    comm_->check();
  } else {
    (void)bytes, (void)enqueue;
  }
}

// Marks the end of the collectives enqueued on the trainer's stream so far: the control stream's
// next collective runs after them on the device too (the k-th collective of every rank meets the
// k-th: an engine that runs each stream's collectives as they come must see them in call order).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::collectives_enqueued(stream_type stream) {
  if constexpr (data_parallel)
    Backend::record(collectives_done_, stream);
  else
    (void)stream;
}

// The record of this coordinator the ranks compare before their first step (kind first_step) or of
// the checkpoint it loads (kind checkpoint): the options, the parameters and their
// hyper-parameters as fingerprints, and the position of the schedule.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
detail::agreement basic_coordinator<Backend, HostOptimizer, Communicator>::agreement_of(
    std::int64_t kind, const detail::agreement_position& at) const {
  using detail::fingerprint;
  detail::agreement a;
  a.w[detail::agreement::kind] = kind;
  std::uint64_t h = detail::fingerprint_basis;
  const options_type& o = options_;
  h = fingerprint(h, o.mode);
  h = fingerprint(h, o.topk_ratio);
  h = fingerprint(h, o.select_interval_steps());
  h = fingerprint(h, o.update_interval.is_auto);
  h = fingerprint(h, o.update_interval.value);
  h = fingerprint(h, o.full_warm_up_rounds);
  h = fingerprint(h, o.overlap_step);
  h = fingerprint(h, o.max_update_interval);
  h = fingerprint(h, o.cover_cpu_update);
  h = fingerprint(h, o.max_grad_norm);
  h = detail::fingerprint_fields(h, o.optimizer, false);
  a.w[detail::agreement::options] = static_cast<std::int64_t>(h);
  a.w[detail::agreement::parameters] = static_cast<std::int64_t>(params_.size());
  h = detail::fingerprint_basis;
  for (const auto& p : params_) {
    for (char c : p.name) h = fingerprint(h, c);
    h = fingerprint(h, p.is_vector);
    h = fingerprint(h, p.is_vector ? p.vector.size : p.matrix.rows);
    h = fingerprint(h, p.is_vector ? index_t{1} : p.matrix.cols);
    h = fingerprint(h, p.is_vector ? p.vector.type : p.matrix.type);
    h = fingerprint(h, p.grad_type);
  }
  a.w[detail::agreement::registration] = static_cast<std::int64_t>(h);
  a.w[detail::agreement::hyper_parameters] = static_cast<std::int64_t>(at.hyper_parameters);
  a.w[detail::agreement::initial_values] =
      kind == detail::agreement::first_step ? static_cast<std::int64_t>(initial_values_) : 0;
  a.w[detail::agreement::step] = at.step;
  a.w[detail::agreement::started] = at.started ? 1 : 0;
  a.w[detail::agreement::interval] = at.interval;
  a.w[detail::agreement::interval_first_step] = at.interval_first_step;
  a.w[detail::agreement::interval_target] = at.interval_target;
  a.w[detail::agreement::pending_interval] = at.pending_interval;
  a.w[detail::agreement::selections] = static_cast<std::int64_t>(at.selections);
  a.w[detail::agreement::cpu_steps] = at.cpu_steps;
  a.w[detail::agreement::gpu_steps] = at.gpu_steps;
  a.w[detail::agreement::parameter_steps] = static_cast<std::int64_t>(at.parameter_steps);
  return a;
}

// This coordinator's position before its first step (fresh: nothing has happened yet).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
detail::agreement_position basic_coordinator<Backend, HostOptimizer, Communicator>::current_position() const {
  detail::agreement_position at;
  at.step = step_;
  const auto& s = schedule_.position();
  at.started = s.started;
  at.interval = s.interval;
  at.interval_first_step = s.interval_first_step;
  at.interval_target = s.target;
  at.pending_interval = s.pending;
  // Before the first step no parameter has a GPU step count (gpu_step_count would synchronize).
  for (const auto& p : params_) at.add(p.gpu_columns, p.hyper, p.cpu_steps, 0);
  at.cpu_steps = host_opt_.step_count();
  return at;
}

// load_checkpoint (checkpoint_load.hpp reads and applies the file: read_checkpoint). Data parallel:
// every rank validates its own file, then the ranks compare what they loaded (or why they could
// not) before any of them changes anything (agree): all load, or none does.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::load_checkpoint(const std::string& path,
                                                                              stream_type stream,
                                                                              checkpoint_match match) {
  const device_scope scope(device_);
  try {
    check_stream(stream);
    rethrow_worker_error();
  } catch (...) {
    fail_peers(std::current_exception());  // a failed rank never compares: its peers must not wait for it
    throw;
  }
  int stage = 0;  // 1: the ranks compared their records, 2: applying
  std::optional<detail::checkpoint_reader> reader;
  try {
    reader.emplace(path, detail::checkpoint_verification::deferred);
    read_checkpoint(*reader, stream, match, stage);
  } catch (...) {
    auto e = std::current_exception();
    // The file's checksum is verified after its validation (read_checkpoint): a corrupted file
    // that failed a check on the way is named as corrupted, whatever field or value broke first.
    if (stage == 0 && reader && !reader->verified()) {
      try {
        reader->verify();
      } catch (...) {
        e = std::current_exception();
      }
    }
    if constexpr (data_parallel) {
      if (stage == 0) refuse_checkpoint(e);  // tells the peers why; throws
    }
    if (stage == 2) {  // half applied (a backend error, a file written while it loaded): unusable
      shared_.fail(e);
      if constexpr (data_parallel) fail_peers(e);  // which applied theirs
    }
    std::rethrow_exception(e);
  }
}

// This rank could not load its checkpoint (`e`): the ranks compare records all the same, so that
// every rank throws with this rank's reason (none of them loaded). Always throws.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::refuse_checkpoint(const std::exception_ptr& e) {
  detail::agreement mine = agreement_of(detail::agreement::checkpoint, current_position());
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    mine.reject(x.what());
  } catch (...) {
    mine.reject("unknown error");
  }
  agree(mine);
  std::rethrow_exception(e);  // not reached: this rank's record is rejected
}

// Every rank's record to every rank (one all-gather of a fixed size: ranks that registered
// different parameters still make the same collective), then the same verdict on every rank:
// throws naming the first rank whose checkpoint was rejected, or the first field in which a rank
// differs from rank 0. Synchronizes with the control stream.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::agree(const detail::agreement& mine) {
  if constexpr (data_parallel) {
    using A = detail::agreement;
    const std::size_t n = A::words;
    std::vector<std::int64_t> all(n * static_cast<std::size_t>(ranks_));
    on_control_stream(all.size() * sizeof(std::int64_t), [&](std::byte* device, std::byte* host, stream_type control) {
      auto* words = reinterpret_cast<std::int64_t*>(device);
      std::memcpy(host, mine.w.data(), n * sizeof(std::int64_t));
      Backend::copy_async(words + static_cast<std::size_t>(rank_) * n, host, n * sizeof(std::int64_t), control);
      comm_->all_gather(std::span<const std::int64_t>(words + static_cast<std::size_t>(rank_) * n, n),
                        std::span<std::int64_t>(words, all.size()), control);
      Backend::copy_async(host, words, all.size() * sizeof(std::int64_t), control);
    });
    std::memcpy(all.data(), agreement_host_.data(), all.size() * sizeof(std::int64_t));
    auto at = [&](int r, std::size_t f) { return all[static_cast<std::size_t>(r) * n + f]; };
    for (int r = 0; r < ranks_; ++r)
      expects(at(r, A::status) == 0, "load_checkpoint", "rank ", r, " of ", ranks_,
              " could not load its checkpoint, so no rank loaded one: ",
              A::reason_of(std::span<const std::int64_t>(all).subspan(static_cast<std::size_t>(r) * n, n)));
    for (std::size_t f = 0; f < A::count; ++f)
      for (int r = 1; r < ranks_; ++r)
        if (at(r, f) != at(0, f))
          throw error("data parallel",
                      A::disagreement(f, r, ranks_, at(0, f), at(r, f), field_names<hyper_parameters_type>(true)));
  } else {
    (void)mine;
  }
}

// Every rank must give gradients to the same parameters (they are reduced together): one
// all-reduce of the per-parameter flags. A disagreement (or, with missing_gradients::reject, a
// parameter without a gradient on some rank) is rejected on every rank alike.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::agree_on_gradients(missing_gradients missing,
                                                                                 stream_type stream) {
  if (params_.empty()) return;
  std::vector<std::int32_t> given(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) given[i] = params_[i].has_grad ? 1 : 0;
  const auto counts = or_fail([&] { return all_reduce_to_host<std::int32_t>(given, reduce_op::sum); });
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const int n = counts[i];
    if (n == ranks_ || (n == 0 && missing == missing_gradients::skip)) continue;
    abandon_step(stream);
    if (n == 0)
      expects(false, "step", "no gradient was submitted for parameter ", i, " (", params_[i].name, ") in step ", step_,
              " on any rank; the step's gradients were dropped: submit all of them again");
    expects(false, "step", "parameter ", i, " (", params_[i].name, ") has a gradient on ", n, " of ", ranks_,
            " ranks in step ", step_, " (data-parallel ranks must give gradients to the same parameters); ",
            "the step's gradients were dropped on every rank: submit them again");
  }
}

// Whether any rank's gradients hold a NaN/Inf (a selection is not made from them). Synchronizes.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::any_nonfinite_gradient(stream_type stream) {
  std::vector<const_matrix_view> m;
  std::vector<const_vector_view> v;
  for (const auto& p : params_) {
    if (!p.has_grad) continue;
    if (p.is_vector)
      v.push_back(p.grad_vector);
    else
      m.push_back(p.grad_matrix);
  }
  auto* stats = reinterpret_cast<double*>(reduce_scratch_.data());
  Backend::partial_statistics(m, v, stats, statistics_scratch_.data(), stream);
  double local[2];
  Backend::copy_async(local, stats, sizeof local, stream);
  Backend::synchronize(stream);
  const double count[1] = {local[1]};
  return all_reduce_to_host<double>(count, reduce_op::sum)[0] > 0.0;
}

// The step's collectives over its gradients, in parameter order on every rank (O1), launched
// together (grouped): the selected columns of each 2-D gradient (gathered, all-reduced, written
// back into the trainer's gradient, where the device step reads them), each 1-D gradient
// (all-reduced into the coordinator's staging), and the CPU columns (gathered in owner order into
// equal blocks, reduce-scattered: this rank's block holds the sum of its own columns). First every
// gather, then the collectives, then the write-backs into the gradients (a collective of a group
// runs when the group is launched, after whatever its stream held then). Sums: the step's flags
// carry the 1/ranks.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::reduce_gradients(stream_type stream) {
  if constexpr (data_parallel) {
    const int parity = static_cast<int>(step_ % 2);
    for (auto& p : params_) {
      if (!p.has_grad) continue;
      if (p.is_vector) {
        // Sized at the first step (a 1-D gradient's dtype is not registered), kept afterwards.
        const std::size_t bytes = static_cast<std::size_t>(p.vector.size) * dtype_size(p.grad_vector.type);
        if (p.vector_stage.bytes() != bytes) p.vector_stage = device_buffer(bytes);
        continue;
      }
      if (!p.gpu_columns.empty())
        Backend::gather(p.grad_matrix, p.gpu_columns, reinterpret_cast<const std::int32_t*>(p.gpu_columns_dev.data()),
                        p.selected_stage.data(), p.grad_type, unit_flags(), stream);
      const std::size_t esize = dtype_size(p.grad_type);
      const auto* cpu_columns_dev = reinterpret_cast<const std::int32_t*>(p.cpu_columns_dev.data());
      for (int r = 0; r < ranks_ && !p.cpu_columns.empty(); ++r) {
        const std::size_t first = p.pieces[r], count = p.pieces[r + 1] - first;
        if (count == 0) continue;
        Backend::gather(p.grad_matrix, std::span<const std::int32_t>(p.cpu_columns).subspan(first, count),
                        cpu_columns_dev + first,
                        (*p.by_step)[parity].grad_stage.data() + static_cast<std::size_t>(r) * p.block * esize,
                        p.grad_type, unit_flags(), stream);
      }
    }
    grouped([&] {
      for (auto& p : params_) {
        if (!p.has_grad) continue;
        const dtype type = p.is_vector ? p.grad_vector.type : p.grad_type;
        dispatch_dtype(type, [&](auto tag) {
          using T = decltype(tag);
          if (p.is_vector) {
            const auto n = static_cast<std::size_t>(p.vector.size);
            comm_->all_reduce(std::span<const T>(static_cast<const T*>(p.grad_vector.data), n),
                              std::span<T>(reinterpret_cast<T*>(p.vector_stage.data()), n), reduce_op::sum, stream);
            return;
          }
          const std::span<T> selected(reinterpret_cast<T*>(p.selected_stage.data()),
                                      p.gpu_columns.size() * static_cast<std::size_t>(p.matrix.rows));
          if (!selected.empty()) comm_->all_reduce(std::span<const T>(selected), selected, reduce_op::sum, stream);
          if (p.cpu_columns.empty()) return;
          T* blocks = reinterpret_cast<T*>((*p.by_step)[parity].grad_stage.data());
          comm_->reduce_scatter(std::span<const T>(blocks, static_cast<std::size_t>(ranks_) * p.block),
                                std::span<T>(blocks + static_cast<std::size_t>(rank_) * p.block, p.block),
                                reduce_op::sum, stream);
        });
      }
    });
    for (auto& p : params_) {
      if (!p.has_grad) continue;
      if (p.is_vector) {
        p.grad_vector =
            const_vector_view(p.vector_stage.data(), p.vector.size, p.grad_vector.type, Backend::device_space);
      } else if (!p.gpu_columns.empty()) {
        const matrix_view grad(const_cast<void*>(p.grad_matrix.data), p.grad_matrix.rows, p.grad_matrix.cols,
                               p.grad_matrix.row_stride, p.grad_matrix.col_stride, p.grad_matrix.type,
                               p.grad_matrix.space);
        Backend::scatter(p.selected_stage.data(), p.grad_type, p.gpu_columns,
                         reinterpret_cast<const std::int32_t*>(p.gpu_columns_dev.data()), grad, stream);
      }
    }
  } else {
    (void)stream;
  }
}

// Runs `enqueue`, whose collectives the communicator launches together when it can
// (communicates_in_groups: NCCL's group calls): one launch instead of one per collective.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
template <class Enqueue>
void basic_coordinator<Backend, HostOptimizer, Communicator>::grouped(Enqueue&& enqueue) {
  if constexpr (communicates_in_groups<Communicator>) {
    comm_->group_start();
    try {
      enqueue();
    } catch (...) {
      try {
        comm_->group_end();
      } catch (...) {
      }
      throw;
    }
    comm_->group_end();
  } else {
    enqueue();
  }
}

// The step's flags from the reduced gradients: each rank's share of the statistics (its own CPU
// columns; rank 0 adds the replicated selected columns and 1-D parameters), summed over the ranks.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::reduced_statistics(step_flags* flags_dev,
                                                                                 step_flags* flags_host_dev,
                                                                                 stream_type stream) {
  if constexpr (data_parallel) {
    const int parity = static_cast<int>(step_ % 2);
    std::vector<const_matrix_view> m;
    std::vector<const_vector_view> v;
    for (const auto& p : params_) {
      if (!p.has_grad) continue;
      if (p.is_vector) {
        if (rank_ == 0) v.push_back(p.grad_vector);
        continue;
      }
      const index_t rows = p.matrix.rows;
      if (rank_ == 0 && !p.gpu_columns.empty())
        m.push_back(const_matrix_view::column_contiguous(p.selected_stage.data(), rows,
                                                         static_cast<index_t>(p.gpu_columns.size()), p.grad_type,
                                                         Backend::device_space));
      const auto own = static_cast<index_t>(owned_piece_elements(p)) / rows;
      if (own > 0)
        m.push_back(const_matrix_view::column_contiguous(
            (*p.by_step)[parity].grad_stage.data() +
                static_cast<std::size_t>(rank_) * p.block * dtype_size(p.grad_type),
            rows, own, p.grad_type, Backend::device_space));
    }
    auto* stats = reinterpret_cast<double*>(reduce_scratch_.data());
    Backend::partial_statistics(m, v, stats, statistics_scratch_.data(), stream);
    comm_->all_reduce(std::span<const double>(stats, 2), std::span<double>(stats, 2), reduce_op::sum, stream);
    Backend::mean_step_flags(stats, ranks_, options_.max_grad_norm, flags_dev, flags_host_dev, stream);
  } else {
    (void)flags_dev, (void)flags_host_dev, (void)stream;
  }
}

}  // namespace zenflow
