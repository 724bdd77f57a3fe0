// Compact CPU state through the coordinator (coordinator_config::cpu_state): the CPU columns'
// moments held as bf16 or 8-bit blocks train as fp32 moments do, across reselections (the state
// leaves and enters the CPU optimizer through its fp32 export and import), in fewer bytes. The
// checkpoint side (save, load, resume bit-identically, crafted files rejected) runs in
// test_checkpoint.cpp through checkpoint_configurations(), which holds compact configurations.
// State on disk (coordinator_config::nvme; the moments, or the master too) trains bit-identically to
// state in RAM.
#include <zenflow/coordinator.hpp>

#include "../support/exported_state.hpp"
#include "../support/storage_test_utils.hpp"
#include "coordinator_harness.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

struct run_result {
  std::vector<float> weights;  // every weight element, as floats
  double loss_before = 0.0, loss_after = 0.0;
  std::size_t state_bytes = 0;
  cpu_state_format format = cpu_state_format::fp32;
  int reselections = 0;
  std::vector<float> moments;  // the CPU columns' exported m and v at the end (both weights)
  std::size_t host_state_bytes = 0;
  std::size_t master_bytes = 0;  // the fp32 master of every tensor the CPU optimizer holds
  std::uint64_t disk_bytes_read = 0, disk_bytes_written = 0;
  std::uint64_t metrics_disk_read = 0, metrics_disk_written = 0;  // sums over the steps' metrics
  int metrics_lines_with_disk = 0;
};

zenflow_options cpu_state_options() {
  zenflow_options o;
  o.optimizer.lr = 0.01f;
  o.optimizer.weight_decay = 0.01f;
  o.topk_ratio = 0.25f;
  o.select_interval = interval_option::fixed(3);  // a reselection every 3 steps: state migrates often
  o.update_interval = interval_option::fixed(2);
  o.overlap_step = true;
  return o;
}

run_result train(cpu_state_format format, std::int64_t steps, const zenflow_options& options = cpu_state_options(),
                 const zenflow_test::scratch_dir* nvme_dir = nullptr, bool master_on_disk = true) {
  auto config = nvme_dir != nullptr ? harness::on_disk(nvme_dir->path()) : harness::small_config();
  config.cpu_state = format;
  if (config.nvme) config.nvme->master_on_disk = master_on_disk;
  harness h(options, config);
  run_result out;
  out.loss_before = h.model.loss();
  for (std::int64_t s = 0; s < steps; ++s) {
    h.train(1);
    const auto& m = h.coordinator.metrics();
    out.reselections += m.reselected ? 1 : 0;
    if (m.cpu_update_launched || m.written_back) {  // a new CPU update's figures (reported until the next one)
      out.metrics_disk_read += m.cpu_update_disk_read_bytes;
      out.metrics_disk_written += m.cpu_update_disk_written_bytes;
    }
    std::ostringstream line;
    line << m;
    out.metrics_lines_with_disk += line.str().find("(disk: read") != std::string::npos ? 1 : 0;
  }
  h.finish();
  out.loss_after = h.model.loss();
  for (auto& w : h.model.weights) {
    const const_matrix_view v = w.view();
    for (index_t r = 0; r < w.rows; ++r)
      for (index_t c = 0; c < w.cols; ++c) out.weights.push_back(toy_model::load(v, r, c));
  }
  const auto& opt = h.coordinator.host_optimizer();
  out.state_bytes = opt.state_bytes();
  out.host_state_bytes = opt.host_state_bytes();
  for (std::size_t t = 0; t < opt.tensor_count(); ++t)
    out.master_bytes += static_cast<std::size_t>(opt.rows(t) * opt.cols(t)) * sizeof(float);
  out.format = opt.state_format();
  if (opt.nvme_file() != nullptr) {
    out.disk_bytes_read = opt.nvme_file()->counters().bytes_read;
    out.disk_bytes_written = opt.nvme_file()->counters().bytes_written;
  }
  for (std::size_t i = 0; i < h.model.weights.size(); ++i) {
    const auto on_gpu = h.coordinator.gpu_columns(i);
    std::vector<std::int32_t> cpu_columns;
    for (index_t c = 0; c < h.model.weights[i].cols; ++c)
      if (std::find(on_gpu.begin(), on_gpu.end(), static_cast<std::int32_t>(c)) == on_gpu.end())
        cpu_columns.push_back(static_cast<std::int32_t>(c));
    const auto s = zenflow_test::export_state(opt, i, cpu_columns);
    out.moments.insert(out.moments.end(), s.exp_avg.begin(), s.exp_avg.end());
    out.moments.insert(out.moments.end(), s.exp_avg_sq.begin(), s.exp_avg_sq.end());
  }
  return out;
}

}  // namespace

