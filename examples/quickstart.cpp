// Quickstart: ZenFlow on the host backend. One weight W[8, 16], its gradient handed over each step.
#include <zenflow/coordinator.hpp>

#include <cmath>
#include <iostream>
#include <vector>

int main() {
  using namespace zenflow;
  zenflow_options opts;                              // DeepSpeed's names and defaults; the async CPU update is on
  opts.topk_ratio = 0.25f;                           // 4 of 16 columns updated on the "GPU" every step
  opts.update_interval = interval_option::fixed(2);  // the other 12 on the CPU every 2 steps
  opts.optimizer.lr = 0.05f;
  std::vector<float> w(8 * 16, 0.0f), g(w.size()), w0(w.size(), 0.0f);  // the trainer's tensors
  host_stream stream;  // stands in for the trainer's CUDA stream (cuda_coordinator: a cudaStream_t)
  host_coordinator zf(opts);
  zf.register_parameter("W", matrix_view::row_major(w.data(), 8, 16, dtype::f32),
                        const_matrix_view::row_major(w0.data(), 8, 16, dtype::f32), dtype::f32);
  for (int step = 0; step < 400; ++step) {
    stream.synchronize();  // the "backward" below reads the weights the last step wrote
    for (std::size_t i = 0; i < w.size(); ++i) g[i] = w[i] - static_cast<float>(i % 16) / 16.0f;
    zf.submit_gradient(0, const_matrix_view::row_major(g.data(), 8, 16, dtype::f32), &stream);
    zf.step(&stream);  // GPU columns now; CPU columns asynchronously, written back within one interval
  }
  zf.finish(&stream);  // completes and writes back the last CPU update
  std::cout << "W[3, 12] = " << w[3 * 16 + 12] << " (target 0.75); last step: " << zf.metrics() << '\n';
  return std::abs(w[3 * 16 + 12] - 0.75f) < 0.02f ? 0 : 1;
}
