// The host instantiation of the coordinator: the whole asynchronous schedule on a CPU.
//   - equivalences that must hold bit for bit (dense, ZeRO-Offload, ZenFlow with everything on
//     the GPU, ZenFlow with update_interval 1 and no overlap);
//   - the staleness oracle (bound, exactly-once write-back) for fixed and auto intervals,
//     warm-up and reselection in the middle of an interval;
//   - checkpoint/resume bit identity, corrupted and truncated checkpoints rejected;
//   - non-finite steps skipped, errors surfaced, metrics (clipping over both paths: in
//     test_known_defects.cpp).
#include <zenflow/coordinator.hpp>

#include "coordinator_harness.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

static_assert(offload_coordinator<host_coordinator>);
static_assert(!offload_coordinator<host_stream>);

TEST_CASE("dense, ZeRO-Offload and ZenFlow with everything on the GPU are bit-identical") {
  const std::int64_t steps = 13;
  auto dense_opts = zenflow_options::dense();
  dense_opts.optimizer = base_options().optimizer;
  harness dense(dense_opts);
  dense.train(steps);
  const auto reference = dense.finish();
  CHECK(dense.model.loss() < toy_model().loss());  // it trains

  auto zero = zenflow_options::zero_offload();
  zero.optimizer = base_options().optimizer;
  harness zero_offload(zero);
  zero_offload.train(steps);
  CHECK(zero_offload.finish() == reference);
  CHECK(zero_offload.coordinator.host_optimizer().step_count() == steps);

  auto all_gpu = base_options();
  all_gpu.topk_ratio = 1.0f;
  harness everything_on_gpu(all_gpu);
  everything_on_gpu.train(steps);
  CHECK(everything_on_gpu.finish() == reference);

  auto sync1 = base_options();
  sync1.update_interval = interval_option::fixed(1);
  sync1.select_interval = interval_option::fixed(4);
  sync1.overlap_step = false;
  sync1.full_warm_up_rounds = 2;
  harness interval_one(sync1);
  interval_one.train(steps);
  CHECK(interval_one.finish() == reference);  // migration at each reselection is lossless
  CHECK(interval_one.coordinator.metrics().bytes_device_to_host > 0);
}

TEST_CASE("the host backend's accumulation on its stream gives the staged offload's bits in every mode") {
  // host_backend accumulates each step's CPU columns on the stream at step() (R13); the staged
  // path gathers them (at submit_gradient where it can) and the offload worker accumulates them.
  // Same bits, same trace and counts, with a skipped step and with clipping; no gradient staging.
  auto zero = zenflow_options::zero_offload();
  zero.optimizer = base_options().optimizer;
  auto async = base_options();
  async.update_interval = interval_option::fixed(3);
  auto sync = base_options();
  sync.overlap_step = false;
  auto clipped = base_options();
  clipped.max_grad_norm = 0.5f;
  auto automatic = base_options();
  automatic.update_interval = interval_option::automatic();
  for (const auto& o : {zero, async, sync, clipped, automatic}) {
    CAPTURE(offload_mode_name(o.mode));
    CAPTURE(o.overlap_step);
    CAPTURE(o.max_grad_norm);
    harness fused(o, harness::small_config(), toy_model::with_large_weight());
    staged_harness staged(o, staged_harness::small_config(), toy_model::with_large_weight());
    fused.train(14, /*poison_step=*/5);
    staged.train(14, /*poison_step=*/5);
    CHECK(fused.finish() == staged.finish());
    const auto a = fused.coordinator.trace(), b = staged.coordinator.trace();
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].first_step == b[i].first_step);
      CHECK(a[i].last_step == b[i].last_step);
      CHECK(a[i].accumulated_steps == b[i].accumulated_steps);
      CHECK(a[i].written_back_at == b[i].written_back_at);
    }
    CHECK(fused.coordinator.metrics().bytes_device_to_host == staged.coordinator.metrics().bytes_device_to_host);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(fused.coordinator.cpu_step_count(i) == staged.coordinator.cpu_step_count(i));
    // No gradient staging: the "device" buffers are the write-back staging only. ZeRO-Offload's
    // column-contiguous fp32 weight is updated in place: no accumulator either.
    const host_memory_bytes fm = fused.coordinator.host_memory(), sm = staged.coordinator.host_memory();
    CHECK(fm.device_buffers < sm.device_buffers);
    std::size_t in_place_bytes = 0;
    for (const auto& w : fused.model.weights)
      if (w.updated_in_place(o.mode)) in_place_bytes += static_cast<std::size_t>(w.rows * w.cols) * sizeof(float);
    CHECK(in_place_bytes == (o.mode == offload_mode::zero_offload ? 9 * 14 * sizeof(float) : 0));
    CHECK(fm.accumulators == sm.accumulators - in_place_bytes);
  }
}

