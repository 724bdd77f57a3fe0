// The data-parallel schedule on one rank (self_communicator) against the single-process
// coordinator: the same steps, selections and write-backs, and, without clipping, the same
// parameters and CPU state bit for bit (with one rank the mean is the gradient itself). With
// clipping the factor is the same number, but the data-parallel schedule applies it to the CPU
// columns' reduced gradient in fp32 as they accumulate, where one process scales the gradient
// before offloading it in its dtype (bf16 here): the values agree within the tolerance of the
// multi-rank tests, and the schedule and skipped steps are identical. The one-GPU NCCL test
// (tests/nccl) checks the same for the CUDA backend; this runs in CI.
#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "../support/coordinator_instances.hpp"
#include "../support/data_parallel_model.hpp"
#include "../support/exported_state.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::host_stream;
using zenflow::missing_gradients;
using zenflow_test::data_parallel_model;

namespace {

using one_rank_coordinator = zenflow::data_parallel_host_coordinator<zenflow::self_communicator>;

void run_against_single_process(float max_grad_norm, bool with_nan_step,
                                zenflow::cpu_state_format cpu_state = zenflow::cpu_state_format::fp32) {
  const bool exact = max_grad_norm == 0.0f;
  const auto options = zenflow_test::data_parallel_test_options(max_grad_norm);
  zenflow::self_communicator comm;
  data_parallel_model dp_model, ref_model;
  zenflow::coordinator_config config;
  config.record_trace = true;
  config.cpu_state = cpu_state;
  one_rank_coordinator dp(comm, options, config);
  zenflow::host_coordinator ref(options, config);
  dp_model.register_with(dp);
  ref_model.register_with(ref);
  CHECK(dp.rank() == 0);
  CHECK(dp.ranks() == 1);
  host_stream s_dp, s_ref;
  for (int t = 0; t < 16; ++t) {
    CAPTURE(t);
    dp_model.make_gradients(t, 0, 1);
    ref_model.make_gradients(t, -1, 1);
    if (with_nan_step && t == 7) {
      dp_model.g2[5] = ref_model.g2[5] = std::numeric_limits<float>::quiet_NaN();
    }
    const bool with_w2 = !zenflow_test::w2_missing(t);
    dp_model.submit(dp, &s_dp, with_w2);
    ref_model.submit(ref, &s_ref, with_w2);
    const auto m = dp.step(&s_dp, missing_gradients::skip);
    const auto mr = ref.step(&s_ref, missing_gradients::skip);
    s_dp.synchronize();
    s_ref.synchronize();
    CHECK(m.reselected == mr.reselected);
    CHECK(m.cpu_update_launched == mr.cpu_update_launched);
    CHECK(m.written_back == mr.written_back);
    CHECK(m.bytes_device_to_host == mr.bytes_device_to_host);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto sel = dp.gpu_columns(i), ref_sel = ref.gpu_columns(i);
      CHECK(std::vector<std::int32_t>(sel.begin(), sel.end()) ==
            std::vector<std::int32_t>(ref_sel.begin(), ref_sel.end()));
    }
    CHECK(zenflow_test::parameters_apart(dp_model, ref_model, exact) == 0);
  }
  dp.finish(&s_dp);
  ref.finish(&s_ref);
  CHECK(zenflow_test::parameters_apart(dp_model, ref_model, exact) == 0);
  const auto trace = dp.trace(), ref_trace = ref.trace();
  REQUIRE(trace.size() == ref_trace.size());
  CHECK(trace.size() >= 5);
  for (std::size_t k = 0; k < trace.size(); ++k) {
    CHECK(trace[k].first_step == ref_trace[k].first_step);
    CHECK(trace[k].last_step == ref_trace[k].last_step);
    CHECK(trace[k].accumulated_steps == ref_trace[k].accumulated_steps);
    CHECK(trace[k].written_back_at == ref_trace[k].written_back_at);
  }
  if (with_nan_step) {  // step 7 was skipped: its interval averaged one step fewer than it spans
    bool saw_skip = false;
    for (const auto& r : trace)
      if (r.first_step <= 7 && 7 <= r.last_step) saw_skip = r.accumulated_steps == r.last_step - r.first_step;
    CHECK(saw_skip);
  }
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(dp.owned_columns(i).first == 0);
    CHECK(dp.owned_columns(i).last == (i == 0 ? data_parallel_model::c1 : data_parallel_model::c2));
    const auto& h = dp.host_optimizer();
    const auto& rh = ref.host_optimizer();
    CHECK(zenflow_test::state_apart(h.params(i), rh.params(i), exact, 2e-3f) == 0);
    CHECK(h.state_format() == cpu_state);
    const auto got = zenflow_test::export_state(h, i), want = zenflow_test::export_state(rh, i);
    CHECK(zenflow_test::state_apart(got.exp_avg, want.exp_avg, exact, 1e-2f) == 0);
    CHECK(zenflow_test::state_apart(got.exp_avg_sq, want.exp_avg_sq, exact, 1e-2f) == 0);
    CHECK(dp.cpu_step_count(i) == ref.cpu_step_count(i));
    CHECK(dp.gpu_step_count(i) == ref.gpu_step_count(i));
  }
}

}  // namespace

TEST_CASE("one rank of the data-parallel schedule equals one process, bit for bit") {
  run_against_single_process(0.0f, false);
}

TEST_CASE("one rank of the data-parallel schedule: clipping and a NaN step, within a tolerance of one process") {
  run_against_single_process(0.5f, true);
}

TEST_CASE("one rank of the data-parallel schedule with compact CPU moments equals one process, bit for bit") {
  for (const auto format : {zenflow::cpu_state_format::bf16_moments, zenflow::cpu_state_format::blockwise8_moments}) {
    CAPTURE(zenflow::cpu_state_format_name(format));
    run_against_single_process(0.0f, false, format);
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
