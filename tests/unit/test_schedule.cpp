// The coordinator's schedule alone (detail/coordinator/schedule.hpp), without a backend:
//   - warm-up and overlap by mode;
//   - the intervals a run of steps makes (fixed length after warm-up, one step in warm-up);
//   - when a step selects: after warm-up, as the policy says, dense once, and a selection that a
//     skipped step postponed;
//   - the "auto" length from the selection's masses, its bound and its degenerate inputs;
//   - the pending write-back;
//   - which checkpoint positions are rejected, with the words the coordinator has always used.
#include <zenflow/coordinator.hpp>

#include "../support/error_text.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::interval_option;
using zenflow::offload_mode;
using zenflow::zenflow_options;
using zenflow::detail::interval_masses;
using zenflow::detail::schedule;
using zenflow::detail::schedule_position;
using zenflow::detail::selection_facts;
using zenflow_test::contains;
using zenflow_test::error_of;

namespace {

zenflow_options zenflow_mode(std::int64_t warm_up, std::int64_t update_interval, bool overlap = true) {
  zenflow_options o;
  o.mode = offload_mode::zenflow;
  o.full_warm_up_rounds = warm_up;
  o.update_interval = interval_option::fixed(update_interval);
  o.select_interval = interval_option::fixed(4);
  o.overlap_step = overlap;
  o.validate();
  return o;
}

// The steps at which intervals end over `steps` steps, as the coordinator drives the schedule
// (no CPU columns matter here: every end begins the next interval).
std::vector<std::int64_t> interval_ends(schedule& s, std::int64_t steps) {
  std::vector<std::int64_t> ends;
  s.start(0);
  for (std::int64_t step = 0; step < steps; ++step) {
    if (s.count_step(step)) {
      ends.push_back(step);
      s.begin_interval(s.interval() + 1, step + 1);
    }
    s.step_done(step + 1);
  }
  return ends;
}

// schedule::selects asks for the facts through a callable (only when they matter).
const auto unselected = [] {
  return selection_facts{.has_matrices = true, .any_selection = false, .dense_unselected = true};
};
const auto selected_once = [] {
  return selection_facts{.has_matrices = true, .any_selection = true, .dense_unselected = false};
};
const auto no_matrices = [] { return selection_facts{}; };

}  // namespace

TEST_CASE("warm-up: every ZeRO-Offload step, the first full_warm_up_rounds steps of ZenFlow") {
  auto zero = zenflow_options::zero_offload();
  zero.validate();
  const schedule z(zero);
  CHECK(z.in_warm_up(0));
  CHECK(z.in_warm_up(1000));
  CHECK(!z.overlapped(1000));

  const schedule s(zenflow_mode(3, 2));
  CHECK(s.in_warm_up(2));
  CHECK(!s.in_warm_up(3));
  CHECK(!s.overlapped(2));
  CHECK(s.overlapped(3));
  CHECK(!schedule(zenflow_mode(3, 2, /*overlap=*/false)).overlapped(3));
}

TEST_CASE("intervals: one step each in warm-up, then update_interval steps") {
  schedule s(zenflow_mode(2, 3));
  CHECK(interval_ends(s, 11) == std::vector<std::int64_t>{0, 1, 4, 7, 10});
  CHECK(s.interval() == 5);
  CHECK(s.position().interval_first_step == 11);
  CHECK(s.target() == 3);

  schedule none(zenflow_mode(0, 4));
  CHECK(interval_ends(none, 9) == std::vector<std::int64_t>{3, 7});
  CHECK(none.interval_steps() == 1);

  auto zero = zenflow_options::zero_offload();
  zero.validate();
  schedule z(zero);
  CHECK(interval_ends(z, 3) == std::vector<std::int64_t>{0, 1, 2});
}

