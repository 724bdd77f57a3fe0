// Definition of cuda_gradient_stats (included by zenflow/gradient_stats.cuh; not a public header).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/detail/gradient_stats/kernels.cuh"
#include "zenflow/error.hpp"
#include "zenflow/gradient_stats.cuh"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

inline void cuda_gradient_stats(std::span<const const_matrix_view> grads, std::span<const const_vector_view> vectors,
                                gradient_stats_device* out, cudaStream_t stream) {
  namespace st = detail::stats;
  for (const auto& g : grads) g.validate("grads", memory_space::device);
  for (const auto& v : vectors) v.validate("vectors", memory_space::device);
  expects(out != nullptr, "out", "must point to device memory");
  std::vector<st::stats_tensor> tensors;
  auto add = [&tensors](const void* data, index_t rows, index_t cols, index_t rs, index_t cs, dtype t) {
    if (rows == 0 || cols == 0) return;
    const bool rows_inner = cols == 1 || (rows > 1 && rs <= cs);
    st::stats_tensor d{};
    d.data = data;
    d.inner_n = rows_inner ? rows : cols, d.outer_n = rows_inner ? cols : rows;
    d.inner_stride = rows_inner ? rs : cs, d.outer_stride = rows_inner ? cs : rs;
    d.type = static_cast<int>(t);
    d.contiguous = (d.inner_stride == 1 || d.inner_n == 1) && (d.outer_n == 1 || d.outer_stride == d.inner_n);
    if (d.inner_n == 1) d.inner_stride = 1;  // a single inner element: any stride addresses it
    tensors.push_back(d);
  };
  for (const auto& g : grads) add(g.data, g.rows, g.cols, g.row_stride, g.col_stride, g.type);
  for (const auto& v : vectors) add(v.data, 1, v.size, v.size * v.stride, v.stride, v.type);
  long long chunks = 0;
  std::vector<long long> first(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    first[i] = chunks;
    chunks += (tensors[i].inner_n * tensors[i].outer_n + st::stats_chunk - 1) / st::stats_chunk;
  }
  // Scratch, stream-ordered: [sum partials (chunks doubles) | non-finite partials (chunks u64)],
  // freed on `stream` after the final kernel.
  const detail::cuda_async_buffer partials(static_cast<std::size_t>(chunks) * 16, stream);
  double* partial_sum = partials.data<double>();
  unsigned long long* partial_bad =
      partial_sum != nullptr ? reinterpret_cast<unsigned long long*>(partial_sum + chunks) : nullptr;
  for (std::size_t b = 0; b < tensors.size(); b += st::stats_max_tensors) {
    st::stats_batch batch{};
    batch.count = static_cast<int>(std::min<std::size_t>(st::stats_max_tensors, tensors.size() - b));
    batch.partial_base = first[b];
    for (int j = 0; j < batch.count; ++j) {
      batch.tensors[j] = tensors[b + static_cast<std::size_t>(j)];
      batch.tensors[j].first_chunk = first[b + static_cast<std::size_t>(j)] - first[b];
    }
    const std::size_t end = b + static_cast<std::size_t>(batch.count);
    const long long grid = (end < tensors.size() ? first[end] : chunks) - first[b];
    st::stats_partials_kernel<<<static_cast<unsigned>(grid), st::stats_threads, 0, stream>>>(batch, partial_sum,
                                                                                             partial_bad);
    ZENFLOW_CUDA_TRY(cudaGetLastError());
  }
  st::stats_final_kernel<<<1, st::stats_final_threads, 0, stream>>>(partial_sum, partial_bad, chunks, out);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
}

}  // namespace zenflow