TEST_CASE("compact CPU moments train through reselections as fp32 moments do, in fewer bytes") {
  constexpr std::int64_t steps = 40;
  const auto fp32 = train(cpu_state_format::fp32, steps);
  REQUIRE(fp32.reselections >= 10);
  REQUIRE(fp32.loss_after < 0.8 * fp32.loss_before);
  for (const auto format : {cpu_state_format::bf16_moments, cpu_state_format::blockwise8_moments}) {
    CAPTURE(cpu_state_format_name(format));
    const auto compact = train(format, steps);
    CHECK(compact.format == format);
    CHECK(compact.reselections == fp32.reselections);
    const bool q8 = format == cpu_state_format::blockwise8_moments;
    // Master 4 B + moments 8 B (fp32), 4 B (bf16) or 2 B and two fp32 scales per block of a
    // column (blocks of 9 and 12 rows here: 0.67-0.89 B per element).
    CHECK(static_cast<double>(compact.state_bytes) <= (q8 ? 0.6 : 0.67) * static_cast<double>(fp32.state_bytes));
    // The weights follow the fp32 run's: each within 1% (bf16) or 6% (8-bit) of the largest
    // weight's magnitude (the 8-bit run's largest difference is about 4%); the loss within 0.5%.
    double w_max = 0.0, far = 0.0;
    for (const float w : fp32.weights) w_max = std::max(w_max, std::fabs(double{w}));
    for (std::size_t i = 0; i < fp32.weights.size(); ++i)
      far = std::max(far, std::fabs(static_cast<double>(compact.weights[i]) - fp32.weights[i]));
    CHECK(far <= (q8 ? 0.06 : 0.01) * w_max);
    CHECK(compact.loss_after == doctest::Approx(fp32.loss_after).epsilon(0.005));
    // The CPU columns' moments as exported, against fp32's: each within 5% (bf16) or 10% (8-bit)
    // of the largest |m| or of itself (v's scale varies by column).
    REQUIRE(compact.moments.size() == fp32.moments.size());
    double m_max = 0.0;
    for (std::size_t i = 0; i < fp32.moments.size(); ++i) m_max = std::max(m_max, std::fabs(double{fp32.moments[i]}));
    int apart = 0;
    for (std::size_t i = 0; i < fp32.moments.size(); ++i) {
      const double d = std::fabs(static_cast<double>(compact.moments[i]) - fp32.moments[i]);
      const double tol = q8 ? 0.10 : 0.05;
      if (!(d <= tol * m_max || d <= tol * std::fabs(double{fp32.moments[i]}))) ++apart;
    }
    CHECK(apart == 0);
  }
}

