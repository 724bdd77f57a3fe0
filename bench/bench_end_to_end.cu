// End-to-end on a GPU: a stack of transformer-sized linear layers (hidden 4096, bf16, real
// cuBLAS GEMMs for forward and backward) trained with each mode through cuda_coordinator.
// Reports step time, stall fraction (time the trainer thread waited on the CPU side over step
// time), PCIe bytes per step, and each mode's speed as a fraction of dense (no offload, the
// roofline measured in the same binary). The bars (H100): ZenFlow async stall <= 15% of
// ZeRO-Offload's, ZenFlow async step time within 1.25x of dense.
//
//   bench_end_to_end [--benchmark_filter=...]   env: ZENFLOW_E2E_LAYERS (8), ZENFLOW_E2E_TOKENS (4096)
#include <benchmark/benchmark.h>

#include <cublas_v2.h>
#include <zenflow/coordinator.cuh>
#include "../tests/support/cuda_test_utils.cuh"
#include "end_to_end_modes.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace zenflow;

#define ZENFLOW_CUBLAS_TRY(call)                                                                                 \
  do {                                                                                                           \
    const cublasStatus_t zf_status_ = (call);                                                                    \
    if (zf_status_ != CUBLAS_STATUS_SUCCESS)                                                                     \
      throw zenflow::error(#call, std::string("cuBLAS status ") + std::to_string(static_cast<int>(zf_status_))); \
  } while (0)

constexpr index_t hidden = 4096;
index_t env_or(const char* name, index_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoll(v) : fallback;
}

using device_array = zenflow_test::device_buffer;

__global__ void fill_kernel(__nv_bfloat16* p, std::size_t n, float scale, unsigned seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16(scale * (static_cast<float>(x & 0xffff) / 32768.0f - 1.0f));
  }
}

struct model {
  index_t layers, tokens;
  std::vector<std::unique_ptr<device_array>> w, g, act;
  std::unique_ptr<device_array> dy, dx;
  std::vector<std::vector<float>> w0;
  cublasHandle_t handle{};
  model(index_t layers_, index_t tokens_, cudaStream_t stream) : layers(layers_), tokens(tokens_) {
    const std::size_t wbytes = hidden * hidden * 2, abytes = tokens * hidden * 2;
    std::mt19937 rng(3);
    std::normal_distribution<float> n01(0.0f, 0.02f);
    for (index_t l = 0; l < layers; ++l) {
      w.push_back(std::make_unique<device_array>(wbytes));
      g.push_back(std::make_unique<device_array>(wbytes));
      w0.emplace_back(hidden * hidden);
      for (auto& x : w0.back()) x = n01(rng);
      std::vector<bfloat16> wb(w0.back().size());
      for (std::size_t i = 0; i < wb.size(); ++i) wb[i] = to_bfloat16(w0.back()[i]);
      ZENFLOW_CUDA_TRY(cudaMemcpy(w.back()->data(), wb.data(), wbytes, cudaMemcpyHostToDevice));
    }
    for (index_t l = 0; l <= layers; ++l) act.push_back(std::make_unique<device_array>(abytes));
    dy = std::make_unique<device_array>(abytes);
    dx = std::make_unique<device_array>(abytes);
    fill_kernel<<<1024, 256, 0, stream>>>(act[0]->data<__nv_bfloat16>(), tokens * hidden, 1.0f, 11u);
    ZENFLOW_CUBLAS_TRY(cublasCreate(&handle));
    ZENFLOW_CUBLAS_TRY(cublasSetStream(handle, stream));
    ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());  // the weight uploads ran on the legacy stream
  }
  ~model() { cublasDestroy(handle); }
  // C(m x n, ldc) = op(A) op(B), bf16 in and out, fp32 accumulation (column-major cuBLAS view of
  // our row-major tensors; see the comments at the call sites).
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a, int lda, const void* b,
            int ldb, void* c, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    ZENFLOW_CUBLAS_TRY(cublasGemmEx(handle, ta, tb, m, n, k, &one, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &zero, c,
                                    CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  const int H = static_cast<int>(hidden);
  void forward() {  // Y[T, out] = X[T, in] W^T: column-major Y^T = op_T(W^T) X^T
    for (index_t l = 0; l < layers; ++l)
      gemm(CUBLAS_OP_T, CUBLAS_OP_N, H, static_cast<int>(tokens), H, w[l]->data(), H, act[l]->data(), H,
           act[l + 1]->data(), H);
  }
  template <class Submit>
  void backward(cudaStream_t stream, Submit&& submit) {
    fill_kernel<<<1024, 256, 0, stream>>>(dy->data<__nv_bfloat16>(), tokens * hidden, 1e-3f, 7u);
    for (index_t l = layers; l-- > 0;) {
      // dW[out, in] = dY^T X: column-major dW^T = X^T op_T(dY^T)
      gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, H, static_cast<int>(tokens), act[l]->data(), H, dy->data(), H, g[l]->data(), H);
      submit(l);
      // dX[T, in] = dY W: column-major dX^T = W^T dY^T
      gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, static_cast<int>(tokens), H, w[l]->data(), H, dy->data(), H, dx->data(), H);
      std::swap(dy, dx);
    }
  }
};

