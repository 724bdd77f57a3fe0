// CUDA kernels of the sparse-column Adam and the column gather/scatter (not a public header).
//
// The update kernel is one multi-tensor launch over all parameters. The compact state of a
// parameter is enumerated in the order of its layout (see state_layout): element e of a
// row-major parameter is (row e / k, slot e % k), so a warp takes 32 consecutive selected columns
// of one row -- consecutive state words, and parameter/gradient words that are as close as the
// selection is dense -- and element e of a column-contiguous parameter is (slot e / rows, row
// e % rows): fully contiguous runs. Work is cut in tiles of kTile state elements; a persistent
// grid strides over the tiles of all parameters, each block finding its parameter by binary
// search over the tiles' prefix sums. Each thread loads kItems independent elements before it
// computes, to keep enough bytes in flight.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/sparse_adam/element.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::sparse_adam {

inline constexpr int kThreads = 256;
inline constexpr int kItems = 4;
inline constexpr int kTile = kThreads * kItems;

#ifndef ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM
/// The step kernel's __launch_bounds__ minimum of resident blocks of 256 threads per SM. 0 (the
/// default) gives none: ptxas picks 80 registers (sm_80 and sm_90, nvcc 13.0), 3 blocks per SM.
/// 4 caps them at 64 (about 110-130 bytes spilled), 5 at 48, 6 at 40, 8 at 32 (ever larger
/// spills); 1 and 2 let ptxas take 94-96 (2 blocks per SM). Which is fastest is measured on a GPU
/// (docs/BENCHMARKS.md, "GPU sparse-column Adam"): build with
/// -DCMAKE_CUDA_FLAGS=-DZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM=N to try N.
#define ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM 0
#endif
static_assert(ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM >= 0 && ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM <= 8,
              "ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM: 0 (none) to 8 blocks of 256 threads per SM");
#if ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM > 0
#define ZENFLOW_DETAIL_SPARSE_ADAM_STEP_BOUNDS __launch_bounds__(kThreads, ZENFLOW_SPARSE_ADAM_MIN_BLOCKS_PER_SM)
#else
#define ZENFLOW_DETAIL_SPARSE_ADAM_STEP_BOUNDS __launch_bounds__(kThreads)
#endif

/// One registered parameter as the kernels see it (a vector is one column; columns == nullptr).
struct param_desc {
  void* param = nullptr;
  index_t row_stride = 0;
  index_t col_stride = 0;
  const std::int32_t* columns = nullptr;  // k ascending indices on device, or nullptr: column j is j
  float* master = nullptr;                // rows * k each, in state_layout order
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::uint32_t rows = 0;
  std::uint32_t k = 0;
  std::int64_t tile_begin = 0;   // first tile of this parameter in the launch
  std::int64_t* step = nullptr;  // this parameter's applied steps (device): its bias correction
  float lr = 0.0f;               // this parameter's per-group hyper-parameters (adam_options::fields)
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float eps = 0.0f;
  float weight_decay = 0.0f;
  dtype type = dtype::f32;
  bool state_row_major = false;
};

/// The gradient of one parameter for one step (data == nullptr: none this step, the parameter is
/// skipped and its step count stays).
struct grad_desc {
  const void* data = nullptr;
  index_t row_stride = 0;
  index_t col_stride = 0;
  dtype type = dtype::f32;
  friend bool operator==(const grad_desc&, const grad_desc&) = default;
};

/// Device-resident control block of one optimizer: the step counter lives here so that skipped
/// steps (decided on device) never need the host.
struct control_block {
  std::int64_t step = 0;
  unsigned int done_blocks = 0;  // last-block-done counter of the update kernel, back to 0 after it
  int nonfinite = 0;             // set by the finite check of the current step
};

/// What the update kernel needs besides the tables.
struct step_control {
  adam_options options;       // the fields every parameter shares (the per-group ones are in param_desc)
  bool betas_differ = false;  // some parameter's beta1, beta2 or eps differs from another's
  float grad_scale = 1.0f;
  const float* scale_ptr = nullptr;
  const int* skip_flag = nullptr;
  bool use_nonfinite = false;
  control_block* control = nullptr;
};

struct element_coord {
  std::uint32_t row;
  std::uint32_t slot;
  index_t column;
};

