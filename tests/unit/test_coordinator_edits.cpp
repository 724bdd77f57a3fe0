// The trainer between backward and step, and between steps, as torch.optim's users work:
//   - discard_gradients() drops the gradients handed over (an interrupted iteration), including
//     those already with the offload worker, and nothing else;
//   - reload_parameter() adopts an edit of the trainer's weights into the fp32 master of every
//     column (GPU and CPU), keeps moments and step counts, keeps a bf16 master's low bits where
//     the trainer left the value as it was, and wins over a CPU update in flight; with the CPU
//     optimizer's state on disk (master included) as in RAM.
#include <zenflow/coordinator.hpp>

#include "../support/exported_state.hpp"
#include "../support/storage_test_utils.hpp"
#include "coordinator_harness.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ranges>
#include <span>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

std::vector<std::byte> reference_run(const zenflow_options& o, std::int64_t steps) {
  harness h(o);
  h.train(steps);
  return h.finish();
}

zenflow_options sync_options() {
  auto o = base_options();
  o.overlap_step = false;
  return o;
}

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

// Element (r, c) of weight w as a float.
float value(toy_model::weight& w, index_t r, index_t c) {
  return toy_model::load(w.view(), r, c);
}

// Sets every element of weight w to f(r, c) (rounded to its dtype).
template <class F>
void edit(toy_model::weight& w, F f) {
  auto v = w.view();
  for (index_t r = 0; r < w.rows; ++r)
    for (index_t c = 0; c < w.cols; ++c) toy_model::store(v, r, c, f(r, c));
}

// Parameter i's index in the device optimizer (matrices enter it at their first selection, the
// bias at registration): the one with its rows and selection.
template <class H>
std::size_t device_index(H& h, std::size_t i, index_t rows) {
  const auto& opt = h.coordinator.device_optimizer();
  const auto selection = h.coordinator.gpu_columns(i);
  const std::vector<std::int32_t> vector_selection{0};
  const std::span<const std::int32_t> want = i == 2 ? std::span<const std::int32_t>(vector_selection) : selection;
  for (std::size_t j = 0; j < opt.parameter_count(); ++j)
    if (opt.rows(j) == rows && std::ranges::equal(opt.selection(j), want)) return j;
  FAIL("parameter " << i << " is not in the device optimizer");
  return 0;
}

// The fp32 master of column c of parameter i (rows values): from the device optimizer when the
// column is selected, else from the CPU optimizer (one process: the CPU tensor holds every column).
template <class H>
std::vector<float> master_column(H& h, std::size_t i, index_t c, index_t rows) {
  const auto selection = h.coordinator.gpu_columns(i);
  const auto at = std::find(selection.begin(), selection.end(), static_cast<std::int32_t>(c));
  if (at != selection.end()) {
    std::vector<float> packed(3 * rows * selection.size());
    h.coordinator.device_optimizer().export_state(device_index(h, i, rows), packed);
    const auto l = static_cast<std::size_t>(at - selection.begin());
    return {packed.begin() + static_cast<std::ptrdiff_t>(3 * l * rows),
            packed.begin() + static_cast<std::ptrdiff_t>((3 * l + 1) * rows)};
  }
  const std::int32_t column[] = {static_cast<std::int32_t>(c)};
  return zenflow_test::export_state(h.coordinator.host_optimizer(), i, column).master;
}

// The moments of every column of parameter i, CPU and GPU, as [m, v] per column in column order.
template <class H>
std::vector<float> moments(H& h, std::size_t i, index_t rows, index_t cols) {
  const auto selection = h.coordinator.gpu_columns(i);
  std::vector<float> packed(3 * rows * selection.size());
  if (!selection.empty()) h.coordinator.device_optimizer().export_state(device_index(h, i, rows), packed);
  const auto cpu = zenflow_test::export_state(h.coordinator.host_optimizer(), i);
  std::vector<float> out;
  for (index_t c = 0; c < cols; ++c) {
    const auto at = std::find(selection.begin(), selection.end(), static_cast<std::int32_t>(c));
    if (at != selection.end()) {
      const auto l = static_cast<std::size_t>(at - selection.begin());
      out.insert(out.end(), packed.begin() + static_cast<std::ptrdiff_t>((3 * l + 1) * rows),
                 packed.begin() + static_cast<std::ptrdiff_t>((3 * l + 3) * rows));
    } else {
      for (const auto* part : {&cpu.exp_avg, &cpu.exp_avg_sq})
        out.insert(out.end(), part->begin() + c * rows, part->begin() + (c + 1) * rows);
    }
  }
  return out;
}

}  // namespace

