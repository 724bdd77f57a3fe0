// zenflow_options::cover_cpu_update on a coordinator whose CPU update takes longer than the "auto"
// interval the gradient masses ask for (a CPU optimizer that sleeps, as one streaming its state
// from an SSD waits on the disk):
//   - without the rule, ZenFlow async stalls at every interval's end on the previous update;
//   - with it, the interval grows to what the measured update needs at the measured pace of the
//     steps (step_metrics::interval_floor), the stall goes away, and the staleness bound still
//     holds for intervals of changing length.
// The timings are sleeps far apart (an update of 300 ms, steps of about 12 ms: the toy's masses
// ask for 8-step intervals, 96 ms; the rule for about 28), so the checks hold with steps up to
// twice as slow (a loaded machine, the sanitizers); the rule's arithmetic is tested alone in
// test_schedule.cpp.
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <thread>
#include <vector>

#include "coordinator_harness.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

// A CPU optimizer whose updates take 300 ms more than the arithmetic.
using slow_harness = basic_harness<basic_coordinator<host_backend, delayed_cpu_adam<300>>>;

zenflow_options auto_interval(bool cover) {
  zenflow_options o = base_options();
  o.update_interval = interval_option::automatic();
  o.select_interval = interval_option::fixed(100);
  o.max_update_interval = 40;
  o.cover_cpu_update = cover;
  o.validate();
  return o;
}

struct run_result {
  double late_stall = 0.0;        // stall of the steps after the first 16
  std::int64_t max_floor = 0;     // the largest interval_floor reported
  std::int64_t max_interval = 0;  // the longest interval
  std::vector<step_metrics> steps;
  std::vector<update_record> trace;
};

// `steps` steps of about 12 ms of "GPU work" each (a sleep before the gradients arrive).
run_result train(bool cover, std::int64_t steps) {
  slow_harness h(auto_interval(cover));
  run_result r;
  for (std::int64_t s = 0; s < steps; ++s) {
    h.backward();
    std::this_thread::sleep_for(std::chrono::milliseconds(12));
    for (std::size_t i = 0; i <= h.model.weights.size(); ++i) h.submit(i);
    h.coordinator.step(&h.stream);
    const step_metrics& m = h.coordinator.metrics();
    r.steps.push_back(m);
    if (s >= 16) r.late_stall += m.stall_seconds;
    r.max_floor = std::max(r.max_floor, m.interval_floor);
    r.max_interval = std::max(r.max_interval, m.interval);
  }
  h.finish();
  r.trace = h.coordinator.trace();
  return r;
}

}  // namespace

TEST_CASE("cover_cpu_update: the auto interval grows to cover a slow CPU update, and ZenFlow async stops stalling") {
  constexpr std::int64_t steps = 64;
  const run_result plain = train(/*cover=*/false, steps);
  const run_result covered = train(/*cover=*/true, steps);

  // Without the rule: the masses' length, no floor, and a stall at the intervals' ends.
  CHECK(plain.max_floor == 0);
  INFO("masses' interval " << plain.max_interval << ", stall without the rule " << plain.late_stall * 1e3
                           << " ms, with it " << covered.late_stall * 1e3 << " ms, floor " << covered.max_floor);
  REQUIRE(plain.max_interval <= 10);  // shorter than the update needs: the case to cover
  CHECK(plain.late_stall > 0.2);      // ~300 - 8 x 12 ms at each of the 6 intervals' ends

  // With it: a floor of about 1.1 x 300 / 12 ~ 28 steps (fewer when the steps run slower), the
  // intervals at least that long, and at most a fifth of the stall.
  CHECK(covered.max_floor > plain.max_interval);
  for (const step_metrics& m : covered.steps) {
    CAPTURE(m.step);
    CHECK(m.interval >= m.interval_floor);
    CHECK(m.interval <= 40);
  }
  CHECK(covered.late_stall < 0.2 * plain.late_stall);
  check_staleness(covered.trace, steps, /*overlap=*/true);
}

TEST_CASE("cover_cpu_update: a checkpoint keeps the interval's length; the floor is measured again after a load") {
  slow_harness a(auto_interval(true));
  for (std::int64_t s = 0; s < 24; ++s) {
    a.backward();
    std::this_thread::sleep_for(std::chrono::milliseconds(12));
    for (std::size_t i = 0; i <= a.model.weights.size(); ++i) a.submit(i);
    a.coordinator.step(&a.stream);
  }
  const std::int64_t length = a.coordinator.metrics().interval;
  CHECK(length > 1);
  const auto path = (std::filesystem::temp_directory_path() / "zenflow_test_cover_update.bin").string();
  a.coordinator.save_checkpoint(path, &a.stream);

  slow_harness b(auto_interval(true));
  b.coordinator.load_checkpoint(path, &b.stream);
  std::filesystem::remove(path);
  b.train(1);
  CHECK(b.coordinator.metrics().interval == length);   // the saved length stands
  CHECK(b.coordinator.metrics().interval_floor == 0);  // not measured in this process yet
  a.finish();
  b.finish();
}

}  // namespace ZENFLOW_TEST_FILE_ID
