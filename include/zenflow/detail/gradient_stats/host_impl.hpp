// Definition of the host gradient statistics (included by zenflow/gradient_stats.hpp; not a
// public header).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "zenflow/detail/gradient_stats/host_kernels.hpp"
#include "zenflow/detail/gradient_stats/math.hpp"
#include "zenflow/detail/host_device/line_kernels.hpp"
#include "zenflow/detail/host_device/parallel.hpp"
#include "zenflow/gradient_stats.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

namespace detail::stats {
/// A tensor of the statistics as `outer` lines of `inner` elements, inner dimension the one with
/// the smaller stride (cuda_gradient_stats' rule), and its first block's index.
struct host_tensor {
  const void* data = nullptr;
  dtype type = dtype::f32;
  index_t inner_n = 0, outer_n = 0, inner_stride = 1, outer_stride = 1;
  bool contiguous = true;
  std::size_t first_block = 0;
  [[nodiscard]] index_t size() const noexcept { return inner_n * outer_n; }
};

inline host_tensor make_host_tensor(const void* data, index_t rows, index_t cols, index_t rs, index_t cs, dtype t) {
  const bool rows_inner = cols == 1 || (rows > 1 && rs <= cs);
  host_tensor d;
  d.data = data;
  d.type = t;
  d.inner_n = rows_inner ? rows : cols;
  d.outer_n = rows_inner ? cols : rows;
  d.inner_stride = d.inner_n == 1 ? 1 : rows_inner ? rs : cs;
  d.outer_stride = rows_inner ? cs : rs;
  d.contiguous = d.inner_stride == 1 && (d.outer_n == 1 || d.outer_stride == d.inner_n);
  return d;
}
}  // namespace detail::stats

inline gradient_stats host_gradient_stats(std::span<const const_matrix_view> grads,
                                          std::span<const const_vector_view> vectors, const host_execution& exec) {
  namespace st = detail::stats;
  namespace hd = detail::host_device;
  for (const auto& g : grads) g.validate("grads", memory_space::host);
  for (const auto& v : vectors) v.validate("vectors", memory_space::host);
  const cpu_isa isa = hd::checked_isa(exec, "exec.isa");
  std::vector<st::host_tensor> tensors;
  std::size_t blocks = 0;
  auto add = [&](const void* data, index_t rows, index_t cols, index_t rs, index_t cs, dtype t) {
    if (rows == 0 || cols == 0) return;
    tensors.push_back(st::make_host_tensor(data, rows, cols, rs, cs, t));
    tensors.back().first_block = blocks;
    blocks +=
        static_cast<std::size_t>((tensors.back().size() + st::stats_block_elements - 1) / st::stats_block_elements);
  };
  for (const auto& g : grads) add(g.data, g.rows, g.cols, g.row_stride, g.col_stride, g.type);
  for (const auto& v : vectors) add(v.data, 1, v.size, v.size * v.stride, v.stride, v.type);

  // Each block's statistics (any thread, any order), then their sum in block order.
  std::vector<st::block_stats> partial(blocks);
  constexpr std::size_t blocks_per_task = 4;
  hd::parallel_for(exec, (blocks + blocks_per_task - 1) / blocks_per_task, [&](std::size_t task) {
    const std::size_t b0 = task * blocks_per_task, b1 = std::min(blocks, b0 + blocks_per_task);
    auto t = std::upper_bound(tensors.begin(), tensors.end(), b0,
                              [](std::size_t b, const st::host_tensor& x) { return b < x.first_block; });
    --t;
    std::vector<float> gathered;  // a strided block, as floats (exact)
    for (std::size_t b = b0; b < b1; ++b) {
      while (b >= t->first_block +
                      static_cast<std::size_t>((t->size() + st::stats_block_elements - 1) / st::stats_block_elements))
        ++t;
      const index_t e0 = static_cast<index_t>(b - t->first_block) * st::stats_block_elements;
      const index_t n = std::min(st::stats_block_elements, t->size() - e0);
      if (t->contiguous) {
        partial[b] = st::select_stats_block(isa, t->type)(
            static_cast<const std::byte*>(t->data) + static_cast<std::size_t>(e0) * dtype_size(t->type), n);
        continue;
      }
      gathered.resize(static_cast<std::size_t>(n));
      const index_t extent = (t->outer_n - 1) * t->outer_stride + (t->inner_n - 1) * t->inner_stride;
      const auto copy = hd::select_copy_line(isa, t->type, dtype::f32, false, extent < hd::max_simd_offset);
      for (index_t e = e0; e < e0 + n;) {  // line pieces of the block, in element order
        const index_t outer = e / t->inner_n, inner = e - outer * t->inner_n;
        const index_t len = std::min(t->inner_n - inner, e0 + n - e);
        copy(static_cast<const std::byte*>(t->data) +
                 static_cast<std::size_t>(outer * t->outer_stride + inner * t->inner_stride) * dtype_size(t->type),
             {nullptr, t->inner_stride}, gathered.data() + (e - e0), {}, len, 1.0f);
        e += len;
      }
      partial[b] = st::select_stats_block(isa, dtype::f32)(gathered.data(), n);
    }
  });
  gradient_stats out;
  for (const auto& p : partial) {
    out.sum_of_squares += p.sum;
    out.nonfinite_count += p.nonfinite;
  }
  return out;
}

}  // namespace zenflow