TEST_CASE("without overlap_step one write-back staging serves every interval") {
  // A CPU update without overlap completes and is written back before the next interval's update
  // begins: one accumulator and one write-back staging per parameter, not one per parity.
  auto sync = base_options();
  sync.overlap_step = false;
  harness one(sync, harness::small_config(), toy_model::with_large_weight());
  harness two(base_options(), harness::small_config(), toy_model::with_large_weight());
  one.train(8);
  two.train(8);
  const host_memory_bytes a = one.coordinator.host_memory(), b = two.coordinator.host_memory();
  CHECK(a.device_buffers * 2 == b.device_buffers);
  CHECK(a.accumulators * 2 == b.accumulators);
  one.finish();
  two.finish();
}

TEST_CASE("large gradients accumulated by several threads give the same bits for any cpu_threads") {
  // The staged offload's worker accumulates on a pool of cpu_threads threads (host_backend: the
  // stream's pool), and a parameter's first step of an interval overwrites its accumulator:
  // neither may change a bit.
  auto run = [](const zenflow_options& o, std::size_t threads) {
    auto config = harness::small_config();
    config.cpu_threads = threads;
    staged_harness h(o, config, toy_model::with_large_weight());
    h.train(9);
    return h.finish();
  };
  auto dense = zenflow_options::dense();
  dense.optimizer = base_options().optimizer;
  const auto reference = run(dense, 1);
  auto zero = zenflow_options::zero_offload();
  zero.optimizer = base_options().optimizer;
  CHECK(run(zero, 1) == reference);
  CHECK(run(zero, 3) == reference);
  auto zen = base_options();
  zen.update_interval = interval_option::fixed(3);  // 3 steps accumulated per interval
  const auto one = run(zen, 1);
  CHECK(one != reference);
  CHECK(run(zen, 3) == one);
}

TEST_CASE("staleness oracle: bound and exactly-once write-back") {
  SUBCASE("fixed interval, async, with warm-up and reselection mid-interval") {
    auto o = base_options();
    o.update_interval = interval_option::fixed(4);
    o.select_interval = interval_option::fixed(6);  // reselects at step 2 + 6 = 8, in the middle of an interval
    o.full_warm_up_rounds = 2;
    harness h(o);
    h.train(23);
    h.finish();
    const auto trace = h.coordinator.trace();
    check_staleness(trace, 23, true);
    CHECK(trace[0].synchronous);  // warm-up
    CHECK(trace[1].synchronous);
    // The reselection at step 8 = 2 + 6 forced a synchronous update boundary after step 7, in the
    // middle of the interval that began at step 6.
    bool cut_short = false;
    for (const auto& r : trace)
      if (r.first_step == 6 && r.last_step == 7 && r.synchronous && r.written_back_at == 7) cut_short = true;
    CHECK(cut_short);
  }
  SUBCASE("fixed interval, sync (ZenFlow sync)") {
    auto o = base_options();
    o.overlap_step = false;
    harness h(o);
    h.train(15);
    h.finish();
    check_staleness(h.coordinator.trace(), 15, false);
  }
  SUBCASE("auto interval") {
    auto o = base_options();
    o.update_interval = interval_option::automatic();
    o.max_update_interval = 5;
    harness h(o);
    h.train(20);
    h.finish();
    check_staleness(h.coordinator.trace(), 20, true);
    CHECK(h.coordinator.metrics().interval >= 1);
    CHECK(h.coordinator.metrics().interval <= 5);
  }
}

