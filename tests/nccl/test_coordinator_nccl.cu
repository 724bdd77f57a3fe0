// The CUDA coordinator as one rank of a data-parallel group on NCCL, one rank on one GPU: the
// data-parallel schedule (every collective a one-rank NCCL call) against the single-process
// cuda_coordinator on the same gradients. As on the host (tests/unit/test_coordinator_one_rank),
// without clipping the parameters and the CPU state are bit-identical; with clipping and a NaN
// step the schedule and the skip are identical and the values within a tolerance. Then a per-rank
// checkpoint through the CUDA backend, and a failed communicator failing the step. Label "gpu".
#include <zenflow/coordinator.cuh>
#include <zenflow/nccl_communicator.cuh>

#include <doctest/doctest.h>

#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../support/cuda_test_utils.cuh"
#include "../support/error_text.hpp"
#include "device_model.cuh"

using zenflow::missing_gradients;
using zenflow::nccl_communicator;
using zenflow_test::contains;
using zenflow_test::data_parallel_model;
using zenflow_test::device_model;
using zenflow_test::error_of;

namespace {

using nccl_coordinator = zenflow::data_parallel_cuda_coordinator<nccl_communicator>;
static_assert(zenflow::coordinator_communicator<nccl_communicator, zenflow::cuda_backend>);

zenflow::coordinator_config traced() {
  zenflow::coordinator_config config;
  config.record_trace = true;
  return config;
}

void run_against_single_process(float max_grad_norm, bool with_nan_step) {
  const bool exact = max_grad_norm == 0.0f;
  const auto options = zenflow_test::data_parallel_test_options(max_grad_norm);
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
  device_model dp_model, ref_model;
  zenflow_test::cuda_stream dp_stream, ref_stream;
  const cudaStream_t s_dp = dp_stream.get(), s_ref = ref_stream.get();
  nccl_coordinator dp(comm, options, traced());
  zenflow::cuda_coordinator ref(options, traced());
  dp_model.register_with(dp);
  ref_model.register_with(ref);
  CHECK(dp.rank() == 0);
  CHECK(dp.ranks() == 1);
  for (int t = 0; t < 16; ++t) {
    CAPTURE(t);
    dp_model.host.make_gradients(t, 0, 1);
    ref_model.host.make_gradients(t, -1, 1);
    if (with_nan_step && t == 7) dp_model.host.g2[5] = ref_model.host.g2[5] = std::numeric_limits<float>::quiet_NaN();
    dp_model.upload_gradients(s_dp);
    ref_model.upload_gradients(s_ref);
    const bool with_w2 = !zenflow_test::w2_missing(t);
    dp_model.submit(dp, s_dp, with_w2);
    ref_model.submit(ref, s_ref, with_w2);
    const auto m = dp.step(s_dp, missing_gradients::skip);
    const auto mr = ref.step(s_ref, missing_gradients::skip);
    dp_model.bytes(s_dp);
    ref_model.bytes(s_ref);
    CHECK(m.reselected == mr.reselected);
    CHECK(m.cpu_update_launched == mr.cpu_update_launched);
    CHECK(m.written_back == mr.written_back);
    CHECK(m.bytes_device_to_host == mr.bytes_device_to_host);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto sel = dp.gpu_columns(i), ref_sel = ref.gpu_columns(i);
      CHECK(std::vector<std::int32_t>(sel.begin(), sel.end()) ==
            std::vector<std::int32_t>(ref_sel.begin(), ref_sel.end()));
    }
    CHECK(zenflow_test::parameters_apart(dp_model.host, ref_model.host, exact) == 0);
  }
  dp.finish(s_dp);
  ref.finish(s_ref);
  dp_model.bytes(s_dp);
  ref_model.bytes(s_ref);
  CHECK(zenflow_test::parameters_apart(dp_model.host, ref_model.host, exact) == 0);
  const auto trace = dp.trace(), ref_trace = ref.trace();
  REQUIRE(trace.size() == ref_trace.size());
  CHECK(trace.size() >= 5);
  for (std::size_t k = 0; k < trace.size(); ++k) {
    CHECK(trace[k].first_step == ref_trace[k].first_step);
    CHECK(trace[k].last_step == ref_trace[k].last_step);
    CHECK(trace[k].accumulated_steps == ref_trace[k].accumulated_steps);
    CHECK(trace[k].written_back_at == ref_trace[k].written_back_at);
    CHECK(trace[k].write_backs == 1);
  }
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(dp.owned_columns(i).first == 0);
    CHECK(dp.owned_columns(i).last == (i == 0 ? data_parallel_model::c1 : data_parallel_model::c2));
    const auto& h = dp.host_optimizer();
    const auto& rh = ref.host_optimizer();
    CHECK(zenflow_test::state_apart(h.params(i), rh.params(i), exact, 2e-3f) == 0);
    CHECK(zenflow_test::state_apart(h.exp_avg(i), rh.exp_avg(i), exact, 1e-2f) == 0);
    CHECK(zenflow_test::state_apart(h.exp_avg_sq(i), rh.exp_avg_sq(i), exact, 1e-2f) == 0);
    CHECK(dp.cpu_step_count(i) == ref.cpu_step_count(i));
    CHECK(dp.gpu_step_count(i) == ref.gpu_step_count(i));
  }
  comm.check();
}

}  // namespace