TEST_CASE("state on disk trains bit-identically to state in RAM, through reselections, every mode and layout") {
  auto zero_offload = zenflow_options::zero_offload();
  zero_offload.optimizer = cpu_state_options().optimizer;
  constexpr auto fp32 = cpu_state_format::fp32, bf16 = cpu_state_format::bf16_moments;
  constexpr auto q8 = cpu_state_format::blockwise8_moments;
  // Plain variables, not structured bindings: doctest's CAPTURE and INFO capture them in a lambda,
  // which clang before 16 refuses for a binding.
  for (const auto& c :
       {std::tuple{"zenflow", cpu_state_options(), true, fp32}, std::tuple{"zero_offload", zero_offload, true, fp32},
        std::tuple{"zenflow", cpu_state_options(), false, fp32}, std::tuple{"zero_offload", zero_offload, false, fp32},
        std::tuple{"zenflow", cpu_state_options(), true, bf16}, std::tuple{"zero_offload", zero_offload, false, bf16},
        std::tuple{"zenflow", cpu_state_options(), true, q8}, std::tuple{"zenflow", cpu_state_options(), false, q8},
        std::tuple{"zero_offload", zero_offload, true, q8}}) {
    const char* const name = std::get<0>(c);
    const zenflow_options& options = std::get<1>(c);
    const bool master_on_disk = std::get<2>(c);
    const cpu_state_format format = std::get<3>(c);
    CAPTURE(name);
    CAPTURE(master_on_disk);
    CAPTURE(cpu_state_format_name(format));
    const auto ram = train(format, 24, options);
    zenflow_test::scratch_dir dir;
    const auto disk = train(format, 24, options, &dir, master_on_disk);
    REQUIRE(ram.weights.size() == disk.weights.size());
    CHECK(std::memcmp(ram.weights.data(), disk.weights.data(), ram.weights.size() * sizeof(float)) == 0);
    REQUIRE(ram.moments.size() == disk.moments.size());
    CHECK(std::memcmp(ram.moments.data(), disk.moments.data(), ram.moments.size() * sizeof(float)) == 0);
    CHECK(disk.reselections == ram.reselections);
    // RAM keeps the fp32 master only, or nothing.
    CHECK(disk.state_bytes == ram.state_bytes);
    CHECK(ram.master_bytes > 0);
    CHECK(disk.host_state_bytes == (master_on_disk ? 0 : ram.master_bytes));
    CHECK(disk.disk_bytes_read > 0);
    CHECK(disk.disk_bytes_written > 0);
    // The steps' metrics name the CPU updates' disk traffic (RAM state reports none).
    CHECK(disk.metrics_disk_read > 0);
    CHECK(disk.metrics_disk_written > 0);
    CHECK(disk.metrics_lines_with_disk > 0);
    CHECK(ram.metrics_disk_read == 0);
    CHECK(ram.metrics_lines_with_disk == 0);
  }
}

TEST_CASE("host_memory: one accumulator without overlap_step, two with it; state on disk holds none in RAM") {
  auto zero_offload = zenflow_options::zero_offload();  // overlap_step false: every update completes in its step
  zero_offload.optimizer = cpu_state_options().optimizer;
  // Plain variables, not structured bindings: doctest's CAPTURE and INFO capture them in a lambda,
  // which clang before 16 refuses for a binding.
  for (const auto& c :
       {std::tuple{"zenflow", cpu_state_options(), false}, std::tuple{"zero_offload", zero_offload, false},
        std::tuple{"zenflow", cpu_state_options(), true}, std::tuple{"zero_offload", zero_offload, true}}) {
    const char* const name = std::get<0>(c);
    const zenflow_options& options = std::get<1>(c);
    const bool disk = std::get<2>(c);
    CAPTURE(name);
    CAPTURE(disk);
    zenflow_test::scratch_dir dir;
    harness h(options, disk ? harness::on_disk(dir.path()) : harness::small_config());
    h.train(7);
    const host_memory_bytes m = h.coordinator.host_memory();
    // Every CPU column of every weight, on this one rank, but for ZeRO-Offload's column-contiguous
    // fp32 weight: its CPU updates run in place, with no accumulator.
    std::size_t cpu_elements = 0;
    for (std::size_t i = 0; i < h.model.weights.size(); ++i) {
      const auto& w = h.model.weights[i];
      if (w.updated_in_place(options.mode)) continue;
      cpu_elements +=
          (static_cast<std::size_t>(w.cols) - h.coordinator.gpu_columns(i).size()) * static_cast<std::size_t>(w.rows);
    }
    REQUIRE(cpu_elements > 0);
    CHECK(m.accumulators == (options.overlap_step ? 2 : 1) * cpu_elements * sizeof(float));
    CHECK(m.cpu_state == h.coordinator.host_optimizer().host_state_bytes());
    CHECK((m.cpu_state == 0) == disk);  // on disk: the master and the moments
    CHECK((m.state_file_pool == 5 * 4096) == disk);
    CHECK(m.copy_out == 0);       // the host backend writes results into its device buffers
    CHECK(m.device_buffers > 0);  // which stand in for the GPU's memory
    CHECK(m.host_total() == m.cpu_state + m.accumulators + m.state_file_pool);
    h.finish();
  }
}

