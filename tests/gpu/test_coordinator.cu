// The CUDA coordinator against the host coordinator (the oracle that CI runs): the same model,
// the same gradients, the same options. The schedule (intervals, write-back steps) must be
// identical; parameters must agree to within one rounding of their dtype (the device computes
// its bias corrections with its own pow, which may differ from glibc's in the last bit), and the
// CPU Adam's fp32 state must agree too. The gradients' magnitude changes by up to 7500x from
// step to step, so a clip factor from the wrong step, or none, shows in the CPU state; one test
// checks the CPU columns' clipped gradients against clip factors computed here. An edit of the
// parameters is reloaded on both sides alike. Checkpoints are saved and restored through the CUDA
// backend.
#include <zenflow/coordinator.cuh>

#include <doctest/doctest.h>

#include "../support/cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace zenflow;

namespace {

using device_memory = zenflow_test::device_buffer;
using zenflow_test::mapped_flags;
using zenflow_test::spin_until_flag;

constexpr index_t rows = 48, cols = 96, bias_size = 48;

/// The gradients' scale at `step`: the global norm is ~190 x this (weight ~130, bias ~140), so
/// with max_grad_norm 1 the clip factor changes by up to 7500x between steps, and the 0.004 steps
/// (norm ~0.75) are not clipped at all.
float step_magnitude(std::int64_t step) {
  constexpr float cycle[] = {1.0f, 30.0f, 0.004f, 0.3f, 6.0f};
  return cycle[step % 5];
}

std::vector<bfloat16> gradient(std::int64_t step) {
  std::mt19937 rng(static_cast<std::uint32_t>(77 + step));
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const float m = step_magnitude(step);
  std::vector<bfloat16> g(rows * cols);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) g[r * cols + c] = to_bfloat16(m * (c % 7 == 0 ? 5.0f : 0.3f) * n01(rng));
  return g;
}
std::vector<float> bias_gradient(std::int64_t step) {
  std::mt19937 rng(static_cast<std::uint32_t>(991 + step));
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const float m = step_magnitude(step);
  std::vector<float> g(bias_size);
  for (auto& x : g) x = 20.0f * m * n01(rng);  // as large as the weight's: a clip factor that ignores it is off
  return g;
}

/// Counts elements of `got` farther than `rel` x (|want| + 1e-3 x the largest |want|) from `want`.
int far_apart(std::span<const float> got, std::span<const float> want, double rel) {
  double largest = 0.0;
  for (float w : want) largest = std::max(largest, std::fabs(static_cast<double>(w)));
  int far = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double w = want[i], tol = rel * (std::fabs(w) + 1e-3 * largest);
    if (!(std::fabs(static_cast<double>(got[i]) - w) <= tol)) ++far;
  }
  return far;
}

/// The weight's initial fp32 master.
std::vector<float> initial_master() {
  std::vector<float> w0(rows * cols);
  std::mt19937 rng(5);
  std::normal_distribution<float> n01(0.0f, 0.1f);
  for (auto& x : w0) x = n01(rng);
  return w0;
}
std::vector<bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<bfloat16> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_bfloat16(x[i]);
  return out;
}

