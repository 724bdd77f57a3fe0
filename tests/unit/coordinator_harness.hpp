// The host coordinator's test harness: a tiny model in host memory (the host backend's device
// memory) trained by a coordinator, shared by the coordinator's test files.
#pragma once

#include <zenflow/coordinator.hpp>

#include "../support/coordinator_instances.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace zenflow::testing {

// A tiny "model" in host memory (the host backend's device memory): two weights of different
// layouts and dtypes and a bias, trained towards fixed targets with noisy gradients whose
// column norms differ, so that the selection matters.
struct toy_model {
  struct weight {
    index_t rows, cols;
    dtype type;
    bool row_major;
    std::vector<std::byte> storage, grad;
    std::vector<float> target, master0;
    std::vector<float> column_scale;
    matrix_view view() {
      auto* d = storage.data();
      return row_major ? matrix_view::row_major(d, rows, cols, type)
                       : matrix_view::column_contiguous(d, rows, cols, type);
    }
    /// Whether the host backend updates this weight in place in `mode` (ZeRO-Offload of a
    /// column-contiguous weight with fp32 gradients): it holds no accumulator.
    bool updated_in_place(offload_mode mode) const {
      return mode == offload_mode::zero_offload && !row_major && type == dtype::f32;
    }
    const_matrix_view grad_view() const {
      auto* d = grad.data();
      return row_major ? const_matrix_view::row_major(d, rows, cols, type)
                       : const_matrix_view::column_contiguous(d, rows, cols, type);
    }
  };
  std::vector<weight> weights;
  std::vector<float> bias, bias_grad, bias_target;

  explicit toy_model(std::uint32_t seed = 7) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    add(rng, n01, 12, 20, dtype::bf16, true);
    add(rng, n01, 9, 14, dtype::f32, false);
    bias.resize(10);
    bias_target.resize(10);
    for (auto& b : bias_target) b = n01(rng);
    bias_grad.resize(10);
  }
  /// The toy model plus a 256 x 1024 bf16 weight: large enough that its CPU columns' gradient is
  /// accumulated by several threads (the offload worker splits above 2 x 65,536 elements).
  static toy_model with_large_weight(std::uint32_t seed = 7) {
    toy_model m(seed);
    std::mt19937 rng(seed + 1);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    m.add(rng, n01, 256, 1024, dtype::bf16, true);
    return m;
  }
  template <class R, class D>
  void add(R& rng, D& n01, index_t rows, index_t cols, dtype type, bool row_major) {
    weight w{rows, cols, type, row_major, {}, {}, {}, {}, {}};
    w.storage.resize(rows * cols * dtype_size(type));
    w.grad.resize(rows * cols * dtype_size(type));
    w.target.resize(rows * cols);
    w.master0.resize(rows * cols);
    w.column_scale.resize(cols);
    for (index_t c = 0; c < cols; ++c) w.column_scale[c] = (c % 5 == 0) ? 8.0f : 0.5f + 0.05f * static_cast<float>(c);
    for (auto& t : w.target) t = n01(rng);
    auto v = w.view();
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = 0; c < cols; ++c) {
        const float x = 0.1f * n01(rng);
        w.master0[r * cols + c] = x;  // row-major fp32 initial values
        store(v, r, c, x);
      }
    weights.push_back(std::move(w));
  }
  static float load(const const_matrix_view& v, index_t r, index_t c) {
    float out = 0;
    dispatch_dtype(v.type, [&](auto tag) {
      using T = decltype(tag);
      out = to_float(static_cast<const T*>(v.data)[v.offset(r, c)]);
    });
    return out;
  }
  static void store(const matrix_view& v, index_t r, index_t c, float x) {
    dispatch_dtype(v.type, [&](auto tag) {
      using T = decltype(tag);
      static_cast<T*>(v.data)[v.offset(r, c)] = from_float<T>(x);
    });
  }
  // Gradient of 0.5 * scale_c * (w - target)^2 plus deterministic noise of this step.
  void make_gradients(std::int64_t step, bool poison = false) {
    std::mt19937 rng(static_cast<std::uint32_t>(1000 + step));
    std::normal_distribution<float> n01(0.0f, 1.0f);
    for (auto& w : weights) {
      auto v = w.view();
      matrix_view g{w.grad.data(), w.rows, w.cols, v.row_stride, v.col_stride, w.type, memory_space::host};
      for (index_t r = 0; r < w.rows; ++r)
        for (index_t c = 0; c < w.cols; ++c) {
          const float x = load(v, r, c);
          store(g, r, c, w.column_scale[c] * (x - w.target[r * w.cols + c]) + 0.05f * n01(rng));
        }
    }
    for (std::size_t i = 0; i < bias.size(); ++i) bias_grad[i] = bias[i] - bias_target[i] + 0.05f * n01(rng);
    if (poison) bias_grad[3] = std::nanf("");
  }
  std::vector<std::byte> snapshot() const {
    std::vector<std::byte> all;
    for (const auto& w : weights) all.insert(all.end(), w.storage.begin(), w.storage.end());
    const auto* b = reinterpret_cast<const std::byte*>(bias.data());
    all.insert(all.end(), b, b + bias.size() * sizeof(float));
    return all;
  }
  double loss() const {
    double l = 0;
    for (const auto& w : weights) {
      const_matrix_view v = const_cast<weight&>(w).view();
      for (index_t r = 0; r < w.rows; ++r)
        for (index_t c = 0; c < w.cols; ++c) {
          const double d = load(v, r, c) - w.target[r * w.cols + c];
          l += 0.5 * d * d;
        }
    }
    return l;
  }
};