TEST_CASE("a CPU update uploaded in waves through a small copy-out window gives the in-place bits") {
  // staged_host_backend's CPU updates write into the copy-out window and upload it through the
  // queue, as a CUDA backend's do (R14 off); the host backend writes the write-back staging in
  // place. With a window smaller than one parameter's CPU columns, an update is several optimizer
  // steps over parts of the columns: every state format, in RAM and on disk, must still give the
  // bits, counts and state of one step, with the window as the only copy-out memory.
  auto zero = zenflow_options::zero_offload();
  zero.optimizer = cpu_state_options().optimizer;
  for (const auto& o : {zero, cpu_state_options()})
    for (const cpu_state_format format :
         {cpu_state_format::fp32, cpu_state_format::bf16_moments, cpu_state_format::blockwise8_moments})
      for (const bool on_disk : {false, true})
        // Windows of 9.8 columns of the large weight in RAM and of 78 on disk (a wave of a few
        // columns would be thousands of state-file passes: slow, and no different); in RAM with
        // fp32 moments, ZenFlow's update also with a window of one column.
        for (const std::size_t window : on_disk ? std::vector<std::size_t>{40000}
                                        : format == cpu_state_format::fp32 && o.mode == offload_mode::zenflow
                                            ? std::vector<std::size_t>{1, 5000}
                                            : std::vector<std::size_t>{5000}) {
          CAPTURE(offload_mode_name(o.mode));
          CAPTURE(cpu_state_format_name(format));
          CAPTURE(on_disk);
          CAPTURE(window);
          zenflow_test::scratch_dir dir_a, dir_b;
          auto config_a = on_disk ? harness::on_disk(dir_a.path()) : harness::small_config();
          auto config_b = on_disk ? harness::on_disk(dir_b.path()) : harness::small_config();
          config_a.cpu_state = config_b.cpu_state = format;
          config_b.copy_out_window_bytes = window;
          config_b.h2d_slot_bytes = 4096;  // the 192-byte slots' hand-offs would be most of the time
          harness in_place(o, config_a, toy_model::with_large_weight());
          staged_harness waves(o, config_b, toy_model::with_large_weight());
          in_place.train(9, /*poison_step=*/4);
          waves.train(9, /*poison_step=*/4);
          CHECK(in_place.finish() == waves.finish());
          CHECK(in_place.coordinator.host_optimizer().step_count() == waves.coordinator.host_optimizer().step_count());
          for (std::size_t i = 0; i < in_place.model.weights.size(); ++i)
            CHECK(in_place.coordinator.cpu_step_count(i) == waves.coordinator.cpu_step_count(i));
          CHECK(in_place.coordinator.metrics().bytes_host_to_device ==
                waves.coordinator.metrics().bytes_host_to_device);
          // The window: what was asked for, raised to the widest column (rows x the parameter's
          // dtype) when that is more (and capped by what every column needs together, far more).
          std::size_t widest = 0, total = 0;
          for (const auto& w : in_place.model.weights) {
            widest = std::max(widest, static_cast<std::size_t>(w.rows) * dtype_size(w.type));
            total += static_cast<std::size_t>(w.rows * w.cols) * dtype_size(w.type);
          }
          CHECK(in_place.coordinator.host_memory().copy_out == 0);
          const std::size_t copy_out = waves.coordinator.host_memory().copy_out;
          CHECK(widest < 5000);
          CHECK(total > 40000);
          CHECK(copy_out == (window == 1 ? widest : window));
        }
}

}  // namespace ZENFLOW_TEST_FILE_ID
