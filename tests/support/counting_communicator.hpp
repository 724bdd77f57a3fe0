// What the data-parallel coordinator costs per step, seen through the interfaces it runs on: a
// communicator that counts collectives and launches (a group of collectives is one launch, as
// with NCCL's group calls), a host backend that counts synchronizations of the trainer's stream
// and "device" allocations, and a model with many parameters whose selection moves, so that each
// rank's share of the CPU columns changes at every reselection. Shared by the unit tests (one rank)
// and the MPI tests.
#pragma once

#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace zenflow_test {

/// A communicator over `Inner` (kept by the caller) that counts what the coordinator calls: every
/// collective of at least one element, and launches (a collective outside a group, or a group
/// with at least one collective). Its group_start()/group_end() make the coordinator group its
/// collectives as it does on NCCL; the collectives still run one by one on Inner.
template <class Inner>
class counting_communicator {
 public:
  using stream_type = typename Inner::stream_type;

  explicit counting_communicator(Inner& inner) : inner_(inner) {}

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }

  template <zenflow::communicable T>
  void all_reduce(std::span<const T> send, std::span<T> recv, zenflow::reduce_op op, stream_type stream) {
    inner_.all_reduce(send, recv, op, stream);
    count(send.size());
  }
  template <zenflow::communicable T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, zenflow::reduce_op op, stream_type stream) {
    if (on_reduce_scatter && !recv.empty()) on_reduce_scatter(std::as_bytes(send), recv.size() * sizeof(T), stream);
    inner_.reduce_scatter(send, recv, op, stream);
    count(recv.size());
  }
  template <zenflow::communicable T>
  void all_gather(std::span<const T> send, std::span<T> recv, stream_type stream) {
    inner_.all_gather(send, recv, stream);
    count(send.size());
  }
  template <zenflow::communicable T>
  void broadcast(std::span<T> buffer, int root, stream_type stream) {
    inner_.broadcast(buffer, root, stream);
    count(buffer.size());
  }
  void abort(std::string_view reason) noexcept { inner_.abort(reason); }
  void check() const { inner_.check(); }

  void group_start() {
    if (depth_++ == 0) in_group_ = 0;
  }
  void group_end() {
    if (--depth_ == 0 && in_group_ > 0) ++launches;
  }

  std::int64_t collectives = 0;  ///< collectives of at least one element
  std::int64_t launches = 0;     ///< collectives outside a group plus groups with a collective
  /// Called with each reduce_scatter's send buffer (all blocks) and block size in bytes, before
  /// it is enqueued on `stream` (the buffer is read when the stream gets to it).
  std::function<void(std::span<const std::byte>, std::size_t, stream_type)> on_reduce_scatter;

 private:
  void count(std::size_t n) {
    if (n == 0) return;
    ++collectives;
    if (depth_ > 0)
      ++in_group_;
    else
      ++launches;
  }

  Inner& inner_;
  int depth_ = 0;
  std::int64_t in_group_ = 0;
};

/// The host backend, counting what the coordinator does to the trainer's stream and how often it
/// allocates "device" memory (every device_buffer of at least one byte).
struct counting_backend : zenflow::host_backend {
  static inline zenflow::host_stream* trainer = nullptr;
  static inline std::atomic<std::int64_t> trainer_syncs{0};
  static inline std::atomic<std::int64_t> allocations{0};

  class device_buffer : public zenflow::host_backend::device_buffer {
   public:
    device_buffer() = default;
    explicit device_buffer(std::size_t bytes) : zenflow::host_backend::device_buffer(bytes) {
      if (bytes > 0) ++allocations;
    }
  };

  static void synchronize(stream_type stream) {
    if (stream == trainer) ++trainer_syncs;
    zenflow::host_backend::synchronize(stream);
  }
  static void synchronize(const event_type& event) { zenflow::host_backend::synchronize(event); }
};

/// `matrices` f32 matrices (rows x cols, half of them row-major) and `vectors` f32 vectors, with
/// gradients that differ per rank and whose heavy columns move from step to step.
struct wide_model {
  static constexpr zenflow::index_t rows = 6, cols = 24, nv = 5;
  std::vector<std::vector<float>> w, g, v, gv;

  wide_model(int matrices, int vectors) {
    for (int i = 0; i < matrices; ++i) {
      w.emplace_back(rows * cols, 0.1f * static_cast<float>(i % 3));
      g.emplace_back(rows * cols, 0.0f);
    }
    for (int i = 0; i < vectors; ++i) {
      v.emplace_back(nv, 0.5f);
      gv.emplace_back(nv, 0.0f);
    }
  }
  [[nodiscard]] zenflow::matrix_view matrix(std::size_t i, float* data) const {
    return i % 2 == 0 ? zenflow::matrix_view::row_major(data, rows, cols, zenflow::dtype::f32)
                      : zenflow::matrix_view::column_contiguous(data, rows, cols, zenflow::dtype::f32);
  }
  template <class C>
  void register_with(C& c) {
    for (std::size_t i = 0; i < w.size(); ++i) {
      const std::vector<float> initial = w[i];
      const auto view = matrix(i, w[i].data());
      c.register_parameter("w" + std::to_string(i), view,
                           zenflow::const_matrix_view(initial.data(), rows, cols, view.row_stride, view.col_stride,
                                                      zenflow::dtype::f32, zenflow::memory_space::host),
                           zenflow::dtype::f32);
    }
    for (std::size_t i = 0; i < v.size(); ++i)
      c.register_parameter("v" + std::to_string(i), zenflow::vector_view(v[i].data(), nv, zenflow::dtype::f32),
                           std::span<const float>(v[i]));
  }
  /// Step t's gradients of rank `rank`: small everywhere, large on 4 columns that move with t.
  void make_gradients(int t, int rank) {
    for (std::size_t i = 0; i < g.size(); ++i) {
      const auto view = matrix(i, g[i].data());
      for (zenflow::index_t r = 0; r < rows; ++r)
        for (zenflow::index_t c = 0; c < cols; ++c) {
          const bool heavy = (c + t * 5 + static_cast<int>(i)) % 6 == 0;
          static_cast<float*>(view.data)[r * view.row_stride + c * view.col_stride] =
              (heavy ? 4.0f : 0.25f) * static_cast<float>(1 + (r + c + rank) % 3) / 4.0f;
        }
    }
    for (auto& x : gv)
      for (std::size_t k = 0; k < x.size(); ++k) x[k] = 0.125f * static_cast<float>(1 + (k + t + rank) % 4);
  }
  template <class C>
  void submit(C& c, zenflow::host_stream* stream) const {
    for (std::size_t i = 0; i < g.size(); ++i) {
      const auto view = matrix(i, const_cast<float*>(g[i].data()));
      c.submit_gradient(i, zenflow::const_matrix_view(view), stream);
    }
    for (std::size_t i = 0; i < gv.size(); ++i)
      c.submit_gradient(g.size() + i, zenflow::const_vector_view(gv[i].data(), nv, zenflow::dtype::f32), stream);
  }
};

}  // namespace zenflow_test
