// CUDA kernels of the importance selector (nvcc only).
//
// Column scores (one launch for every parameter): a flat grid; each block finds its parameter by
// binary search over the descriptors' `first_block` prefix and runs one of two paths, chosen per
// parameter from its strides:
//   - column_per_warp (row_stride <= col_stride, a column is the inner dimension): one warp per
//     column, each lane sums rows lane*V, lane*V + 32V, ... with 16-byte loads when the column is
//     contiguous and aligned; then a fixed xor-butterfly warp sum.
//   - row_sweep (col_stride < row_stride, e.g. row-major W[out, in]): a block covers a tile of
//     32*V adjacent columns (V = 16 bytes / element size when vectorizable, else 1) and a segment
//     of `seg_rows` rows (segments sized so that the grid fills whole waves of the blocks the
//     device keeps resident); warp w sums rows w, w+8, ... of the segment for its lane's V columns;
//     the 8 warps are combined in order through shared memory. With several segments each block
//     writes its partial sums, takes a ticket (integer atomic) for its tile, and the last block
//     of the tile adds the segments' partials in segment order (0, 1, ...) and resets the ticket.
// Every sum is fp32 in a fixed order: the scores are bitwise reproducible run to run.
//
// Top-k (one launch, one 512-thread block per parameter): MSB-first radix select over
// orderable_key(score) with 11 + 11 + 10 bit digits (shared-memory histogram, block suffix scan
// to find the digit holding the k-th largest key), which yields the threshold key T and the
// number `need` of keys equal to T to take. A final pass writes, in index order, every index with
// key > T and the first `need` indices with key == T, at position
// (#greater before it) + min(#equal before it, need) from a block-wide exclusive scan: the output
// is ascending and ties go to the lower index. No float atomics anywhere.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "zenflow/config.hpp"
#include "zenflow/detail/cuda/loads.cuh"
#include "zenflow/detail/importance_selector/math.hpp"
#include "zenflow/error.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow::detail::selector {

inline constexpr int score_threads = 256;
inline constexpr int score_warps = score_threads / 32;
inline constexpr int topk_threads = 512;
inline constexpr int topk_items = 4;  // consecutive indices per thread in the output pass

enum score_path : int { column_per_warp = 0, row_sweep = 1 };

/// One parameter of the column-score launch.
struct score_desc {
  const void* data;
  long long rows, cols, row_stride, col_stride;
  long long score_offset;    ///< into the score buffer
  long long partial_offset;  ///< row_sweep with segments > 1: partials[segment * cols + c]
  long long counter_offset;  ///< row_sweep with segments > 1: one ticket per column tile
  long long first_block;     ///< first block of this parameter in the flat grid
  long long seg_rows;        ///< row_sweep: rows per segment
  int segments;              ///< row_sweep: row segments (1: no partials)
  int tiles;                 ///< row_sweep: column tiles
  int type;                  ///< zenflow::dtype
  int path;                  ///< score_path
  int vectorized;            ///< 16-byte loads along the inner dimension
};

/// One parameter of the top-k launch.
struct topk_desc {
  long long score_offset;
  long long out_offset;
  int cols;
  int k;
};

// --- host-side planning (shape only, so buffer sizes are known at registration) ----------------

/// Most waves of resident blocks the row_sweep plan spreads one parameter over.
inline constexpr long long row_sweep_max_waves = 4;

/// Rows per segment when `rows` are cut into `segments`: a multiple of the 8 warps.
inline constexpr long long row_sweep_rows_per(long long rows, long long segments) {
  const long long per = (rows + segments - 1) / segments;
  return (per + score_warps - 1) / score_warps * score_warps;
}
/// Segments of `seg_rows` rows that cover `rows`.
inline constexpr long long row_sweep_segments(long long rows, long long seg_rows) {
  return (rows + seg_rows - 1) / seg_rows;
}

