// The NVMe state tier against the disk it runs on. One benchmark per engine (io_uring, posix);
// each iteration measures, in this order and on the same file system, block size and queue depth:
//
//   roofline read    sequential O_DIRECT reads of the state's bytes (a second preallocated file of
//                    the same size), queue depth Q, blocks of B: the disk
//   roofline write   sequential O_DIRECT writes of the same bytes
//   stream           one CPU Adam/AdamW update of the whole state streamed through a state_file
//                    (read_ahead Q/2 - 1, write_behind Q/2: Q buffers, so at most Q requests in
//                    flight): read and verify each block, run zenflow::cpu_adam's step on its
//                    columns (fp32 master, m, v from the block; the accumulated fp32 gradient in
//                    RAM), write it back with its new checksum
//
// and reports roofline_fraction = (read time + write time) / stream time (bar: >= 0.85), the
// rates, and the time the stream's thread waited on the disk. cpu_adam_nvme measures the same for
// zenflow::cpu_adam with its state on the disk (cpu_adam_config::nvme; master_on_disk 1: the fp32
// master and the moments in the file; 0: the moments only, the master in RAM; cpu_state 0: fp32
// moments, 1: bf16, 2: 8-bit), the CPU update a coordinator runs: one step over every column.
// coordinator_memory measures the host RAM a ZeRO-Offload coordinator adds per parameter with its
// state in RAM, its moments on disk and its master too (resident memory, and the coordinator's own
// accounting). coordinator_stall measures what the trainer waits for per step, ZeRO-Offload
// against ZenFlow async (update_interval 8, "auto", and "auto" with cover_cpu_update), with the
// state in RAM and on disk (ZENFLOW_BENCH_STEP_MS: the simulated GPU step). larger_than_ram (only with
// ZENFLOW_BENCH_LARGER_THAN_RAM_GB set) steps a cpu_adam whose state on disk is that many GB, more
// than the machine's RAM, and reports its peak resident memory (VmHWM); coordinator_larger_than_ram
// (with the same variable) trains a ZeRO-Offload host_coordinator with that much state on disk,
// saves its checkpoint and resumes from it in a fresh coordinator. checkpoint_io times a
// checkpoint's save and load against a plain write and read of the same bytes.
//
// Layout of a block: 85 columns of 1024 rows (with B = 1 MiB), column-contiguous, as three
// arrays: master | m | v (12 B per parameter; the rest of the block is padding). The bench
// imports a block's columns into a cpu_adam tensor, steps it and exports them back: the bytes an
// optimizer's state storage would move.
//
// Environment: ZENFLOW_BENCH_NVME_DIR (default: the working directory; must be on the disk to
// measure, not tmpfs), ZENFLOW_BENCH_NVME_BYTES (state bytes, default 2 GiB),
// ZENFLOW_BENCH_NVME_BLOCK (default 1 MiB), ZENFLOW_BENCH_NVME_QD (default 32). The files are
// removed at the end.
#include <zenflow/coordinator.hpp>
#include <zenflow/cpu_adam.hpp>
#include <zenflow/io_engine.hpp>
#include <zenflow/state_file.hpp>

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "bench_env.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using zenflow_bench::env_count;
std::filesystem::path bench_dir() {
  const char* s = std::getenv("ZENFLOW_BENCH_NVME_DIR");
  return s != nullptr && *s != '\0' ? std::filesystem::path(s) : std::filesystem::current_path();
}

constexpr zenflow::index_t rows = 1024;

struct nvme_bench_settings {
  std::uint64_t bytes;
  std::size_t block;
  std::size_t queue_depth;
};
/// ZENFLOW_BENCH_NVME_BYTES, _BLOCK (a multiple of 4096 holding at least one column of 1024 rows'
/// master, m and v: 12 KiB) and _QD (read-ahead qd / 2 - 1 and write-behind qd / 2: at least 2).
nvme_bench_settings nvme_settings() {
  const std::size_t block = env_count("ZENFLOW_BENCH_NVME_BLOCK", std::size_t{1} << 20, 12 * rows, 1ull << 30);
  if (block % 4096 != 0) {
    std::fprintf(stderr, "ZENFLOW_BENCH_NVME_BLOCK: must be a multiple of 4096, got %zu\n", block);
    std::exit(2);
  }
  return {env_count("ZENFLOW_BENCH_NVME_BYTES", std::uint64_t{2} << 30, 1), block,
          env_count("ZENFLOW_BENCH_NVME_QD", 32, 2, 4096)};
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Sequential O_DIRECT transfer of a whole file at queue depth qd through `engine`.
double sequential(zenflow::any_io_engine& engine, std::uint32_t file, const zenflow::pinned_buffer_pool& pool,
                  std::uint64_t blocks, zenflow::io_op op) {
  const std::size_t bytes = pool.buffer_bytes();
  std::vector<zenflow::io_completion> done(pool.size());
  std::vector<std::uint32_t> free_buffers;
  for (std::size_t i = 0; i < pool.size(); ++i) free_buffers.push_back(static_cast<std::uint32_t>(i));
  const auto t0 = clock_type::now();
  std::uint64_t next = 0;
  while (next < blocks || engine.in_flight() > 0) {
    while (next < blocks && !free_buffers.empty()) {
      const std::uint32_t b = free_buffers.back();
      free_buffers.pop_back();
      zenflow::io_request r;
      r.op = op;
      r.file = file;
      r.offset = next++ * bytes;
      r.buffer = pool.buffer(b).data();
      r.bytes = bytes;
      r.buffer_index = static_cast<std::int32_t>(b);
      r.user_data = b;
      engine.submit(r);
    }
    const std::size_t n = engine.wait(done, 1);
    for (std::size_t i = 0; i < n; ++i) {
      if (!done[i].ok()) throw zenflow::error("roofline", engine.describe(done[i]));
      free_buffers.push_back(static_cast<std::uint32_t>(done[i].request.user_data));
    }
  }
  return seconds_since(t0);
}

// The roofline's own preallocated file (written once), engine and pool: sequential O_DIRECT reads
// and writes of `blocks` blocks at queue depth qd.
class roofline_file {
 public:
  roofline_file(std::uint64_t blocks, std::size_t block, zenflow::io_engine_kind kind, std::size_t qd)
      : blocks_(blocks),
        path_((bench_dir() / "zenflow_bench_roofline.bin").string()),
        engine_(zenflow::make_io_engine({kind, qd})),
        pool_(qd, block) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd_ < 0 || ::fallocate(fd_, 0, 0, static_cast<off_t>(blocks * block)) != 0) {
      error_ = "cannot create " + path_ + ": " + std::strerror(errno);
      return;
    }
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < pool_.size(); ++i) spans.push_back(pool_.buffer(i));
    engine_.register_buffers(spans);
    file_ = engine_.add_file(fd_, path_);
    added_ = true;
    (void)write();  // every extent written once
  }
  roofline_file(const roofline_file&) = delete;
  roofline_file& operator=(const roofline_file&) = delete;
  ~roofline_file() {
    if (added_) engine_.remove_file(file_);
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());
  }
  [[nodiscard]] const std::string& error() const noexcept { return error_; }
  double read() { return sequential(engine_, file_, pool_, blocks_, zenflow::io_op::read); }
  double write() { return sequential(engine_, file_, pool_, blocks_, zenflow::io_op::write); }

 private:
  std::uint64_t blocks_;
  std::string path_;
  zenflow::any_io_engine engine_;
  zenflow::pinned_buffer_pool pool_;
  int fd_ = -1;
  std::uint32_t file_ = 0;
  bool added_ = false;
  std::string error_;
};

