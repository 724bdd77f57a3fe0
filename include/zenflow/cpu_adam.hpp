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
//
// State formats (`cpu_adam_config::cpu_state`; bytes per parameter, fp32 gradient in, no copy-out):
//
// | format             | held  | moved per update | moments                                       |
// |--------------------|-------|------------------|-----------------------------------------------|
// | fp32               | 12    | 28               | fp32                                          |
// | bf16_moments       | 8     | 20               | bf16, stochastic rounding                     |
// | blockwise8_moments | 6.03  | 16.06            | 8-bit codes, an fp32 scale per 256-row block, |
// |                    |       |                  | stochastic rounding, bounded quotient         |
//
// (a coordinator adds its 4-byte fp32 gradient accumulator to "held"; a bf16 gradient in moves 2
// bytes less, a bf16 copy-out 2 more). Every format keeps the fp32 master (`params(t)`); only fp32
// state has fp32 moment spans (`exp_avg(t)`, `exp_avg_sq(t)`). The compact formats compute in fp32
// and round m and v stochastically with random bits from a hash of (seed, tensor, step, element),
// so they are as bit-identical across ISAs, threads and chunkings as fp32 state, and an exponential
// average in them decays and grows as in fp32 on average (round to nearest freezes it); the 8-bit
// format's blocks never cross a column, and its update quotient m / (sqrt(v) + eps) is clamped to
// the bound exact Adam obeys, so a badly quantized v cannot blow an update up
// (detail/cpu_adam/compact_math.hpp). State moves in and out in fp32 by columns
// (`export_columns` / `import_columns`: the GPU's columns are fp32) and as raw bytes per tensor
// (`save_state` / `load_state`: a compact format saves compactly).
//
// State on an SSD (`cpu_adam_config::nvme`, the NVMe state tier; every format) lives in one
// preallocated O_DIRECT state file (state_file.hpp: a CRC32C per block, verified on every read).
// A block of B bytes holds up to S consecutive elements of one tensor (column-contiguous order)
// as arrays of S slots: the master (when on disk), then m and v (fp32), the bf16 moments' words,
// or the 8-bit m codes, v codes and the scales of its 8-bit blocks. fp32 and bf16: S = B / (4 x
// arrays), rounded down to a multiple of 16. 8-bit: a state-file block holds Q whole 8-bit blocks,
// Q = B / (256 x (4 + 2) + 8) with the master on disk (B / 520 without), S = 256 Q; a column
// whose rows are not a multiple of 256 ends in a short 8-bit block, and the slots it leaves stay
// unused. Two layouts (`nvme_state_config::master_on_disk`):
//
// - master on disk (the default): no state in RAM; a block is [master | m | v] (fp32: S = B / 12),
//   [master | words] (bf16: S = B / 8) or [master | m codes | v codes | m scales | v scales]
//   (8-bit). add_tensor extends the file by the tensor's blocks and writes
//   its initial master there (a full disk is reported then, with nothing registered); tensors may
//   be added at any time. `params(t)` throws: the master moves through export_columns /
//   import_columns and save_state / load_state as the moments do.
// - master in RAM: the fp32 master stays in RAM (`params(t)`, 4 bytes per parameter); a block is
//   [m | v] (S = B / 8), [words] (S = B / 4) or [m codes | v codes | scales]. Construction's
//   one-block file is replaced, by the first call that touches the moments, with one sized for
//   every tensor registered (a full disk is reported then, before any state changed); add_tensor
//   after that throws.
//
// A tensor starts on a fresh block. `step` streams the blocks its columns touch (read ahead, the
// Adam on the pool, write behind); a block that also holds unlisted columns is read and written
// back with those unchanged. Results are bit-identical to RAM state. Construction creates a
// one-block file (the directory, O_DIRECT, engine and pool are checked, and the file's lock is
// held). An I/O or checksum failure in a step throws with the file, offset and errno or the
// block; the blocks written back before it hold the new state, the others the old.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cpu_adam/byte_range.hpp"
#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/detail/cpu_adam/kernels_bf16.hpp"
#include "zenflow/detail/cpu_adam/kernels_q8.hpp"
#include "zenflow/detail/cpu_adam/state_format.hpp"
#include "zenflow/error.hpp"
#include "zenflow/optimizer_task.hpp"
#include "zenflow/options.hpp"
#include "zenflow/state_file.hpp"
#include "zenflow/state_slots.hpp"
#include "zenflow/thread_pool.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