/// Rows per segment of the row_sweep path (shape only, so buffer sizes are known before the
/// gradients are). `resident_blocks` is how many score blocks the device runs at once (SMs x
/// occupancy, score_resident_blocks). The grid of a parameter is tiles x segments blocks; with
/// tiles_ref = ceil(cols / 256), the tile count of a vectorized 16-bit gradient (f32 and
/// unvectorized gradients have about 2x and 8x as many tiles, which keeps whole waves whole), the
/// plan takes the segment count in [1, ceil(rows / 128)], up to the first that makes
/// row_sweep_max_waves waves, whose grid fills its waves best, the fewest segments among equals:
/// a grid of 1.1 waves would leave most SMs idle during its second wave.
inline constexpr long long row_sweep_seg_rows(long long rows, long long cols, long long resident_blocks) {
  const long long resident = resident_blocks < 1 ? 1 : resident_blocks;
  const long long tiles_ref = (cols + 255) / 256;
  const long long max_segments = (rows + 127) / 128;
  long long limit = (row_sweep_max_waves * resident + tiles_ref - 1) / tiles_ref;  // reaches max_waves waves
  limit = limit < 1 ? 1 : limit > max_segments ? max_segments : limit;
  long long best_rows = row_sweep_rows_per(rows, 1), best_blocks = 0, best_waves = 1;
  for (long long s = 1; s <= limit; ++s) {
    const long long seg_rows = row_sweep_rows_per(rows, s);
    const long long blocks = tiles_ref * row_sweep_segments(rows, seg_rows);
    const long long waves = (blocks + resident - 1) / resident;
    if (blocks * best_waves > best_blocks * waves) {  // blocks / waves: the fill of the waves
      best_rows = seg_rows, best_blocks = blocks, best_waves = waves;
      if (blocks == waves * resident) break;  // every wave full
    }
  }
  return best_rows;
}
/// Upper bound of the row_sweep tiles (V = 1).
inline constexpr long long row_sweep_max_tiles(long long cols) {
  return (cols + 31) / 32;
}

/// The launch plan of one gradient view (validated by the caller): the path from the strides,
/// 16-byte vectors when the inner dimension is contiguous and aligned, and for the row_sweep path
/// segments of `seg_rows` rows (row_sweep_seg_rows).
inline score_desc make_score_desc(const const_matrix_view& g, long long score_offset, long long partial_offset,
                                  long long counter_offset, long long first_block, long long seg_rows) {
  score_desc d{};
  d.data = g.data;
  d.rows = g.rows, d.cols = g.cols, d.row_stride = g.row_stride, d.col_stride = g.col_stride;
  d.score_offset = score_offset, d.partial_offset = partial_offset, d.counter_offset = counter_offset;
  d.first_block = first_block;
  d.type = static_cast<int>(g.type);
  const auto esize = static_cast<long long>(g.element_size());
  const bool aligned = reinterpret_cast<std::uintptr_t>(g.data) % 16 == 0;
  // A column is the inner dimension when its stride is the smaller one (or there is one column).
  const bool column_inner = g.cols == 1 || (g.rows > 1 && g.row_stride <= g.col_stride);
  if (column_inner) {
    d.path = column_per_warp;
    d.vectorized = aligned && g.row_stride == 1 && (g.col_stride * esize) % 16 == 0;
    d.tiles = static_cast<int>((g.cols + score_warps - 1) / score_warps);
    d.segments = 1;
    d.seg_rows = g.rows;
  } else {
    d.path = row_sweep;
    d.vectorized = aligned && g.col_stride == 1 && (g.rows == 1 || (g.row_stride * esize) % 16 == 0);
    const long long tile_cols = 32LL * (d.vectorized ? 16 / esize : 1);
    d.tiles = static_cast<int>((g.cols + tile_cols - 1) / tile_cols);
    d.seg_rows = seg_rows;
    d.segments = static_cast<int>(row_sweep_segments(g.rows, seg_rows));
  }
  return d;
}
/// Blocks of one parameter in the flat score grid.
inline long long score_blocks(const score_desc& d) {
  return d.path == column_per_warp ? d.tiles : static_cast<long long>(d.tiles) * d.segments;
}

// --- device helpers ----------------------------------------------------------------------------

ZENFLOW_DEVICE ZENFLOW_FORCEINLINE float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);  // same bits in every lane
  return x;
}