// The counters of `pass` (read and write every one of `bytes` once per iteration) against the
// roofline's sequential read and write of the same bytes: <pass>_GBps (read + written),
// <pass>_Mparams_per_s, <pass>_wait_fraction (waiting on the disk), roofline_fraction.
void report_pass(benchmark::State& state, const std::string& pass, double bytes, std::size_t params, double t_read,
                 double t_write, double t_pass, double t_wait) {
  const double it = static_cast<double>(state.iterations());
  state.counters["read_GBps"] = bytes * it / t_read * 1e-9;
  state.counters["write_GBps"] = bytes * it / t_write * 1e-9;
  state.counters[pass + "_GBps"] = 2 * bytes * it / t_pass * 1e-9;
  state.counters[pass + "_Mparams_per_s"] = static_cast<double>(params) * it / t_pass * 1e-6;
  state.counters[pass + "_wait_fraction"] = t_wait / t_pass;
  state.counters["roofline_fraction"] = (t_read + t_write) / t_pass;
}

bool io_uring_missing(benchmark::State& state, zenflow::io_engine_kind kind) {
  zenflow::any_io_engine probe = zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 2});
  if (kind == zenflow::io_engine_kind::uring && probe.name() != "io_uring") {
    state.SkipWithError(("io_uring does not run here: " + probe.status()).c_str());
    return true;
  }
  return false;
}

