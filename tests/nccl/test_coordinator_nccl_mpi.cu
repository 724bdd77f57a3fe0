// The data-parallel CUDA coordinator on NCCL under mpirun (2 and 3 ranks), one rank per GPU,
// bootstrapped over MPI: N ranks on N micro-batches against cuda_coordinator on their mean gradient
// (run on every rank's own GPU), bit for bit on 2 ranks without clipping (support/data_parallel_model.hpp
// makes every sum exact) and within the multi-rank tolerances otherwise (clipping on some steps,
// gradients whose ranks would each select other columns, 4x larger shapes); identical parameters on every
// rank after every step; 1/N of the CPU state per rank; a rank that aborts makes every rank's step
// fail at once with its reason (the MPI bootstrap is the NCCL communicator's abort channel).
// Skipped (exit 77) with fewer GPUs than ranks.
#include <zenflow/coordinator.cuh>
#include <zenflow/mpi_communicator.hpp>
#include <zenflow/nccl_communicator.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../support/cuda_test_utils.cuh"
#include "../support/error_text.hpp"
#include "device_model.cuh"
#include "mpi_bootstrap.cuh"
#include "mpi_doctest.hpp"

using namespace std::chrono_literals;
using zenflow::missing_gradients;
using zenflow::nccl_communicator;
using zenflow_test::contains;
using zenflow_test::device_model;
using zenflow_test::error_of;
using zenflow_test::make_communicator;
using zenflow_test::same_on_every_rank;
using zenflow_test::world_rank;
using zenflow_test::world_size;

namespace {

using nccl_coordinator = zenflow::data_parallel_cuda_coordinator<nccl_communicator>;

// As tests/mpi/test_coordinator_data_parallel.cpp's run against one process (scenario), on GPUs.
template <int Scale>
void run_against_reference(const zenflow_test::scenario& how) {
  using model = zenflow_test::basic_data_parallel_model<Scale>;
  const int rank = world_rank(), ranks = world_size(), steps = 14;
  const auto norms = zenflow_test::mean_gradient_norms<model>(steps, ranks, how.rank_specific);
  const float max_grad_norm = how.clip ? zenflow_test::threshold_between(norms) : 0.0f;
  const auto options = zenflow_test::data_parallel_test_options(max_grad_norm);
  nccl_communicator comm = make_communicator();
  zenflow_test::basic_device_model<Scale> dp_model, ref_model;
  zenflow_test::cuda_stream dp_stream, ref_stream;
  const cudaStream_t s_dp = dp_stream.get(), s_ref = ref_stream.get();
  nccl_coordinator dp(comm, options);
  zenflow::cuda_coordinator ref(options);
  dp_model.register_with(dp);
  ref_model.register_with(ref);
  REQUIRE(dp.rank() == rank);
  REQUIRE(dp.ranks() == ranks);
  for (int t = 0; t < steps; ++t) {
    CAPTURE(t);
    if (how.rank_specific) {
      dp_model.make_rank_specific_gradients(t, rank, ranks, s_dp);
      ref_model.make_rank_specific_gradients(t, -1, ranks, s_ref);
    } else {
      dp_model.make_gradients(t, rank, ranks, s_dp);
      ref_model.make_gradients(t, -1, ranks, s_ref);
    }
    const bool with_w2 = !zenflow_test::w2_missing(t);
    dp_model.submit(dp, s_dp, with_w2);
    ref_model.submit(ref, s_ref, with_w2);
    const auto m = dp.step(s_dp, missing_gradients::skip);
    const auto mr = ref.step(s_ref, missing_gradients::skip);
    const auto got = dp_model.bytes(s_dp);
    const auto want = ref_model.bytes(s_ref);
    CHECK(m.reselected == mr.reselected);
    CHECK(m.written_back == mr.written_back);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto sel = dp.gpu_columns(i), ref_sel = ref.gpu_columns(i);
      CHECK(std::vector<std::int32_t>(sel.begin(), sel.end()) ==
            std::vector<std::int32_t>(ref_sel.begin(), ref_sel.end()));
    }
    CHECK(same_on_every_rank(got));
    if (how.exact) {
      CHECK(got == want);
    } else {
      const auto& a = dp_model.host;
      const auto& b = ref_model.host;
      const std::size_t n = a.w1.size() + a.w2.size() + a.b.size();
      CHECK(zenflow_test::far(zenflow_test::w1_values(a), zenflow_test::w1_values(b), 1e-2f) +
                zenflow_test::far(a.w2, b.w2, how.tolerance) + zenflow_test::far(a.b, b.b, how.tolerance) <=
            std::max<std::size_t>(1, n / 100));
    }
  }
  dp.finish(s_dp);
  ref.finish(s_ref);
  const auto final_bytes = dp_model.bytes(s_dp);
  if (how.exact) CHECK(final_bytes == ref_model.bytes(s_ref));
  CHECK(same_on_every_rank(final_bytes));
  // This rank's CPU state: its own columns of the reference's, and nothing else.
  std::size_t held = 0, total = 0;
  for (std::size_t i = 0; i < 2; ++i) {
    const auto range = dp.owned_columns(i);
    const std::size_t rows = i == 0 ? model::r1 : model::r2;
    const std::size_t cols = i == 0 ? model::c1 : model::c2;
    CHECK(range.first == static_cast<zenflow::index_t>(cols * rank / ranks));
    CHECK(range.last == static_cast<zenflow::index_t>(cols * (rank + 1) / ranks));
    const auto& host = dp.host_optimizer();
    const auto& ref_host = ref.host_optimizer();
    REQUIRE(host.params(i).size() == rows * static_cast<std::size_t>(range.size()));
    held += 3 * host.params(i).size() * sizeof(float);
    total += 3 * ref_host.params(i).size() * sizeof(float);
    const std::size_t at = rows * static_cast<std::size_t>(range.first), n = host.params(i).size();
    const float moments = i == 0 ? 1e-2f : how.tolerance;
    int part = 0;
    for (const auto& [mine, theirs] :
         {std::pair{host.params(i), ref_host.params(i)}, std::pair{host.exp_avg(i), ref_host.exp_avg(i)},
          std::pair{host.exp_avg_sq(i), ref_host.exp_avg_sq(i)}}) {
      const auto wanted = std::span<const float>(theirs).subspan(at, n);
      if (how.exact)
        CHECK(zenflow_test::state_apart(std::span<const float>(mine), wanted, true, 0.0f) == 0);
      else if (part == 0)
        CHECK(zenflow_test::far(mine, wanted, how.tolerance) <= std::max<std::size_t>(1, n / 100));
      else
        CHECK(zenflow_test::far(mine, wanted, moments) == 0);
      ++part;
    }
    CHECK(dp.cpu_step_count(i) == ref.cpu_step_count(i));
  }
  long long sum = static_cast<long long>(held);
  MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == static_cast<long long>(total));
  if (rank == 0)
    MESSAGE("CPU state per rank: ", held, " of ", total, " bytes (", static_cast<double>(held) / total, ") on ", ranks,
            " ranks");
  comm.check();
}

}  // namespace