TEST_CASE("ZenFlow async trains and reports its metrics") {
  harness h(base_options());
  const double before = h.model.loss();
  h.train(30);
  const auto& m = h.coordinator.metrics();
  CHECK(m.step == 29);
  CHECK(m.bytes_device_to_host > 0);
  h.finish();
  CHECK(h.model.loss() < 0.8 * before);
  CHECK(h.coordinator.gpu_columns(0).size() == 5);  // floor(0.25 * 20)
  CHECK(h.coordinator.gpu_columns(1).size() == 3);  // floor(0.25 * 14)
  std::ostringstream text;
  text << m;
  CHECK(text.str().find("stall") != std::string::npos);
}

TEST_CASE("checkpoint and resume are bit-identical; bad checkpoints are rejected") {
  const auto path = (std::filesystem::temp_directory_path() / "zenflow_test_checkpoint.bin").string();
  auto o = base_options();
  o.update_interval = interval_option::fixed(3);
  harness uninterrupted(o);
  uninterrupted.train(20);
  const auto reference = uninterrupted.finish();

  std::vector<std::byte> resumed_result;
  {
    harness first(o);
    first.train(10);  // mid-interval, with a CPU update pending
    first.coordinator.save_checkpoint(path, &first.stream);
    harness second(o);
    second.coordinator.load_checkpoint(path, &second.stream);
    CHECK(second.model.snapshot() == first.model.snapshot());
    second.train(10);
    resumed_result = second.finish();
  }
  CHECK(resumed_result == reference);

  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto write = [&](const std::vector<char>& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  harness fresh(o);
  const auto before = fresh.model.snapshot();
  auto corrupted = bytes;
  corrupted[corrupted.size() / 2] ^= 0x10;
  write(corrupted);
  CHECK_THROWS_WITH_AS(fresh.coordinator.load_checkpoint(path, &fresh.stream), doctest::Contains("corrupted"),
                       zenflow::error);
  write(std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(bytes.size() / 3)));
  CHECK_THROWS_WITH_AS(fresh.coordinator.load_checkpoint(path, &fresh.stream), doctest::Contains("truncated"),
                       zenflow::error);
  CHECK(fresh.model.snapshot() == before);
  CHECK(fresh.coordinator.step_count() == 0);
  write(bytes);
  // The schedule's options: the first one that differs is named, with both values.
  const std::pair<const char*, void (*)(zenflow_options&)> option_edits[] = {
      {"option topk_ratio = 0.25, this coordinator's is 0.5", [](zenflow_options& x) { x.topk_ratio = 0.5f; }},
      {"option mode = zenflow, this coordinator's is dense", [](zenflow_options& x) { x.mode = offload_mode::dense; }},
      {"option overlap_step = true, this coordinator's is false", [](zenflow_options& x) { x.overlap_step = false; }},
      {"option update_interval = 3, this coordinator's is auto",
       [](zenflow_options& x) { x.update_interval = interval_option::automatic(); }},
  };
  for (const auto& [message, edit] : option_edits) {
    auto changed = o;
    edit(changed);
    harness h(changed);
    CHECK_THROWS_WITH_AS(h.coordinator.load_checkpoint(path, &h.stream), doctest::Contains(message), zenflow::error);
    CHECK(h.coordinator.step_count() == 0);
  }
  // The Adam variant the moments were computed with (the fields every parameter shares): each one
  // that differs is named.
  const std::pair<const char*, void (*)(adam_options&)> adam_edits[] = {
      {"adam adamw_mode = true, this coordinator's is false", [](adam_options& a) { a.adamw_mode = false; }},
      {"adam bias_correction", [](adam_options& a) { a.bias_correction = false; }},
  };
  for (const auto& [message, edit] : adam_edits) {
    auto changed = o;
    edit(changed.optimizer);
    harness h(changed);
    CHECK_THROWS_WITH_AS(h.coordinator.load_checkpoint(path, &h.stream), doctest::Contains(message), zenflow::error);
    CHECK(h.coordinator.step_count() == 0);
  }
  // The per-group fields (lr, betas, eps, weight decay) are each parameter's, saved with it: a
  // coordinator built with other betas and eps takes the checkpoint's, as it takes its lr.
  {
    auto changed = o;
    changed.optimizer.beta1 = 0.8f;
    changed.optimizer.beta2 = 0.99f;
    changed.optimizer.eps = 1e-6f;
    harness h(changed);
    h.coordinator.load_checkpoint(path, &h.stream);
    for (std::size_t i = 0; i < h.coordinator.parameter_count(); ++i)
      CHECK(h.coordinator.hyper_parameters_of(i) == o.optimizer);
  }
  // The untouched coordinator still accepts the good file.
  CHECK_NOTHROW(fresh.coordinator.load_checkpoint(path, &fresh.stream));
  CHECK(fresh.coordinator.step_count() == 10);
  std::filesystem::remove(path);
}