// 3 steps, two gradients handed over and discarded, then 9 steps with every gradient.
template <class Harness>
std::vector<std::byte> discard_then_train(const zenflow_options& o) {
  Harness h(o);
  h.train(3);
  h.coordinator.discard_gradients(&h.stream);  // nothing handed over: nothing to drop
  h.backward();
  h.submit(0);
  h.submit(1);
  h.coordinator.discard_gradients(&h.stream);
  watchdog guard("the steps after discard_gradients");
  h.train(9);  // step 3 again, with every gradient: as if the first try never happened
  return h.finish();
}

TEST_CASE("discard_gradients drops the gradients handed over, including those already offloaded") {
  // The staged offload (a CUDA backend's) hands the CPU columns to the offload worker at
  // submit_gradient when no clip factor waits for the step; the host backend keeps them for step().
  for (const bool clip : {false, true}) {
    CAPTURE(clip);
    auto o = base_options();
    if (clip) o.max_grad_norm = 0.5f;
    const auto reference = reference_run(o, 12);
    CHECK(discard_then_train<harness>(o) == reference);
    CHECK(discard_then_train<staged_harness>(o) == reference);
  }
}

TEST_CASE("a step() after discard_gradients applies none of the dropped gradients") {
  const auto o = base_options();
  harness skipped(o);  // step 3 without any gradient
  skipped.train(3);
  skipped.coordinator.step(&skipped.stream, missing_gradients::skip);
  skipped.train(8);
  const auto reference = skipped.finish();

  harness h(o);
  h.train(3);
  h.backward();
  for (std::size_t i = 0; i <= 2; ++i) h.submit(i);
  h.coordinator.discard_gradients(&h.stream);
  h.coordinator.step(&h.stream, missing_gradients::skip);
  h.train(8);
  CHECK(h.finish() == reference);
}

TEST_CASE("reloading a parameter nobody edited changes nothing; a bf16 master keeps its low bits") {
  for (const auto& o : {sync_options(), dense_options(), zero_offload_options()}) {
    CAPTURE(offload_mode_name(o.mode));
    CAPTURE(o.overlap_step);
    const auto reference = reference_run(o, 12);
    harness h(o);
    h.train(5);
    for (std::size_t i = 0; i <= 2; ++i) h.coordinator.reload_parameter(i, &h.stream);
    h.train(7);
    CHECK(h.finish() == reference);
  }
}

TEST_CASE("an edit becomes the master of every column; moments and step counts stay; training goes on from it") {
  for (const std::int64_t before :
       {std::int64_t{0}, std::int64_t{5}}) {  // before the first step: every column on the CPU
    // Plain variables, not structured bindings: doctest's CAPTURE captures them in a lambda, which
    // clang before 16 refuses for a binding.
    for (const auto& setting :
         {std::pair{sync_options(), false}, std::pair{dense_options(), false}, std::pair{zero_offload_options(), false},
          std::pair{sync_options(), true}, std::pair{zero_offload_options(), true}}) {
      const zenflow_options& o = setting.first;
      const bool disk = setting.second;
      CAPTURE(before);
      CAPTURE(offload_mode_name(o.mode));
      CAPTURE(disk);
      zenflow_test::scratch_dir dir;
      harness h(o, disk ? harness::on_disk(dir.path()) : harness::small_config());
      h.train(before);
      h.stream.synchronize();
      auto& model = h.model;
      std::vector<std::vector<float>> kept;
      for (std::size_t i = 0; i < 2; ++i) kept.push_back(moments(h, i, model.weights[i].rows, model.weights[i].cols));
      const auto cpu_steps = h.coordinator.cpu_step_count(0), gpu_steps = h.coordinator.gpu_step_count(0);
      const double trained_loss = model.loss();
      // The trainer sets every weight to its target (the loss' minimum) and the bias too.
      for (auto& w : model.weights) edit(w, [&](index_t r, index_t c) { return w.target[r * w.cols + c]; });
      model.bias = model.bias_target;
      for (std::size_t i = 0; i <= 2; ++i) h.coordinator.reload_parameter(i, &h.stream);
      for (std::size_t i = 0; i < 2; ++i) {
        auto& w = model.weights[i];
        for (index_t c = 0; c < w.cols; ++c) {
          const auto master = master_column(h, i, c, w.rows);
          for (index_t r = 0; r < w.rows; ++r) REQUIRE(master[r] == value(w, r, c));  // exact upcast
        }
        CHECK(moments(h, i, w.rows, w.cols) == kept[i]);
      }
      std::vector<float> bias_state(3 * model.bias.size());
      h.coordinator.device_optimizer().export_state(device_index(h, 2, 10), bias_state);
      CHECK(std::equal(model.bias.begin(), model.bias.end(), bias_state.begin()));
      CHECK(h.coordinator.cpu_step_count(0) == cpu_steps);
      CHECK(h.coordinator.gpu_step_count(0) == gpu_steps);
      // Training continues from the edit: at the minimum, the next steps (GPU updates, CPU
      // updates and their write-backs) stay there instead of returning to the trained weights.
      const double edited_loss = model.loss();
      CHECK(edited_loss < 0.05 * toy_model().loss());
      h.train(4);
      h.finish();
      CHECK(model.loss() < 0.02 * toy_model().loss());  // back at the trained weights: about 0.9 of it
      CHECK(trained_loss > 0.5 * toy_model().loss());
    }
  }
}