void nvme_adam(benchmark::State& state, zenflow::io_engine_kind kind) {
  const auto [want, block, qd] = nvme_settings();
  const zenflow::index_t cols_per_block = static_cast<zenflow::index_t>(block / (12 * rows));
  const std::size_t per_block = static_cast<std::size_t>(rows * cols_per_block);  // parameters per block
  const std::uint64_t blocks = (want + block - 1) / block;
  const std::size_t params = blocks * per_block;

  if (io_uring_missing(state, kind)) return;

  // The state file (stream) and the roofline's file, same size, same directory.
  zenflow::state_file_config cfg;
  cfg.directory = bench_dir();
  cfg.file_name = "zenflow_bench_state.bin";
  cfg.bytes = blocks * block;
  cfg.block_bytes = block;
  cfg.read_ahead = qd / 2 - 1;
  cfg.write_behind = qd / 2;
  std::unique_ptr<zenflow::state_file> made;
  try {  // a directory that cannot hold it (tmpfs, missing, full): this benchmark is skipped, not the run
    made = std::make_unique<zenflow::state_file>(cfg, zenflow::io_engine_config{kind, qd});
  } catch (const zenflow::error& e) {
    state.SkipWithError(e.what());
    return;
  }
  zenflow::state_file& file = *made;

  roofline_file roof(blocks, block, kind, qd);
  if (!roof.error().empty()) {
    state.SkipWithError(roof.error().c_str());
    return;
  }

  // The optimizer: one tensor of a block's columns; the accumulated gradient of every parameter.
  zenflow::adam_options adam;
  adam.lr = 1e-3f;
  adam.weight_decay = 0.01f;
  zenflow::cpu_adam opt(adam);
  opt.add_tensor(std::vector<float>(per_block, 0.0f), rows, cols_per_block);
  std::vector<float> grad(params);
  std::uint32_t seed = 12345;
  for (float& g : grad) {
    seed = seed * 1664525u + 1013904223u;
    g = 1e-3f * (static_cast<float>(seed >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
  const std::size_t array_bytes = per_block * sizeof(float);
  const zenflow::block_range all{0, blocks};
  file.stream({&all, 1}, zenflow::stream_mode::write, [&](const zenflow::stream_block& b) {
    std::memset(b.data.data(), 0, b.data.size());
    auto* master = reinterpret_cast<float*>(b.data.data());
    for (std::size_t i = 0; i < per_block; ++i) master[i] = 0.01f * static_cast<float>((b.index * 7 + i) % 101);
  });

  std::int64_t step = 0;
  double t_read = 0, t_write = 0, t_stream = 0, t_wait = 0;
  for (auto _ : state) {
    t_read += roof.read();
    t_write += roof.write();
    ++step;
    file.reset_counters();
    const auto t0 = clock_type::now();
    file.stream({&all, 1}, zenflow::stream_mode::update, [&](const zenflow::stream_block& b) {
      std::byte* p = b.data.data();
      std::memcpy(opt.params(0).data(), p, array_bytes);
      std::memcpy(opt.exp_avg(0).data(), p + array_bytes, array_bytes);
      std::memcpy(opt.exp_avg_sq(0).data(), p + 2 * array_bytes, array_bytes);
      zenflow::cpu_adam_task task{0, grad.data() + b.index * per_block, zenflow::dtype::f32, {}};
      task.step = step;  // the interval's bias correction, whatever the per-block calls count
      opt.step({&task, 1}, 1.0f, false);
      std::memcpy(p, opt.params(0).data(), array_bytes);
      std::memcpy(p + array_bytes, opt.exp_avg(0).data(), array_bytes);
      std::memcpy(p + 2 * array_bytes, opt.exp_avg_sq(0).data(), array_bytes);
    });
    t_stream += seconds_since(t0);
    t_wait += file.counters().wait_seconds;
  }
  const double bytes = static_cast<double>(blocks * block);
  report_pass(state, "stream", bytes, params, t_read, t_write, t_stream, t_wait);
  state.counters["state_GB"] = bytes * 1e-9;
  state.counters["pool_pinned_MB"] = static_cast<double>(file.pool().pinned_bytes()) * 1e-6;
  state.SetLabel(file.engine().status());
}

// zenflow::cpu_adam with its state on the disk (cpu_adam_config::nvme): what a coordinator's
// CPU update runs. One step over every column of one 1024-row tensor whose state on disk fills
// the state bytes (12, 8, 8 or about 6 B per parameter: fp32 master and moments, fp32 moments,
// fp32 master and bf16 moments, fp32 master and 8-bit moments; the gradient in RAM), against the
// roofline's sequential read + write of the same bytes.
void cpu_adam_nvme(benchmark::State& state, zenflow::io_engine_kind kind) {
  const bool master_on_disk = state.range(0) != 0;
  const auto format = static_cast<zenflow::cpu_state_format>(state.range(1));
  const auto [want, block, qd] = nvme_settings();
  if (io_uring_missing(state, kind)) return;
  // [master |] m | v or [master |] words of this many elements per block, or whole 8-bit blocks of
  // 256 rows (as cpu_adam lays them out)
  const std::size_t arrays = (master_on_disk ? 1 : 0) + (format == zenflow::cpu_state_format::fp32 ? 2 : 1);
  const std::size_t per_block = format == zenflow::cpu_state_format::blockwise8_moments
                                    ? block / (256 * ((master_on_disk ? 4 : 0) + 2) + 8) * 256
                                    : block / (4 * arrays) / 16 * 16;
  const std::uint64_t blocks = (want + block - 1) / block;
  const zenflow::index_t cols = static_cast<zenflow::index_t>(blocks * per_block / rows);
  const std::size_t params = static_cast<std::size_t>(rows * cols);

  zenflow::cpu_adam_config config;
  config.cpu_state = format;
  zenflow::nvme_state_config nvme;
  nvme.file.directory = bench_dir();
  nvme.file.file_name = "zenflow_bench_state.bin";
  nvme.file.block_bytes = block;
  nvme.file.read_ahead = qd / 2 - 1;
  nvme.file.write_behind = qd / 2;
  nvme.engine = {kind, qd};
  nvme.master_on_disk = master_on_disk;
  config.nvme = nvme;
  zenflow::adam_options adam;
  adam.lr = 1e-3f;
  adam.weight_decay = 0.01f;
  std::unique_ptr<zenflow::cpu_adam> made;
  try {  // a directory that cannot hold the state (tmpfs, missing): this benchmark is skipped, not the run
    made = std::make_unique<zenflow::cpu_adam>(adam, config);
  } catch (const zenflow::error& e) {
    state.SkipWithError(e.what());
    return;
  }
  zenflow::cpu_adam& opt = *made;
  std::vector<float> values(params);
  for (std::size_t i = 0; i < params; ++i) values[i] = 0.01f * static_cast<float>(i % 101);
  opt.add_tensor(values, rows, cols);
  std::uint32_t seed = 12345;
  for (float& g : values) {  // the gradient
    seed = seed * 1664525u + 1013904223u;
    g = 1e-3f * (static_cast<float>(seed >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
  zenflow::cpu_adam_task task{0, values.data(), zenflow::dtype::f32, {}};
  try {  // (moments only: sizes the file) every block written once
    opt.step({&task, 1}, 1.0f, false);
  } catch (const zenflow::error& e) {  // a directory that cannot hold it: this benchmark is skipped
    state.SkipWithError(e.what());
    return;
  }

  roofline_file roof(blocks, block, kind, qd);
  if (!roof.error().empty()) {
    state.SkipWithError(roof.error().c_str());
    return;
  }
  double t_read = 0, t_write = 0, t_step = 0, t_wait = 0;
  for (auto _ : state) {
    t_read += roof.read();
    t_write += roof.write();
    const double wait0 = opt.nvme_file()->counters().wait_seconds;
    const auto t0 = clock_type::now();
    opt.step({&task, 1}, 1.0f, false);
    t_step += seconds_since(t0);
    t_wait += opt.nvme_file()->counters().wait_seconds - wait0;
  }
  const double bytes = static_cast<double>(blocks * block);
  report_pass(state, "step", bytes, params, t_read, t_write, t_step, t_wait);
  state.counters["disk_GB"] = bytes * 1e-9;
  state.counters["ram_state_GB"] = static_cast<double>(opt.host_state_bytes()) * 1e-9;
  state.counters["pool_pinned_MB"] = static_cast<double>(opt.nvme_file()->pool().pinned_bytes()) * 1e-6;
  state.SetLabel(opt.nvme_status());
}

// The coordinator benchmarks' configuration: 2 CPU threads; on_disk 0: the state in RAM; 1: the
// moments in a state file in the bench directory; 2: the fp32 master too.
zenflow::coordinator_config coordinator_config_for(std::int64_t on_disk) {
  zenflow::coordinator_config config;
  config.cpu_threads = 2;
  if (on_disk != 0) {
    zenflow::nvme_state_config n;
    n.file.directory = bench_dir();
    n.file.file_name = "zenflow_bench_state.bin";
    n.master_on_disk = on_disk == 2;
    config.nvme = n;
  }
  return config;
}

const char* placement_name(std::int64_t on_disk) {
  return on_disk == 0 ? "state in RAM" : on_disk == 1 ? "moments on disk" : "master and moments on disk";
}

}  // namespace

// The value of a "key: N kB" line of a /proc file, in bytes (0 if absent).
std::uint64_t proc_bytes(const char* file, const char* key) {
  std::ifstream in(file);
  std::string line;
  const std::string k(key);
  while (std::getline(in, line))
    if (line.rfind(k, 0) == 0) return std::strtoull(line.c_str() + k.size(), nullptr, 10) * 1024;
  return 0;
}

// This process's resident memory in bytes (VmRSS).
std::uint64_t resident_bytes() {
  return proc_bytes("/proc/self/status", "VmRSS:");
}

// This process's peak resident memory in bytes (VmHWM), since it started or the last reset_peak.
std::uint64_t peak_resident_bytes() {
  return proc_bytes("/proc/self/status", "VmHWM:");
}
// Sets the peak resident memory (VmHWM) to the current one (VmRSS).
void reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

// Host RAM a coordinator holds for its CPU state, in RAM (on_disk 0) against the moments on disk
// (1) and the master and moments on disk (2), with its moments as fp32, bf16 or 8-bit blocks
// (cpu_state 0, 1, 2: coordinator_config::cpu_state; in RAM only): a ZeRO-Offload host_coordinator (every column on the
// CPU) over one bf16 1024-row matrix of range(0) M parameters, trained 3 steps; the resident memory it added (VmRSS
// with it alive, minus VmRSS before it was built: the model's weight and gradient are not
// counted) per parameter, that less the host backend's device buffers (GPU memory on a CUDA
// backend: the gathered gradients and write-back staging), and its own accounting
// (host_memory(): CPU state in RAM, accumulator, state file pool, copy-out). upload 1: the CPU
// update's results go through the copy-out window and the h2d queue, a wave at a time, as on a
// CUDA backend (concepts.hpp, R14), instead of straight into the host backend's device buffers.
struct uploading_host_backend : zenflow::host_backend {
  static constexpr bool copies_out_in_place = false;
};

template <class Coordinator>
void coordinator_memory_run(benchmark::State& state) {
  const std::int64_t on_disk = state.range(1);
  const auto format = static_cast<zenflow::cpu_state_format>(state.range(2));
  const zenflow::index_t cols = state.range(0) * (1 << 20) / rows;
  const std::size_t params = static_cast<std::size_t>(rows * cols);
  std::vector<zenflow::bfloat16> weight(params, zenflow::to_bfloat16(0.01f)), grad(params, zenflow::to_bfloat16(1e-3f));
  zenflow::coordinator_config config = coordinator_config_for(on_disk);
  config.cpu_state = format;
  double added = 0, accounted = 0, device = 0, copy_out = 0, seconds = 0;
  for (auto _ : state) {
    const std::uint64_t before = resident_bytes();
    zenflow::host_stream stream;
    Coordinator c(zenflow::zenflow_options::zero_offload(), config);
    c.register_parameter("w", zenflow::matrix_view::column_contiguous(weight.data(), rows, cols, zenflow::dtype::bf16),
                         zenflow::const_matrix_view::column_contiguous(weight.data(), rows, cols, zenflow::dtype::bf16),
                         zenflow::dtype::bf16);
    const auto t0 = clock_type::now();
    for (int step = 0; step < 3; ++step) {
      c.submit_gradient(0, zenflow::const_matrix_view::column_contiguous(grad.data(), rows, cols, zenflow::dtype::bf16),
                        &stream);
      c.step(&stream);
      stream.synchronize();
    }
    c.finish(&stream);
    seconds += seconds_since(t0) / 3;
    added += static_cast<double>(resident_bytes() - before);
    const zenflow::host_memory_bytes held = c.host_memory();
    accounted += static_cast<double>(held.host_total());
    device += static_cast<double>(held.device_buffers);
    copy_out += static_cast<double>(held.copy_out);
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["params_M"] = static_cast<double>(params) * 1e-6;
  state.counters["rss_bytes_per_param"] = added / it / static_cast<double>(params);
  state.counters["rss_less_device_bytes_per_param"] = (added - device) / it / static_cast<double>(params);
  state.counters["accounted_bytes_per_param"] = accounted / it / static_cast<double>(params);
  state.counters["copy_out_MB"] = copy_out / it * 1e-6;
  state.counters["step_s"] = seconds / it;
  state.SetLabel(std::string(placement_name(on_disk)) + ", " + std::string(zenflow::cpu_state_format_name(format)) +
                 (std::is_same_v<Coordinator, zenflow::host_coordinator> ? "" : ", copy-out uploaded"));
}

void coordinator_memory(benchmark::State& state) {
  if (state.range(3) == 0)
    coordinator_memory_run<zenflow::host_coordinator>(state);
  else
    coordinator_memory_run<zenflow::basic_coordinator<uploading_host_backend>>(state);
}

// What the trainer waits for with the moments on disk: ZeRO-Offload (every column on the CPU,
// updated every step) against ZenFlow async (10% of the columns on the "GPU", the rest updated
// once per interval of 8 steps, overlapped), each with the moments in RAM (on_disk 0) and on disk
// (1). A host_coordinator over one bf16 1024-row matrix of range(0) M parameters; each step's
// forward and backward is a sleep of ZENFLOW_BENCH_STEP_MS (default 100 ms) on the stream: a GPU
// busy computing while it takes no host core. 2 intervals of warm-up, then 3 intervals (24
// steps) timed: step time and what it adds to the compute (over_compute_s), stall per step (the
// trainer waiting in step(); ZeRO-Offload's includes the wait for the gradients, so the compute),
// and the last CPU update's time, disk wait and bytes. ZeRO-Offload pays the CPU update in every
// step; ZenFlow hides it while the interval's compute (8 x the step time) covers it.
void coordinator_stall(benchmark::State& state) {
  // 0: ZeRO-Offload; ZenFlow async with 1: update_interval 8, 2: "auto" (the gradient-mass rule),
  // 3: "auto" with cover_cpu_update (no shorter than the measured CPU update needs).
  const std::int64_t schedule = state.range(1);
  const bool zenflow_async = schedule != 0;
  const std::int64_t on_disk = state.range(2);
  const zenflow::index_t cols = state.range(0) * (1 << 20) / rows;
  const std::size_t params = static_cast<std::size_t>(rows * cols);
  const auto compute = std::chrono::milliseconds(env_count("ZENFLOW_BENCH_STEP_MS", 100));
  std::vector<zenflow::bfloat16> weight(params, zenflow::to_bfloat16(0.01f)), grad(params);
  for (std::size_t i = 0; i < params; ++i)  // column norms that differ, so the selection matters
    grad[i] = zenflow::to_bfloat16(1e-3f * static_cast<float>(1 + (i / rows) % 97));
  const zenflow::coordinator_config config = coordinator_config_for(on_disk);
  zenflow::zenflow_options options = zenflow::zenflow_options::zero_offload();
  constexpr int interval = 8;
  if (zenflow_async) {
    options = zenflow::zenflow_options{};
    options.topk_ratio = 0.1f;
    options.update_interval =
        schedule == 1 ? zenflow::interval_option::fixed(interval) : zenflow::interval_option::automatic();
    options.select_interval = zenflow::interval_option::fixed(1000);
    options.overlap_step = true;
    options.cover_cpu_update = schedule == 3;
  }
  double step_s = 0, stall_s = 0, update_s = 0, wait_s = 0, read_b = 0, written_b = 0, intervals = 0;
  std::int64_t floor = 0;
  int steps = 0;
  for (auto _ : state) {
    zenflow::host_stream stream(1);
    zenflow::host_coordinator c(options, config);
    c.register_parameter("w", zenflow::matrix_view::column_contiguous(weight.data(), rows, cols, zenflow::dtype::bf16),
                         zenflow::const_matrix_view::column_contiguous(weight.data(), rows, cols, zenflow::dtype::bf16),
                         zenflow::dtype::bf16);
    for (int step = 0; step < 5 * interval; ++step) {
      const auto t0 = clock_type::now();
      stream.enqueue([compute] { std::this_thread::sleep_for(compute); });  // forward + backward
      c.submit_gradient(0, zenflow::const_matrix_view::column_contiguous(grad.data(), rows, cols, zenflow::dtype::bf16),
                        &stream);
      const auto& m = c.step(&stream);
      stream.synchronize();
      if (step < 2 * interval) continue;  // warm-up: the selection, the first intervals
      step_s += seconds_since(t0);
      stall_s += m.stall_seconds;
      intervals += static_cast<double>(m.interval);
      floor = std::max(floor, m.interval_floor);
      if (m.cpu_update_seconds > 0) {
        update_s = m.cpu_update_seconds;
        wait_s = m.cpu_update_disk_wait_seconds;
        read_b = static_cast<double>(m.cpu_update_disk_read_bytes);
        written_b = static_cast<double>(m.cpu_update_disk_written_bytes);
      }
      ++steps;
    }
    c.finish(&stream);
  }
  state.counters["params_M"] = static_cast<double>(params) * 1e-6;
  state.counters["step_s"] = step_s / steps;
  state.counters["stall_s_per_step"] = stall_s / steps;
  state.counters["stall_fraction"] = stall_s / step_s;
  state.counters["over_compute_s"] = step_s / steps - std::chrono::duration<double>(compute).count();
  state.counters["cpu_update_s"] = update_s;
  state.counters["disk_wait_s"] = wait_s;
  state.counters["disk_read_MB"] = read_b * 1e-6;
  state.counters["disk_written_MB"] = written_b * 1e-6;
  state.counters["mean_interval"] = intervals / steps;
  state.counters["interval_floor"] = static_cast<double>(floor);
  static constexpr const char* names[] = {"zero-offload, ", "zenflow async, interval 8, ", "zenflow async, auto, ",
                                          "zenflow async, auto + cover_cpu_update, "};
  state.SetLabel(std::string(names[schedule]) + placement_name(on_disk));
}

// A plain copy of `bytes` bytes to (write) or from (read) `path`, through one buffer of the
// checkpoint's buffer size: pwrite or pread and nothing else. Returns the seconds taken.
double plain_file_pass(const std::string& path, std::uint64_t bytes, bool write) {
  std::vector<std::byte> buffer(zenflow::detail::checkpoint_writer::buffer_bytes, std::byte{0x5a});
  const int fd = ::open(path.c_str(), write ? O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC : O_RDONLY | O_CLOEXEC, 0600);
  if (fd < 0) throw zenflow::error("roofline", "cannot open " + path + ": " + std::strerror(errno));
  const auto t0 = clock_type::now();
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), bytes - at));
    const ssize_t done = write ? ::pwrite(fd, buffer.data(), n, static_cast<off_t>(at))
                               : ::pread(fd, buffer.data(), n, static_cast<off_t>(at));
    if (done <= 0) {
      ::close(fd);
      throw zenflow::error("roofline", path + ": " + (done < 0 ? std::strerror(errno) : "ends early"));
    }
    at += static_cast<std::uint64_t>(done);
  }
  const double seconds = seconds_since(t0);
  ::close(fd);
  benchmark::DoNotOptimize(buffer.data());
  return seconds;
}

// A checkpoint's save and load against the file system's plain copy of the same bytes, timed in
// the same iteration, on the same file system (ZENFLOW_BENCH_NVME_DIR): a ZeRO-Offload
// host_coordinator over one bf16 1024-row weight of range(0) M parameters, its state in RAM
// (fp32 master, m, v), one step taken; then
//
//   save            save_checkpoint of the optimizer state (12 B per parameter)
//   roofline write  a plain pwrite of as many bytes, from one 4 MiB buffer (the writer's size)
//   load            load_checkpoint into a fresh coordinator over the same weight: the state read
//                   twice by design (parsed and validated, its checksum kept on the way and
//                   verified before anything changes, then applied a 16 MiB run at a time)
//   roofline read   a plain pread of the checkpoint's bytes, once
//
// and reports save_fraction = roofline write / save and load_fraction = roofline read / load, with
// each pass's GB/s, and the resident memory each call adds at its peak (VmHWM; the page cache is not
// counted). Neither the save nor the roofline syncs to the disk: with the file in the page
// cache both measure what the CPU does around the copy (the checksum, the state's export and
// import, the validation), which is what the library decides.
void checkpoint_io(benchmark::State& state) {
  const zenflow::index_t cols = state.range(0) * (1 << 20) / rows;
  const std::size_t params = static_cast<std::size_t>(rows * cols);
  std::vector<zenflow::bfloat16> weight(params, zenflow::to_bfloat16(0.01f)), grad(params, zenflow::to_bfloat16(1e-3f));
  const auto path = (bench_dir() / "zenflow_bench_checkpoint.bin").string();
  const auto plain = (bench_dir() / "zenflow_bench_checkpoint_roofline.bin").string();
  auto options = zenflow::zenflow_options::zero_offload();
  options.optimizer.weight_decay = 0.01f;
  double save_s = 0, load_s = 0, write_s = 0, read_s = 0, file_bytes = 0, save_added = 0, load_added = 0;
  // The resident memory a call adds at its peak: VmHWM after it, reset to VmRSS before it.
  const auto peak_added = [](auto&& call) {
    reset_peak();
    const auto before = static_cast<double>(resident_bytes());
    call();
    return static_cast<double>(peak_resident_bytes()) - before;
  };
  const auto make = [&] {
    auto c = std::make_unique<zenflow::host_coordinator>(options, coordinator_config_for(0));
    c->register_parameter(
        "w", zenflow::matrix_view::column_contiguous(weight.data(), rows, cols, zenflow::dtype::bf16),
        zenflow::const_matrix_view::column_contiguous(weight.data(), rows, cols, zenflow::dtype::bf16),
        zenflow::dtype::bf16);
    return c;
  };
  for (auto _ : state) {
    zenflow::host_stream stream;
    auto c = make();
    c->submit_gradient(0, zenflow::const_matrix_view::column_contiguous(grad.data(), rows, cols, zenflow::dtype::bf16),
                       &stream);
    c->step(&stream);
    c->finish(&stream);
    auto t0 = clock_type::now();
    save_added += peak_added([&] { c->save_checkpoint(path, &stream, zenflow::checkpoint_contents::optimizer_state); });
    save_s += seconds_since(t0);
    c.reset();
    const auto bytes = static_cast<std::uint64_t>(std::filesystem::file_size(path));
    file_bytes = static_cast<double>(bytes);
    write_s += plain_file_pass(plain, bytes, true);
    auto fresh = make();
    t0 = clock_type::now();
    load_added += peak_added([&] { fresh->load_checkpoint(path, &stream); });
    load_s += seconds_since(t0);
    read_s += plain_file_pass(path, bytes, false);
    std::filesystem::remove(path);
    std::filesystem::remove(plain);
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["params_M"] = static_cast<double>(params) * 1e-6;
  state.counters["checkpoint_GB"] = file_bytes * 1e-9;
  state.counters["save_s"] = save_s / it;
  state.counters["load_s"] = load_s / it;
  state.counters["save_GBps"] = file_bytes * it / save_s * 1e-9;
  state.counters["load_GBps"] = file_bytes * it / load_s * 1e-9;
  state.counters["roofline_write_GBps"] = file_bytes * it / write_s * 1e-9;
  state.counters["roofline_read_GBps"] = file_bytes * it / read_s * 1e-9;
  state.counters["save_peak_added_GB"] = save_added / it * 1e-9;
  state.counters["load_peak_added_GB"] = load_added / it * 1e-9;
  state.counters["save_fraction"] = write_s / save_s;
  state.counters["load_fraction"] = read_s / load_s;
}

BENCHMARK_CAPTURE(nvme_adam, io_uring, zenflow::io_engine_kind::uring)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(nvme_adam, posix, zenflow::io_engine_kind::posix)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

BENCHMARK_CAPTURE(cpu_adam_nvme, io_uring, zenflow::io_engine_kind::uring)
    ->ArgNames({"master_on_disk", "cpu_state"})
    ->Args({1, 0})
    ->Args({0, 0})
    ->Args({1, 1})
    ->Args({1, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(cpu_adam_nvme, posix, zenflow::io_engine_kind::posix)
    ->ArgNames({"master_on_disk", "cpu_state"})
    ->Args({1, 0})
    ->Args({0, 0})
    ->Args({1, 1})
    ->Args({1, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

BENCHMARK(coordinator_memory)
    ->ArgsProduct({{64, 256}, {0, 1, 2}, {0}, {0}})
    ->Args({256, 0, 1, 0})
    ->Args({256, 0, 2, 0})
    ->Args({256, 2, 0, 1})
    ->ArgNames({"Mparams", "on_disk", "cpu_state", "upload"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

BENCHMARK(checkpoint_io)->Arg(128)->ArgName("Mparams")->UseRealTime()->Unit(benchmark::kSecond)->Iterations(2);

BENCHMARK(coordinator_stall)
    ->ArgsProduct({{64}, {0, 1, 2, 3}, {0, 2}})
    ->ArgNames({"Mparams", "schedule", "on_disk"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

// More optimizer state than the machine has RAM (ZENFLOW_BENCH_LARGER_THAN_RAM_GB of fp32 master,
// m and v on disk, 12 B per parameter): a cpu_adam with its master and moments in a state file,
// tensors of 1024 x 262144 (256 M parameters, 3 GiB of state each) registered from one reused
// buffer, then one step over every column of every tensor with one bf16 gradient buffer that every
// task reads (gradients may share memory: what matters here is the state). Reports the state's GB
// against MemTotal, the peak resident memory (VmHWM) of the whole process (the registration
// buffer and the gradient included), the time to register (writing the initial master) and the
// step's time, rate and disk wait. The machine has no swap to hide in: a resident set above RAM
// would be killed.
void larger_than_ram(benchmark::State& state) {
  const double want_gb = static_cast<double>(env_count("ZENFLOW_BENCH_LARGER_THAN_RAM_GB", 0));
  constexpr zenflow::index_t cols = 262144;  // 256 M parameters per tensor
  const std::size_t per_tensor = static_cast<std::size_t>(rows) * cols;
  const auto tensors = static_cast<std::size_t>(std::ceil(want_gb * 1e9 / (12.0 * static_cast<double>(per_tensor))));
  zenflow::cpu_adam_config config;
  config.threads = 2;
  zenflow::nvme_state_config nvme;
  nvme.file.directory = bench_dir();
  nvme.file.file_name = "zenflow_bench_state.bin";
  nvme.file.read_ahead = 15;
  nvme.file.write_behind = 16;
  nvme.engine = {zenflow::io_engine_kind::automatic, 32};
  config.nvme = nvme;  // master_on_disk: the default
  zenflow::adam_options adam;
  adam.lr = 1e-3f;
  adam.weight_decay = 0.01f;
  double register_s = 0, step_s = 0, wait_s = 0, state_bytes = 0;
  for (auto _ : state) {
    zenflow::cpu_adam opt(adam, config);
    const auto t0 = clock_type::now();
    {
      std::vector<float> initial(per_tensor);
      for (std::size_t t = 0; t < tensors; ++t) {
        for (std::size_t i = 0; i < per_tensor; ++i) initial[i] = 0.01f * static_cast<float>((i + t) % 101);
        opt.add_tensor(initial, rows, cols);
      }
    }
    register_s = seconds_since(t0);
    std::vector<zenflow::bfloat16> grad(per_tensor);
    for (std::size_t i = 0; i < per_tensor; ++i)
      grad[i] = zenflow::to_bfloat16(1e-3f * static_cast<float>(i % 7) - 3e-3f);
    std::vector<zenflow::cpu_adam_task> tasks(tensors);
    for (std::size_t t = 0; t < tensors; ++t) tasks[t] = {t, grad.data(), zenflow::dtype::bf16, {}};
    const double wait0 = opt.nvme_file()->counters().wait_seconds;
    const auto t1 = clock_type::now();
    opt.step(tasks, 1.0f, false);
    step_s = seconds_since(t1);
    wait_s = opt.nvme_file()->counters().wait_seconds - wait0;
    state_bytes = static_cast<double>(opt.state_bytes());
    state.counters["ram_state_GB"] = static_cast<double>(opt.host_state_bytes()) * 1e-9;
    state.counters["pool_pinned_MB"] = static_cast<double>(opt.nvme_file()->pool().pinned_bytes()) * 1e-6;
    state.SetLabel(opt.nvme_status());
  }
  const double params = static_cast<double>(tensors * per_tensor);
  state.counters["params_B"] = params * 1e-9;
  state.counters["state_GB"] = state_bytes * 1e-9;
  state.counters["machine_ram_GB"] = static_cast<double>(proc_bytes("/proc/meminfo", "MemTotal:")) * 1e-9;
  state.counters["peak_rss_GB"] = static_cast<double>(peak_resident_bytes()) * 1e-9;
  state.counters["register_s"] = register_s;
  state.counters["step_s"] = step_s;
  state.counters["step_Mparams_per_s"] = params / step_s * 1e-6;
  state.counters["step_disk_GBps"] = 2 * state_bytes / step_s * 1e-9;
  state.counters["wait_fraction"] = wait_s / step_s;
}

// The same end to end: a ZeRO-Offload host_coordinator (every column on the CPU, updated every
// step) whose CPU columns' state on disk (fp32 master, m and v) is ZENFLOW_BENCH_LARGER_THAN_RAM_GB,
// more than the machine's RAM: bf16 weights of 1024 x 262144 (256 M parameters each, their own
// memory, 2 B per parameter), one bf16 gradient buffer every parameter's gradient reads, 3 training
// steps (each a 1 ms stand-in for the GPU's forward and backward, then every gradient handed over
// and step()). Host RAM: the weights, the fp32 accumulator (4 B), the write-back staging (2 B, GPU
// memory on a CUDA backend) and the state file's pool. Reports the step's time, what the trainer
// stalled in it (the CPU update with its disk time: ZeRO-Offload's point), the CPU update's time,
// bytes and disk wait, the peak resident memory (VmHWM) against MemTotal, and the coordinator's own
// accounting. Then saves the optimizer state's checkpoint beside the state file, destroys the
// coordinator, loads the checkpoint into a new one over the same weights and trains one more step:
// the checkpoint's size, the save's and the load's seconds and peak resident memory (VmHWM reset
// before each), and the resumed step's seconds.
void coordinator_larger_than_ram(benchmark::State& state) {
  const double want_gb = static_cast<double>(env_count("ZENFLOW_BENCH_LARGER_THAN_RAM_GB", 0));
  // Columns per weight (ZENFLOW_BENCH_LARGER_THAN_RAM_COLS).
  const auto cols = static_cast<zenflow::index_t>(env_count("ZENFLOW_BENCH_LARGER_THAN_RAM_COLS", 262144));
  const std::size_t per_tensor = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  const auto tensors = static_cast<std::size_t>(std::ceil(want_gb * 1e9 / (12.0 * static_cast<double>(per_tensor))));
  zenflow::coordinator_config config = coordinator_config_for(2);  // master and moments on disk
  config.nvme->file.read_ahead = 15;
  config.nvme->file.write_behind = 16;
  config.nvme->engine = {zenflow::io_engine_kind::automatic, 32};
  std::vector<std::vector<zenflow::bfloat16>> weights(tensors);
  std::vector<zenflow::bfloat16> grad(per_tensor);
  for (std::size_t i = 0; i < per_tensor; ++i)
    grad[i] = zenflow::to_bfloat16(1e-3f * static_cast<float>(i % 7) - 3e-3f);
  double register_s = 0, step_s = 0, stall_s = 0, update_s = 0, wait_s = 0, read_b = 0, written_b = 0;
  double save_s = 0, save_peak = 0, load_s = 0, load_peak = 0, checkpoint_b = 0, resumed_s = 0;
  zenflow::host_memory_bytes held;
  std::string label;
  constexpr int steps = 3;
  for (auto _ : state) {
    zenflow::host_stream stream(2);
    auto options = zenflow::zenflow_options::zero_offload();
    options.optimizer.lr = 1e-3f;
    options.optimizer.weight_decay = 0.01f;
    auto c = std::make_unique<zenflow::host_coordinator>(options, config);
    const auto t0 = clock_type::now();
    auto register_weights = [&](zenflow::host_coordinator& into) {
      for (std::size_t t = 0; t < tensors; ++t) {
        const auto w = zenflow::matrix_view::column_contiguous(weights[t].data(), rows, cols, zenflow::dtype::bf16);
        into.register_parameter("w" + std::to_string(t), w, zenflow::const_matrix_view(w), zenflow::dtype::bf16);
      }
    };
    auto submit_gradients = [&](zenflow::host_coordinator& to) {  // every parameter's: one shared buffer
      for (std::size_t t = 0; t < tensors; ++t)
        to.submit_gradient(
            t, zenflow::const_matrix_view::column_contiguous(grad.data(), rows, cols, zenflow::dtype::bf16), &stream);
    };
    for (std::size_t t = 0; t < tensors; ++t)
      weights[t].assign(per_tensor, zenflow::to_bfloat16(0.01f * static_cast<float>(t + 1)));
    register_weights(*c);
    register_s = seconds_since(t0);
    for (int s = 0; s < steps; ++s) {
      const auto t1 = clock_type::now();
      stream.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });  // forward + backward
      submit_gradients(*c);
      const zenflow::step_metrics& m = c->step(&stream);
      stream.synchronize();
      step_s += seconds_since(t1);
      stall_s += m.stall_seconds;
      update_s += m.cpu_update_seconds;
      wait_s += m.cpu_update_disk_wait_seconds;
      read_b += static_cast<double>(m.cpu_update_disk_read_bytes);
      written_b += static_cast<double>(m.cpu_update_disk_written_bytes);
    }
    c->finish(&stream);
    held = c->host_memory();
    label = c->host_optimizer().nvme_status();
    // Its checkpoint (the optimizer state: the weights are the trainer's), loaded by a fresh
    // coordinator after the first is gone (its state file with it), which then trains a step.
    const auto checkpoint = (bench_dir() / "zenflow_bench_checkpoint.bin").string();
    reset_peak();
    const auto t2 = clock_type::now();
    c->save_checkpoint(checkpoint, &stream, zenflow::checkpoint_contents::optimizer_state);
    save_s = seconds_since(t2);
    save_peak = static_cast<double>(peak_resident_bytes());
    checkpoint_b = static_cast<double>(std::filesystem::file_size(checkpoint));
    c.reset();
    c = std::make_unique<zenflow::host_coordinator>(options, config);
    register_weights(*c);
    reset_peak();
    const auto t3 = clock_type::now();
    c->load_checkpoint(checkpoint, &stream);
    load_s = seconds_since(t3);
    load_peak = static_cast<double>(peak_resident_bytes());
    std::filesystem::remove(checkpoint);
    const auto t4 = clock_type::now();
    submit_gradients(*c);
    c->step(&stream);
    c->finish(&stream);
    resumed_s = seconds_since(t4);
  }
  const double params = static_cast<double>(tensors * per_tensor);
  state.counters["params_B"] = params * 1e-9;
  state.counters["state_GB"] = params * 12.0 * 1e-9;
  state.counters["machine_ram_GB"] = static_cast<double>(proc_bytes("/proc/meminfo", "MemTotal:")) * 1e-9;
  state.counters["peak_rss_GB"] = static_cast<double>(peak_resident_bytes()) * 1e-9;
  state.counters["accounted_host_GB"] = static_cast<double>(held.host_total()) * 1e-9;
  state.counters["device_buffers_GB"] = static_cast<double>(held.device_buffers) * 1e-9;
  state.counters["register_s"] = register_s;
  state.counters["step_s"] = step_s / steps;
  state.counters["stall_s_per_step"] = stall_s / steps;
  state.counters["cpu_update_s"] = update_s / steps;
  state.counters["disk_wait_s"] = wait_s / steps;
  state.counters["disk_GBps"] = (read_b + written_b) / update_s * 1e-9;
  state.counters["disk_read_GB_per_step"] = read_b / steps * 1e-9;
  state.counters["checkpoint_GB"] = checkpoint_b * 1e-9;
  state.counters["save_s"] = save_s;
  state.counters["save_peak_rss_GB"] = save_peak * 1e-9;
  state.counters["load_s"] = load_s;
  state.counters["load_peak_rss_GB"] = load_peak * 1e-9;
  state.counters["resumed_step_s"] = resumed_s;
  state.SetLabel(label);
}

const bool larger_than_ram_registered = [] {
  if (env_count("ZENFLOW_BENCH_LARGER_THAN_RAM_GB", 0) > 0) {
    benchmark::RegisterBenchmark("larger_than_ram", larger_than_ram)
        ->UseRealTime()
        ->Unit(benchmark::kSecond)
        ->Iterations(1);
    benchmark::RegisterBenchmark("coordinator_larger_than_ram", coordinator_larger_than_ram)
        ->UseRealTime()
        ->Unit(benchmark::kSecond)
        ->Iterations(1);
  }
  return true;
}();

BENCHMARK_MAIN();