/// Where a cpu_adam keeps the moments on an SSD (see the header comment).
struct nvme_state_config {
  /// The state file: directory (on the SSD), file_name (""; "zenflow_state.rank<rank>.bin"), rank,
  /// block_bytes, read_ahead, write_behind, direct, pin. `bytes` is ignored: the optimizer sizes
  /// the file for its tensors.
  state_file_config file;
  io_engine_config engine;  ///< the I/O engine (io_uring or posix threads) and its queue depth
  /// true: the fp32 master lives in the file too ([master | m | v] per block; no state in RAM);
  /// false: it stays in RAM (params(t)) and the file holds [m | v].
  bool master_on_disk = true;
};

/// Construction settings of a `cpu_adam`.
struct cpu_adam_config {
  std::size_t threads = 0;                            ///< pool participants; 0: the CPUs this process may run on
  bool pin_to_cores = false;                          ///< pin the pool's workers to cores (Linux)
  cpu_isa isa = cpu_isa::automatic;                   ///< SIMD path; a path the CPU lacks is an error
  std::size_t chunk_elements = std::size_t{1} << 15;  ///< elements per pool task (load balancing grain)
  /// How m and v are held (see the table at the top of this header); the fp32 master is always kept.
  cpu_state_format cpu_state = cpu_state_format::fp32;
  /// Seed of the compact formats' stochastic rounding: runs with the same seed, tensors, gradients
  /// and steps are bit-identical (a checkpoint resumes bit-identically under the same seed).
  std::uint64_t seed = 0x7a656e666c6f77ull;
  /// Set: the state lives in a state file on an SSD (any cpu_state): the moments, and the fp32
  /// master too unless nvme->master_on_disk is false. The directory, engine and pool are checked at
  /// construction (a one-block probe file).
  std::optional<nvme_state_config> nvme = std::nullopt;
  /// The CPUs the pool's workers may run on (distinct CPUs this process may run on; Linux);
  /// empty: every CPU this process may run on. `threads` 0 then means cpus.size(). The thread
  /// that calls step() is its own affair (the coordinator restricts its update worker too).
  std::vector<int> cpus = {};
};

/// One tensor's share of cpu_adam's multi-tensor step (optimizer_task.hpp).
using cpu_adam_task = optimizer_task<adam_options>;

/// What a step did. applied == false: a non-finite gradient was found and nothing changed.
struct cpu_step_result {
  bool applied = false;
  std::int64_t step = 0;  ///< step_count() after the call
};

/// The CPU Adam/AdamW. Models `zenflow::host_optimizer`. Movable, not copyable. One call at a
/// time per object (calls are not internally serialized against each other).
class cpu_adam {
 public:
  /// Its state in fp32 slots (state_slots.hpp): master, exp_avg, exp_avg_sq, in every format.
  using slots_type = adam_state_slots;
  /// Its hyper-parameters (hyper_parameters.hpp).
  using hyper_parameters = adam_options;

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

  /// The fp32 master of tensor t (column-contiguous, rows*cols floats), in every format. Throws
  /// for a bad index, and when the master lives on an SSD (argument "nvme"; use export_columns /
  /// import_columns).
  [[nodiscard]] std::span<float> params(std::size_t t) { return master(t); }
  [[nodiscard]] std::span<const float> params(std::size_t t) const { return master(t); }
  /// Tensor t's fp32 moments, fp32 format in RAM only: any other format throws (argument
  /// "cpu_state"), and so do moments on an SSD (argument "nvme"; use export_columns /
  /// import_columns).
  [[nodiscard]] std::span<float> exp_avg(std::size_t t) { return fp32_moment(t, 1); }
  [[nodiscard]] std::span<float> exp_avg_sq(std::size_t t) { return fp32_moment(t, 2); }
  [[nodiscard]] std::span<const float> exp_avg(std::size_t t) const { return fp32_moment(t, 1); }
  [[nodiscard]] std::span<const float> exp_avg_sq(std::size_t t) const { return fp32_moment(t, 2); }

