// The coordinator used the way a trainer gets it wrong: each mistake is rejected with a clear
// error before anything changes, nothing hangs, and a failed coordinator stays failed.
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "coordinator_harness.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

// Trains `steps` steps without any misuse and returns the finished model.
std::vector<std::byte> reference_run(const zenflow_options& o, std::int64_t steps) {
  harness h(o);
  h.train(steps);
  return h.finish();
}

}  // namespace

// Both offload paths: the staged one (a CUDA backend's) hands the CPU columns over as they are
// submitted when no clip factor waits for the step; the host backend's keeps them for step().
TEST_CASE_TEMPLATE("a gradient submitted twice in one step is rejected and changes nothing", Harness, harness,
                   staged_harness) {
  const auto o = base_options();  // no clipping: the staged path offloads gradients as they are submitted
  const auto reference = reference_run(o, 12);
  for (std::size_t twice : {std::size_t{0}, std::size_t{1}, std::size_t{2}}) {  // bf16, f32 matrix, the bias
    CAPTURE(twice);
    Harness h(o);
    h.train(3);  // step 3: mid-interval, not a selection step
    h.backward();
    for (std::size_t i = 0; i <= 2; ++i) {
      h.submit(i);
      if (i == twice) {
        CHECK_THROWS_WITH_AS(h.submit(i), doctest::Contains("already has a gradient in step 3"), zenflow::error);
        CHECK_THROWS_WITH_AS(h.submit(i), doctest::Contains(i == 2 ? "(bias)" : "(w"), zenflow::error);
      }
    }
    h.coordinator.step(&h.stream);
    h.train(8);
    CHECK(h.finish() == reference);  // the second copy was neither offloaded nor accumulated
  }
}

TEST_CASE_TEMPLATE("a rejected step() leaves the coordinator as if the step had not begun", Harness, harness,
                   staged_harness) {
  const auto o = base_options();
  SUBCASE("then every gradient is submitted again: bit-identical to an uninterrupted run") {
    const auto reference = reference_run(o, 12);
    Harness h(o);
    h.train(3);
    h.backward();
    h.submit(0);  // staged: offloaded at once (no clipping, mid-interval)
    CHECK_THROWS_WITH_AS(h.coordinator.step(&h.stream), doctest::Contains("no gradient was submitted"), zenflow::error);
    CHECK(h.coordinator.step_count() == 3);
    {
      watchdog guard("the step after a rejected one");
      for (std::size_t i = 0; i <= 2; ++i) h.submit(i);
      h.coordinator.step(&h.stream);
      h.train(8);
      CHECK(h.finish() == reference);
    }
  }
  SUBCASE("then finish() returns, with the rejected step's gradients dropped") {
    const auto reference = reference_run(o, 3);
    Harness h(o);
    h.train(3);
    h.backward();
    h.submit(0);
    h.submit(1);
    CHECK_THROWS_AS(h.coordinator.step(&h.stream), zenflow::error);
    watchdog guard("finish() after a rejected step");
    CHECK(h.finish() == reference);
  }
  SUBCASE("finish() with gradients submitted and no step() drops them") {
    const auto reference = reference_run(o, 5);
    Harness h(o);
    h.train(5);
    h.backward();
    h.submit(1);
    watchdog guard("finish() in the middle of a step");
    CHECK(h.finish() == reference);
  }
  SUBCASE("destruction in the middle of a step") {
    watchdog guard("destruction in the middle of a step");
    Harness h(o);
    h.train(5);
    h.backward();
    h.submit(0);
  }
}

