// Quickstart: the shared Adam math fitting y = 3x - 2 by least squares. The README shows this file.
#include <zenflow/zenflow.hpp>

#include <cstdio>

int main() {
  zenflow::adam_options opts;  // torch.optim.AdamW defaults
  opts.lr = 0.05f;
  float w = 0.0f, b = 0.0f, mw = 0.0f, vw = 0.0f, mb = 0.0f, vb = 0.0f;
  for (std::int64_t step = 1; step <= 500; ++step) {
    float gw = 0.0f, gb = 0.0f;  // gradient of the mean squared error over x in [-1, 1]
    for (int i = 0; i <= 20; ++i) {
      const float x = -1.0f + 0.1f * static_cast<float>(i), err = w * x + b - (3.0f * x - 2.0f);
      gw += 2.0f * err * x / 21.0f;
      gb += 2.0f * err / 21.0f;
    }
    const auto c = zenflow::make_adam_step_constants(opts, step);  // bias corrections in double
    zenflow::adam_update(w, gw, mw, vw, c);
    zenflow::adam_update(b, gb, mb, vb, c);
  }
  std::printf("fitted w = %.4f (3), b = %.4f (-2)\n", w, b);
  return (w > 2.95f && w < 3.05f && b > -2.05f && b < -1.95f) ? 0 : 1;
}