template <score_norm Norm, class T, bool Vec>
ZENFLOW_DEVICE void score_column_per_warp(const score_desc& d, long long local_block, float* scores) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const long long c = local_block * score_warps + warp;
  if (c >= d.cols) return;
  const T* col = static_cast<const T*>(d.data) + c * d.col_stride;
  float acc = 0.0f;
  constexpr int V = vec_elems<T>;
  if constexpr (Vec) {
    const long long full = d.rows / V * V;
#pragma unroll 4
    for (long long r = static_cast<long long>(lane) * V; r < full; r += 32 * V) {
      float x[V];
      load_vec16<T>(col + r, x);
#pragma unroll
      for (int v = 0; v < V; ++v) acc += score_term<Norm>(x[v]);
    }
    for (long long r = full + lane; r < d.rows; r += 32) acc += score_term<Norm>(load_element(col + r));
  } else if (d.row_stride == 1) {
    // A contiguous column that is not 16-byte aligned: element loads, but the vector path's order
    // (lane l sums rows l*V .. l*V+V-1, then every 32*V-th block; the same tail), so the score's
    // bits do not depend on the buffer's alignment.
    const long long full = d.rows / V * V;
    for (long long r = static_cast<long long>(lane) * V; r < full; r += 32 * V) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc += score_term<Norm>(load_element(col + r + v));
    }
    for (long long r = full + lane; r < d.rows; r += 32) acc += score_term<Norm>(load_element(col + r));
  } else {
#pragma unroll 4
    for (long long r = lane; r < d.rows; r += 32) acc += score_term<Norm>(load_element(col + r * d.row_stride));
  }
  acc = warp_sum(acc);
  if (lane == 0) scores[d.score_offset + c] = acc;
}

template <score_norm Norm, class T, int V>
ZENFLOW_DEVICE void score_row_sweep(const score_desc& d, long long local_block, float* scores, float* partials,
                                    unsigned* counters, float* red, int* last_flag) {
  constexpr int tile_cols = 32 * V;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const long long tile = local_block % d.tiles, seg = local_block / d.tiles;
  const long long c0 = tile * tile_cols + static_cast<long long>(lane) * V;
  const long long r_begin = seg * d.seg_rows;
  const long long r_end = r_begin + d.seg_rows < d.rows ? r_begin + d.seg_rows : d.rows;
  const T* base = static_cast<const T*>(d.data);
  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.0f;
  if (c0 + V <= d.cols) {
    if constexpr (V > 1) {
      const T* p = base + c0;  // col_stride == 1
#pragma unroll 4
      for (long long r = r_begin + warp; r < r_end; r += score_warps) {
        float x[V];
        load_vec16<T>(p + r * d.row_stride, x);
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] += score_term<Norm>(x[v]);
      }
    } else {
      const T* p = base + c0 * d.col_stride;
#pragma unroll 4
      for (long long r = r_begin + warp; r < r_end; r += score_warps)
        acc[0] += score_term<Norm>(load_element(p + r * d.row_stride));
    }
  } else if (c0 < d.cols) {  // the last, partial vector of the last tile
    for (long long r = r_begin + warp; r < r_end; r += score_warps)
#pragma unroll
      for (int v = 0; v < V; ++v)
        if (c0 + v < d.cols)
          acc[v] += score_term<Norm>(load_element(base + r * d.row_stride + (c0 + v) * d.col_stride));
  }
#pragma unroll
  for (int v = 0; v < V; ++v) red[warp * score_threads + lane * V + v] = acc[v];
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  const long long c = tile * tile_cols + t;
  const bool owner = t < tile_cols && c < d.cols;
  float total = 0.0f;
  if (owner)