template <class Coordinator = host_coordinator>
struct basic_harness {
  toy_model model;
  host_stream stream;
  Coordinator coordinator;

  using options_type = typename Coordinator::options_type;

  basic_harness(const options_type& o, coordinator_config config = small_config()) : coordinator(o, config) {
    register_model();
  }
  basic_harness(const options_type& o, coordinator_config config, toy_model m)
      : model(std::move(m)), coordinator(o, config) {
    register_model();
  }
  /// One rank of a data-parallel group on `comm`.
  template <class Communicator>
  basic_harness(const options_type& o, coordinator_config config, Communicator& comm) : coordinator(comm, o, config) {
    register_model();
  }
  void register_model() {
    for (std::size_t i = 0; i < model.weights.size(); ++i) {
      auto& w = model.weights[i];
      coordinator.register_parameter("w" + std::to_string(i), w.view(),
                                     const_matrix_view::row_major(w.master0.data(), w.rows, w.cols, dtype::f32),
                                     w.type);
    }
    std::vector<float> b0(model.bias.size(), 0.0f);
    coordinator.register_parameter(
        "bias", vector_view{model.bias.data(), static_cast<index_t>(model.bias.size()), dtype::f32}, b0);
  }
  static coordinator_config small_config() {
    coordinator_config c;
    c.cpu_threads = 2;
    c.d2h_slot_bytes = 256;  // small slots: every gradient is split and pipelined
    c.d2h_slots = 3;
    c.h2d_slot_bytes = 192;
    c.record_trace = true;
    return c;
  }
  /// small_config() with the CPU optimizer's state (the fp32 master included) in a state file in
  /// `directory`: 4096-byte blocks (the toy weights' columns share blocks), `depth` blocks read
  /// ahead and `depth` written behind, an unpinned pool.
  static coordinator_config on_disk(const std::filesystem::path& directory, std::size_t depth = 2) {
    coordinator_config c = small_config();
    nvme_state_config n;
    n.file.directory = directory;
    n.file.block_bytes = 4096;
    n.file.read_ahead = n.file.write_behind = depth;
    n.file.pin = pin_policy::none;
    n.engine = {io_engine_kind::automatic, 4 * depth};
    c.nvme = n;
    return c;
  }
  void train(std::int64_t steps, std::int64_t poison_step = -1) {
    for (std::int64_t s = 0; s < steps; ++s) {
      backward(coordinator.step_count() == poison_step);
      for (std::size_t i = 0; i <= model.weights.size(); ++i) submit(i);
      coordinator.step(&stream);
    }
  }
  // The trainer's "backward" runs on its stream too; sync so the gradient reads the parameters
  // after the previous step's updates (the host backend's stand-in for stream order).
  void backward(bool poison = false) {
    stream.synchronize();
    model.make_gradients(coordinator.step_count(), poison);
  }
  // Hands over parameter i's gradient (the last index is the bias).
  void submit(std::size_t i) {
    if (i < model.weights.size()) {
      coordinator.submit_gradient(i, model.weights[i].grad_view(), &stream);
    } else {
      coordinator.submit_gradient(
          i, const_vector_view{model.bias_grad.data(), static_cast<index_t>(model.bias_grad.size()), dtype::f32},
          &stream);
    }
  }
  std::vector<std::byte> finish() {
    coordinator.finish(&stream);
    return model.snapshot();
  }
};