void BM_end_to_end(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const zenflow_test::cuda_stream owned_stream;
  const cudaStream_t stream = owned_stream.get();
  {
    model m(env_or("ZENFLOW_E2E_LAYERS", 8), env_or("ZENFLOW_E2E_TOKENS", 4096), stream);
    coordinator_config config;
    config.d2h_slot_bytes = std::size_t{16} << 20;
    config.h2d_slot_bytes = std::size_t{16} << 20;
    cuda_coordinator c(zenflow_bench::mode_options(mode, 1e-4f), config);
    for (index_t l = 0; l < m.layers; ++l)
      c.register_parameter("w" + std::to_string(l),
                           matrix_view::row_major(m.w[l]->data(), hidden, hidden, dtype::bf16, memory_space::device),
                           const_matrix_view::row_major(m.w0[l].data(), hidden, hidden, dtype::f32), dtype::bf16);
    auto one_step = [&] {
      m.forward();
      m.backward(stream, [&](index_t l) {
        c.submit_gradient(
            static_cast<std::size_t>(l),
            const_matrix_view::row_major(m.g[l]->data(), hidden, hidden, dtype::bf16, memory_space::device), stream);
      });
      return c.step(stream);
    };
    // First selection, allocations, cuBLAS heuristics; a whole number of update intervals (4), so
    // the timed window (also a multiple of 4 steps) holds the same share of interval boundaries.
    for (int i = 0; i < 8; ++i) one_step();
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    double total = 0.0, stall = 0.0, d2h = 0.0, h2d = 0.0;
    std::int64_t steps = 0;
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto& metrics = one_step();
      stall += metrics.stall_seconds;
      d2h += static_cast<double>(metrics.bytes_device_to_host);
      h2d += static_cast<double>(metrics.bytes_host_to_device);
      ++steps;
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // the step is done when the GPU is done
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      total += seconds;
      state.SetIterationTime(seconds);
    }
    c.finish(stream);
    const double per_step = total / static_cast<double>(steps);
    zenflow_bench::step_seconds()[mode] = per_step;
    zenflow_bench::stall_seconds()[mode] = stall / static_cast<double>(steps);
    state.counters["step_ms"] = per_step * 1e3;
    state.counters["stall_fraction"] = stall / total;
    state.counters["stall_ms_per_step"] = stall / static_cast<double>(steps) * 1e3;
    state.counters["d2h_MB_per_step"] = d2h / static_cast<double>(steps) / 1e6;
    state.counters["h2d_MB_per_step"] = h2d / static_cast<double>(steps) / 1e6;
    if (zenflow_bench::step_seconds().count(0))
      state.counters["fraction_of_dense"] = zenflow_bench::step_seconds()[0] / per_step;
    if (mode == zenflow_bench::zenflow_async && zenflow_bench::step_seconds().count(zenflow_bench::zero_offload)) {
      state.counters["zero_offload_over_zenflow_async"] =
          zenflow_bench::step_seconds()[zenflow_bench::zero_offload] / per_step;
      // The bar: ZenFlow async's stall <= 15% of ZeRO-Offload's.
      state.counters["stall_over_zero_offload"] =
          zenflow_bench::stall_seconds()[zenflow_bench::zenflow_async] /
          std::max(1e-12, zenflow_bench::stall_seconds()[zenflow_bench::zero_offload]);
    }
    state.SetLabel(zenflow_bench::mode_name(mode));
  }
}

}  // namespace

// Dense first: the roofline the other modes are reported against.
BENCHMARK(BM_end_to_end)->DenseRange(0, 3)->Iterations(32)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
