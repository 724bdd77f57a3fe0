// What a data-parallel step costs, counted through the backend and communicator interfaces on one
// rank (self_communicator; tests/mpi/test_coordinator_costs.cpp does the same on 2 and 3 ranks):
//   - between selections a step never synchronizes the trainer's stream (the host reads which
//     parameters got gradients on the coordinator's own stream) and launches a constant number of
//     times whatever the number of parameters (its gradients' collectives go out as one group);
//   - reselections reuse the buffers sized at the first one (a cudaFree, which every reallocation
//     implies on a GPU, waits for the whole device).
#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <cstdint>

#include "../support/counting_communicator.hpp"
#include "../support/data_parallel_model.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::host_stream;
using zenflow_test::counting_backend;
using zenflow_test::counting_communicator;
using zenflow_test::wide_model;

namespace {

using counted_self = counting_communicator<zenflow::self_communicator>;
using coordinator = zenflow::basic_coordinator<counting_backend, zenflow::cpu_adam, counted_self>;

zenflow::zenflow_options options() {
  auto o = zenflow_test::data_parallel_test_options(0.0f);
  o.select_interval = zenflow::interval_option::fixed(4);
  return o;
}

}  // namespace

TEST_CASE("one rank: a step between selections never synchronizes the trainer's stream and launches <= 4 times") {
  zenflow::self_communicator self;
  counted_self comm(self);
  const int matrices = 8, vectors = 4;
  coordinator dp(comm, options());
  wide_model m(matrices, vectors);
  m.register_with(dp);
  host_stream s;
  counting_backend::trainer = &s;
  int checked = 0;
  for (int t = 0; t < 16; ++t) {
    s.synchronize();
    m.make_gradients(t, 0);
    m.submit(dp, &s);
    counting_backend::trainer_syncs = 0;
    comm.collectives = comm.launches = 0;
    const auto& metrics = dp.step(&s);
    CAPTURE(t);
    if (t == 0 || metrics.reselected) continue;  // the first step and selections synchronize
    ++checked;
    CHECK(counting_backend::trainer_syncs.load() == 0);
    // Which parameters got gradients, the step's gradients (one group), the statistics, and a
    // write-back (one group) at the end of an interval.
    CHECK(comm.launches <= 4);
    CHECK(comm.collectives >= 2 * matrices + vectors);
  }
  CHECK(checked >= 8);
  dp.finish(&s);
  counting_backend::trainer = nullptr;
}

TEST_CASE("one rank: reselections reuse the buffers of the first selection") {
  zenflow::self_communicator self;
  counted_self comm(self);
  coordinator dp(comm, options());
  wide_model m(4, 2);
  m.register_with(dp);
  host_stream s;
  int selections = 0;
  std::int64_t after_first = -1;
  for (int t = 0; t < 24; ++t) {
    s.synchronize();
    m.make_gradients(t, 0);
    m.submit(dp, &s);
    const auto& metrics = dp.step(&s);
    if (!metrics.reselected) continue;
    if (++selections == 1) after_first = counting_backend::allocations;
    CAPTURE(t);
    CHECK(counting_backend::allocations.load() == after_first);
  }
  CHECK(selections >= 4);
  dp.finish(&s);
}

}  // namespace ZENFLOW_TEST_FILE_ID