TEST_CASE("a parameter sharing memory with a registered one is rejected naming both") {
  // Tied weights registered twice would be updated by two masters and two sets of moments.
  std::vector<float> w(4 * 6, 0.5f), m0(4 * 6, 0.5f);
  host_coordinator c(base_options());
  const auto initial = const_matrix_view::row_major(m0.data(), 4, 6, dtype::f32);
  c.register_parameter("emb", matrix_view::row_major(w.data(), 4, 6, dtype::f32), initial, dtype::f32);
  CHECK_THROWS_WITH_AS(
      c.register_parameter("head", matrix_view::column_contiguous(w.data(), 6, 4, dtype::f32),
                           const_matrix_view::column_contiguous(m0.data(), 6, 4, dtype::f32), dtype::f32),
      doctest::Contains("shares memory with parameter 0 (emb)"), zenflow::error);
  const std::vector<float> b0(3, 0.5f);
  CHECK_THROWS_WITH_AS(c.register_parameter("bias", vector_view{w.data() + 7, 3, dtype::f32}, b0),
                       doctest::Contains("shares memory with parameter 0 (emb)"), zenflow::error);
  // Interleaved strided views that share no element are separate parameters: the even and odd
  // columns of one row-major buffer.
  std::vector<float> fused(4 * 8, 0.5f), f0(4 * 4, 0.5f);
  const auto f_initial = const_matrix_view::row_major(f0.data(), 4, 4, dtype::f32);
  CHECK_NOTHROW(c.register_parameter("even", matrix_view{fused.data(), 4, 4, 8, 2, dtype::f32, memory_space::host},
                                     f_initial, dtype::f32));
  CHECK_NOTHROW(c.register_parameter("odd", matrix_view{fused.data() + 1, 4, 4, 8, 2, dtype::f32, memory_space::host},
                                     f_initial, dtype::f32));
  CHECK(c.parameter_count() == 3);
}

TEST_CASE("a null host stream is rejected by name before anything changes") {
  const auto o = base_options();
  const auto reference = reference_run(o, 8);
  harness h(o);
  h.train(3);
  h.backward();
  const auto bias =
      const_vector_view{h.model.bias_grad.data(), static_cast<index_t>(h.model.bias_grad.size()), dtype::f32};
  CHECK_THROWS_WITH_AS(h.coordinator.submit_gradient(0, h.model.weights[0].grad_view(), nullptr),
                       doctest::Contains("stream: is null"), zenflow::error);
  CHECK_THROWS_WITH_AS(h.coordinator.submit_gradient(2, bias, nullptr), doctest::Contains("stream: is null"),
                       zenflow::error);
  for (std::size_t i = 0; i <= 2; ++i) h.submit(i);
  CHECK_THROWS_WITH_AS(h.coordinator.step(nullptr), doctest::Contains("stream: is null"), zenflow::error);
  CHECK_THROWS_WITH_AS(h.coordinator.finish(nullptr), doctest::Contains("stream: is null"), zenflow::error);
  CHECK_THROWS_WITH_AS(h.coordinator.discard_gradients(nullptr), doctest::Contains("stream: is null"), zenflow::error);
  CHECK_THROWS_WITH_AS(h.coordinator.reload_parameter(0, nullptr), doctest::Contains("stream: is null"),
                       zenflow::error);
  CHECK_THROWS_WITH_AS(h.coordinator.save_checkpoint("unused.bin", nullptr), doctest::Contains("stream: is null"),
                       zenflow::error);
  CHECK_THROWS_WITH_AS(h.coordinator.load_checkpoint("unused.bin", nullptr), doctest::Contains("stream: is null"),
                       zenflow::error);
  h.coordinator.step(&h.stream);  // the gradients submitted with the real stream
  h.train(4);
  CHECK(h.finish() == reference);
}

TEST_CASE("after a worker error the coordinator is failed: every call rethrows, nothing is written back") {
  for (bool overlap : {true, false}) {
    CAPTURE(overlap);
    auto o = base_options();
    o.overlap_step = overlap;
    basic_harness<basic_coordinator<host_backend, failing_cpu_adam>> h(o);
    auto is_injected = [](const std::runtime_error& e) {
      return std::string(e.what()) == "injected CPU update failure";
    };
    bool surfaced = false;
    try {
      h.train(20);
    } catch (const std::runtime_error& e) {
      surfaced = is_injected(e);
    }
    REQUIRE(surfaced);
    const std::int64_t failed_at = h.coordinator.step_count();
    h.stream.synchronize();
    const auto model_after_failure = h.model.snapshot();
    auto rethrows = [&](auto&& call) {
      try {
        call();
      } catch (const std::runtime_error& e) {
        return is_injected(e);
      }
      return false;
    };
    for (int attempt = 0; attempt < 3; ++attempt) {  // not once: every time
      CHECK(rethrows([&] { h.train(1); }));
      CHECK(rethrows([&] { h.coordinator.step(&h.stream); }));
      CHECK(rethrows([&] { h.coordinator.finish(&h.stream); }));
      CHECK(rethrows([&] { h.coordinator.save_checkpoint("/nonexistent/never-written", &h.stream); }));
      CHECK(rethrows([&] { (void)h.coordinator.host_optimizer(); }));
    }
    CHECK_NOTHROW((void)h.coordinator.metrics());
    h.stream.synchronize();
    CHECK(h.coordinator.step_count() == failed_at);
    CHECK(h.model.snapshot() == model_after_failure);  // no stale buffer was written back
  }                                                    // and destruction of a failed coordinator is clean
}