#pragma unroll
    for (int w = 0; w < score_warps; ++w) total += red[w * score_threads + t];
  if (d.segments == 1) {
    if (owner) scores[d.score_offset + c] = total;
    return;
  }
  if (owner) partials[d.partial_offset + seg * d.cols + c] = total;
  __threadfence();  // publish the partials before taking the ticket
  __syncthreads();
  if (t == 0) *last_flag = atomicAdd(&counters[d.counter_offset + tile], 1u) == static_cast<unsigned>(d.segments - 1);
  __syncthreads();
  if (!*last_flag) return;
  __threadfence();
  if (owner) {
    float sum = 0.0f;
    for (int s = 0; s < d.segments; ++s) sum += __ldcg(&partials[d.partial_offset + s * d.cols + c]);
    scores[d.score_offset + c] = sum;
  }
  if (t == 0) counters[d.counter_offset + tile] = 0u;  // ready for the next launch
}

template <score_norm Norm, class T>
ZENFLOW_DEVICE void score_dispatch_layout(const score_desc& d, long long local, float* scores, float* partials,
                                          unsigned* counters, float* red, int* last_flag) {
  if (d.path == column_per_warp) {
    if (d.vectorized)
      score_column_per_warp<Norm, T, true>(d, local, scores);
    else
      score_column_per_warp<Norm, T, false>(d, local, scores);
  } else {
    if (d.vectorized)
      score_row_sweep<Norm, T, vec_elems<T>>(d, local, scores, partials, counters, red, last_flag);
    else
      score_row_sweep<Norm, T, 1>(d, local, scores, partials, counters, red, last_flag);
  }
}

template <score_norm Norm>
__global__ void __launch_bounds__(score_threads)
    column_scores_kernel(const score_desc* descs, int count, float* scores, float* partials, unsigned* counters) {
  __shared__ float red[score_warps * score_threads];
  __shared__ int last_flag;
  const long long block = blockIdx.x;
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (descs[mid].first_block <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  const score_desc d = descs[lo];
  const long long local = block - d.first_block;
  switch (static_cast<dtype>(d.type)) {
    case dtype::bf16:
      score_dispatch_layout<Norm, bfloat16>(d, local, scores, partials, counters, red, &last_flag);
      break;
    case dtype::f16:
      score_dispatch_layout<Norm, float16>(d, local, scores, partials, counters, red, &last_flag);
      break;
    default:
      score_dispatch_layout<Norm, float>(d, local, scores, partials, counters, red, &last_flag);
      break;
  }
}

/// Score blocks the current device runs at once: SMs x resident blocks of the score kernel for
/// `norm` per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor). Does not synchronize.
inline long long score_resident_blocks(score_norm norm) {
  int device = 0, sms = 0, per_sm = 0;
  ZENFLOW_CUDA_TRY(cudaGetDevice(&device));
  ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (norm == score_norm::l1)
    ZENFLOW_CUDA_TRY(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, column_scores_kernel<score_norm::l1>, score_threads, 0));
  else
    ZENFLOW_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, column_scores_kernel<score_norm::l2_squared>, score_threads, 0));
  return static_cast<long long>(sms < 1 ? 1 : sms) * (per_sm < 1 ? 1 : per_sm);
}

