// Parameters without a gradient in a step (missing_gradients::skip), as torch.optim.AdamW skips a
// parameter whose `.grad` is None:
//   - a frozen layer stays bitwise as registered and gets no optimizer state, in every mode;
//   - an unused branch (gradients on some steps only): dense, ZeRO-Offload and ZenFlow with a
//     one-step synchronous interval equal, bit for bit, a per-parameter AdamW reference written
//     with adam_math (torch's per-parameter `step`);
//   - the CPU path averages each parameter over its own accumulated steps; a parameter without a
//     gradient in a whole interval gets no CPU update and no write-back;
//   - the clip norm and the non-finite check see the given gradients only;
//   - a selection step keeps the selection of a parameter without a gradient, and a parameter
//     without one at the first selection is selected at a later selection step;
//   - a checkpoint taken mid-interval resumes bit-identically.
#include <zenflow/adam_math.hpp>
#include <zenflow/coordinator.hpp>
#include <zenflow/gradient_stats.hpp>

#include "../support/checkpoint_model.hpp"
#include "coordinator_harness.hpp"

#include <doctest/doctest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

// Whether parameter i (0, 1: the weights; 2: the bias) has a gradient in step s.
using presence = std::function<bool(std::size_t i, std::int64_t s)>;

// w1 never has a gradient.
bool frozen_w1(std::size_t i, std::int64_t) {
  return i != 1;
}
// An unused branch per parameter: w0 misses steps 1 mod 3, w1 misses steps 2 mod 4 and 5..8 (four
// in a row), the bias misses steps 3 mod 5.
bool unused_branches(std::size_t i, std::int64_t s) {
  if (i == 0) return s % 3 != 1;
  if (i == 1) return s % 4 != 2 && !(s >= 5 && s <= 8);
  return s % 5 != 3;
}

// One step of harness h: gradients from the weights, those that `has` says handed over, then
// step(skip). A weight's gradient that is not handed over is poisoned with NaN: the coordinator
// must not read it.
template <class H>
void train_step(H& h, const presence& has) {
  const std::int64_t s = h.coordinator.step_count();
  h.backward();
  for (std::size_t i = 0; i <= h.model.weights.size(); ++i) {
    if (has(i, s)) {
      h.submit(i);
    } else if (i < h.model.weights.size()) {
      auto& w = h.model.weights[i];
      toy_model::store(matrix_view{w.grad.data(), w.rows, w.cols, w.view().row_stride, w.view().col_stride, w.type,
                                   memory_space::host},
                       0, 0, std::nanf(""));
    } else {
      h.model.bias_grad[0] = std::nanf("");
    }
  }
  h.coordinator.step(&h.stream, missing_gradients::skip);
}
template <class H>
void train(H& h, std::int64_t steps, const presence& has) {
  for (std::int64_t s = 0; s < steps; ++s) train_step(h, has);
}

// torch.optim.AdamW on the toy model, written with the library's per-element math: every
// parameter has its own step count and is left alone in a step without its gradient. With
// max_norm > 0 the step's gradients (those given) are clipped by one global norm, the
// coordinator's rule (make_step_flags over host_gradient_stats).
struct adamw_reference {
  toy_model model;
  adam_options adam;
  float max_norm = 0.0f;
  std::vector<std::vector<float>> master, m, v;  // per weight (row-major), then the bias
  std::vector<std::int64_t> steps;