/// The model on the device (bf16 weight from initial_master(), zero f32 bias, gradient buffers)
/// and the trainer's non-blocking stream.
struct gpu_model {
  std::vector<float> w0 = initial_master();
  std::vector<float> b0 = std::vector<float>(bias_size, 0.0f);
  device_memory w_dev{w0.size() * 2}, g_dev{w0.size() * 2}, b_dev{bias_size * 4}, gb_dev{bias_size * 4};
  zenflow_test::cuda_stream trainer_stream;  // non-blocking
  cudaStream_t stream = trainer_stream.get();
  gpu_model() {
    const auto w = to_bf16(w0);
    ZENFLOW_CUDA_TRY(cudaMemcpy(w_dev.data(), w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    ZENFLOW_CUDA_TRY(cudaMemcpy(b_dev.data(), b0.data(), bias_size * 4, cudaMemcpyHostToDevice));
    // A pageable upload may return before its DMA landed, on the legacy stream, which the
    // trainer's non-blocking stream does not wait for.
    ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  }
  gpu_model(const gpu_model&) = delete;
  gpu_model& operator=(const gpu_model&) = delete;
};

/// Registers gpu_model's weight and bias with `gpu` (indices 0 and 1).
void register_model(cuda_coordinator& gpu, const gpu_model& m) {
  gpu.register_parameter("w", matrix_view::row_major(m.w_dev.data(), rows, cols, dtype::bf16, memory_space::device),
                         const_matrix_view::row_major(m.w0.data(), rows, cols, dtype::f32), dtype::bf16);
  gpu.register_parameter("b", vector_view{m.b_dev.data(), bias_size, dtype::f32, memory_space::device}, m.b0);
}

/// Trains `gpu` on the test gradients of steps [from, to) on m's stream, one step at a time.
void drive(cuda_coordinator& gpu, const gpu_model& m, std::int64_t from, std::int64_t to) {
  for (std::int64_t s = from; s < to; ++s) {
    const auto g = gradient(s);
    const auto gb = bias_gradient(s);
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(m.g_dev.data(), g.data(), g.size() * 2, cudaMemcpyHostToDevice, m.stream));
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(m.gb_dev.data(), gb.data(), bias_size * 4, cudaMemcpyHostToDevice, m.stream));
    gpu.submit_gradient(0, const_matrix_view::row_major(m.g_dev.data(), rows, cols, dtype::bf16, memory_space::device),
                        m.stream);
    gpu.submit_gradient(1, const_vector_view{m.gb_dev.data(), bias_size, dtype::f32, memory_space::device}, m.stream);
    gpu.step(m.stream);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(m.stream));  // g and gb go out of scope; g_dev is refilled next
  }
}

/// Everything a run leaves behind: the device weight (bits) and bias, the CPU Adam's fp32 state.
struct run_state {
  std::vector<std::uint16_t> w;
  std::vector<float> b, cpu_params, cpu_exp_avg, cpu_exp_avg_sq;
  bool operator==(const run_state&) const = default;
};
run_state snapshot(const cuda_coordinator& gpu, const gpu_model& m) {
  run_state s;
  s.w.resize(rows * cols);
  s.b.resize(bias_size);
  ZENFLOW_CUDA_TRY(cudaMemcpy(s.w.data(), m.w_dev.data(), s.w.size() * 2, cudaMemcpyDeviceToHost));
  ZENFLOW_CUDA_TRY(cudaMemcpy(s.b.data(), m.b_dev.data(), bias_size * 4, cudaMemcpyDeviceToHost));
  // The host optimizer's state of the weight's CPU columns only: a column on the GPU has its state
  // in the device optimizer, and its host slots hold whatever its last CPU interval left (a
  // checkpoint writes each column's state once, from the optimizer that owns it).
  const auto& h = gpu.host_optimizer();
  const auto on_gpu = gpu.gpu_columns(0);
  for (index_t c = 0; c < cols; ++c) {
    if (std::find(on_gpu.begin(), on_gpu.end(), static_cast<std::int32_t>(c)) != on_gpu.end()) continue;
    const auto at = static_cast<std::size_t>(c * rows);  // the CPU tensor is column-contiguous
    const auto n = static_cast<std::size_t>(rows);
    s.cpu_params.insert(s.cpu_params.end(), h.params(0).begin() + at, h.params(0).begin() + at + n);
    s.cpu_exp_avg.insert(s.cpu_exp_avg.end(), h.exp_avg(0).begin() + at, h.exp_avg(0).begin() + at + n);
    s.cpu_exp_avg_sq.insert(s.cpu_exp_avg_sq.end(), h.exp_avg_sq(0).begin() + at, h.exp_avg_sq(0).begin() + at + n);
  }
  REQUIRE(!s.cpu_params.empty());
  return s;
}