TEST_CASE("selection steps: after warm-up as the policy says, dense once, postponed by a skipped step") {
  schedule s(zenflow_mode(2, 2));
  s.start(0);
  CHECK(!s.selects(1, unselected));    // warm-up
  CHECK(s.selects(2, unselected));     // the first step after it
  CHECK(!s.selects(3, no_matrices));   // nothing 2-D: only the policy's steps
  CHECK(s.selects(2, selected_once));  // the policy's step 0
  CHECK(!s.selects(3, selected_once));
  CHECK(s.selects(6, selected_once));  // select_interval 4, counted from the end of warm-up
  CHECK(s.selects(5, unselected));     // a parameter still waits for its first selection

  // A selection step whose gradients were not finite: the next step selects, whatever the policy.
  s.postpone_selection();
  CHECK(s.selects(3, selected_once));
  CHECK(s.position().selection_due);
  s.selected(interval_masses{});
  CHECK(!s.position().selection_due);
  CHECK(!s.selects(3, selected_once));
  CHECK(s.target() == 2);

  auto dense = zenflow_options::dense();
  dense.validate();
  schedule d(dense);
  d.start(0);
  CHECK(d.selects(0, unselected));
  CHECK(!d.selects(4, selected_once));  // dense selects every column once, for good
}

TEST_CASE("auto interval: ceil(important per GPU column / unimportant per CPU column) in [1, bound]") {
  // 6 over 2 GPU columns, 9 over 9 CPU columns: 3 per GPU column against 1 per CPU column.
  CHECK(schedule::auto_length({6.0, 9.0, 2, 9}, 16) == 3);
  CHECK(schedule::auto_length({6.4, 9.0, 2, 9}, 16) == 4);
  CHECK(schedule::auto_length({1000.0, 1.0, 1, 1}, 16) == 16);  // the bound
  CHECK(schedule::auto_length({0.1, 9.0, 1, 1}, 16) == 1);      // at least one step
  // No unimportant mass, no GPU or no CPU columns: the bound.
  CHECK(schedule::auto_length({5.0, 0.0, 2, 9}, 16) == 16);
  CHECK(schedule::auto_length({5.0, 1.0, 0, 9}, 16) == 16);
  CHECK(schedule::auto_length({5.0, 1.0, 2, 0}, 16) == 16);
  CHECK(schedule::auto_length({5.0, std::numeric_limits<double>::quiet_NaN(), 2, 9}, 16) == 16);
  CHECK(schedule::auto_length({std::numeric_limits<double>::infinity(), 1.0, 2, 9}, 16) == 1);

  auto o = zenflow_mode(0, 2);
  o.update_interval = interval_option::automatic();
  o.max_update_interval = 8;
  o.validate();
  schedule s(o);
  s.start(0);
  CHECK(s.target() == 1);  // until the first selection sets it
  CHECK(s.wants_masses());
  s.selected({6.0, 9.0, 2, 9});
  CHECK(s.target() == 3);
  s.selected({1000.0, 1.0, 1, 1});
  CHECK(s.target() == 4);  // the bound: max_update_interval 8, held to the selection interval 4
  CHECK(!schedule(zenflow_mode(0, 2)).wants_masses());
}

TEST_CASE("cover_cpu_update: the auto interval is no shorter than the measured CPU update needs") {
  auto o = zenflow_mode(2, 2);
  o.update_interval = interval_option::automatic();
  o.select_interval = interval_option::fixed(20);
  o.max_update_interval = 12;
  o.cover_cpu_update = true;
  o.validate();
  schedule s(o);
  // ceil(1.1 * update / step), in [1, bound]; nothing measured: 0.
  CHECK(s.steps_for_update(0.095, 0.010) == 11);  // 10.45 steps
  CHECK(s.steps_for_update(0.050, 0.010) == 6);   // 5.5
  CHECK(s.steps_for_update(0.001, 0.010) == 1);
  CHECK(s.steps_for_update(10.0, 0.010) == 12);  // the bound
  CHECK(s.steps_for_update(0.0, 0.010) == 0);
  CHECK(s.steps_for_update(0.050, 0.0) == 0);
  CHECK(s.steps_for_update(0.050, -1.0) == 0);  // stalls exceeding the elapsed time: no measure
  CHECK(s.steps_for_update(std::numeric_limits<double>::quiet_NaN(), 0.01) == 0);

  s.start(0);
  CHECK(!s.covers_cpu_update(0));  // warm-up: every update synchronous
  CHECK(!s.covers_cpu_update(1));
  CHECK(s.covers_cpu_update(2));
  s.cover(7);  // before the first selection: the floor is kept, the interval stays 1 step
  CHECK(s.target() == 1);
  CHECK(s.cpu_update_floor() == 7);
  s.selected({6.0, 9.0, 2, 9});  // masses: 3 steps; the floor: 7
  CHECK(s.target() == 7);
  s.cover(2);  // a faster update lowers the floor: the masses' length
  CHECK(s.target() == 3);
  s.cover(0);  // nothing measured: unchanged
  CHECK(s.target() == 3);
  s.cover(40);  // held to the bound
  CHECK(s.target() == 12);
  CHECK(s.cpu_update_floor() == 12);
  s.selected({0.1, 9.0, 1, 1});  // a new selection of 1 step keeps the floor
  CHECK(s.target() == 12);

  // Off (the default), the same calls leave the masses' length alone.
  auto off = o;
  off.cover_cpu_update = false;
  schedule plain(off);
  plain.start(0);
  CHECK(!plain.covers_cpu_update(5));
  // ZeRO-Offload and dense ignore the option (their modes imply the rest).
  auto zero = o;
  zero.mode = offload_mode::zero_offload;
  zero.validate();
  CHECK(!schedule(zero).covers_cpu_update(5));

  // Contradictions are rejected naming the option.
  auto fixed = o;
  fixed.update_interval = interval_option::fixed(4);
  CHECK(contains(error_of([&] { fixed.validate(); }), "cover_cpu_update"));
  CHECK(contains(error_of([&] { fixed.validate(); }), "fixed at 4 steps"));
  auto sync = o;
  sync.overlap_step = false;
  CHECK(contains(error_of([&] { sync.validate(); }), "cover_cpu_update: needs overlap_step"));
}