  explicit adamw_reference(const adam_options& a, float clip = 0.0f) : adam(a), max_norm(clip) {
    for (const auto& w : model.weights) master.push_back(w.master0);
    master.emplace_back(model.bias.size(), 0.0f);  // the harness registers the bias with zeros
    for (const auto& x : master) {
      m.emplace_back(x.size(), 0.0f);
      v.emplace_back(x.size(), 0.0f);
    }
    steps.assign(master.size(), 0);
  }
  void step(std::int64_t s, const presence& has) {
    model.make_gradients(s);
    std::vector<const_matrix_view> given_matrices;
    std::vector<const_vector_view> given_vectors;
    for (std::size_t i = 0; i < model.weights.size(); ++i)
      if (has(i, s)) given_matrices.push_back(model.weights[i].grad_view());
    if (has(model.weights.size(), s))
      given_vectors.push_back(
          const_vector_view{model.bias_grad.data(), static_cast<index_t>(model.bias_grad.size()), dtype::f32});
    const step_flags flags =
        make_step_flags(host_gradient_stats(given_matrices, given_vectors).sum_of_squares, false, max_norm);
    for (std::size_t i = 0; i < master.size(); ++i) {
      if (!has(i, s)) continue;
      const adam_step_constants c = make_adam_step_constants(adam, ++steps[i], flags.scale);
      if (i < model.weights.size()) {
        auto& w = model.weights[i];
        for (index_t r = 0; r < w.rows; ++r)
          for (index_t col = 0; col < w.cols; ++col) {
            const std::size_t e = static_cast<std::size_t>(r * w.cols + col);
            adam_update(master[i][e], toy_model::load(w.grad_view(), r, col), m[i][e], v[i][e], c);
            toy_model::store(w.view(), r, col, master[i][e]);
          }
      } else {
        for (std::size_t e = 0; e < model.bias.size(); ++e) {
          adam_update(master[i][e], model.bias_grad[e], m[i][e], v[i][e], c);
          model.bias[e] = master[i][e];
        }
      }
    }
  }
  std::vector<std::byte> train(std::int64_t n, const presence& has) {
    for (std::int64_t s = 0; s < n; ++s) step(s, has);
    return model.snapshot();
  }
};

zenflow_options dense_options() {
  auto o = zenflow_options::dense();
  o.optimizer = base_options().optimizer;
  return o;
}
zenflow_options zero_offload_options() {
  auto o = zenflow_options::zero_offload();
  o.optimizer = base_options().optimizer;
  return o;
}
// ZenFlow with a synchronous one-step interval: migration on reselection is lossless, so it trains
// exactly as dense does.
zenflow_options zenflow_interval_one() {
  auto o = base_options();
  o.update_interval = interval_option::fixed(1);
  o.select_interval = interval_option::fixed(4);
  o.overlap_step = false;
  return o;
}