TEST_CASE("one rank on NCCL: the data-parallel CUDA coordinator equals cuda_coordinator, bit for bit") {
  run_against_single_process(0.0f, false);
}

TEST_CASE("one rank on NCCL: clipping and a NaN step, within a tolerance of cuda_coordinator") {
  run_against_single_process(0.5f, true);
}

TEST_CASE("one rank on NCCL: a per-rank checkpoint through the CUDA backend resumes bit-identically") {
  const auto options = zenflow_test::data_parallel_test_options(0.5f);
  const std::string path = "/tmp/zenflow_nccl_ckpt_" + std::to_string(static_cast<long>(getpid())) + ".bin";
  const auto run = [&](int from, int to, bool save_at_5, bool load_first) {
    nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
    device_model m;
    zenflow_test::cuda_stream stream;
    nccl_coordinator dp(comm, options);
    m.register_with(dp);
    if (load_first) dp.load_checkpoint(path, stream.get());
    for (int t = from; t < to; ++t) {
      if (save_at_5 && t == 5) dp.save_checkpoint(path, stream.get());  // a CPU update is pending (overlap_step)
      m.make_gradients(t, 0, 1, stream.get());
      m.submit(dp, stream.get(), !zenflow_test::w2_missing(t));
      dp.step(stream.get(), missing_gradients::skip);
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    }
    dp.finish(stream.get());
    return m.bytes(stream.get());
  };
  const auto uninterrupted = run(0, 10, true, false);
  CHECK(run(5, 10, false, true) == uninterrupted);
  std::remove(path.c_str());
}

TEST_CASE("one rank on NCCL: a failed communicator fails the step with its reason, and every later one") {
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
  device_model m;
  zenflow_test::cuda_stream stream;
  nccl_coordinator dp(comm, zenflow_test::data_parallel_test_options(0.0f));
  m.register_with(dp);
  for (int t = 0; t < 2; ++t) {
    m.make_gradients(t, 0, 1, stream.get());
    m.submit(dp, stream.get());
    dp.step(stream.get());
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  }
  comm.abort("the trainer gave up");
  m.make_gradients(2, 0, 1, stream.get());
  m.submit(dp, stream.get());
  CHECK(contains(error_of([&] { dp.step(stream.get()); }), "the trainer gave up"));
  CHECK(contains(error_of([&] { dp.step(stream.get()); }), "the trainer gave up"));
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream.get()));
}
