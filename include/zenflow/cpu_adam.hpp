// CPU Adam/AdamW over fp32 master parameters and moments, at the memory roofline.
//
// `cpu_adam` owns, for every registered tensor, the fp32 master parameters and both moments in a
// column-contiguous layout (a rows x cols tensor stores column c at [c*rows, (c+1)*rows)), a
// 64-bit step counter and a persistent thread pool. One `step` updates many tensors at once:
//
// - gradients in fp32, bf16 or fp16, multiplied in the same pass by `grad_scale`
//   (1/accumulation count, loss-scale unscaling, clipping);
// - an optional column list per tensor (the CPU's columns; the others are neither read nor
//   written), with the gradient in the full layout or packed to the listed columns;
// - an optional copy-out of the updated parameters as bf16/fp16/fp32 (round to nearest even)
//   into a caller's buffer (a pinned staging slot), in the same pass;
// - an optional non-finite check: if any scaled gradient element is NaN or infinite, nothing is
//   modified and the step is reported as skipped. The check is a read-only pre-pass over the
//   gradients (the only way to leave every state bit unchanged); callers that already checked
//   (e.g. with `accumulate`) pass check_finite = false and pay nothing.
//
// The per-element math is `zenflow::adam_update` (adam_math.hpp), reproduced operation by
// operation in the scalar, AVX2+FMA and AVX-512 paths (chosen at run time by CPU features), so
// results are bit-identical across paths, thread counts, chunk sizes and tensor splits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cpu_adam/byte_range.hpp"
#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/thread_pool.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

/// Construction settings of a `cpu_adam`.
struct cpu_adam_config {
  std::size_t threads = 0;                            ///< pool participants; 0: the CPUs this process may run on
  bool pin_to_cores = false;                          ///< pin the pool's workers to cores (Linux)
  cpu_isa isa = cpu_isa::automatic;                   ///< SIMD path; a path the CPU lacks is an error
  std::size_t chunk_elements = std::size_t{1} << 15;  ///< elements per pool task (load balancing grain)
};

/// One tensor's share of a multi-tensor step. Pointers are host memory (pinned is fine).
struct cpu_adam_task {
  std::size_t tensor = 0;      ///< index returned by add_tensor
  const void* grad = nullptr;  ///< gradient, element type grad_type
  dtype grad_type = dtype::f32;
  std::span<const std::int32_t> columns;  ///< ascending column indices to update; empty = every column
  bool grad_compact = false;              ///< false: grad has the full layout (column c at c*rows);
                                          ///< true: only the listed columns, packed in list order
  void* copy_out = nullptr;               ///< optional: updated params written here (RNE), nullptr: none
  dtype copy_out_type = dtype::bf16;
  bool out_compact = false;  ///< layout of copy_out, as grad_compact is for grad
  /// This task's hyper-parameters (parameter groups); nullptr: the optimizer's options(). The step
  /// count, and so the bias correction, is the optimizer's.
  const adam_options* options = nullptr;
};

/// What a step did. applied == false: a non-finite gradient was found and nothing changed.
struct cpu_step_result {
  bool applied = false;
  std::int64_t step = 0;  ///< step_count() after the call
};

/// The CPU Adam/AdamW. Models `zenflow::host_optimizer`. Movable, not copyable. One call at a
/// time per object (calls are not internally serialized against each other).
class cpu_adam {
 public:
  /// Validates `options` and `config` (threads, chunk_elements >= 1, an isa this CPU supports)
  /// and starts the thread pool. Throws `zenflow::error`.
  explicit cpu_adam(const adam_options& options, const cpu_adam_config& config = {});

  /// Registers a rows x cols tensor (a 1-D tensor is rows = n, cols = 1) with its initial
  /// parameters in column-contiguous layout; moments start at 0. Returns its index.
  /// Throws before registering anything if rows < 1, cols < 1 or the size does not match.
  std::size_t add_tensor(std::span<const float> initial_params, index_t rows, index_t cols);

  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  [[nodiscard]] index_t rows(std::size_t t) const { return tensor(t, "t").rows; }
  [[nodiscard]] index_t cols(std::size_t t) const { return tensor(t, "t").cols; }

  /// The state of tensor t (column-contiguous, rows*cols floats). Throws for a bad index.
  [[nodiscard]] std::span<float> params(std::size_t t) { return tensor(t, "t").span(0); }
  [[nodiscard]] std::span<float> exp_avg(std::size_t t) { return tensor(t, "t").span(1); }
  [[nodiscard]] std::span<float> exp_avg_sq(std::size_t t) { return tensor(t, "t").span(2); }
  [[nodiscard]] std::span<const float> params(std::size_t t) const { return tensor(t, "t").span(0); }
  [[nodiscard]] std::span<const float> exp_avg(std::size_t t) const { return tensor(t, "t").span(1); }
  [[nodiscard]] std::span<const float> exp_avg_sq(std::size_t t) const { return tensor(t, "t").span(2); }