  [[nodiscard]] cpu_state_format state_format() const noexcept { return format_; }
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  /// Bytes of state held for tensor t (master, moments, 8-bit block scales; no alignment padding).
  [[nodiscard]] std::size_t state_bytes(std::size_t t) const;
  /// Bytes of state held for all tensors.
  [[nodiscard]] std::size_t state_bytes() const;
  /// Bytes of state held in RAM: state_bytes(), less what lives on an SSD.
  [[nodiscard]] std::size_t host_state_bytes() const;

  /// True when the moments live in a state file on an SSD (cpu_adam_config::nvme).
  [[nodiscard]] bool on_nvme() const noexcept { return nvme_.has_value(); }
  /// True when the fp32 master lives in the state file too (nvme_state_config::master_on_disk).
  [[nodiscard]] bool master_on_nvme() const noexcept { return nvme_ && nvme_->master_on_disk; }
  /// The state file; nullptr in RAM mode. Master on disk: it grows with every add_tensor. Moments
  /// only: one block from construction (it checked the directory and engine and holds the file's
  /// lock) until the first call that touches the moments sizes it for every registered tensor.
  /// Its counters() account the I/O, status() names the engine and pool.
  [[nodiscard]] const state_file* nvme_file() const noexcept { return file_.get(); }
  /// One line on the state file as constructed: its path, the I/O mode (O_DIRECT or buffered),
  /// the engine (and why, when automatic chose) and the pool (its pinning); "" in RAM mode. Fixed
  /// at construction: safe to read while a step runs on another thread.
  [[nodiscard]] const std::string& nvme_status() const noexcept { return nvme_status_; }

  /// Writes the state of tensor t's listed columns (strictly ascending) in fp32, packed in list
  /// order (the j-th listed column at [j*rows, (j+1)*rows) of each output): the master as held and
  /// the moments decoded. Each output holds columns.size() * rows floats. Throws
  /// `zenflow::error` for a bad index, column or size before writing anything. Does not change
  /// the state; synchronous, single-threaded.
  void export_columns(std::size_t t, std::span<const std::int32_t> columns, std::span<float> params,
                      std::span<float> exp_avg, std::span<float> exp_avg_sq) const;
  /// Replaces the state of tensor t's listed columns (strictly ascending) from fp32, packed as
  /// export_columns writes it: the master as given, the moments encoded to nearest (an 8-bit
  /// block is re-scaled from the imported column alone: blocks never span two columns). Moments
  /// must be finite and exp_avg_sq >= 0. Throws `zenflow::error` naming the argument before
  /// changing anything. Exporting and importing back leaves a compact state unchanged.
  void import_columns(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> params,
                      std::span<const float> exp_avg, std::span<const float> exp_avg_sq);

  /// export_columns and import_columns with the three slots in one span, slot after slot (the
  /// host exchange layout of state_slots.hpp: the master, then exp_avg, then exp_avg_sq, each
  /// columns.size() * rows floats): the form a coordinator moves state in without naming a slot.
  /// A wrong size throws naming `out` / `in`; everything else is checked as export_columns and
  /// import_columns check it (an import names the slot it rejects).
  void export_state(std::size_t t, std::span<const std::int32_t> columns, std::span<float> out) const;
  void import_state(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> in);