TEST_CASE("a non-finite gradient on a selection step skips the step; the selection waits for the next one") {
  auto o = base_options();
  o.overlap_step = false;  // every update is written back in its own step: a skipped step changes nothing
  o.update_interval = interval_option::fixed(2);
  o.select_interval = interval_option::fixed(4);  // selections at steps 0, 4, 8, ...
  harness h(o);
  h.train(4);
  h.stream.synchronize();
  const auto before = h.model.snapshot();
  const std::vector<std::int32_t> columns(h.coordinator.gpu_columns(0).begin(), h.coordinator.gpu_columns(0).end());
  const auto cpu_steps = h.coordinator.host_optimizer().step_count();
  const auto gpu_steps = h.coordinator.device_optimizer().step_count();
  CHECK_NOTHROW(h.train(1, /*poison_step=*/4));
  h.stream.synchronize();
  CHECK(h.model.snapshot() == before);
  CHECK_FALSE(h.coordinator.metrics().reselected);
  CHECK(std::vector<std::int32_t>(h.coordinator.gpu_columns(0).begin(), h.coordinator.gpu_columns(0).end()) == columns);
  CHECK(h.coordinator.host_optimizer().step_count() == cpu_steps);
  CHECK(h.coordinator.device_optimizer().step_count() == gpu_steps);
  h.train(1);
  CHECK(h.coordinator.metrics().reselected);  // the postponed selection, at the next finite step
  h.train(1, /*poison_step=*/6);
  h.train(9);
  h.finish();
  const auto trace = h.coordinator.trace();
  check_staleness(trace, 16, false, {4, 6});
}

namespace {
// A CPU optimizer whose updates take a while: a read that does not wait for them sees a stale
// state (and races them).
using slow_cpu_adam = delayed_cpu_adam<40>;
}  // namespace

TEST_CASE("reading the CPU optimizer between steps waits for the CPU updates already launched") {
  basic_harness<basic_coordinator<host_backend, slow_cpu_adam>> async(base_options());
  async.train(5);  // intervals of 2: the updates of steps 0-1 and 2-3 were launched, the second still runs
  CHECK(async.coordinator.host_optimizer().step_count() == 2);
  async.train(2);
  CHECK(async.coordinator.host_optimizer().step_count() == 3);
  async.coordinator.finish(&async.stream);
  CHECK(async.coordinator.host_optimizer().step_count() == 4);  // steps 0-1, 2-3, 4-5, 6
}

TEST_CASE("a gradient computed while the stream still updates the parameters is detected (host backend)") {
  for (bool check : {true, false}) {
    CAPTURE(check);
    auto config = harness::small_config();
    config.check_stream_order = check;
    harness h(base_options(), config);
    h.train(2);
    // Hold the stream: the next step's updates stay queued behind this task until it is released.
    std::promise<void> release;
    auto released = release.get_future().share();
    h.stream.synchronize();
    h.stream.enqueue([released] { released.wait(); });
    h.model.make_gradients(2);  // a trainer that forgot stream.synchronize()
    for (std::size_t i = 0; i <= 2; ++i) h.submit(i);
    h.coordinator.step(&h.stream);
    h.model.make_gradients(3);
    if (check) {
      CHECK_THROWS_WITH_AS(h.submit(0), doctest::Contains("stream.synchronize()"), zenflow::error);
    } else {
      CHECK_NOTHROW(h.submit(0));
    }
    release.set_value();
    h.stream.synchronize();
    if (check) {
      for (std::size_t i = 0; i <= 2; ++i) h.submit(i);  // the rejected call changed nothing
      h.coordinator.step(&h.stream);
    }
  }
}