TEST_CASE("a non-finite gradient skips the whole step") {
  auto dense_opts = zenflow_options::dense();
  harness dense(dense_opts);
  dense.train(3);
  dense.stream.synchronize();
  const auto before = dense.model.snapshot();
  dense.train(1, /*poison_step=*/3);
  dense.stream.synchronize();
  CHECK(dense.model.snapshot() == before);

  auto zero = zenflow_options::zero_offload();
  harness offload(zero);
  offload.train(6, /*poison_step=*/2);
  offload.finish();
  CHECK(offload.coordinator.host_optimizer().step_count() == 5);
  for (const auto& r : offload.coordinator.trace()) CHECK(r.accumulated_steps == (r.first_step == 2 ? 0 : 1));
}

TEST_CASE("last_step_gradients says which step was skipped and the norm clipping saw") {
  for (auto o : {zenflow_options::dense(), base_options()}) {
    o.max_grad_norm = 0.5f;  // clipping takes the same norm
    harness h(o);
    CHECK_FALSE(h.coordinator.last_step_gradients().has_value());
    for (std::int64_t step = 0; step < 6; ++step) {
      h.train(1, /*poison_step=*/3);
      const auto g = h.coordinator.last_step_gradients();
      REQUIRE(g.has_value());
      CHECK(g->skipped == (step == 3));
      double sum = 0.0;  // the step's gradients are still in the model's buffers
      for (const auto& w : h.model.weights)
        for (index_t r = 0; r < w.rows; ++r)
          for (index_t c = 0; c < w.cols; ++c) {
            const double x = toy_model::load(w.grad_view(), r, c);
            sum += x * x;
          }
      for (const float b : h.model.bias_grad)
        if (std::isfinite(b)) sum += static_cast<double>(b) * b;
      CHECK(g->grad_norm == doctest::Approx(std::sqrt(sum)).epsilon(1e-9));
    }
  }
}

// One f32 weight with fp16 gradients, three steps of ~1 with a 60000 spike, clipped to norm 1e-3:
// a clip factor of ~1.6e-8, which turns the ~1 gradients into values below fp16's smallest.
// `gathered_at_submit`: per step, the column gathers submit_gradient enqueued (staged offload).
template <class Coordinator>
std::vector<float> clipped_fp16_run(zenflow_options o, std::vector<std::int64_t>* gathered_at_submit = nullptr) {
  const index_t rows = 8, cols = 24;
  o.max_grad_norm = 1e-3f;
  o.optimizer.lr = 1e-2f;
  std::vector<float> w(static_cast<std::size_t>(rows * cols)), w0;
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * static_cast<float>(i % 17);
  w0 = w;
  std::vector<float16> g(w.size());
  host_stream s;
  Coordinator c(o);
  c.register_parameter("w", matrix_view::row_major(w.data(), rows, cols, dtype::f32),
                       const_matrix_view::row_major(w0.data(), rows, cols, dtype::f32), dtype::f16);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < g.size(); ++i)
      g[i] = from_float<float16>(0.5f + 0.1f * static_cast<float>((i + step) % 11));
    g[5] = from_float<float16>(60000.0f);
    const std::int64_t gathers = staged_host_backend::gathers;
    c.submit_gradient(0, const_matrix_view::row_major(g.data(), rows, cols, dtype::f16), &s);
    if (gathered_at_submit != nullptr) gathered_at_submit->push_back(staged_host_backend::gathers - gathers);
    c.step(&s);
    s.synchronize();
  }
  c.finish(&s);
  return w;
}