  [[nodiscard]] const adam_options& options() const noexcept { return options_; }
  /// Replaces the hyper-parameters (e.g. an lr schedule); validated first, throws on bad input.
  void set_options(const adam_options& options) {
    options.validate();
    options_ = options;
  }

  /// Updates applied so far; the next step uses t = step_count() + 1 for bias correction.
  [[nodiscard]] std::int64_t step_count() const noexcept { return step_count_; }
  /// Restores the counter (checkpoints). Throws if step < 0.
  void set_step_count(std::int64_t step) {
    expects(step >= 0, "step", "must be >= 0, got ", step);
    step_count_ = step;
  }

  /// One Adam step over many tensors, balanced across the pool in one parallel pass (no
  /// fork/join per tensor). Every gradient element read is multiplied by grad_scale.
  /// check_finite: if any scaled gradient element is NaN/Inf, nothing is modified, the step
  /// count is unchanged and applied = false is returned (a read-only pre-pass over the
  /// gradients). Validates everything (tensor indices, duplicates, columns, dtypes, null and
  /// misaligned pointers, copy_out overlapping anything, gradients overlapping the state,
  /// grad_scale) and throws `zenflow::error` before touching any state. Synchronizes.
  cpu_step_result step(std::span<const cpu_adam_task> tasks, float grad_scale = 1.0f, bool check_finite = true);

  /// Fused accumulate, multi-threaded: acc[i] = fma(scale, float(grad[i]), acc[i]) for i < n
  /// (one rounding per element). With check_finite, returns false if any resulting acc[i] is NaN
  /// or infinite (a non-finite gradient, or overflow); acc is then NOT restored (the check is
  /// fused into the single pass): its contents are unspecified and the caller resets it. Use
  /// `all_finite` first when the accumulator must survive a bad gradient. With check_finite
  /// false, returns true. Validates (null, misaligned, overlapping acc/grad, dtype, n < 0,
  /// non-finite scale) before writing. Synchronizes.
  bool accumulate(float* acc, const void* grad, dtype grad_type, index_t n, float scale = 1.0f,
                  bool check_finite = true);

  /// True when every grad[i] * scale (i < n) is finite. Read-only, multi-threaded. Synchronizes.
  [[nodiscard]] bool all_finite(const void* grad, dtype grad_type, index_t n, float scale = 1.0f);

  [[nodiscard]] thread_pool& pool() noexcept { return *pool_; }
  /// The concrete SIMD path in use (never `automatic`).
  [[nodiscard]] cpu_isa isa() const noexcept { return isa_; }
  [[nodiscard]] std::size_t chunk_elements() const noexcept { return chunk_; }

 private:
  struct aligned_free {
    void operator()(float* p) const noexcept;
  };
  struct tensor_state {
    index_t rows = 0, cols = 0;
    std::size_t size = 0;                         // rows * cols
    std::unique_ptr<float[], aligned_free> data;  // params | exp_avg | exp_avg_sq, each padded
    std::size_t stride = 0;                       // floats between the three arrays
    [[nodiscard]] std::span<float> span(int which) const noexcept {
      return {data.get() + static_cast<std::size_t>(which) * stride, size};
    }
  };
  // A contiguous run of elements of one task: state, gradient and copy-out pointers.
  struct segment {
    std::size_t begin = 0;  // first element in the step's global index space
    std::size_t n = 0;
    float* p = nullptr;
    float* m = nullptr;
    float* v = nullptr;
    const unsigned char* g = nullptr;
    unsigned char* out = nullptr;
    std::uint32_t task = 0;
  };

  [[nodiscard]] const tensor_state& tensor(std::size_t t, const char* argument) const {
    expects(t < tensors_.size(), argument, "tensor index ", t, " out of range (", tensors_.size(), " tensors)");
    return tensors_[t];
  }
  void validate_tasks(std::span<const cpu_adam_task> tasks);
  void build_segments(std::span<const cpu_adam_task> tasks);
  template <class Fn>
  void for_each_piece(std::size_t total, Fn&& fn);

  adam_options options_;
  cpu_isa isa_ = cpu_isa::scalar;
  std::size_t chunk_ = 0;
  std::int64_t step_count_ = 0;
  std::vector<tensor_state> tensors_;
  std::unique_ptr<thread_pool> pool_;
  std::vector<segment> segments_;                 // scratch of step()
  std::vector<detail::byte_range> state_ranges_;  // every tensor's state, sorted (validation)
};

}  // namespace zenflow

#include "zenflow/detail/cpu_adam/cpu_adam_impl.hpp"
