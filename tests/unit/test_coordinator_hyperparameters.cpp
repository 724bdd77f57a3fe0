// Learning-rate schedules and parameter groups on the coordinator: the rule that decides which
// hyper-parameters an update uses (GPU columns: those set before the step; a CPU update: those
// in effect when its interval ended), per-parameter lr / weight decay, checkpoints that keep them.
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <vector>

#include "coordinator_harness.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

// Trains with lr(step) set before each step; `groups` gives the bias no weight decay and the
// bf16 weight twice the learning rate.
template <class Harness>
void train_scheduled(Harness& h, std::int64_t steps, bool groups) {
  for (std::int64_t s = 0; s < steps; ++s) {
    const std::int64_t step = h.coordinator.step_count();
    adam_options a = h.coordinator.options().adam;
    a.lr = 0.02f / static_cast<float>(1 + step);  // a decay schedule
    h.coordinator.set_adam_options(a);
    if (groups) {
      adam_options no_decay = a, faster = a;
      no_decay.weight_decay = 0.0f;
      faster.lr = 2.0f * a.lr;
      h.coordinator.set_adam_options(2, no_decay);
      h.coordinator.set_adam_options(0, faster);
    }
    h.train(1);
  }
}

}  // namespace

TEST_CASE("a schedule and parameter groups reach the GPU and the CPU path alike") {
  // Dense runs everything on the GPU path, ZeRO-Offload every matrix on the CPU path (an interval
  // of one step, which ends where it began): with the same schedule and groups they agree bit for
  // bit on the f32 weight and the bias.
  for (bool groups : {false, true}) {
    CAPTURE(groups);
    auto dense_opts = zenflow_options::dense();
    dense_opts.adam = base_options().adam;
    auto zero = zenflow_options::zero_offload();
    zero.adam = base_options().adam;
    harness dense(dense_opts), offload(zero), constant(dense_opts);
    train_scheduled(dense, 12, groups);
    train_scheduled(offload, 12, groups);
    constant.train(12);
    dense.finish();
    offload.finish();
    constant.finish();
    CHECK(dense.model.weights[1].storage == offload.model.weights[1].storage);
    CHECK(dense.model.bias == offload.model.bias);
    CHECK(dense.model.weights[1].storage != constant.model.weights[1].storage);  // the schedule was used
  }
  auto dense_opts = zenflow_options::dense();
  dense_opts.adam = base_options().adam;
  harness plain(dense_opts), grouped(dense_opts);
  train_scheduled(plain, 6, false);
  train_scheduled(grouped, 6, true);
  plain.finish();
  grouped.finish();
  CHECK(plain.model.bias != grouped.model.bias);  // the groups were used
  CHECK(plain.model.weights[0].storage != grouped.model.weights[0].storage);
  CHECK(plain.model.weights[1].storage == grouped.model.weights[1].storage);  // not in a group
}

TEST_CASE("the CPU update of an interval uses the hyper-parameters in effect when the interval ended") {
  // lr is 0 everywhere except in step 1, which ends the interval [0, 1]: the GPU columns move in
  // step 1 only, and the CPU columns move exactly once, by the update of [0, 1] -- whether it runs
  // synchronously or while later steps (with lr 0 again) train.
  for (bool overlap : {true, false}) {
    CAPTURE(overlap);
    auto o = base_options();
    o.adam.weight_decay = 0.0f;
    o.update_interval = interval_option::fixed(2);
    o.select_interval = interval_option::fixed(100);
    o.overlap_step = overlap;
    harness h(o);
    std::vector<std::byte> before = h.model.snapshot(), after_step1;
    for (std::int64_t s = 0; s < 6; ++s) {
      adam_options a = o.adam;
      a.lr = s == 1 ? 0.05f : 0.0f;
      h.coordinator.set_adam_options(a);
      CHECK(h.coordinator.adam_options_of(0).lr == a.lr);
      h.train(1);
      h.stream.synchronize();
      if (s == 1) after_step1 = h.model.snapshot();
    }
    h.finish();
    const auto cpu_columns = complement_columns(h.coordinator.gpu_columns(1), h.model.weights[1].cols);
    const auto gpu_columns = h.coordinator.gpu_columns(1);
    const auto& w = h.model.weights[1];  // f32, column-contiguous: column c at c * rows
    auto column = [&](const std::vector<std::byte>& all, std::int32_t c) {
      const auto* base = reinterpret_cast<const float*>(all.data() + h.model.weights[0].storage.size());
      return std::vector<float>(base + c * w.rows, base + (c + 1) * w.rows);
    };
    const auto final_state = h.model.snapshot();
    for (std::int32_t c : gpu_columns) {
      CHECK(column(after_step1, c) != column(before, c));       // moved in step 1
      CHECK(column(final_state, c) == column(after_step1, c));  // and never again
    }
    for (std::int32_t c : cpu_columns) CHECK(column(final_state, c) != column(before, c));  // the update of [0, 1]
    CHECK(h.coordinator.host_optimizer().step_count() == 3);  // [0, 1], [2, 3], [4, 5]: two of them with lr 0
    // With lr 0 from the start, nothing moves at all: the CPU columns moved by [0, 1]'s lr alone.
    harness still(o);
    adam_options zero_lr = o.adam;
    zero_lr.lr = 0.0f;
    still.coordinator.set_adam_options(zero_lr);
    still.train(6);
    CHECK(still.finish() == before);
  }
}

TEST_CASE("hyper-parameters: bad values are rejected before anything changes; checkpoints keep them") {
  harness h(base_options());
  adam_options a = base_options().adam;
  a.beta1 = 0.8f;
  CHECK_THROWS_WITH_AS(h.coordinator.set_adam_options(1, a), doctest::Contains("beta1"), zenflow::error);
  a = base_options().adam;
  a.lr = -1.0f;
  CHECK_THROWS_WITH_AS(h.coordinator.set_adam_options(a), doctest::Contains("lr"), zenflow::error);
  CHECK_THROWS_AS(h.coordinator.set_adam_options(7, base_options().adam), zenflow::error);
  CHECK(h.coordinator.adam_options_of(1) == base_options().adam);

  const auto path = (std::filesystem::temp_directory_path() / "zenflow_test_hyperparameters.bin").string();
  auto o = base_options();
  o.update_interval = interval_option::fixed(3);
  harness uninterrupted(o);
  train_scheduled(uninterrupted, 16, true);
  const auto reference = uninterrupted.finish();
  harness first(o);
  train_scheduled(first, 8, true);  // mid-interval, a CPU update pending
  first.coordinator.save_checkpoint(path, &first.stream);
  harness second(o);
  second.coordinator.load_checkpoint(path, &second.stream);
  CHECK(second.coordinator.adam_options_of(0).lr == first.coordinator.adam_options_of(0).lr);
  CHECK(second.coordinator.adam_options_of(2).weight_decay == 0.0f);
  train_scheduled(second, 8, true);
  CHECK(second.finish() == reference);
  std::filesystem::remove(path);
}

}  // namespace ZENFLOW_TEST_FILE_ID
