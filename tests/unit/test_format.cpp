// zenflow/format.hpp: the exact text of every fmt::formatter, the string format specs, and
// step_metrics printed the same through fmt and through operator<<.
#include <zenflow/format.hpp>

#include <doctest/doctest.h>

#include <fmt/format.h>

#include <sstream>
#include <string>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;

TEST_CASE("enums print their names") {
  CHECK(fmt::format("{} {} {}", dtype::f32, dtype::bf16, dtype::f16) == "f32 bf16 f16");
  CHECK(fmt::format("{} {}", memory_space::host, memory_space::device) == "host device");
  CHECK(fmt::format("{} {} {} {}", cpu_isa::automatic, cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512) ==
        "automatic scalar avx2 avx512");
  CHECK(fmt::format("{} {} {}", selection_strategy::automatic, selection_strategy::step, selection_strategy::epoch) ==
        "auto step epoch");
  CHECK(fmt::format("{} {} {}", offload_mode::zenflow, offload_mode::zero_offload, offload_mode::dense) ==
        "zenflow zero_offload dense");
  CHECK(fmt::format("{}", static_cast<dtype>(7)) == "unknown");
}

TEST_CASE("names take the string format specs") {
  CHECK(fmt::format("[{:>6}]", dtype::bf16) == "[  bf16]");
  CHECK(fmt::format("[{:<6}]", dtype::f16) == "[f16   ]");
  CHECK(fmt::format("[{:*^9}]", offload_mode::dense) == "[**dense**]");
}

TEST_CASE("16-bit floats print their value with the float specs") {
  CHECK(fmt::format("{}", to_bfloat16(1.5f)) == "1.5");
  CHECK(fmt::format("{:.2f}", to_bfloat16(1.5f)) == "1.50");
  CHECK(fmt::format("{:8.3f}", to_float16(-0.25f)) == "  -0.250");
  CHECK(fmt::format("{}", to_bfloat16(0.1f)) == "0.100097656");  // the bf16 value, not the float given
  CHECK(fmt::format("{}", to_float16(0.1f)) == "0.099975586");
  CHECK(fmt::format("{}", to_float16(1.0e6f)) == "inf");
}

TEST_CASE("interval_option: auto or the count") {
  CHECK(fmt::format("{}", interval_option::automatic()) == "auto");
  CHECK(fmt::format("{}", interval_option::fixed(4)) == "4");
  CHECK(fmt::format("[{:>5}]", interval_option::fixed(16)) == "[   16]");
}

TEST_CASE("adam_options: every field") {
  CHECK(fmt::format("{}", adam_options{}) ==
        "{lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-08, weight_decay: 0, adamw_mode: true, "
        "bias_correction: true}");
  adam_options a;
  a.lr = 2e-5f;
  a.weight_decay = 0.01f;
  a.adamw_mode = false;
  CHECK(fmt::format("{}", a) ==
        "{lr: 2e-05, beta1: 0.9, beta2: 0.999, eps: 1e-08, weight_decay: 0.01, adamw_mode: false, "
        "bias_correction: true}");
}

TEST_CASE("zenflow_options: every field, DeepSpeed's names") {
  CHECK(fmt::format("{}", zenflow_options{}) ==
        "{mode: zenflow, topk_ratio: 0.1, select_strategy: auto, select_interval: auto, update_interval: auto, "
        "full_warm_up_rounds: 0, overlap_step: true, steps_per_epoch: 0, auto_select_steps: 100, "
        "max_update_interval: 16, cover_cpu_update: false, max_grad_norm: 0, adam: {lr: 0.001, beta1: 0.9, "
        "beta2: 0.999, eps: 1e-08, weight_decay: 0, adamw_mode: true, bias_correction: true}}");
  zenflow_options o = zenflow_options::zero_offload();
  o.select_strategy = selection_strategy::epoch;
  o.select_interval = interval_option::fixed(2);
  o.steps_per_epoch = 50;
  o.max_grad_norm = 1.0f;
  CHECK(fmt::format("{}", o) ==
        "{mode: zero_offload, topk_ratio: 0.1, select_strategy: epoch, select_interval: 2, update_interval: 1, "
        "full_warm_up_rounds: 0, overlap_step: false, steps_per_epoch: 50, auto_select_steps: 100, "
        "max_update_interval: 16, cover_cpu_update: false, max_grad_norm: 1, adam: {lr: 0.001, beta1: 0.9, "
        "beta2: 0.999, eps: 1e-08, weight_decay: 0, adamw_mode: true, bias_correction: true}}");
}

