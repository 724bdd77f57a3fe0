// The CUDA coordinator against the host coordinator (the oracle that CI runs): the same model,
// the same gradients, the same options. The schedule (intervals, write-back steps) must be
// identical; parameters must agree to within one rounding of their dtype (the device computes
// its bias corrections with its own pow, which may differ from glibc's in the last bit).
#include <zenflow/coordinator.cuh>

#include <doctest/doctest.h>

#include "hold_stream.cuh"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace zenflow;

namespace {

struct device_memory {
  void* ptr = nullptr;
  explicit device_memory(std::size_t bytes) { ZENFLOW_CUDA_TRY(cudaMalloc(&ptr, bytes)); }
  ~device_memory() { ZENFLOW_CUDA_ASSERT(cudaFree(ptr)); }
};

constexpr index_t rows = 48, cols = 96, bias_size = 48;

std::vector<bfloat16> gradient(std::int64_t step) {
  std::mt19937 rng(static_cast<std::uint32_t>(77 + step));
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<bfloat16> g(rows * cols);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) g[r * cols + c] = to_bfloat16((c % 7 == 0 ? 5.0f : 0.3f) * n01(rng));
  return g;
}
std::vector<float> bias_gradient(std::int64_t step) {
  std::mt19937 rng(static_cast<std::uint32_t>(991 + step));
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> g(bias_size);
  for (auto& x : g) x = n01(rng);
  return g;
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
  cudaStream_t stream{};
  gpu_model() {
    const auto w = to_bf16(w0);
    ZENFLOW_CUDA_TRY(cudaMemcpy(w_dev.ptr, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    ZENFLOW_CUDA_TRY(cudaMemcpy(b_dev.ptr, b0.data(), bias_size * 4, cudaMemcpyHostToDevice));
    // A pageable upload may return before its DMA landed, on the legacy stream, which the
    // non-blocking stream below does not wait for.
    ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
    ZENFLOW_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  gpu_model(const gpu_model&) = delete;
  gpu_model& operator=(const gpu_model&) = delete;
  ~gpu_model() { ZENFLOW_CUDA_ASSERT(cudaStreamDestroy(stream)); }
};

/// Runs the same gradients through the CUDA and the host coordinator and compares the weights,
/// the bias, the update trace and the bytes moved. At `nan_step` (if >= 0) one gradient element
/// is NaN: both must skip that step.
void compare_modes(const zenflow_options& options, std::int64_t steps, std::int64_t nan_step = -1) {
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
  gpu.register_parameter("w", matrix_view::row_major(w_dev.ptr, rows, cols, dtype::bf16, memory_space::device), initial,
                         dtype::bf16);
  gpu.register_parameter("b", vector_view{b_dev.ptr, bias_size, dtype::f32, memory_space::device}, b0);
  cpu.register_parameter("w", matrix_view::row_major(w_host.data(), rows, cols, dtype::bf16), initial, dtype::bf16);
  cpu.register_parameter("b", vector_view{b_host.data(), bias_size, dtype::f32}, b0);

  host_stream host;
  for (std::int64_t s = 0; s < steps; ++s) {
    auto g = gradient(s);
    auto gb = bias_gradient(s);
    if (s == nan_step) g[5 * cols + 17] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
    host.synchronize();
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // the staging copies below reuse g_dev
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(g_dev.ptr, g.data(), g.size() * 2, cudaMemcpyHostToDevice, stream));
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(gb_dev.ptr, gb.data(), bias_size * 4, cudaMemcpyHostToDevice, stream));
    gpu.submit_gradient(0, const_matrix_view::row_major(g_dev.ptr, rows, cols, dtype::bf16, memory_space::device),
                        stream);
    gpu.submit_gradient(1, const_vector_view{gb_dev.ptr, bias_size, dtype::f32, memory_space::device}, stream);
    gpu.step(stream);
    cpu.submit_gradient(0, const_matrix_view::row_major(g.data(), rows, cols, dtype::bf16), &host);
    cpu.submit_gradient(1, const_vector_view{gb.data(), bias_size, dtype::f32}, &host);
    cpu.step(&host);
    host.synchronize();  // g and gb are about to go out of scope
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  }
  gpu.finish(stream);
  cpu.finish(&host);

  std::vector<bfloat16> w_back(w_host.size());
  ZENFLOW_CUDA_TRY(cudaMemcpy(w_back.data(), w_dev.ptr, w_back.size() * 2, cudaMemcpyDeviceToHost));
  int far = 0;
  for (std::size_t i = 0; i < w_back.size(); ++i) {
    const int d = std::abs(static_cast<int>(w_back[i].bits) - static_cast<int>(w_host[i].bits));
    if (d > 1) ++far;
  }
  CHECK(far == 0);
  // The bias: the same fp32 math on both sides (device pow and FMA contraction: a few ulps).
  std::vector<float> b_back(bias_size);
  ZENFLOW_CUDA_TRY(cudaMemcpy(b_back.data(), b_dev.ptr, bias_size * 4, cudaMemcpyDeviceToHost));
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
    gpu.register_parameter("w", matrix_view::row_major(w_dev.ptr, rows, cols, dtype::bf16, memory_space::device),
                           const_matrix_view::row_major(m.w0.data(), rows, cols, dtype::f32), dtype::bf16);
    gpu.register_parameter("b", vector_view{b_dev.ptr, bias_size, dtype::f32, memory_space::device}, m.b0);
    for (std::int64_t s = 0; s < steps; ++s) {
      auto g = gradient(s);
      const auto gb = bias_gradient(s);
      // A skipped step, held too: its skip flag reaches the offload worker through mapped memory,
      // read only once the step's stats_ready_ event completed.
      if (s == 4) g[5 * cols + 17] = to_bfloat16(std::numeric_limits<float>::quiet_NaN());
      // Uploaded before any hold (a pageable copy would wait for the held stream); the trainer's
      // stream and every earlier step are idle here.
      ZENFLOW_CUDA_TRY(cudaMemcpy(g_dev.ptr, g.data(), g.size() * 2, cudaMemcpyHostToDevice));
      ZENFLOW_CUDA_TRY(cudaMemcpy(gb_dev.ptr, gb.data(), bias_size * 4, cudaMemcpyHostToDevice));
      ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
      mapped_flags flags;
      const bool held = hold && s > 0;  // step 0 is the first selection, which synchronizes
      if (held) spin_until_flag<<<1, 1, 0, stream>>>(flags.device, flags.device + 1, 10'000'000'000ull);  // 10 s cap
      gpu.submit_gradient(0, const_matrix_view::row_major(g_dev.ptr, rows, cols, dtype::bf16, memory_space::device),
                          stream);
      gpu.submit_gradient(1, const_vector_view{gb_dev.ptr, bias_size, dtype::f32, memory_space::device}, stream);
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
  ZENFLOW_CUDA_TRY(cudaMemcpy(out.w.data(), w_dev.ptr, out.w.size() * 2, cudaMemcpyDeviceToHost));
  ZENFLOW_CUDA_TRY(cudaMemcpy(out.b.data(), b_dev.ptr, bias_size * 4, cudaMemcpyDeviceToHost));
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

TEST_CASE("cuda_coordinator follows the host coordinator: global-norm clipping and a NaN step") {
  zenflow_options o;
  o.topk_ratio = 0.1f;
  o.update_interval = interval_option::fixed(3);
  o.select_interval = interval_option::fixed(9);
  o.max_grad_norm = 1.0f;  // the test gradients' norm is ~100: every step is clipped
  compare_modes(o, 13, /*nan_step=*/4);
  compare_modes(zenflow_options::zero_offload(), 6, /*nan_step=*/2);
}
