// The values a coordinator takes and gives back, apart from the class itself (coordinator.hpp):
// its resources (coordinator_config), what a step did (step_metrics), a CPU update's record
// (update_record), what step() does with a missing gradient, the host memory it holds
// (host_memory_bytes), what a checkpoint holds, and a parameter's column ranges (column_range).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

#include "zenflow/cpu_adam.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

/// Resources of a coordinator (the method's knobs are in zenflow_options).
struct coordinator_config {
  /// Size of the CPU Adam's thread pool and of the offload worker's accumulation pool (two pools:
  /// the interval's update and the next interval's accumulation overlap); 0: the cores this
  /// process may use.
  std::size_t cpu_threads = 0;
  bool pin_threads = false;
  /// CPUs left to the trainer: the first reserved_cpus of the CPUs this process may run on
  /// (sched_getaffinity of the constructing thread, ascending) run none of the coordinator's
  /// threads: its offload and update workers and their pools (the accumulation's and the CPU
  /// optimizer's) run on the other CPUs, and cpu_threads 0 then means their number. (The NVMe
  /// tier's I/O threads, which wait on the disk, are not restricted.) A trainer whose step is
  /// bound by its own threads (a GPU trainer launching kernels from Python) keeps them free of
  /// the CPU update's load, as DeepSpeed's ZenFlow does with pt_reserved_cores_perc. 0 (default):
  /// no CPU is reserved. At most the number of CPUs - 1.
  std::size_t reserved_cpus = 0;
  /// How the CPU optimizer holds the CPU columns' moments (the table in cpu_adam.hpp): fp32, or
  /// bf16 / 8-bit blockwise moments for fewer bytes held and moved per update. The fp32 master
  /// is kept in every format; reselection and checkpoints move the state as fp32 (a checkpoint
  /// loads into a coordinator of any format).
  cpu_state_format cpu_state = cpu_state_format::fp32;
  /// Set: the CPU columns' state lives in a state file on an SSD (the NVMe state tier, any
  /// cpu_state; cpu_adam.hpp): the moments and, with nvme->master_on_disk (the default), the master.
  /// Host RAM keeps the gradient accumulator (4 bytes per CPU-column parameter, 8 with
  /// overlap_step; host_memory()), the master if it is not on disk (4 more) and a pool of
  /// read_ahead + 1 + write_behind blocks, instead of 16 or 20 bytes per parameter in RAM. The
  /// file is named for this rank (file.rank is set to it) unless file_name is given.
  std::optional<nvme_state_config> nvme = std::nullopt;
  std::size_t d2h_slot_bytes = std::size_t{4} << 20;  ///< gradient staging slot size
  std::size_t d2h_slots = 4;
  std::size_t h2d_slot_bytes = std::size_t{4} << 20;  ///< parameter staging slot size
  std::size_t h2d_slots = 2;
  /// A backend whose CPU updates cannot write device memory (a CUDA backend; concepts.hpp, R14):
  /// the host memory a CPU update writes its updated columns into before they are uploaded
  /// through the h2d slots. The update runs in waves of whole columns whose copy-out fits (one
  /// column at least; the window grows to the widest column), each uploaded before the next is
  /// computed: host RAM holds this window instead of a copy-out of every CPU column (2 B per
  /// bf16 parameter). Larger windows mean fewer waves (one optimizer step each; with the NVMe
  /// state tier, a state-file block a wave boundary crosses is read and written once per wave).
  /// Unused by the host backend.
  std::size_t copy_out_window_bytes = std::size_t{64} << 20;
  bool record_trace = false;  ///< keep an update_record per CPU update (the staleness oracle)
  /// Host backend only (its "device" memory is the trainer's host memory): reject the first
  /// gradient of a step while the previous step's parameter updates are still running on the
  /// stream, i.e. when the trainer computed it without stream.synchronize() first. A check, not a
  /// proof: a race that happens to finish in time goes unseen.
  bool check_stream_order = true;
};

/// What one step did and what it cost. Printable.
struct step_metrics {
  std::int64_t step = -1;           ///< 0-based training step this describes
  double stall_seconds = 0.0;       ///< time the trainer thread waited on CPU-side work
  std::string stall_reason;         ///< why it waited ("" when it did not)
  double cpu_update_seconds = 0.0;  ///< duration of the last completed CPU update
  /// NVMe state tier (coordinator_config::nvme): the last completed CPU update's reads and writes
  /// of its state file, and the part of cpu_update_seconds it spent waiting on the disk (0 with
  /// the state in RAM).
  std::uint64_t cpu_update_disk_read_bytes = 0;
  std::uint64_t cpu_update_disk_written_bytes = 0;
  double cpu_update_disk_wait_seconds = 0.0;
  std::uint64_t bytes_device_to_host = 0;  ///< offloaded by this step: its CPU-column gradients, migration
  std::uint64_t bytes_host_to_device = 0;  ///< written back by this step: CPU-updated columns, migration
  double selection_overlap = 1.0;          ///< mean overlap of the last selection with the one before
  std::int64_t interval = 1;               ///< length (steps) of the current update interval
  /// zenflow_options::cover_cpu_update: the steps the last measured CPU update needs, which the
  /// "auto" interval is held to at least (0: the rule is off or nothing has been measured yet).
  std::int64_t interval_floor = 0;
  bool reselected = false;
  bool cpu_update_launched = false;
  bool written_back = false;
};
/// Prints one line: step, stall (and why), CPU update time, bytes each way, overlap, interval and
/// what happened.
inline std::ostream& operator<<(std::ostream& os, const step_metrics& m);