__device__ ZENFLOW_FORCEINLINE element_coord coord_of(const param_desc& d, std::uint32_t e) {
  element_coord x;
  if (d.state_row_major) {
    x.row = e / d.k;
    x.slot = e - x.row * d.k;
  } else {
    x.slot = e / d.rows;
    x.row = e - x.slot * d.rows;
  }
  x.column = d.columns != nullptr ? static_cast<index_t>(__ldg(d.columns + x.slot)) : static_cast<index_t>(x.slot);
  return x;
}

/// Index of the parameter owning `tile`: the last p with params[p].tile_begin <= tile.
__device__ ZENFLOW_FORCEINLINE int find_param(const param_desc* params, int count, std::int64_t tile) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (params[mid].tile_begin <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/// One thread's kItems elements of a tile, between their loads and their update.
struct tile_registers {
  float g[kItems], p[kItems], m[kItems], v[kItems];
  index_t poff[kItems];
};

template <class TGrad>
__device__ ZENFLOW_FORCEINLINE void load_tile(const param_desc& d, const grad_desc& g, std::uint32_t first,
                                              tile_registers& x) {
  const std::uint32_t n = d.rows * d.k;
  const TGrad* grad = static_cast<const TGrad*>(g.data);
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const std::uint32_t e = first + static_cast<std::uint32_t>(it * kThreads) + threadIdx.x;
    if (e < n) {
      const element_coord at = coord_of(d, e);
      x.poff[it] = at.row * d.row_stride + at.column * d.col_stride;
      x.g[it] = to_float(grad[at.row * g.row_stride + at.column * g.col_stride]);
      x.p[it] = __ldcs(d.master + e);  // streamed once per step: evict first
      x.m[it] = __ldcs(d.exp_avg + e);
      x.v[it] = __ldcs(d.exp_avg_sq + e);
    }
  }
}

template <class TParam>
__device__ ZENFLOW_FORCEINLINE void update_tile(const param_desc& d, std::uint32_t first, tile_registers& x,
                                                const adam_step_constants& c) {
  const std::uint32_t n = d.rows * d.k;
  TParam* param = static_cast<TParam*>(d.param);
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const std::uint32_t e = first + static_cast<std::uint32_t>(it * kThreads) + threadIdx.x;
    if (e < n) {
      TParam out;
      update_element(out, x.p[it], x.m[it], x.v[it], x.g[it], c);
      __stcs(d.master + e, x.p[it]);
      __stcs(d.exp_avg + e, x.m[it]);
      __stcs(d.exp_avg_sq + e, x.v[it]);
      param[x.poff[it]] = out;
    }
  }
}

__device__ ZENFLOW_FORCEINLINE void load_tile_any(const param_desc& d, const grad_desc& g, std::uint32_t first,
                                                  tile_registers& x) {
  switch (g.type) {
    case dtype::bf16:
      load_tile<bfloat16>(d, g, first, x);
      break;
    case dtype::f16:
      load_tile<float16>(d, g, first, x);
      break;
    default:
      load_tile<float>(d, g, first, x);
      break;
  }
}

__device__ ZENFLOW_FORCEINLINE void update_tile_any(const param_desc& d, std::uint32_t first, tile_registers& x,
                                                    const adam_step_constants& c) {
  switch (d.type) {
    case dtype::bf16:
      update_tile<bfloat16>(d, first, x, c);
      break;
    case dtype::f16:
      update_tile<float16>(d, first, x, c);
      break;
    default:
      update_tile<float>(d, first, x, c);
      break;
  }
}

/// effective_scale for a whole block: *scale_ptr is read by one thread and shared, because the
/// pointer may be mapped pinned host memory, where each read crosses PCIe. Every thread of the
/// block must call it (it synchronizes the block when scale_ptr is set).
__device__ ZENFLOW_FORCEINLINE float block_effective_scale(float grad_scale, const float* scale_ptr) {
  if (scale_ptr == nullptr) return grad_scale;  // a kernel argument: the same in every thread
  __shared__ float scale;
  if (threadIdx.x == 0 && threadIdx.y == 0) scale = effective_scale(grad_scale, scale_ptr);
  __syncthreads();
  return scale;
}

/// The step's decision (skip flag, non-finite flag, effective scale), taken by one thread of every
/// block: the same in every block. The three inputs are loaded unconditionally and independently,
/// so their latencies overlap.
__device__ ZENFLOW_FORCEINLINE void decide_step(const step_control& ctl, float& scale, int& apply) {
  const int skip = ctl.skip_flag != nullptr ? *ctl.skip_flag : 0;
  const int nonfinite = ctl.use_nonfinite ? ctl.control->nonfinite : 0;
  scale = effective_scale(ctl.grad_scale, ctl.scale_ptr);
  apply = skip == 0 && nonfinite == 0 && usable_scale(scale) ? 1 : 0;
}