TEST_CASE("the pending write-back: set when a CPU update is launched, cleared by its own write-back") {
  schedule s(zenflow_mode(0, 2));
  s.start(0);
  CHECK(!s.pending());
  s.awaits_write_back(4);
  REQUIRE(s.pending());
  CHECK(*s.pending() == 4);
  s.written_back(3);
  CHECK(s.pending());
  s.written_back(4);
  CHECK(!s.pending());
  CHECK(s.position().pending == -1);
}

TEST_CASE("checkpoint positions: consistent ones restored, inconsistent ones rejected naming what is wrong") {
  const schedule s(zenflow_mode(0, 4));
  // Step 9: interval 2 began at step 8 (intervals 0 and 1 were steps 0-3 and 4-7), one step in,
  // interval 1 awaiting its write-back.
  const schedule_position good{true, 2, 8, 1, 4, 1, false};
  CHECK_NOTHROW(s.check(good, 9, 1, 4, 1, 9));
  schedule restored(zenflow_mode(0, 4));
  restored.restore(good);
  CHECK(restored.interval() == 2);
  CHECK(*restored.pending() == 1);

  auto bad = [&](schedule_position at, std::int64_t step, std::int64_t current, std::int64_t pending_count,
                 std::int64_t host_steps, std::int64_t device_steps, const char* words) {
    const auto message = error_of([&] { s.check(at, step, current, pending_count, host_steps, device_steps); });
    INFO(message);
    CHECK(contains(message, "checkpoint"));
    CHECK(contains(message, words));
  };
  auto at = good;
  at.interval_steps = 2;  // not step - first_step
  bad(at, 9, 1, 4, 1, 9, "inconsistent position");
  bad(schedule_position{false, 0, 0, 0, 1, -1, false}, 3, 0, 0, 0, 0, "inconsistent position");  // steps, not started
  at = good;
  at.target = 5;  // above update_interval
  bad(at, 9, 1, 4, 1, 9, "update interval target of 5");
  at = good;
  at.target = 1;  // already reached
  bad(at, 9, 1, 4, 1, 9, "update interval target of 1");
  at = good;
  at.pending = 0;  // only the previous interval can be pending
  bad(at, 9, 1, 4, 1, 9, "pending interval 0");
  bad(good, 9, 2, 4, 1, 9, "accumulated step counts");  // more than the interval's steps
  bad(good, 9, 1, 9, 1, 9, "accumulated step counts");  // more than the pending interval had
  bad(good, 9, 1, 4, 3, 9, "optimizer step counts");    // more CPU updates than intervals
  bad(good, 9, 1, 4, 1, 10, "optimizer step counts");   // more GPU updates than steps

  const schedule no_overlap(zenflow_mode(0, 4, /*overlap=*/false));
  const auto message = error_of([&] { no_overlap.check(good, 9, 1, 4, 1, 9); });
  CHECK(contains(message, "these options never leave one pending"));
}

}  // namespace ZENFLOW_TEST_FILE_ID