TEST_CASE("N ranks on NCCL equal cuda_coordinator on the mean gradient (bit for bit on 2 ranks)") {
  run_against_reference<1>({.exact = world_size() == 2});
}

TEST_CASE("on NCCL, clipping on some steps only, by one global norm across the ranks") {
  run_against_reference<1>({.clip = true});
}

TEST_CASE("on NCCL, gradients whose ranks would each select other columns: the summed scores select") {
  run_against_reference<1>({.rank_specific = true, .exact = world_size() == 2});
}

TEST_CASE("on NCCL, larger shapes (4x every dimension), with and without clipping") {
  run_against_reference<4>({.exact = world_size() == 2});
  run_against_reference<4>({.clip = true});
}

TEST_CASE("a rank that aborts makes every rank's step fail at once with its reason") {
  // The NCCL communicator's abort channel is its MPI bootstrap: the peers' watchdogs read the
  // reason there and abort their own kernels, long before the 60 s timeout.
  const int rank = world_rank(), ranks = world_size();
  nccl_communicator comm = make_communicator(60s);
  device_model m;
  zenflow_test::cuda_stream stream;
  nccl_coordinator dp(comm, zenflow_test::data_parallel_test_options(0.0f));
  m.register_with(dp);
  for (int t = 0; t < 2; ++t) {
    m.make_gradients(t, rank, ranks, stream.get());
    m.submit(dp, stream.get());
    dp.step(stream.get());
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  }
  m.make_gradients(2, rank, ranks, stream.get());
  m.submit(dp, stream.get());
  MPI_Barrier(MPI_COMM_WORLD);  // every rank finished step 1's collectives
  const auto start = std::chrono::steady_clock::now();
  if (rank == 1) comm.abort("rank 1 ran out of memory");
  // The step fails at once on rank 1; on its peers in the step, or in the next call that looks at
  // the communicator.
  std::string e = error_of([&] {
    dp.step(stream.get());
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  });
  while (e.empty() && std::chrono::steady_clock::now() < start + 30s) e = error_of([&] { comm.check(); });
  CAPTURE(e);
  CHECK(contains(e, "rank 1 ran out of memory"));
  CHECK(std::chrono::steady_clock::now() - start < 15s);
  MPI_Barrier(MPI_COMM_WORLD);
}
