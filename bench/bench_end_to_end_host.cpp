// End-to-end: a stack of linear layers trained with each mode on the coordinator's HOST backend
// (a host_stream stands in for the GPU stream and runs the layers' GEMMs). Reports step time,
// stall fraction and offload bytes per step, and each mode's speed as a fraction of dense (the
// no-offload roofline, measured in the same binary). On a machine without a GPU this is the
// host-only version of the GPU end-to-end benchmark; the "GPU" and the CPU optimizer share the
// same cores, so it shows the schedule's behaviour, not GPU speed-ups.
#include <benchmark/benchmark.h>

#include <zenflow/coordinator.hpp>
#include "end_to_end_modes.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using zenflow::bfloat16;
using zenflow::index_t;

constexpr index_t hidden = 384;
constexpr index_t layers = 4;
constexpr index_t batch = 32;

struct stack {
  std::vector<std::vector<bfloat16>> w, g;
  std::vector<std::vector<float>> w0, b, gb;
  std::vector<float> x;
  stack() {
    std::mt19937 rng(1);
    std::normal_distribution<float> n01(0.0f, 0.05f);
    for (index_t l = 0; l < layers; ++l) {
      w0.emplace_back(hidden * hidden);
      for (auto& v : w0.back()) v = n01(rng);
      w.emplace_back(hidden * hidden);
      for (std::size_t i = 0; i < w.back().size(); ++i) w.back()[i] = zenflow::to_bfloat16(w0.back()[i]);
      g.emplace_back(hidden * hidden);
      b.emplace_back(hidden, 0.0f);
      gb.emplace_back(hidden, 0.0f);
    }
    x.resize(batch * hidden);
    for (auto& v : x) v = n01(rng);
  }
  // "Forward and backward" of layer l as the GPU would run it: y = x W^T, then the weight gradient
  // G = dy^T x with dy = y - x (a regression towards the identity), stored in bf16.
  void layer_step(index_t l) {
    std::vector<float> wf(hidden * hidden), y(batch * hidden, 0.0f);
    for (std::size_t i = 0; i < wf.size(); ++i) wf[i] = zenflow::to_float(w[l][i]);
    for (index_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < hidden; ++o) {
        float acc = 0.0f;
        for (index_t i = 0; i < hidden; ++i) acc += wf[o * hidden + i] * x[s * hidden + i];
        y[s * hidden + o] = acc - x[s * hidden + o];
      }
    std::vector<float> grad(hidden * hidden, 0.0f);
    for (index_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < hidden; ++o) {
        const float d = y[s * hidden + o] / batch;
        for (index_t i = 0; i < hidden; ++i) grad[o * hidden + i] += d * x[s * hidden + i];
      }
    for (std::size_t i = 0; i < grad.size(); ++i) g[l][i] = zenflow::to_bfloat16(grad[i]);
    for (index_t o = 0; o < hidden; ++o) gb[l][o] = 0.0f;
  }
};

void BM_end_to_end(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  stack model;
  zenflow::host_stream stream;
  zenflow::coordinator_config config;
  config.cpu_threads = 1;  // the other core plays the GPU
  config.d2h_slot_bytes = 1 << 20;
  config.h2d_slot_bytes = 1 << 20;
  zenflow::host_coordinator c(zenflow_bench::mode_options(mode, 1e-3f), config);
  for (index_t l = 0; l < layers; ++l) {
    c.register_parameter("w" + std::to_string(l),
                         zenflow::matrix_view::row_major(model.w[l].data(), hidden, hidden, zenflow::dtype::bf16),
                         zenflow::const_matrix_view::row_major(model.w0[l].data(), hidden, hidden, zenflow::dtype::f32),
                         zenflow::dtype::bf16);
    c.register_parameter("b" + std::to_string(l), zenflow::vector_view{model.b[l].data(), hidden, zenflow::dtype::f32},
                         model.b[l]);
  }
  double stall = 0.0, total = 0.0;
  std::uint64_t d2h = 0, h2d = 0, steps = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (index_t l = layers; l-- > 0;) {
      stream.enqueue([&model, l] { model.layer_step(l); });  // backward of layer l on the "GPU"
      c.submit_gradient(2 * l,
                        zenflow::const_matrix_view::row_major(model.g[l].data(), hidden, hidden, zenflow::dtype::bf16),
                        &stream);
      c.submit_gradient(2 * l + 1, zenflow::const_vector_view{model.gb[l].data(), hidden, zenflow::dtype::f32},
                        &stream);
    }
    const auto& m = c.step(&stream);
    stream.synchronize();  // the step is done when the "GPU" is done
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stall += m.stall_seconds;
    d2h += m.bytes_device_to_host;
    h2d += m.bytes_host_to_device;
    ++steps;
  }
  c.finish(&stream);
  const double per_step = total / static_cast<double>(steps);
  zenflow_bench::step_seconds()[mode] = per_step;
  zenflow_bench::stall_seconds()[mode] = stall / static_cast<double>(steps);
  state.counters["step_ms"] = per_step * 1e3;
  state.counters["stall_fraction"] = stall / total;
  state.counters["d2h_MB_per_step"] = static_cast<double>(d2h) / static_cast<double>(steps) / 1e6;
  state.counters["h2d_MB_per_step"] = static_cast<double>(h2d) / static_cast<double>(steps) / 1e6;
  if (zenflow_bench::step_seconds().count(0))
    state.counters["fraction_of_dense"] = zenflow_bench::step_seconds()[0] / per_step;
  if (mode == zenflow_bench::zenflow_async && zenflow_bench::stall_seconds().count(zenflow_bench::zero_offload))
    state.counters["stall_over_zero_offload"] =  // the bar: <= 0.15
        zenflow_bench::stall_seconds()[zenflow_bench::zenflow_async] /
        std::max(1e-12, zenflow_bench::stall_seconds()[zenflow_bench::zero_offload]);
  state.SetLabel(zenflow_bench::mode_name(mode));
}

}  // namespace

// Dense first: it is the roofline the other modes are reported against.
BENCHMARK(BM_end_to_end)->DenseRange(0, 3)->Iterations(40)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();