TEST_CASE("what a new user sets works as written") {
  SUBCASE("select_interval below the default bound of an auto update interval") {
    auto o = base_options();
    o.update_interval = interval_option::automatic();
    o.select_interval = interval_option::fixed(3);  // max_update_interval stays at its default, 16
    harness h(o);
    h.train(12);
    CHECK(h.coordinator.metrics().interval <= 3);
    h.finish();
    check_staleness(h.coordinator.trace(), 12, true);
  }
  SUBCASE("mode = zero_offload on otherwise default options runs ZeRO-Offload") {
    auto by_mode = base_options();
    by_mode.mode = offload_mode::zero_offload;
    auto by_factory = zenflow_options::zero_offload();
    by_factory.optimizer = by_mode.optimizer;
    CHECK(reference_run(by_mode, 7) == reference_run(by_factory, 7));
    auto dense = base_options();
    dense.mode = offload_mode::dense;
    auto dense_factory = zenflow_options::dense();
    dense_factory.optimizer = dense.optimizer;
    CHECK(reference_run(dense, 7) == reference_run(dense_factory, 7));
  }
  SUBCASE("a bf16 weight's initial value in bf16 is taken as it is (upcast)") {
    const auto o = base_options();
    std::vector<std::byte> results[2];
    for (int own_dtype = 0; own_dtype < 2; ++own_dtype) {
      toy_model model;
      host_stream stream;
      host_coordinator c(o, harness::small_config());
      auto& w = model.weights[0];  // bf16, row-major
      std::vector<float> exact(w.master0.size());
      const auto v = w.view();
      for (index_t r = 0; r < w.rows; ++r)
        for (index_t col = 0; col < w.cols; ++col) exact[r * w.cols + col] = toy_model::load(v, r, col);
      const auto initial =
          own_dtype ? const_matrix_view(v) : const_matrix_view::row_major(exact.data(), w.rows, w.cols, dtype::f32);
      c.register_parameter("w0", w.view(), initial, w.type);
      for (int s = 0; s < 6; ++s) {
        stream.synchronize();
        model.make_gradients(s);
        c.submit_gradient(0, w.grad_view(), &stream);
        c.step(&stream);
      }
      c.finish(&stream);
      results[own_dtype] = w.storage;
    }
    CHECK(results[0] == results[1]);
    host_coordinator c(o);
    toy_model model;
    auto& w1 = model.weights[1];  // an f32 param: a bf16 initial value is neither f32 nor its dtype
    std::vector<std::byte> bf16_values(static_cast<std::size_t>(w1.rows * w1.cols) * 2);
    CHECK_THROWS_WITH_AS(
        c.register_parameter("w1", w1.view(),
                             const_matrix_view::row_major(bf16_values.data(), w1.rows, w1.cols, dtype::bf16), w1.type),
        doctest::Contains("must be f32 or the param's dtype (f32), got bf16"), zenflow::error);
  }
}

TEST_CASE("a bad coordinator_config is rejected naming its own field") {
  auto rejected_field = [](coordinator_config config) -> std::string {
    try {
      host_coordinator c(zenflow_options{}, config);
    } catch (const zenflow::error& e) {
      CHECK(std::string(e.what()).find(e.argument()) != std::string::npos);
      return e.argument();
    }
    return "(accepted)";
  };
  coordinator_config c;
  c.d2h_slots = 1;
  CHECK(rejected_field(c) == "d2h_slots");
  c = {};
  c.h2d_slots = 0;
  CHECK(rejected_field(c) == "h2d_slots");
  c = {};
  c.h2d_slot_bytes = 2;
  CHECK(rejected_field(c) == "h2d_slot_bytes");
  c = {};
  c.d2h_slots = std::size_t{1} << 60;  // d2h_slots x d2h_slot_bytes overflows size_t
  CHECK(rejected_field(c) == "d2h_slots");
  c = {};
  c.copy_out_window_bytes = 0;
  CHECK(rejected_field(c) == "copy_out_window_bytes");
  c = {};
  c.cpu_threads = 100000;
  CHECK(rejected_field(c) == "cpu_threads");
}

}  // namespace ZENFLOW_TEST_FILE_ID