using harness = basic_harness<>;
// staged_host_backend: coordinator_instances.hpp.
using staged_harness = basic_harness<basic_coordinator<staged_host_backend>>;

// A CPU optimizer whose updates take `Milliseconds` longer than the arithmetic (a slow CPU, or a
// state file on a slow disk).
template <int Milliseconds>
struct delayed_cpu_adam : cpu_adam {
  using cpu_adam::cpu_adam;
  cpu_step_result step(std::span<const cpu_adam_task> tasks, float grad_scale, bool check_finite) {
    std::this_thread::sleep_for(std::chrono::milliseconds(Milliseconds));
    return cpu_adam::step(tasks, grad_scale, check_finite);
  }
};

// A CPU optimizer that fails on its third update, to show worker errors reach the trainer.
struct failing_cpu_adam : cpu_adam {
  using cpu_adam::cpu_adam;
  int calls = 0;
  cpu_step_result step(std::span<const cpu_adam_task> tasks, float grad_scale, bool check_finite) {
    if (++calls == 3) throw std::runtime_error("injected CPU update failure");
    return cpu_adam::step(tasks, grad_scale, check_finite);
  }
};

// Ends the process if a scope takes longer than `seconds`: a test of "never hangs" fails fast
// instead of waiting for ctest's timeout.
class watchdog {
 public:
  explicit watchdog(const char* what, int seconds = 60)
      : thread_([this, what, seconds] {
          std::unique_lock lock(mutex_);
          if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [&] { return done_; })) {
            std::fprintf(stderr, "watchdog: '%s' did not finish within %d s (hang)\n", what, seconds);
            std::_Exit(3);
          }
        }) {}
  ~watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

inline zenflow_options base_options() {
  zenflow_options o;
  o.optimizer.lr = 0.01f;
  o.optimizer.weight_decay = 0.01f;
  o.topk_ratio = 0.25f;
  o.select_interval = interval_option::fixed(6);
  o.update_interval = interval_option::fixed(2);
  return o;
}

// The staleness oracle: every step in exactly one interval, each written back exactly once, by
// the end of the next interval (async) or at its own end (sync). `skipped`: the non-finite steps.
inline void check_staleness(const std::vector<update_record>& trace, std::int64_t steps, bool overlap,
                            const std::vector<std::int64_t>& skipped = {}) {
  REQUIRE(!trace.empty());
  std::int64_t expected_first = trace.front().first_step;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const auto& r = trace[i];
    INFO("interval " << r.interval << " steps [" << r.first_step << ", " << r.last_step << "] written back at "
                     << r.written_back_at);
    CHECK(r.first_step == expected_first);  // every step's gradient lands in exactly one interval
    expected_first = r.last_step + 1;
    CHECK(r.write_backs == 1);                // exactly once
    CHECK(r.written_back_at >= r.last_step);  // never before its interval ended
    const auto skips = std::count_if(skipped.begin(), skipped.end(),
                                     [&](std::int64_t s) { return s >= r.first_step && s <= r.last_step; });
    CHECK(r.accumulated_steps == r.last_step - r.first_step + 1 - skips);
    if (r.synchronous || !overlap) {
      CHECK(r.written_back_at == r.last_step);
    } else if (i + 1 < trace.size()) {
      CHECK(r.written_back_at <= trace[i + 1].last_step);  // by the end of the next interval
    }
  }
  CHECK(expected_first == steps);
}

}  // namespace zenflow::testing