TEST_CASE("an element the trainer left as it was keeps its fp32 master; an edited one takes the value") {
  for (const bool disk : {false, true}) {
    CAPTURE(disk);
    zenflow_test::scratch_dir dir;
    harness h(sync_options(), disk ? harness::on_disk(dir.path()) : harness::small_config());
    h.train(5);
    h.stream.synchronize();
    auto& w = h.model.weights[0];  // bf16
    REQUIRE(w.type == dtype::bf16);
    std::vector<std::vector<float>> before;
    for (index_t c = 0; c < w.cols; ++c) before.push_back(master_column(h, 0, c, w.rows));
    // The master is finer than its bf16 value (else the check below would not tell the rules apart).
    std::size_t finer = 0;
    for (index_t c = 0; c < w.cols; ++c)
      for (index_t r = 0; r < w.rows; ++r) finer += before[c][r] != value(w, r, c);
    REQUIRE(finer > static_cast<std::size_t>(w.rows * w.cols / 2));
    edit(w, [&](index_t r, index_t c) { return std::clamp(value(w, r, c), -0.05f, 0.05f); });  // p.clamp_()
    h.coordinator.reload_parameter(0, &h.stream);
    std::size_t clamped = 0;
    for (index_t c = 0; c < w.cols; ++c) {
      const auto master = master_column(h, 0, c, w.rows);
      for (index_t r = 0; r < w.rows; ++r) {
        const bool changed = from_float<bfloat16>(before[c][r]).bits != from_float<bfloat16>(value(w, r, c)).bits;
        clamped += changed;
        CHECK(master[r] == (changed ? value(w, r, c) : before[c][r]));
      }
    }
    CHECK(clamped > 0);
  }
}

TEST_CASE("an edit wins over a CPU update in flight; the other parameters get their results") {
  const auto o = base_options();  // async, intervals of 2 steps
  harness reference(o);
  reference.train(4);
  reference.stream.synchronize();

  for (const bool disk : {false, true}) {
    CAPTURE(disk);
    zenflow_test::scratch_dir dir;
    harness h(o, disk ? harness::on_disk(dir.path()) : harness::small_config());
    h.train(2);  // the CPU update of steps 0-1 is launched; it is written back at the end of step 3
    h.stream.synchronize();
    auto& w = h.model.weights[0];
    edit(w, [&](index_t r, index_t c) { return 0.25f - 0.01f * static_cast<float>((r + c) % 7); });
    const std::vector<std::byte> edited = w.storage;
    h.coordinator.reload_parameter(0, &h.stream);
    CHECK(h.coordinator.cpu_step_count(0) == 1);  // the update completed (its moments stay)
    const auto cpu_columns = complement_columns(h.coordinator.gpu_columns(0), w.cols);
    REQUIRE(!cpu_columns.empty());
    const auto cpu = zenflow_test::export_state(h.coordinator.host_optimizer(), 0);
    for (const auto c : cpu_columns)
      for (index_t r = 0; r < w.rows; ++r) {
        CHECK(cpu.master[c * w.rows + r] == value(w, r, c));
        CHECK(cpu.exp_avg[c * w.rows + r] != 0.0f);
      }
    h.train(2);  // the end of step 3 writes the pending result back
    h.stream.synchronize();
    REQUIRE(h.coordinator.trace()[0].written_back_at == 3);
    // w's CPU columns hold the edit, not the update's result; w1 and the bias are the reference's.
    toy_model edited_model;
    edited_model.weights[0].storage = edited;
    for (const auto c : cpu_columns)
      for (index_t r = 0; r < w.rows; ++r) CHECK(value(w, r, c) == value(edited_model.weights[0], r, c));
    CHECK(h.model.weights[1].storage == reference.model.weights[1].storage);
    CHECK(h.model.bias == reference.model.bias);
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