/// The fused multi-tensor sparse Adam step. Thread 0 of each block takes the step's decision while
/// the block's other warps already load their first tile (loads have no effect; nothing is written
/// before the decision), so the decision's latency hides behind those loads. The decision is the
/// same in every block. Each parameter's constants come from its own step counter (torch's
/// per-parameter `step`) and its betas and eps, computed in double by one thread when the block
/// reaches a parameter at another step than the last one (usually once per block: parameters step
/// together), or at every parameter it reaches when the betas or eps differ between parameters
/// (ctl.betas_differ: a launch-wide flag costs no register, where comparing each parameter's with
/// the last one's took 10 more and a resident block less per SM); then only the parameter's lr and
/// weight decay are set. A parameter without a gradient is skipped. The last block to finish
/// advances the counters (the optimizer's, and those of the parameters with a gradient), after
/// every block has read them: a block counts itself done only once all its warps left the tile
/// loop (a barrier every thread reaches), so no lagging warp of another block reads a count the
/// last block has already advanced.
static __global__ void ZENFLOW_DETAIL_SPARSE_ADAM_STEP_BOUNDS sparse_adam_step_kernel(const param_desc* params,
                                                                                      const grad_desc* grads, int count,
                                                                                      std::int64_t tiles,
                                                                                      step_control ctl) {
  __shared__ adam_step_constants constants;
  __shared__ double bc1;
  __shared__ float scale;
  __shared__ int apply;
  __shared__ int last;
  if (threadIdx.x == 0) decide_step(ctl, scale, apply);  // before its own loads: fewer live registers
  adam_step_constants c{};
  double c_bc1 = 0.0;       // the bias correction c was made with
  std::int64_t c_step = 0;  // the step c was made for (0: none yet)
  bool decided = false;     // uniform over the block: the tiles of a block depend on blockIdx only
  int current = -1;         // the parameter whose hyper-parameters c holds
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int p = find_param(params, count, t);
    const grad_desc g = grads[p];
    if (g.data == nullptr) continue;  // no gradient this step (uniform over the block)
    const param_desc d = params[p];   // copies: the stores below cannot alias them
    const auto first = static_cast<std::uint32_t>((t - d.tile_begin) * kTile);
    tile_registers x;
    load_tile_any(d, g, first, x);
    if (!decided) {
      __syncthreads();
      if (apply == 0) return;  // uniform over the grid: nothing is written, the counters stay
      decided = true;
    }
    if (p != current) {                       // uniform over the block
      const std::int64_t step = *d.step + 1;  // one counter, read by every thread: uniform too
      // Parameters at the same step share the constants, unless their betas or eps may differ.
      if (step != c_step || ctl.betas_differ) {
        __syncthreads();  // every thread has copied the previous constants
        if (threadIdx.x == 0) {
          adam_options o = ctl.options;  // the shared fields, with the parameter's betas and eps
          o.beta1 = params[p].beta1;
          o.beta2 = params[p].beta2;
          o.eps = params[p].eps;
          constants = adam_step_constants_unchecked(o, step, scale);
          bc1 = adam_bias_correction1(o, step);
        }
        __syncthreads();
        c = constants;
        c_bc1 = bc1;
        c_step = step;
      }
      set_lr_and_weight_decay(c, ctl.options.adamw_mode, d.lr, d.weight_decay, c_bc1);  // the parameter's group
      current = p;
    }
    update_tile_any(d, first, x, c);
  }
  if (!decided) {  // a block without a tile to update still agrees before it counts
    __syncthreads();
    if (apply == 0) return;
  }
  // Every warp of the block is past its last read of a step count (the loop above) before thread 0
  // counts the block done. Reached by every thread: the returns above are uniform over the grid.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release: this block's reads and writes come before its count
    last = atomicAdd(&ctl.control->done_blocks, 1u) == gridDim.x - 1 ? 1 : 0;
    if (last != 0) __threadfence();  // acquire: the increments below come after every block's count
  }
  __syncthreads();
  if (last != 0) {
    for (int i = static_cast<int>(threadIdx.x); i < count; i += kThreads)
      if (grads[i].data != nullptr) *params[i].step += 1;
    if (threadIdx.x == 0) {
      ctl.control->step += 1;
      ctl.control->done_blocks = 0;
    }
  }
}