TEST_CASE("the clip factor applies in fp32 on the CPU path too: an fp16 gradient's small values are kept") {
  // Rounded into the fp16 gradient before it is accumulated, every scaled value but the spike
  // would be 0 and the CPU columns would not move. Both paths apply it in fp32: ZeRO-Offload (every
  // column on the CPU) equals dense (every column on the "GPU") bit for bit, through the host
  // backend's fused offload and through the staged one (the CUDA backend's).
  const auto dense = clipped_fp16_run<host_coordinator>(zenflow_options::dense());
  std::size_t moved = 0;
  for (std::size_t i = 0; i < dense.size(); ++i) moved += dense[i] != 0.01f * static_cast<float>(i % 17);
  CHECK(moved == dense.size());
  CHECK(clipped_fp16_run<host_coordinator>(zenflow_options::zero_offload()) == dense);
  // The staged offload gathers a gradient's CPU columns as it is handed over (from the second
  // step on), before step() knows the clip factor: clipping does not hold the copy back.
  std::vector<std::int64_t> gathered_at_submit;
  CHECK(clipped_fp16_run<basic_coordinator<staged_host_backend>>(zenflow_options::zero_offload(),
                                                                 &gathered_at_submit) == dense);
  CHECK(gathered_at_submit == std::vector<std::int64_t>{0, 1, 1});
}

TEST_CASE("bad input is rejected before anything changes") {
  harness h(base_options());
  auto& w = h.model.weights[0];
  CHECK_THROWS_AS(h.coordinator.submit_gradient(7, w.grad_view(), &h.stream), zenflow::error);
  const_matrix_view wrong_shape = const_matrix_view::row_major(w.grad.data(), w.rows - 1, w.cols, w.type);
  CHECK_THROWS_AS(h.coordinator.submit_gradient(0, wrong_shape, &h.stream), zenflow::error);
  const_matrix_view wrong_type = const_matrix_view::row_major(w.grad.data(), w.rows, w.cols / 2, dtype::f32);
  CHECK_THROWS_AS(h.coordinator.submit_gradient(0, wrong_type, &h.stream), zenflow::error);
  CHECK_THROWS_AS(h.coordinator.submit_gradient(2, w.grad_view(), &h.stream), zenflow::error);  // 1-D param
  h.coordinator.submit_gradient(0, w.grad_view(), &h.stream);
  CHECK_THROWS_WITH_AS(h.coordinator.step(&h.stream), doctest::Contains("no gradient"), zenflow::error);
  CHECK(h.coordinator.step_count() == 0);
  zenflow_options bad;
  bad.topk_ratio = 2.0f;
  CHECK_THROWS_AS(host_coordinator{bad}, zenflow::error);
  coordinator_config tiny;
  tiny.d2h_slot_bytes = 3;  // not one fp32 element: would never make progress
  CHECK_THROWS_WITH_AS((host_coordinator{zenflow_options{}, tiny}), doctest::Contains("d2h_slot_bytes"),
                       zenflow::error);
}

TEST_CASE("an error on a worker thread reaches the trainer from the next call") {
  for (bool overlap : {true, false}) {
    auto o = base_options();
    o.overlap_step = overlap;
    basic_harness<basic_coordinator<host_backend, failing_cpu_adam>> h(o);
    bool surfaced = false;
    try {
      h.train(20);
    } catch (const std::runtime_error& e) {
      surfaced = std::string(e.what()) == "injected CPU update failure";
    }
    CHECK(surfaced);
    CHECK(h.coordinator.step_count() < 20);
  }  // and destruction after the failure is clean
}

TEST_CASE("destruction with CPU work in flight is clean") {
  for (int steps : {1, 5, 7, 9}) {
    harness h(base_options());
    h.train(steps);  // async: an update is pending or running, gradients are in the offload queue
  }
  harness h(base_options());
  h.train(6);
  h.coordinator.finish(&h.stream);
  const auto trace = h.coordinator.trace();
  for (const auto& r : trace) CHECK(r.write_backs == 1);
}

}  // namespace ZENFLOW_TEST_FILE_ID