  /// Size in bytes of save_state(t)'s output: a 40-byte header (format, shape, block rows) and
  /// the state as held.
  [[nodiscard]] std::size_t saved_state_size(std::size_t t) const;
  /// Writes tensor t's state as raw bytes (host byte order) into out (exactly saved_state_size(t)).
  void save_state(std::size_t t, std::span<std::byte> out) const;
  /// Restores tensor t's state, bit for bit, from save_state's bytes. Throws `zenflow::error`
  /// (argument "in") before changing anything if the size, header, format or shape differ from
  /// this optimizer's tensor t.
  void load_state(std::size_t t, std::span<const std::byte> in);

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
    std::size_t size = 0;                            // rows * cols
    std::unique_ptr<float[], aligned_free> data;     // params | m | v [| m scales | v scales], each 64-byte aligned
    std::size_t m_off = 0, v_off = 0;                // byte offsets of m and v (staggered: add_tensor)
    std::size_t dm_off = 0, dv_off = 0, blocks = 0;  // 8-bit: byte offsets of the scales, blocks per moment
    std::size_t alloc_bytes = 0;
    std::uint64_t first_block = 0;                                   // NVMe: the state file block its element 0 is in
    [[nodiscard]] std::span<float> span(int which) const noexcept {  // fp32 format (params: any)
      return {which == 0 ? data.get() : reinterpret_cast<float*>(at(which == 1 ? m_off : v_off)), size};
    }
    [[nodiscard]] unsigned char* at(std::size_t byte_offset) const noexcept {
      return reinterpret_cast<unsigned char*>(data.get()) + byte_offset;
    }
    [[nodiscard]] float* scales(std::size_t byte_offset) const noexcept {
      return reinterpret_cast<float*>(at(byte_offset));
    }
    // 8-bit format: blocks per column, the block element e is in (e = size: `blocks`), and the
    // first element of block j (j = blocks: size).
    [[nodiscard]] std::size_t q8_per_col() const noexcept {
      return (static_cast<std::size_t>(rows) + q8_block_rows - 1) / q8_block_rows;
    }
    [[nodiscard]] std::size_t q8_block_of(std::size_t e) const noexcept {
      const auto r = static_cast<std::size_t>(rows);
      return (e / r) * q8_per_col() + (e % r) / q8_block_rows;
    }
    [[nodiscard]] std::size_t q8_block_start(std::size_t j) const noexcept {
      return (j / q8_per_col()) * static_cast<std::size_t>(rows) + (j % q8_per_col()) * q8_block_rows;
    }
  };
  // A contiguous run of elements of one task: state, gradient and copy-out pointers.
  struct segment {
    std::size_t begin = 0;  // first element in the step's global index space
    std::size_t n = 0;
    float* p = nullptr;
    void* m = nullptr;  // fp32: float, bf16_moments: bf16_word (m and v), blockwise8: code bytes
    void* v = nullptr;
    const unsigned char* g = nullptr;
    unsigned char* out = nullptr;
    std::uint32_t task = 0;
    std::size_t elem = 0;  // index of the first element in its tensor
  };

  [[nodiscard]] const tensor_state& tensor(std::size_t t, const char* argument) const {
    expects(t < tensors_.size(), argument, "tensor index ", t, " out of range (", tensors_.size(), " tensors)");
    return tensors_[t];
  }
  [[nodiscard]] std::span<float> fp32_moment(std::size_t t, int which) const;
  [[nodiscard]] std::span<float> master(std::size_t t) const;
  void validate_columns(std::size_t t, std::span<const std::int32_t> columns,
                        std::initializer_list<std::pair<const char*, std::size_t>> sizes) const;
  void validate_tasks(std::span<const cpu_adam_task> tasks);
  void build_segments(std::span<const cpu_adam_task> tasks);
  template <class Fn>
  void for_each_piece(std::size_t total, Fn&& fn);
  void step_compact(std::span<const cpu_adam_task> tasks, const std::vector<adam_step_constants>& constants,
                    std::size_t total);
  // NVMe: a run of one tensor's elements inside one block of the state file. `tag` and `off` are
  // the caller's (which buffer and where in it the run's first element goes).
  struct nvme_piece {
    std::uint64_t block = 0;
    std::size_t slot = 0;  // the run's first element's position in the block
    std::size_t n = 0;
    std::size_t tag = 0;
    std::size_t off = 0;
    std::size_t elem = 0;  // the run's first element's index in its tensor
  };
  std::unique_ptr<state_file> make_state_file(std::uint64_t bytes) const;
  void split_into_blocks(std::size_t t, std::size_t elem, std::size_t n, std::size_t tag, std::size_t off,
                         std::vector<nvme_piece>& out) const;
  // A block's arrays: slot i of each belongs to the block's element i. p is nullptr when the master
  // is in RAM; m and v (fp32 state), words (bf16 state: m and v in one 32-bit word) or qm, qv, dm
  // and dv (8-bit state: the codes, and the scales of the block's 8-bit blocks, the first at [0])
  // are set.
  struct nvme_arrays {
    float* p = nullptr;
    float* m = nullptr;
    float* v = nullptr;
    std::uint32_t* words = nullptr;
    std::uint8_t* qm = nullptr;
    std::uint8_t* qv = nullptr;
    float* dm = nullptr;
    float* dv = nullptr;
  };
  // Where the state of nvme_read_state / nvme_write_state goes or comes from, element x.off of a
  // piece x at byte x.off x (element bytes): p the master; m and v fp32 moments, or with `raw` as
  // held (bf16: the words in m; 8-bit: the codes in m and v, and the scales in dm and dv at the
  // 8-bit block's index in its tensor, as save_state lays them out). Bytes: a saved state's arrays
  // may be unaligned.
  template <class Byte>  // std::byte (read into) or const std::byte (write from)
  struct nvme_buffers {
    Byte* p = nullptr;
    Byte* m = nullptr;
    Byte* v = nullptr;
    Byte* dm = nullptr;
    Byte* dv = nullptr;
    bool raw = false;
  };
  // Streams the blocks of `pieces` (sorted here) in `mode`; fn(pieces of one block, arrays).
  template <class Fn>
  void nvme_stream(std::vector<nvme_piece>& pieces, stream_mode mode, Fn&& fn) const;
  // The pieces of tensor t's listed columns, off = the column's place in a packed buffer.
  [[nodiscard]] std::vector<nvme_piece> column_pieces(std::size_t t, std::span<const std::int32_t> columns) const;
  // Copies the state of tensor t's `pieces` out of the file into `to`, or from `from` into it; the
  // master only when it is on disk. The moments as fp32 (compact state: decoded, or encoded to
  // nearest, an 8-bit block re-scaled from its own values), or raw (see nvme_buffers).
  void nvme_read_state(std::size_t t, std::vector<nvme_piece>& pieces, const nvme_buffers<std::byte>& to) const;
  void nvme_write_state(std::size_t t, std::vector<nvme_piece>& pieces, const nvme_buffers<const std::byte>& from);
  // save_state's arrays past the master in RAM, from `at` (the master first when it is on disk).
  template <class Byte>
  [[nodiscard]] nvme_buffers<Byte> saved_arrays(const tensor_state& ts, Byte* at) const;
  // The state-file blocks tensor ts needs, and the elements [first, first + count) of its block d.
  [[nodiscard]] std::uint64_t nvme_blocks(const tensor_state& ts) const;
  [[nodiscard]] std::pair<std::size_t, std::size_t> nvme_block_elements(const tensor_state& ts, std::uint64_t d) const;
  // Master on disk: extends the file by tensor t's blocks and writes its initial master there.
  void nvme_add_tensor(tensor_state& ts, std::span<const float> initial);
  // (byte offset, bytes) of each array of a tensor's state, in save_state's order
  [[nodiscard]] std::vector<std::pair<std::size_t, std::size_t>> state_regions(const tensor_state& ts) const;

  adam_options options_;
  cpu_state_format format_ = cpu_state_format::fp32;
  std::uint64_t seed_ = 0;
  cpu_isa isa_ = cpu_isa::scalar;
  std::size_t chunk_ = 0;
  std::int64_t step_count_ = 0;
  std::vector<tensor_state> tensors_;
  std::unique_ptr<thread_pool> pool_;
  std::vector<segment> segments_;                 // scratch of step()
  std::vector<detail::byte_range> state_ranges_;  // every tensor's state, sorted (validation)
  std::optional<nvme_state_config> nvme_;
  std::size_t slots_ = 0;                     // NVMe: elements per block
  std::size_t q8_per_block_ = 0;              // NVMe, 8-bit state: 8-bit blocks per state-file block
  std::uint64_t blocks_ = 0;                  // NVMe: blocks the registered tensors need
  mutable std::unique_ptr<state_file> file_;  // NVMe: one block until the first call that needs it
  std::string nvme_status_;
  mutable bool sized_ = false;      // NVMe: file_ holds every registered tensor's blocks
  std::vector<nvme_piece> pieces_;  // scratch of step()
};

}  // namespace zenflow

#include "zenflow/detail/cpu_adam/cpu_adam_impl.hpp"
#include "zenflow/detail/cpu_adam/nvme_state.hpp"
#include "zenflow/detail/cpu_adam/state_io.hpp"