/// The trainer's edit of the weight and the bias between steps (the same on both sides): the weight
/// clamped to [-0.05, 0.05], the bias set to 0.5.
void edit(std::vector<bfloat16>& w, std::vector<float>& b) {
  for (auto& x : w) x = to_bfloat16(std::clamp(to_float(x), -0.05f, 0.05f));
  std::fill(b.begin(), b.end(), 0.5f);
}

/// Runs the same gradients through the CUDA and the host coordinator and compares the weights,
/// the bias, the update trace and the bytes moved. At `nan_step` (if >= 0) one gradient element
/// is NaN: both must skip that step. With `has`, parameter i (0: the weight, 1: the bias) gets a
/// gradient in step s only where has(i, s), and both step with missing_gradients::skip. Before
/// step `edit_step` (if >= 0) both sides edit the parameters (edit()) and reload them.
void compare_modes(const zenflow_options& options, std::int64_t steps, std::int64_t nan_step = -1,
                   const std::function<bool(std::size_t, std::int64_t)>& has = {}, std::int64_t edit_step = -1) {
  const auto given = [&](std::size_t i, std::int64_t s) { return !has || has(i, s); };
  const missing_gradients missing = has ? missing_gradients::skip : missing_gradients::reject;
  gpu_model m;
  const std::vector<float>& w0 = m.w0;
  const std::vector<float>& b0 = m.b0;
  std::vector<bfloat16> w_host = to_bf16(w0);
  std::vector<float> b_host = b0;
  const cudaStream_t stream = m.stream;
  device_memory &w_dev = m.w_dev, &g_dev = m.g_dev, &b_dev = m.b_dev, &gb_dev = m.gb_dev;

  coordinator_config config;
  config.record_trace = true;
  config.d2h_slot_bytes = 4096;
  config.h2d_slot_bytes = 4096;
  cuda_coordinator gpu(options, config);
  host_coordinator cpu(options, config);
  const auto initial = const_matrix_view::row_major(w0.data(), rows, cols, dtype::f32);
  gpu.register_parameter("w", matrix_view::row_major(w_dev.data(), rows, cols, dtype::bf16, memory_space::device),
                         initial, dtype::bf16);
  gpu.register_parameter("b", vector_view{b_dev.data(), bias_size, dtype::f32, memory_space::device}, b0);
  cpu.register_parameter("w", matrix_view::row_major(w_host.data(), rows, cols, dtype::bf16), initial, dtype::bf16);
  cpu.register_parameter("b", vector_view{b_host.data(), bias_size, dtype::f32}, b0);

  host_stream host;
  for (std::int64_t s = 0; s < steps; ++s) {
    auto g = gradient(s);
    auto gb = bias_gradient(s);
    if (s == nan_step) g[5 * cols + 17] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
    host.synchronize();
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // the staging copies below reuse g_dev
    if (s == edit_step) {
      edit(w_host, b_host);
      std::vector<bfloat16> w_edit(w_host.size());
      std::vector<float> b_edit(bias_size);
      ZENFLOW_CUDA_TRY(cudaMemcpy(w_edit.data(), w_dev.data(), w_edit.size() * 2, cudaMemcpyDeviceToHost));
      ZENFLOW_CUDA_TRY(cudaMemcpy(b_edit.data(), b_dev.data(), bias_size * 4, cudaMemcpyDeviceToHost));
      edit(w_edit, b_edit);
      ZENFLOW_CUDA_TRY(cudaMemcpy(w_dev.data(), w_edit.data(), w_edit.size() * 2, cudaMemcpyHostToDevice));
      ZENFLOW_CUDA_TRY(cudaMemcpy(b_dev.data(), b_edit.data(), bias_size * 4, cudaMemcpyHostToDevice));
      ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
      for (std::size_t i = 0; i < 2; ++i) {
        gpu.reload_parameter(i, stream);
        cpu.reload_parameter(i, &host);
      }
    }
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(g_dev.data(), g.data(), g.size() * 2, cudaMemcpyHostToDevice, stream));
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(gb_dev.data(), gb.data(), bias_size * 4, cudaMemcpyHostToDevice, stream));
    if (given(0, s))
      gpu.submit_gradient(0, const_matrix_view::row_major(g_dev.data(), rows, cols, dtype::bf16, memory_space::device),
                          stream);
    if (given(1, s))
      gpu.submit_gradient(1, const_vector_view{gb_dev.data(), bias_size, dtype::f32, memory_space::device}, stream);
    gpu.step(stream, missing);
    if (given(0, s)) cpu.submit_gradient(0, const_matrix_view::row_major(g.data(), rows, cols, dtype::bf16), &host);
    if (given(1, s)) cpu.submit_gradient(1, const_vector_view{gb.data(), bias_size, dtype::f32}, &host);
    cpu.step(&host, missing);
    host.synchronize();  // g and gb are about to go out of scope
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  }
  gpu.finish(stream);
  cpu.finish(&host);

  std::vector<bfloat16> w_back(w_host.size());
  ZENFLOW_CUDA_TRY(cudaMemcpy(w_back.data(), w_dev.data(), w_back.size() * 2, cudaMemcpyDeviceToHost));
  int far = 0;
  for (std::size_t i = 0; i < w_back.size(); ++i) {
    const int d = std::abs(static_cast<int>(w_back[i].bits) - static_cast<int>(w_host[i].bits));
    if (d > 1) ++far;
  }
  CHECK(far == 0);
  // The bias: the same fp32 math on both sides (device pow and FMA contraction: a few ulps).
  std::vector<float> b_back(bias_size);
  ZENFLOW_CUDA_TRY(cudaMemcpy(b_back.data(), b_dev.data(), bias_size * 4, cudaMemcpyDeviceToHost));
  for (index_t i = 0; i < bias_size; ++i) {
    CAPTURE(i);
    CHECK(b_back[i] == doctest::Approx(b_host[i]).epsilon(1e-5));
  }
  CHECK(b_back != b0);  // it was updated at all
  const auto gt = gpu.trace(), ct = cpu.trace();
  REQUIRE(gt.size() == ct.size());
  for (std::size_t i = 0; i < gt.size(); ++i) {
    CHECK(gt[i].first_step == ct[i].first_step);
    CHECK(gt[i].last_step == ct[i].last_step);
    CHECK(gt[i].written_back_at == ct[i].written_back_at);
    CHECK(gt[i].accumulated_steps == ct[i].accumulated_steps);  // the device's skip flags reached the host
    CHECK(gt[i].write_backs == 1);
  }
  CHECK(gpu.metrics().bytes_device_to_host == cpu.metrics().bytes_device_to_host);
  // The CPU Adam's state of the weight (every column: the CPU ones it updated, the GPU ones it
  // handed over or took back). The same schedule and the same clipped, offloaded gradients give
  // the same fp32 state, up to the device's last-bit differences carried through migration.
  const auto& gh = gpu.host_optimizer();
  const auto& ch = cpu.host_optimizer();
  CHECK(gh.step_count() == ch.step_count());
  CHECK(far_apart(gh.params(0), ch.params(0), 1e-4) == 0);
  CHECK(far_apart(gh.exp_avg(0), ch.exp_avg(0), 1e-3) == 0);
  CHECK(far_apart(gh.exp_avg_sq(0), ch.exp_avg_sq(0), 1e-3) == 0);
  for (std::size_t i = 0; i < 2; ++i) {  // per-parameter step counts (missing gradients)
    CHECK(gpu.cpu_step_count(i) == cpu.cpu_step_count(i));
    CHECK(gpu.gpu_step_count(i) == cpu.gpu_step_count(i));
  }
}