/// One block per parameter; see the header comment. `nan_flags[p]` = 1 when a score was NaN.
static __global__ void __launch_bounds__(topk_threads)
    topk_kernel(const topk_desc* descs, const float* scores, std::int32_t* out, int* nan_flags) {
  using scan32 = cub::BlockScan<unsigned, topk_threads>;
  using scan64 = cub::BlockScan<unsigned long long, topk_threads>;
  __shared__ union {
    typename scan32::TempStorage s32;
    typename scan64::TempStorage s64;
  } temp;
  __shared__ unsigned hist[radix_max_bins];
  __shared__ unsigned s_digit, s_greater;
  __shared__ int s_nan;
  const int tid = static_cast<int>(threadIdx.x);
  const topk_desc d = descs[blockIdx.x];
  const float* s = scores + d.score_offset;  // 16-byte aligned slice
  const int n4 = d.cols / 4;
  if (tid == 0) s_nan = 0;
  unsigned prefix = 0, need = static_cast<unsigned>(d.k);

  for (int pass = 0; pass < radix_pass_count; ++pass) {
    const int shift = radix_shift(pass), bits = radix_bits(pass), bins = 1 << bits;
    const int hi_shift = shift + bits;  // 32 in the first pass: every key is a candidate
    for (int i = tid; i < radix_max_bins; i += topk_threads) hist[i] = 0u;
    __syncthreads();
    auto count = [&](float x) {
      if (pass == 0 && x != x) s_nan = 1;
      const unsigned key = orderable_key(x);
      if (hi_shift >= 32 || (key >> hi_shift) == prefix) atomicAdd(&hist[(key >> shift) & (bins - 1)], 1u);
    };
#pragma unroll 4
    for (long long i = tid; i < n4; i += topk_threads) {  // 64-bit: cols may be near INT32_MAX
      const float4 v = __ldcg(reinterpret_cast<const float4*>(s) + i);
      count(v.x), count(v.y), count(v.z), count(v.w);
    }
    for (long long i = 4LL * n4 + tid; i < d.cols; i += topk_threads) count(__ldcg(s + i));
    __syncthreads();
    // Thread t owns bins bins-1-(4t+j), j = 0..3: an exclusive scan in that (descending) order
    // gives, for each bin, how many candidates have a larger digit.
    constexpr int per_thread = radix_max_bins / topk_threads;
    unsigned h[per_thread], own = 0;
#pragma unroll
    for (int j = 0; j < per_thread; ++j) {
      const int b = bins - 1 - (per_thread * tid + j);
      h[j] = b >= 0 ? hist[b] : 0u;
      own += h[j];
    }
    unsigned greater;
    scan32(temp.s32).ExclusiveSum(own, greater);
#pragma unroll
    for (int j = 0; j < per_thread; ++j) {
      const int b = bins - 1 - (per_thread * tid + j);
      if (b >= 0 && greater < need && greater + h[j] >= need) s_digit = static_cast<unsigned>(b), s_greater = greater;
      greater += h[j];
    }
    __syncthreads();
    prefix = (pass == 0 ? 0u : prefix << bits) | s_digit;
    need -= s_greater;
    __syncthreads();
  }

  // prefix is now the k-th largest key T; take every key > T and the first `need` keys == T.
  const unsigned threshold = prefix;
  const unsigned long long take_equal = need;
  unsigned long long running = 0;  // (greater << 32) | equal, over the previous tiles
  for (long long base = 0; base < d.cols; base += static_cast<long long>(topk_threads) * topk_items) {
    const long long i0 = base + static_cast<long long>(tid) * topk_items;
    unsigned key[topk_items];
    bool valid[topk_items];
    if (i0 + topk_items <= d.cols) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(s + i0));
      key[0] = orderable_key(v.x), key[1] = orderable_key(v.y), key[2] = orderable_key(v.z),
      key[3] = orderable_key(v.w);
#pragma unroll
      for (int j = 0; j < topk_items; ++j) valid[j] = true;
    } else {
#pragma unroll
      for (int j = 0; j < topk_items; ++j) {
        valid[j] = i0 + j < d.cols;
        key[j] = valid[j] ? orderable_key(__ldcg(s + i0 + j)) : 0u;
      }
    }
    unsigned long long local = 0;
#pragma unroll
    for (int j = 0; j < topk_items; ++j)
      if (valid[j]) local += key[j] > threshold ? (1ull << 32) : key[j] == threshold ? 1ull : 0ull;
    unsigned long long before, aggregate;
    scan64(temp.s64).ExclusiveSum(local, before, aggregate);
    before += running;
#pragma unroll
    for (int j = 0; j < topk_items; ++j) {
      if (!valid[j]) continue;
      const unsigned long long gt_before = before >> 32, eq_before = before & 0xffffffffull;
      const bool gt = key[j] > threshold, eq = key[j] == threshold;
      if (gt || (eq && eq_before < take_equal))
        out[d.out_offset + static_cast<long long>(gt_before + (eq_before < take_equal ? eq_before : take_equal))] =
            static_cast<std::int32_t>(i0 + j);
      before += gt ? (1ull << 32) : eq ? 1ull : 0ull;
    }
    running += aggregate;
    __syncthreads();  // temp storage reuse
  }
  if (tid == 0) nan_flags[blockIdx.x] = s_nan;
}

}  // namespace zenflow::detail::selector
