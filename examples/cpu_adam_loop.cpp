// A plain training loop on the CPU Adam alone: multi-output linear regression y = W x + b on
// generated data. Each step accumulates two micro-batch gradients (bf16, as a GPU would send
// them) into an fp32 accumulator, then runs one AdamW step on the mean (grad_scale = 1/2) and
// writes the updated weights as bf16 (the copy a GPU would receive). Exits non-zero unless the
// model recovers the generating weights.
#include <zenflow/cpu_adam.hpp>
#include <zenflow/format.hpp>

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  constexpr int in = 32, out = 8, batch = 64, micro_batches = 2, steps = 400;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  // Ground truth. W is [out x in] stored column-contiguous: column c (input c) at c * out.
  std::vector<float> w_true(in * out), b_true(out);
  for (auto& x : w_true) x = normal(rng);
  for (auto& x : b_true) x = normal(rng);

  zenflow::adam_options options;
  options.lr = 0.02f;
  options.weight_decay = 1e-4f;
  zenflow::cpu_adam adam(options);
  const std::size_t w = adam.add_tensor(std::vector<float>(in * out, 0.0f), out, in);
  const std::size_t b = adam.add_tensor(std::vector<float>(out, 0.0f), out, 1);

  std::vector<float> acc_w(in * out), acc_b(out), x(in), err(out);
  std::vector<zenflow::bfloat16> grad_w(in * out), grad_b(out), w_bf16(in * out);
  double loss = 0;
  for (int step = 0; step < steps; ++step) {
    std::fill(acc_w.begin(), acc_w.end(), 0.0f);
    std::fill(acc_b.begin(), acc_b.end(), 0.0f);
    loss = 0;
    for (int mb = 0; mb < micro_batches; ++mb) {
      std::vector<float> gw(in * out, 0.0f), gb(out, 0.0f);
      const auto wp = adam.params(w), bp = adam.params(b);
      for (int s = 0; s < batch; ++s) {
        for (auto& v : x) v = normal(rng);
        for (int o = 0; o < out; ++o) {
          float pred = bp[o], target = b_true[o] + 0.01f * normal(rng);
          for (int c = 0; c < in; ++c) {
            pred += wp[c * out + o] * x[c];
            target += w_true[c * out + o] * x[c];
          }
          err[o] = pred - target;
          loss += 0.5 * err[o] * err[o] / (batch * micro_batches);
        }
        for (int c = 0; c < in; ++c)
          for (int o = 0; o < out; ++o) gw[c * out + o] += err[o] * x[c] / batch;
        for (int o = 0; o < out; ++o) gb[o] += err[o] / batch;
      }
      for (int i = 0; i < in * out; ++i) grad_w[i] = zenflow::to_bfloat16(gw[i]);
      for (int o = 0; o < out; ++o) grad_b[o] = zenflow::to_bfloat16(gb[o]);
      // Fused accumulate with the non-finite check (a bad micro-batch would return false).
      if (!adam.accumulate(acc_w.data(), grad_w.data(), zenflow::dtype::bf16, in * out) ||
          !adam.accumulate(acc_b.data(), grad_b.data(), zenflow::dtype::bf16, out)) {
        fmt::print(stderr, "non-finite gradient at step {}\n", step);
        return 1;
      }
    }
    zenflow::cpu_adam_task tasks[2] = {{w, acc_w.data(), zenflow::dtype::f32, {}},
                                       {b, acc_b.data(), zenflow::dtype::f32, {}}};
    tasks[0].copy_out = w_bf16.data();  // the bf16 weights a GPU would receive
    tasks[0].copy_out_type = zenflow::dtype::bf16;
    if (!adam.step(tasks, 1.0f / micro_batches, /*check_finite=*/false).applied) return 1;
    if (step % 100 == 0) fmt::print("step {:4}  loss {:.6f}\n", step, loss);
  }

  double max_err = 0;
  const auto wp = adam.params(w), bp = adam.params(b);
  for (int i = 0; i < in * out; ++i) {
    max_err = std::max(max_err, static_cast<double>(std::fabs(wp[i] - w_true[i])));
    if (w_bf16[i].bits != zenflow::to_bfloat16(wp[i]).bits) {
      fmt::print(stderr, "copy-out mismatch at {}\n", i);
      return 1;
    }
  }
  for (int o = 0; o < out; ++o) max_err = std::max(max_err, static_cast<double>(std::fabs(bp[o] - b_true[o])));
  fmt::print("final loss {:.6f}, max |param - truth| {:.4f}, {} steps on {} threads ({})\n", loss, max_err,
             adam.step_count(), adam.pool().size(), adam.isa());
  if (!(max_err < 0.05) || adam.step_count() != steps) {
    fmt::print(stderr, "FAILED: the model did not converge\n");
    return 1;
  }
  return 0;
}