/// Sets control->nonfinite if any gradient value the update would read is NaN or infinite once
/// scaled (as the CPU Adam checks it). Integer atomicOr: the result does not depend on the order.
static __global__ void __launch_bounds__(kThreads)
    sparse_adam_nonfinite_kernel(const param_desc* params, const grad_desc* grads, int count, std::int64_t tiles,
                                 float grad_scale, const float* scale_ptr, control_block* control) {
  const float scale = block_effective_scale(grad_scale, scale_ptr);
  bool bad = false;
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int p = find_param(params, count, t);
    const param_desc& d = params[p];
    const grad_desc& g = grads[p];
    if (g.data == nullptr) continue;  // no gradient this step: not read
    const auto first = static_cast<std::uint32_t>((t - d.tile_begin) * kTile);
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const std::uint32_t e = first + static_cast<std::uint32_t>(it * kThreads) + threadIdx.x;
      if (e < d.rows * d.k) {
        const element_coord x = coord_of(d, e);
        bad |= !is_finite_bits(
            scaled(load_as_float(g.data, g.type, x.row * g.row_stride + x.column * g.col_stride), scale));
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(&control->nonfinite, 1);
}

/// The three state arrays of one parameter.
struct state_arrays {
  float* part[3];
};

/// New state (layout `layout`) from old state and packed entering columns. source[j] >= 0: slot j
/// keeps old slot source[j]; source[j] < 0: slot j takes packed column -source[j] - 1 of
/// `entering`. source == nullptr: every slot j takes packed column j (import; may be in place).
static __global__ void rebuild_state_kernel(state_arrays old_state, state_arrays new_state, state_layout layout,
                                            const std::int32_t* source, const float* entering) {
  const index_t n = layout.size();
  for (index_t e = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t r = layout.row_of(e), j = layout.slot_of(e);
    const std::int32_t from = source != nullptr ? source[j] : -static_cast<std::int32_t>(j) - 1;
#pragma unroll
    for (int p = 0; p < 3; ++p)
      new_state.part[p][e] = from >= 0 ? old_state.part[p][layout.index(r, from)]
                                       : entering[packed_index(layout.rows, -static_cast<index_t>(from) - 1, p, r)];
  }
}

/// Packs slots `slots[0..n)` (or 0..n when slots == nullptr) of a state into the packed format.
/// One thread per (list position, row) moves all three parts: the part index is a compile-time
/// constant (a runtime index into `state.part` would put the array on the local-memory stack),
/// consecutive threads read consecutive rows and write consecutive packed values, and each
/// thread reads its slot once.
static __global__ void pack_state_kernel(state_arrays state, state_layout layout, const std::int32_t* slots, index_t n,
                                         float* packed) {
  const index_t total = layout.rows * n;
  for (index_t q = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; q < total;
       q += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t l = q / layout.rows;
    const index_t r = q - l * layout.rows;
    const index_t at = layout.index(r, slots != nullptr ? slots[l] : l);
#pragma unroll
    for (int p = 0; p < part_count; ++p) packed[packed_index(layout.rows, l, p, r)] = state.part[p][at];
  }
}

/// Gather/scatter, column-contiguous path: block (column i = blockIdx.x, row tiles blockIdx.y, blockIdx.y +
/// gridDim.y, ... of kTile rows): both sides contiguous along rows. gridDim.y is capped at 65535, so a
/// block walks as many row tiles as it takes.
static __global__ void __launch_bounds__(kThreads)
    gather_columns_direct_kernel(const void* src, dtype src_type, index_t rows, index_t cols, index_t row_stride,
                                 index_t col_stride, const std::int32_t* columns, void* dst, dtype dst_type,
                                 float scale, const float* scale_ptr) {
  const index_t i = blockIdx.x;
  const std::int32_t c = columns[i];
  if (c < 0 || c >= cols) return;  // out-of-range indices are ignored (the whole block returns)
  const float s = block_effective_scale(scale, scale_ptr);
  for (index_t t = blockIdx.y * static_cast<index_t>(kTile); t < rows; t += gridDim.y * static_cast<index_t>(kTile))
    for (index_t r = t + threadIdx.x; r < rows && r < t + kTile; r += kThreads)
      store_from_float(dst, dst_type, i * rows + r,
                       scaled(load_as_float(src, src_type, r * row_stride + c * col_stride), s));
}

static __global__ void __launch_bounds__(kThreads)
    scatter_columns_direct_kernel(const void* src, dtype src_type, const std::int32_t* columns, void* dst,
                                  dtype dst_type, index_t rows, index_t cols, index_t row_stride, index_t col_stride) {
  const index_t i = blockIdx.x;
  const std::int32_t c = columns[i];
  if (c < 0 || c >= cols) return;
  for (index_t t = blockIdx.y * static_cast<index_t>(kTile); t < rows; t += gridDim.y * static_cast<index_t>(kTile))
    for (index_t r = t + threadIdx.x; r < rows && r < t + kTile; r += kThreads)
      store_from_float(dst, dst_type, r * row_stride + c * col_stride, load_as_float(src, src_type, i * rows + r));
}

inline constexpr int kTransposeTile = 32;
inline constexpr int kTransposeRows = 8;

/// Row-major path: a 32 x 32 tile (32 listed columns x 32 rows) through shared memory, so that
/// the source is read along rows (consecutive listed columns of one row) and the compact buffer
/// written along columns, both coalesced. Blocks walk row tiles blockIdx.y, blockIdx.y + gridDim.y, ...
/// (gridDim.y is capped at 65535).
static __global__ void __launch_bounds__(kTransposeTile* kTransposeRows)
    gather_columns_transpose_kernel(const void* src, dtype src_type, index_t rows, index_t cols, index_t row_stride,
                                    index_t col_stride, const std::int32_t* columns, index_t n, void* dst,
                                    dtype dst_type, float scale, const float* scale_ptr) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const index_t i0 = static_cast<index_t>(blockIdx.x) * kTransposeTile;
  const float s = block_effective_scale(scale, scale_ptr);
  const index_t i_load = i0 + threadIdx.x;
  const std::int32_t c_load = i_load < n ? columns[i_load] : -1;
  for (index_t r0 = static_cast<index_t>(blockIdx.y) * kTransposeTile; r0 < rows;
       r0 += static_cast<index_t>(gridDim.y) * kTransposeTile) {
    for (int dr = threadIdx.y; dr < kTransposeTile; dr += kTransposeRows) {
      const index_t r = r0 + dr;
      if (c_load >= 0 && c_load < cols && r < rows)
        tile[dr][threadIdx.x] = scaled(load_as_float(src, src_type, r * row_stride + c_load * col_stride), s);
    }
    __syncthreads();
    for (int di = threadIdx.y; di < kTransposeTile; di += kTransposeRows) {
      const index_t i = i0 + di, r = r0 + threadIdx.x;
      if (i < n && r < rows) {
        const std::int32_t c = columns[i];
        if (c >= 0 && c < cols) store_from_float(dst, dst_type, i * rows + r, tile[threadIdx.x][di]);
      }
    }
    __syncthreads();  // the tile is refilled by the next row tile
  }
}