/// What the gradients of a step were (basic_coordinator::last_step_gradients).
struct step_gradients {
  bool skipped = false;    ///< a gradient held a NaN or an infinity: the step updated and accumulated nothing
  double grad_norm = 0.0;  ///< their global L2 norm before clipping (of the finite elements when skipped)
};

/// One CPU update as the staleness oracle sees it.
struct update_record {
  std::int64_t interval = 0;           ///< 0-based interval index
  std::int64_t first_step = 0;         ///< first training step whose gradient it accumulated
  std::int64_t last_step = 0;          ///< last one
  std::int64_t accumulated_steps = 0;  ///< non-skipped steps averaged (0: no update applied)
  std::int64_t written_back_at = -1;   ///< training step at whose end it reached the GPU parameters
  int write_backs = 0;                 ///< how often it was written back (must be 1)
  bool synchronous = false;
};

/// What step() does with a registered parameter that got no gradient in the step.
enum class missing_gradients {
  /// The step is rejected (step() throws and drops the step's gradients): every parameter needs a
  /// gradient every step.
  reject,
  /// The parameter is skipped this step, as torch.optim.AdamW skips a parameter whose `.grad` is
  /// None: no Adam update and no step-count advance for it (see basic_coordinator::step).
  skip,
};

/// Host memory a coordinator holds for its CPU columns, in bytes, by what it is for
/// (basic_coordinator::host_memory). The trainer's own parameters and gradients are not counted.
struct host_memory_bytes {
  /// The CPU optimizer's state in RAM (cpu_adam::host_state_bytes: what is not on an SSD).
  std::size_t cpu_state = 0;
  /// The fp32 gradient accumulators: 4 bytes per CPU-column element, twice with overlap_step;
  /// none for a parameter the host backend updates in place (ZeRO-Offload, a column-contiguous
  /// parameter with fp32 gradients), unless a step's gradient came in another layout.
  std::size_t accumulators = 0;
  /// The CPU updates' results on their way to the device: a CUDA backend's copy-out window
  /// (coordinator_config::copy_out_window_bytes, or less when every CPU column fits in less;
  /// allocated at the first CPU update); the host backend writes them straight into the device
  /// buffers: none.
  std::size_t copy_out = 0;
  /// The NVMe state file's pinned pool (read_ahead + 1 + write_behind blocks); 0 in RAM.
  std::size_t state_file_pool = 0;
  /// The backend's device buffers for the CPU columns: the write-back staging (the parameter's
  /// dtype, twice with overlap_step) and, unless the backend accumulates on its stream (the host
  /// backend in one process), the gathered gradients (the gradient's dtype, twice). Sized once for
  /// every column of the parameter (in data parallel, the largest owned range per block), not for
  /// the CPU columns of the moment: the columns move at each selection, and on a GPU a
  /// reallocation would be a cudaFree, which waits for the whole device; a parameter whose every
  /// column is selected holds none. GPU memory on a CUDA backend, host RAM on the host backend,
  /// where they stand in for it (no write-back staging for a parameter updated in place, as for
  /// the accumulators).
  std::size_t device_buffers = 0;
  /// Host RAM on a GPU backend: every field but device_buffers.
  [[nodiscard]] std::size_t host_total() const noexcept {
    return cpu_state + accumulators + copy_out + state_file_pool;
  }
};

/// How load_checkpoint pairs the checkpoint's parameters with the registered ones.
enum class checkpoint_match : std::uint8_t {
  /// The i-th saved parameter restores the i-th registered one, and their names must agree: a
  /// renamed or reordered parameter is rejected.
  names,
  /// The i-th saved parameter restores the i-th registered one whatever their names, as
  /// torch.optim's load_state_dict pairs parameters by position (a model wrapped by torch.compile
  /// or DDP, a module renamed); shapes, dtypes and every other field must still agree.
  positions,
};

/// What save_checkpoint writes besides the optimizer state (load_checkpoint reads which from the
/// file).
enum class checkpoint_contents : std::uint8_t {
  /// The optimizer state and the parameters' values: load_checkpoint restores both.
  everything,
  /// The optimizer state only, as torch.optim's state_dict: the trainer saves and restores its
  /// parameters itself (before load_checkpoint). An f32 parameter's fp32 master is its value (but
  /// for columns whose CPU result awaits its write-back, which the checkpoint holds) and is not
  /// written; load_checkpoint reads it from the parameter. A bf16/fp16 parameter's master is
  /// written. The size is then the moments (8 bytes per element, as torch.optim.AdamW's over fp32
  /// parameters), plus 4 per element of a bf16/fp16 parameter, plus within an interval the CPU
  /// columns' accumulated gradient (4 bytes per element) and, with overlap_step, their pending
  /// result (in the parameter's dtype).
  optimizer_state,
};

/// A contiguous range [first, last) of a parameter's columns.
struct column_range {
  index_t first = 0;
  index_t last = 0;
  [[nodiscard]] index_t size() const noexcept { return last - first; }
  friend bool operator==(const column_range&, const column_range&) = default;
};

}  // namespace zenflow