TEST_CASE("cpu_adam_config and coordinator_config: every field") {
  CHECK(fmt::format("{}", cpu_adam_config{}) ==
        "{threads: 0, pin_to_cores: false, isa: automatic, chunk_elements: 32768, cpu_state: fp32, "
        "seed: 0x7a656e666c6f77, nvme: none, cpus: []}");
  CHECK(fmt::format("{}", cpu_adam_config{2, true, cpu_isa::avx2, 1024}) ==
        "{threads: 2, pin_to_cores: true, isa: avx2, chunk_elements: 1024, cpu_state: fp32, seed: 0x7a656e666c6f77, "
        "nvme: none, cpus: []}");
  cpu_adam_config on_two;
  on_two.cpus = {2, 3};
  CHECK(fmt::format("{}", on_two) ==
        "{threads: 0, pin_to_cores: false, isa: automatic, chunk_elements: 32768, cpu_state: fp32, "
        "seed: 0x7a656e666c6f77, nvme: none, cpus: [2, 3]}");
  coordinator_config reserving;
  reserving.reserved_cpus = 4;
  CHECK(fmt::format("{}", reserving).starts_with("{cpu_threads: 0, pin_threads: false, reserved_cpus: 4, "));
  CHECK(fmt::format("{}", coordinator_config{}) ==
        "{cpu_threads: 0, pin_threads: false, reserved_cpus: 0, cpu_state: fp32, nvme: none, d2h_slot_bytes: 4194304, "
        "d2h_slots: 4, h2d_slot_bytes: 4194304, h2d_slots: 2, copy_out_window_bytes: 67108864, record_trace: false, "
        "check_stream_order: true}");
  // An 8-bit state on an SSD prints as one (not as the fp32 state in RAM of the defaults).
  coordinator_config on_disk;
  on_disk.cpu_state = cpu_state_format::blockwise8_moments;
  on_disk.nvme = nvme_state_config{};
  on_disk.nvme->file.directory = "/mnt/nvme";
  on_disk.nvme->engine.kind = io_engine_kind::posix;
  const std::string expected =
      "{cpu_threads: 0, pin_threads: false, reserved_cpus: 0, cpu_state: blockwise8_moments, nvme: {directory: "
      "/mnt/nvme, file_name: , rank: 0, block_bytes: 1048576, read_ahead: 4, write_behind: 4, direct: required, "
      "allow_memory_backed: false, keep_file: false, pin: automatic, engine: posix, queue_depth: 32, "
      "engine_threads: 0, master_on_disk: true}, d2h_slot_bytes: ";
  CHECK(fmt::format("{}", on_disk).starts_with(expected));
  cpu_adam_config compact;
  compact.cpu_state = cpu_state_format::bf16_moments;
  compact.seed = 7;
  CHECK(fmt::format("{}", compact).find("cpu_state: bf16_moments, seed: 0x7, nvme: none") != std::string::npos);
}

TEST_CASE("option structs take the string format specs as a whole") {
  const std::string text =
      "{threads: 0, pin_to_cores: false, isa: automatic, chunk_elements: 32768, cpu_state: fp32, "
      "seed: 0x7a656e666c6f77, nvme: none, cpus: []}";
  CHECK(fmt::format("{:>160}", cpu_adam_config{}) == std::string(160 - text.size(), ' ') + text);
  CHECK(fmt::format("{:>10}", cpu_adam_config{}) == text);  // narrower than the text: not cut
  CHECK(fmt::format("[{:<8}]", interval_option::automatic()) == "[auto    ]");
}

TEST_CASE("step_metrics: fmt and operator<< write the same text") {
  step_metrics m;
  CHECK(fmt::format("{}", m) == "step -1 stall 0 ms cpu_update 0 ms d2h 0 B h2d 0 B overlap 1 interval 1");
  m.step = 12;
  m.stall_seconds = 0.0015;
  m.stall_reason = "cpu update of interval 2";
  m.cpu_update_seconds = 0.25;
  m.bytes_device_to_host = 4096;
  m.bytes_host_to_device = 1024;
  m.selection_overlap = 0.875;
  m.interval = 4;
  m.reselected = true;
  m.cpu_update_launched = true;
  m.written_back = true;
  const std::string expected =
      "step 12 stall 1.5 ms (cpu update of interval 2) cpu_update 250 ms d2h 4096 B h2d 1024 B overlap 0.875 "
      "interval 4 reselected cpu-update write-back";
  CHECK(fmt::format("{}", m) == expected);
  std::ostringstream os;
  os << m;
  CHECK(os.str() == expected);
  CHECK(fmt::format("{:>{}}", m, expected.size() + 4) == "    " + expected);
}

}  // namespace ZENFLOW_TEST_FILE_ID