/// The CUDA coordinator alone, ZenFlow async. With `hold`, every step after the first selection
/// is submitted while a kernel holds the trainer's stream.
struct held_run {
  std::vector<bfloat16> w;
  std::vector<float> b;
  int held = 0;                 // steps submitted behind a held stream
  int returned_while_held = 0;  // ... whose step() returned while the stream was still held
  std::vector<update_record> trace;
};

held_run train_on_gpu(const zenflow_options& options, std::int64_t steps, bool hold) {
  gpu_model m;
  const cudaStream_t stream = m.stream;
  device_memory &w_dev = m.w_dev, &g_dev = m.g_dev, &b_dev = m.b_dev, &gb_dev = m.gb_dev;
  held_run out;
  {
    coordinator_config config;
    config.d2h_slot_bytes = 4096;
    config.h2d_slot_bytes = 4096;
    config.record_trace = true;
    cuda_coordinator gpu(options, config);
    gpu.register_parameter("w", matrix_view::row_major(w_dev.data(), rows, cols, dtype::bf16, memory_space::device),
                           const_matrix_view::row_major(m.w0.data(), rows, cols, dtype::f32), dtype::bf16);
    gpu.register_parameter("b", vector_view{b_dev.data(), bias_size, dtype::f32, memory_space::device}, m.b0);
    for (std::int64_t s = 0; s < steps; ++s) {
      auto g = gradient(s);
      const auto gb = bias_gradient(s);
      // A skipped step, held too: its skip flag reaches the offload worker through mapped memory,
      // read only once the step's stats_ready_ event completed.
      if (s == 4) g[5 * cols + 17] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
      // Uploaded before any hold (a pageable copy would wait for the held stream); the trainer's
      // stream and every earlier step are idle here.
      ZENFLOW_CUDA_TRY(cudaMemcpy(g_dev.data(), g.data(), g.size() * 2, cudaMemcpyHostToDevice));
      ZENFLOW_CUDA_TRY(cudaMemcpy(gb_dev.data(), gb.data(), bias_size * 4, cudaMemcpyHostToDevice));
      ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
      mapped_flags flags;
      const bool held = hold && s > 0;  // step 0 is the first selection, which synchronizes
      if (held) spin_until_flag<<<1, 1, 0, stream>>>(flags.device, flags.device + 1, 10'000'000'000ull);  // 10 s cap
      gpu.submit_gradient(0, const_matrix_view::row_major(g_dev.data(), rows, cols, dtype::bf16, memory_space::device),
                          stream);
      gpu.submit_gradient(1, const_vector_view{gb_dev.data(), bias_size, dtype::f32, memory_space::device}, stream);
      gpu.step(stream);
      if (held) {
        ++out.held;
        const cudaError_t query = cudaStreamQuery(stream);
        (void)cudaGetLastError();
        if (flags.outcome() == 0 && query == cudaErrorNotReady) ++out.returned_while_held;
        flags.set();
      }
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
      if (held) CHECK(flags.outcome() == 1);  // released by the host, not timed out
    }
    gpu.finish(stream);
    out.trace = gpu.trace();
  }
  out.w.resize(m.w0.size());
  out.b.resize(bias_size);
  ZENFLOW_CUDA_TRY(cudaMemcpy(out.w.data(), w_dev.data(), out.w.size() * 2, cudaMemcpyDeviceToHost));
  ZENFLOW_CUDA_TRY(cudaMemcpy(out.b.data(), b_dev.data(), bias_size * 4, cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace

TEST_CASE("cuda_coordinator: step() never waits for the trainer's stream; results do not depend on timing") {
  zenflow_options o;
  o.topk_ratio = 0.1f;
  o.update_interval = interval_option::fixed(3);
  o.select_strategy = selection_strategy::step;
  o.select_interval = interval_option::fixed(1000);  // one selection, at step 0
  const held_run free_run = train_on_gpu(o, 13, false);
  const held_run held = train_on_gpu(o, 13, true);
  CHECK(held.held == 12);
  // Mid-interval steps and interval ends alike: the GPU update, the gathers, the offload copies
  // (which wait on their gather's event) and the CPU update's launch are all enqueued or handed
  // to the workers; nothing waits for the held stream.
  CHECK(held.returned_while_held == held.held);
  // Every copy and update waited for its events, not for luck: the same bits as without holds.
  CHECK(held.w.size() == free_run.w.size());
  bool same_w = true;
  for (std::size_t i = 0; i < held.w.size(); ++i) same_w &= held.w[i].bits == free_run.w[i].bits;
  CHECK(same_w);
  CHECK(held.b == free_run.b);
  REQUIRE(held.trace.size() == free_run.trace.size());
  for (std::size_t i = 0; i < held.trace.size(); ++i) {
    CHECK(held.trace[i].last_step == free_run.trace[i].last_step);
    CHECK(held.trace[i].written_back_at == free_run.trace[i].written_back_at);
    CHECK(held.trace[i].accumulated_steps == free_run.trace[i].accumulated_steps);
  }
  // Step 4's NaN skipped it: its interval accumulated one step fewer than it spans.
  bool saw_skip = false;
  for (const auto& r : held.trace)
    if (r.first_step <= 4 && 4 <= r.last_step) saw_skip = r.accumulated_steps == r.last_step - r.first_step;
  CHECK(saw_skip);
}

TEST_CASE("cuda_coordinator follows the host coordinator: ZenFlow async") {
  zenflow_options o;
  o.topk_ratio = 0.1f;
  o.update_interval = interval_option::fixed(3);
  o.select_interval = interval_option::fixed(9);
  compare_modes(o, 25);
}

TEST_CASE("cuda_coordinator follows the host coordinator: ZeRO-Offload, dense and ZenFlow sync") {
  compare_modes(zenflow_options::zero_offload(), 8);
  compare_modes(zenflow_options::dense(), 8);
  zenflow_options sync;
  sync.overlap_step = false;
  sync.update_interval = interval_option::fixed(2);
  sync.select_interval = interval_option::fixed(6);
  sync.full_warm_up_rounds = 2;
  compare_modes(sync, 14);
}

TEST_CASE("cuda_coordinator follows the host coordinator: an edit reloaded between steps") {
  // ZenFlow async: before step 4 the CPU update of steps 0-2 is pending (the edit wins over it;
  // written back at the end of step 5), GPU columns selected at step 0.
  zenflow_options o;
  o.topk_ratio = 0.1f;
  o.update_interval = interval_option::fixed(3);
  o.select_interval = interval_option::fixed(9);
  compare_modes(o, 12, -1, {}, /*edit_step=*/4);
  compare_modes(zenflow_options::dense(), 6, -1, {}, /*edit_step=*/3);
  compare_modes(zenflow_options::zero_offload(), 6, -1, {}, /*edit_step=*/3);
  compare_modes(o, 3, -1, {}, /*edit_step=*/0);  // before the first step: every column on the CPU
}

TEST_CASE("cuda_coordinator follows the host coordinator: global-norm clipping and a NaN step") {
  zenflow_options o;
  o.topk_ratio = 0.1f;
  o.update_interval = interval_option::fixed(3);
  o.select_interval = interval_option::fixed(9);
  o.max_grad_norm = 1.0f;  // the test gradients' norm is ~0.75 to ~5700: most steps are clipped
  compare_modes(o, 13, /*nan_step=*/4);
  compare_modes(zenflow_options::zero_offload(), 6, /*nan_step=*/2);
}

TEST_CASE("cuda_coordinator follows the host coordinator with missing gradients") {
  // The weight misses steps 1 mod 3 and the whole interval 6..8, the bias steps 2 mod 4: skipped
  // parameters, per-parameter counts and means, selection steps without a gradient.
  const auto has = [](std::size_t i, std::int64_t s) {
    return i == 0 ? s % 3 != 1 && !(s >= 6 && s <= 8) : s % 4 != 2;
  };
  zenflow_options async;
  async.topk_ratio = 0.1f;
  async.update_interval = interval_option::fixed(3);
  async.select_interval = interval_option::fixed(4);
  compare_modes(async, 16, -1, has);
  auto sync = async;
  sync.overlap_step = false;
  sync.max_grad_norm = 1.0f;
  compare_modes(sync, 13, 5, has);
  compare_modes(zenflow_options::dense(), 10, -1, has);
  compare_modes(zenflow_options::zero_offload(), 10, -1, has);
}

TEST_CASE("cuda_coordinator: the CPU columns get each step's own clip factor") {
  // ZeRO-Offload: every weight column is a CPU column, updated synchronously every step, so the
  // CPU Adam's moments are sums of the offloaded, clipped bf16 gradients of each step.
  zenflow_options o = zenflow_options::zero_offload();
  o.max_grad_norm = 1.0f;
  const std::int64_t steps = 5;  // one cycle of step_magnitude: clipped by 1/190 .. 1/5700, and unclipped
  gpu_model m;
  coordinator_config config;
  config.d2h_slot_bytes = 4096;
  config.h2d_slot_bytes = 4096;
  cuda_coordinator gpu(o, config);
  register_model(gpu, m);
  drive(gpu, m, 0, steps);
  gpu.finish(m.stream);
  REQUIRE(gpu.gpu_columns(0).empty());
  const auto& h = gpu.host_optimizer();
  REQUIRE(h.step_count() == steps);

  // The clip factor of each step from the global norm computed here (fp64), the offloaded value
  // bf16(g x factor), and the moments' recurrences in fp64. A flipped bf16 rounding (the device's
  // norm may differ in its last bits) moves one term by 2^-8: 1% of the terms' magnitude allows
  // it; a factor from another step (30x to 7500x apart), a missing one, or a norm without the bias
  // (off by ~45%) does not fit.
  const double beta1 = o.optimizer.beta1, beta2 = o.optimizer.beta2;
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  std::vector<double> m_want(n, 0.0), m_mass(n, 0.0), v_want(n, 0.0);
  for (std::int64_t s = 0; s < steps; ++s) {
    const auto g = gradient(s);
    const auto gb = bias_gradient(s);
    double sum_of_squares = 0.0;
    for (const auto x : g) sum_of_squares += static_cast<double>(to_float(x)) * to_float(x);
    for (const float x : gb) sum_of_squares += static_cast<double>(x) * x;
    const double norm = std::sqrt(sum_of_squares);
    const float clip =
        norm > o.max_grad_norm ? static_cast<float>(static_cast<double>(o.max_grad_norm) / (norm + 1e-6)) : 1.0f;
    CAPTURE(s);
    CAPTURE(clip);
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = 0; c < cols; ++c) {
        const std::size_t i = static_cast<std::size_t>(c * rows + r);  // the CPU tensor is column-contiguous
        const double x = to_float(to_bfloat16(to_float(g[static_cast<std::size_t>(r * cols + c)]) * clip));
        m_want[i] = beta1 * m_want[i] + (1.0 - beta1) * x;
        m_mass[i] = beta1 * m_mass[i] + (1.0 - beta1) * std::fabs(x);
        v_want[i] = beta2 * v_want[i] + (1.0 - beta2) * x * x;
      }
  }
  int m_far = 0, v_far = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!(std::fabs(h.exp_avg(0)[i] - m_want[i]) <= 1e-2 * m_mass[i] + 1e-30)) ++m_far;
    if (!(std::fabs(h.exp_avg_sq(0)[i] - v_want[i]) <= 2e-2 * v_want[i] + 1e-30)) ++v_far;
  }
  CHECK(m_far == 0);
  CHECK(v_far == 0);
}

TEST_CASE("cuda_coordinator: a checkpoint resumes bit-identically; a truncated one changes nothing") {
  zenflow_options o;
  o.topk_ratio = 0.1f;
  o.update_interval = interval_option::fixed(3);
  o.select_interval = interval_option::fixed(9);
  o.max_grad_norm = 1.0f;
  coordinator_config config;
  config.d2h_slot_bytes = 4096;
  config.h2d_slot_bytes = 4096;
  const auto path = (std::filesystem::temp_directory_path() / "zenflow_gpu_test_checkpoint.bin").string();

  run_state reference;
  {
    gpu_model m;
    cuda_coordinator gpu(o, config);
    register_model(gpu, m);
    drive(gpu, m, 0, 20);
    gpu.finish(m.stream);
    reference = snapshot(gpu, m);
  }
  run_state resumed;
  {
    gpu_model m1;
    cuda_coordinator first(o, config);
    register_model(first, m1);
    drive(first, m1, 0, 10);  // mid-interval, after a reselection, with a CPU update pending
    first.save_checkpoint(path, m1.stream);
    const run_state saved = snapshot(first, m1);
    gpu_model m2;
    cuda_coordinator second(o, config);
    register_model(second, m2);
    second.load_checkpoint(path, m2.stream);
    CHECK(second.step_count() == 10);
    const run_state loaded = snapshot(second, m2);
    CHECK(loaded.w == saved.w);  // the checkpoint restores the device parameters too
    CHECK(loaded.b == saved.b);
    CHECK(loaded.cpu_params == saved.cpu_params);
    CHECK(loaded.cpu_exp_avg == saved.cpu_exp_avg);
    CHECK(loaded.cpu_exp_avg_sq == saved.cpu_exp_avg_sq);
    drive(second, m2, 10, 20);
    second.finish(m2.stream);
    resumed = snapshot(second, m2);
  }
  CHECK(resumed.w == reference.w);
  CHECK(resumed.b == reference.b);
  CHECK(resumed.cpu_params == reference.cpu_params);
  CHECK(resumed.cpu_exp_avg == reference.cpu_exp_avg);
  CHECK(resumed.cpu_exp_avg_sq == reference.cpu_exp_avg_sq);

  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  REQUIRE(bytes.size() > 16);
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  gpu_model m;
  cuda_coordinator fresh(o, config);
  register_model(fresh, m);
  const run_state before = snapshot(fresh, m);
  CHECK_THROWS_AS(fresh.load_checkpoint(path, m.stream), zenflow::error);
  CHECK(fresh.step_count() == 0);
  CHECK(snapshot(fresh, m) == before);
  std::filesystem::remove(path);
}

TEST_CASE("pinning: the coordinator's per-step staging is page-locked (cudaHostGetFlags)") {
  // What the offload and the write-back copy through (every slot of the coordinator's queues,
  // both directions), the step's flags and the data-parallel agreement's host buffer: a copy from
  // or into memory that is not page-locked is staged synchronously by the driver (pinning lost).
  // The host twin counts such copies through the backend interface (tests/unit/test_known_defects.cpp).
  // Mutation to see this fail on a GPU (compiled, not run): in detail/cuda/memory.cuh,
  // cuda_host_buffer allocates with `data_ = ::operator new(bytes)` instead of cudaHostAlloc (and
  // frees with ::operator delete): every slot and the flags are then pageable.
  for (const auto direction :
       {zenflow::transfer_direction::device_to_host, zenflow::transfer_direction::host_to_device}) {
    zenflow::cuda_backend::queue_type queue(direction, std::size_t{1} << 20, 4);
    std::vector<zenflow::transfer_slot> slots;
    for (int i = 0; i < 4; ++i) {
      slots.push_back(queue.acquire());
      unsigned flags = 0;
      CHECK(cudaHostGetFlags(&flags, slots.back().data) == cudaSuccess);
    }
    for (const auto& slot : slots) queue.release(slot);
  }
  zenflow::cuda_backend::host_buffer mapped(256);
  unsigned flags = 0;
  REQUIRE(cudaHostGetFlags(&flags, mapped.data()) == cudaSuccess);
  CHECK((flags & cudaHostAllocMapped) != 0);
}
