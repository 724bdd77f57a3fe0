// The data-parallel parts of basic_coordinator (docs/DATA_PARALLEL.md): the column ownership of
// each rank, the agreement checks, the gradient reductions of a step and the reduced statistics.
// With single_process as the communicator none of this communicates: a rank owns every column.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <span>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/checkpoint_io.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"

namespace zenflow {

namespace detail {
/// FNV-1a over the bytes of `value`, continuing `h`.
template <class T>
std::uint64_t fingerprint(std::uint64_t h, const T& value) noexcept {
  const auto* bytes = reinterpret_cast<const unsigned char*>(&value);
  for (std::size_t i = 0; i < sizeof(T); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return h;
}
}  // namespace detail

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

// values summed (or min/max) over the ranks, on the host. Synchronizes with `stream`.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
template <class T>
std::vector<T> basic_coordinator<Backend, HostOptimizer, Communicator>::all_reduce_to_host(std::span<const T> values,
                                                                                           reduce_op op,
                                                                                           stream_type stream) {
  std::vector<T> out(values.begin(), values.end());
  if constexpr (data_parallel) {
    // Kept between calls (every call synchronizes, so none is in flight when it grows): no
    // allocation per step for the gradient agreement.
    if (agreement_buffer_.bytes() < values.size_bytes()) agreement_buffer_ = device_buffer(values.size_bytes());
    device_buffer& buffer = agreement_buffer_;
    const std::span<T> on_device(reinterpret_cast<T*>(buffer.data()), values.size());
    detail::synchronize_on_unwind<Backend> guard(stream);
    Backend::copy_async(buffer.data(), values.data(), values.size_bytes(), stream);
    comm_->all_reduce(std::span<const T>(on_device), on_device, op, stream);
    Backend::copy_async(out.data(), buffer.data(), values.size_bytes(), stream);
    Backend::synchronize(stream);
    comm_->check();
  }
  return out;
}

// The first step: every rank must have registered the same parameters (names, shapes, dtypes) with
// the same options; a mismatch would pair unrelated buffers in the collectives.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::agree_on_registration(stream_type stream) {
  if constexpr (data_parallel) {
    std::uint64_t h = 14695981039346656037ull;
    const zenflow_options& o = options_;
    h = detail::fingerprint(h, o.mode);
    h = detail::fingerprint(h, o.topk_ratio);
    h = detail::fingerprint(h, o.select_interval_steps());
    h = detail::fingerprint(h, o.update_interval.is_auto);
    h = detail::fingerprint(h, o.update_interval.value);
    h = detail::fingerprint(h, o.full_warm_up_rounds);
    h = detail::fingerprint(h, o.overlap_step);
    h = detail::fingerprint(h, o.max_update_interval);
    h = detail::fingerprint(h, o.max_grad_norm);
    h = detail::fingerprint(h, params_.size());
    for (const auto& p : params_) {
      for (char c : p.name) h = detail::fingerprint(h, c);
      h = detail::fingerprint(h, p.is_vector);
      h = detail::fingerprint(h, p.is_vector ? p.vector.size : p.matrix.rows);
      h = detail::fingerprint(h, p.is_vector ? index_t{1} : p.matrix.cols);
      h = detail::fingerprint(h, p.is_vector ? p.vector.type : p.matrix.type);
      h = detail::fingerprint(h, p.grad_type);
    }
    const auto v = static_cast<std::int64_t>(h >> 1);
    const std::int64_t both[2] = {v, -v};
    const auto max = all_reduce_to_host<std::int64_t>(both, reduce_op::max, stream);
    expects(max[0] == -max[1], "data parallel", "the ranks registered different parameters (names, shapes, dtypes) ",
            "or set different options: every rank must build the same coordinator");
  } else {
    (void)stream;
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
  const auto counts = or_fail([&] { return all_reduce_to_host<std::int32_t>(given, reduce_op::sum, stream); });
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
  return all_reduce_to_host<double>(count, reduce_op::sum, stream)[0] > 0.0;
}

// The step's collectives over its gradients, in parameter order on every rank (O1): the selected
// columns of each 2-D gradient (gathered, all-reduced, written back into the trainer's gradient,
// where the device step reads them), each 1-D gradient (all-reduced into the coordinator's
// staging), and the CPU columns (gathered in owner order into equal blocks, reduce-scattered: this
// rank's block holds the sum of its own columns). Sums: the step's flags carry the 1/ranks.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::reduce_gradients(stream_type stream) {
  if constexpr (data_parallel) {
    const int parity = static_cast<int>(step_ % 2);
    for (auto& p : params_) {
      if (!p.has_grad) continue;
      if (p.is_vector) {
        const dtype type = p.grad_vector.type;
        const auto n = static_cast<std::size_t>(p.vector.size);
        // Sized at the first step (a 1-D gradient's dtype is not registered), kept afterwards.
        if (p.vector_stage.bytes() != n * dtype_size(type)) p.vector_stage = device_buffer(n * dtype_size(type));
        dispatch_dtype(type, [&](auto tag) {
          using T = decltype(tag);
          comm_->all_reduce(std::span<const T>(static_cast<const T*>(p.grad_vector.data), n),
                            std::span<T>(reinterpret_cast<T*>(p.vector_stage.data()), n), reduce_op::sum, stream);
        });
        p.grad_vector = const_vector_view(p.vector_stage.data(), p.vector.size, type, Backend::device_space);
        continue;
      }
      const std::size_t rows = static_cast<std::size_t>(p.matrix.rows);
      const std::size_t esize = dtype_size(p.grad_type);
      dispatch_dtype(p.grad_type, [&](auto tag) {
        using T = decltype(tag);
        if (!p.selection.empty()) {
          const auto* columns_dev = reinterpret_cast<const std::int32_t*>(p.selection_dev.data());
          Backend::gather(p.grad_matrix, p.selection, columns_dev, p.selected_stage.data(), p.grad_type, unit_flags(),
                          stream);
          const std::span<T> stage(reinterpret_cast<T*>(p.selected_stage.data()), p.selection.size() * rows);
          comm_->all_reduce(std::span<const T>(stage), stage, reduce_op::sum, stream);
          const matrix_view grad(const_cast<void*>(p.grad_matrix.data), p.grad_matrix.rows, p.grad_matrix.cols,
                                 p.grad_matrix.row_stride, p.grad_matrix.col_stride, p.grad_matrix.type,
                                 p.grad_matrix.space);
          Backend::scatter(p.selected_stage.data(), p.grad_type, p.selection, columns_dev, grad, stream);
        }
        if (!p.complement.empty()) {
          std::byte* stage = p.grad_stage[parity].data();
          const auto* complement_dev = reinterpret_cast<const std::int32_t*>(p.complement_dev.data());
          for (int r = 0; r < ranks_; ++r) {
            const std::size_t first = p.pieces[r], count = p.pieces[r + 1] - first;
            if (count == 0) continue;
            Backend::gather(p.grad_matrix, std::span<const std::int32_t>(p.complement).subspan(first, count),
                            complement_dev + first, stage + static_cast<std::size_t>(r) * p.block * esize, p.grad_type,
                            unit_flags(), stream);
          }
          T* blocks = reinterpret_cast<T*>(stage);
          comm_->reduce_scatter(std::span<const T>(blocks, static_cast<std::size_t>(ranks_) * p.block),
                                std::span<T>(blocks + static_cast<std::size_t>(rank_) * p.block, p.block),
                                reduce_op::sum, stream);
        }
      });
    }
  } else {
    (void)stream;
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
      if (rank_ == 0 && !p.selection.empty())
        m.push_back(const_matrix_view::column_contiguous(p.selected_stage.data(), rows,
                                                         static_cast<index_t>(p.selection.size()), p.grad_type,
                                                         Backend::device_space));
      const auto own = static_cast<index_t>(owned_piece_elements(p)) / rows;
      if (own > 0)
        m.push_back(const_matrix_view::column_contiguous(
            p.grad_stage[parity].data() + static_cast<std::size_t>(rank_) * p.block * dtype_size(p.grad_type), rows,
            own, p.grad_type, Backend::device_space));
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