// The bytes of weight i of a fresh (untrained) toy model.
std::vector<std::byte> initial_weight(std::size_t i) {
  return toy_model().weights[i].storage;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("zenflow_test_missing_gradients_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

}  // namespace

TEST_CASE("the default still rejects a step with a missing gradient; skip accepts it") {
  harness h(base_options());
  h.backward();
  h.submit(0);
  h.submit(2);
  CHECK_THROWS_WITH_AS(h.coordinator.step(&h.stream), doctest::Contains("no gradient was submitted for parameter 1"),
                       zenflow::error);
  CHECK(h.coordinator.step_count() == 0);
  h.submit(0);  // the rejected step's gradients were dropped
  h.submit(2);
  CHECK_NOTHROW(h.coordinator.step(&h.stream, missing_gradients::skip));
  CHECK(h.coordinator.step_count() == 1);
  // A step without any gradient is still a training step, and changes no parameter.
  h.stream.synchronize();
  const auto before = h.model.snapshot();
  CHECK_NOTHROW(h.coordinator.step(&h.stream, missing_gradients::skip));
  CHECK(h.coordinator.step_count() == 2);
  h.stream.synchronize();
  CHECK(h.model.snapshot() == before);
}

TEST_CASE("a frozen layer stays bitwise as registered and gets no optimizer state, in every mode") {
  const std::int64_t steps = 13;
  auto sync = base_options();
  sync.overlap_step = false;
  struct mode {
    const char* name;
    zenflow_options options;
  };
  // Members, not structured bindings: doctest's INFO captures them in a lambda, which clang before
  // 16 refuses for a binding.
  for (const mode& m : {mode{"dense", dense_options()}, mode{"zero_offload", zero_offload_options()},
                        mode{"zenflow async", base_options()}, mode{"zenflow sync", sync}}) {
    const char* const name = m.name;
    const zenflow_options& options = m.options;
    INFO(name);
    harness h(options);
    train(h, steps, frozen_w1);
    const auto trained = h.finish();
    CHECK(h.model.weights[1].storage == initial_weight(1));
    CHECK(h.model.weights[0].storage != initial_weight(0));  // the others train
    CHECK(h.coordinator.cpu_step_count(1) == 0);
    CHECK(h.coordinator.gpu_step_count(1) == 0);
    const auto& cpu = h.coordinator.host_optimizer();
    CHECK(std::all_of(cpu.exp_avg(1).begin(), cpu.exp_avg(1).end(), [](float x) { return x == 0.0f; }));
    CHECK(std::all_of(cpu.exp_avg_sq(1).begin(), cpu.exp_avg_sq(1).end(), [](float x) { return x == 0.0f; }));
    const auto& w = h.model.weights[1];
    for (index_t c = 0; c < w.cols; ++c)
      for (index_t r = 0; r < w.rows; ++r) CHECK(cpu.params(1)[c * w.rows + r] == w.master0[r * w.cols + c]);
    if (options.mode == offload_mode::zenflow) CHECK(h.coordinator.gpu_columns(1).empty());  // never selected
    if (options.mode != offload_mode::zenflow) {
      // Dense and ZeRO-Offload train every other parameter exactly as torch's AdamW does.
      adamw_reference reference(options.optimizer);
      CHECK(trained == reference.train(steps, frozen_w1));
    }
  }
}

TEST_CASE("an unused branch trains as torch's per-parameter AdamW in dense, ZeRO-Offload and ZenFlow") {
  const std::int64_t steps = 14;
  adamw_reference reference(base_options().optimizer);
  const auto expected = reference.train(steps, unused_branches);
  CHECK(reference.steps == std::vector<std::int64_t>{9, 8, 11});  // the pattern does miss steps

  harness dense(dense_options());
  train(dense, steps, unused_branches);
  CHECK(dense.finish() == expected);
  for (std::size_t i = 0; i < 3; ++i) CHECK(dense.coordinator.gpu_step_count(i) == reference.steps[i]);

  harness zero(zero_offload_options());
  train(zero, steps, unused_branches);
  CHECK(zero.finish() == expected);
  CHECK(zero.coordinator.cpu_step_count(0) == reference.steps[0]);
  CHECK(zero.coordinator.cpu_step_count(1) == reference.steps[1]);
  CHECK(zero.coordinator.gpu_step_count(2) == reference.steps[2]);
  // One CPU update per step that had a 2-D gradient (steps 7 and 10 had none).
  CHECK(zero.coordinator.host_optimizer().step_count() == steps - 2);

  // Selection steps 0, 4, 8, 12 include missing gradients (w1 at 8, w0 at 4): kept selections.
  harness zenflow(zenflow_interval_one());
  train(zenflow, steps, unused_branches);
  CHECK(zenflow.finish() == expected);
  CHECK(zenflow.coordinator.metrics().bytes_device_to_host > 0);
}

TEST_CASE("the CPU path averages each parameter over its own steps; a whole interval without one: nothing") {
  auto o = base_options();
  o.update_interval = interval_option::fixed(2);
  o.select_interval = interval_option::fixed(100);
  o.overlap_step = false;  // the CPU result is written back at the end of its own interval
  harness h(o);
  const std::size_t weights = h.model.weights.size();
  // Interval 0 (steps 0, 1): w0 in both, w1 in step 0 only. Interval 1 (steps 2, 3): w1 in none.
  const presence has = [](std::size_t i, std::int64_t s) { return i != 1 || s == 0; };
  std::vector<std::vector<float>> sum(weights);  // the fp32 sum of each weight's given gradients
  for (std::int64_t s = 0; s < 2; ++s) {
    h.backward();
    for (std::size_t i = 0; i < weights; ++i) {
      if (!has(i, s)) continue;
      const auto& w = h.model.weights[i];
      sum[i].resize(static_cast<std::size_t>(w.rows * w.cols), 0.0f);
      for (index_t c = 0; c < w.cols; ++c)
        for (index_t r = 0; r < w.rows; ++r)
          sum[i][c * w.rows + r] = std::fma(1.0f, toy_model::load(w.grad_view(), r, c), sum[i][c * w.rows + r]);
    }
    for (std::size_t i = 0; i <= weights; ++i)
      if (has(i, s)) h.submit(i);
    h.coordinator.step(&h.stream, missing_gradients::skip);
  }
  h.stream.synchronize();
  const std::int64_t count[] = {2, 1};
  const auto& cpu = h.coordinator.host_optimizer();
  for (std::size_t i = 0; i < weights; ++i) {
    INFO("w" << i);
    const auto& w = h.model.weights[i];
    const auto gpu = h.coordinator.gpu_columns(i);
    const auto cpu_columns = complement_columns(gpu, w.cols);
    REQUIRE(!cpu_columns.empty());
    // First CPU update of these columns: fp32 master from registration, zero moments, the mean over
    // this parameter's own count (not the interval's 2 steps).
    const adam_step_constants c = make_adam_step_constants(o.optimizer, 1, 1.0f / static_cast<float>(count[i]));
    bool cpu_state_ok = true, weights_ok = true;
    for (std::int32_t col : cpu_columns)
      for (index_t r = 0; r < w.rows; ++r) {
        float p = w.master0[r * w.cols + col], m = 0.0f, v = 0.0f;
        adam_update(p, sum[i][col * w.rows + r], m, v, c);
        const std::size_t e = static_cast<std::size_t>(col * w.rows + r);
        cpu_state_ok &= cpu.params(i)[e] == p && cpu.exp_avg(i)[e] == m && cpu.exp_avg_sq(i)[e] == v;
        float written = 0.0f;
        dispatch_dtype(w.type, [&](auto tag) { written = to_float(from_float<decltype(tag)>(p)); });
        weights_ok &= toy_model::load(const_cast<toy_model::weight&>(w).view(), r, col) == written;  // written back
      }
    CHECK(cpu_state_ok);
    CHECK(weights_ok);
    CHECK(h.coordinator.cpu_step_count(i) == 1);
  }

  // Interval 1: no gradient for w1 at all: no CPU update for it, nothing written back (its GPU
  // columns have no gradient either: the whole weight stays as it is).
  const auto w1_before = h.model.weights[1].storage;
  const std::vector<float> cpu1_before[] = {{cpu.params(1).begin(), cpu.params(1).end()},
                                            {cpu.exp_avg(1).begin(), cpu.exp_avg(1).end()},
                                            {cpu.exp_avg_sq(1).begin(), cpu.exp_avg_sq(1).end()}};
  const auto w0_before = h.model.weights[0].storage;
  train(h, 2, has);
  h.stream.synchronize();
  CHECK(h.model.weights[1].storage == w1_before);
  CHECK(same_bits(cpu.params(1), cpu1_before[0]));
  CHECK(same_bits(cpu.exp_avg(1), cpu1_before[1]));
  CHECK(same_bits(cpu.exp_avg_sq(1), cpu1_before[2]));
  CHECK(h.coordinator.cpu_step_count(1) == 1);
  CHECK(h.coordinator.cpu_step_count(0) == 2);
  CHECK(h.model.weights[0].storage != w0_before);
  const auto trace = h.coordinator.trace();
  REQUIRE(trace.size() == 2);
  CHECK(trace[1].accumulated_steps == 2);
  CHECK(trace[1].write_backs == 1);
}

TEST_CASE("the clip norm and the non-finite check see the given gradients only") {
  // The gradients not handed over hold a NaN (train_step poisons them): a step that read one would
  // be skipped; one that counted a stale gradient in the norm would clip by another factor.
  const std::int64_t steps = 9;
  const presence has = [](std::size_t i, std::int64_t s) { return i != 1 || s % 3 == 0; };
  auto o = dense_options();
  o.max_grad_norm = 1.0f;
  harness h(o);
  train(h, steps, has);
  adamw_reference reference(o.optimizer, o.max_grad_norm);
  CHECK(h.finish() == reference.train(steps, has));
  CHECK(h.coordinator.gpu_step_count(0) == steps);  // no step was skipped
  CHECK(h.coordinator.gpu_step_count(1) == 3);
}

TEST_CASE("a selection step keeps the selection of a parameter without a gradient") {
  auto o = base_options();
  o.select_interval = interval_option::fixed(3);
  o.update_interval = interval_option::fixed(1);
  o.overlap_step = false;
  harness h(o);
  // Step 0 (the first selection): no gradient for w1, which keeps every column on the CPU.
  // Step 3 (a selection step): no gradient for w0, which keeps its selection; w1 is selected.
  const presence has = [](std::size_t i, std::int64_t s) { return !(i == 1 && s == 0) && !(i == 0 && s == 3); };
  train_step(h, has);
  const std::vector<std::int32_t> w0_selection(h.coordinator.gpu_columns(0).begin(),
                                               h.coordinator.gpu_columns(0).end());
  CHECK(!w0_selection.empty());
  CHECK(h.coordinator.gpu_columns(1).empty());
  train(h, 2, has);
  CHECK(h.coordinator.gpu_columns(1).empty());  // not a selection step
  CHECK(h.coordinator.cpu_step_count(1) == 2);  // trained on the CPU meanwhile
  train_step(h, has);
  CHECK(h.coordinator.metrics().reselected);
  CHECK(std::equal(w0_selection.begin(), w0_selection.end(), h.coordinator.gpu_columns(0).begin(),
                   h.coordinator.gpu_columns(0).end()));
  CHECK(h.coordinator.gpu_columns(1).size() == 3);  // k = floor(0.25 * 14)
  h.finish();
  // Documented rule: a 2-D parameter's GPU count starts, at its first selection, from the device
  // optimizer's count of applied steps (3: the bias stepped every step), then counts its own.
  CHECK(h.coordinator.gpu_step_count(1) == 4);
  CHECK(h.coordinator.gpu_step_count(0) == 3);  // steps 0, 1, 2; not 3
}

TEST_CASE("a checkpoint taken mid-interval with missing gradients resumes bit-identically") {
  auto o = base_options();
  o.update_interval = interval_option::fixed(3);
  o.select_interval = interval_option::fixed(4);
  // Intervals (reselection at 0, 4, 8 ends one early): [0 1 2] [3] [4 5 6] [7] [8 9 10] ... w0
  // misses steps 1 mod 3, w1 misses 2 mod 4 and the whole interval [4 5 6], the bias 3 mod 5.
  // Saved after 6 steps the current interval's counts differ per parameter (w0 1, w1 0, the
  // interval 1); after 8 the pending interval's (w0 2, w1 0, the interval 2) and the current one's;
  // after 9 the CPU update counts (w0 3, w1 3, the optimizer 4).
  const presence has = [](std::size_t i, std::int64_t s) {
    if (i == 0) return s % 3 != 1;
    if (i == 1) return s % 4 != 2 && !(s >= 4 && s <= 6);
    return s % 5 != 3;
  };
  for (const std::int64_t at : {6, 8, 9}) {
    INFO("saved after " << at << " steps");
    const auto path = temp_path("mid_interval.bin");
    harness uninterrupted(o);
    train(uninterrupted, at, has);
    uninterrupted.coordinator.save_checkpoint(path, &uninterrupted.stream);
    harness resumed(o);
    resumed.coordinator.load_checkpoint(path, &resumed.stream);
    const auto saved = read_file_bytes(path);
    resumed.coordinator.save_checkpoint(path, &resumed.stream);
    CHECK(read_file_bytes(path) == saved);  // nothing of the state was lost or invented
    std::filesystem::remove(path);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(resumed.coordinator.cpu_step_count(i) == uninterrupted.coordinator.cpu_step_count(i));
      CHECK(resumed.coordinator.gpu_step_count(i) == uninterrupted.coordinator.gpu_step_count(i));
    }
    train(uninterrupted, 8, has);
    train(resumed, 8, has);
    CHECK(resumed.finish() == uninterrupted.finish());
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(resumed.coordinator.cpu_step_count(i) == uninterrupted.coordinator.cpu_step_count(i));
      CHECK(resumed.coordinator.gpu_step_count(i) == uninterrupted.coordinator.gpu_step_count(i));
    }
  }
  // The counts differ per parameter (see has).
  harness h(o);
  train(h, 9, has);
  h.stream.synchronize();
  CHECK(h.coordinator.cpu_step_count(0) == 3);
  CHECK(h.coordinator.cpu_step_count(1) == 3);
  CHECK(h.coordinator.host_optimizer().step_count() == 4);
  CHECK(h.coordinator.gpu_step_count(0) == 6);
  CHECK(h.coordinator.gpu_step_count(1) == 5);
  CHECK(h.coordinator.gpu_step_count(2) == 7);
}

}  // namespace ZENFLOW_TEST_FILE_ID