static __global__ void __launch_bounds__(kTransposeTile* kTransposeRows)
    scatter_columns_transpose_kernel(const void* src, dtype src_type, const std::int32_t* columns, index_t n, void* dst,
                                     dtype dst_type, index_t rows, index_t cols, index_t row_stride,
                                     index_t col_stride) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const index_t i0 = static_cast<index_t>(blockIdx.x) * kTransposeTile;
  const index_t i_store = i0 + threadIdx.x;
  const std::int32_t c_store = i_store < n ? columns[i_store] : -1;
  const bool store = c_store >= 0 && c_store < cols;
  for (index_t r0 = static_cast<index_t>(blockIdx.y) * kTransposeTile; r0 < rows;
       r0 += static_cast<index_t>(gridDim.y) * kTransposeTile) {
    for (int di = threadIdx.y; di < kTransposeTile; di += kTransposeRows) {
      const index_t i = i0 + di, r = r0 + threadIdx.x;
      if (i < n && r < rows) tile[threadIdx.x][di] = load_as_float(src, src_type, i * rows + r);
    }
    __syncthreads();
    for (int dr = threadIdx.y; store && dr < kTransposeTile; dr += kTransposeRows) {
      const index_t r = r0 + dr;
      if (r < rows) store_from_float(dst, dst_type, r * row_stride + c_store * col_stride, tile[dr][threadIdx.x]);
    }
    __syncthreads();  // the tile is refilled by the next row tile
  }
}

/// gridDim.y for a launch over `tiles` row tiles: the kernels above loop over what does not fit.
inline unsigned int row_tile_grid(index_t rows, index_t tile) {
  return static_cast<unsigned int>(std::clamp<index_t>((rows + tile - 1) / tile, 1, 65535));
}

}  // namespace zenflow::detail::sparse_adam
