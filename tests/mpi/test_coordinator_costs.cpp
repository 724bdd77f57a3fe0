// What a data-parallel step costs on 2 and 3 ranks, counted through the backend and communicator
// interfaces (the host twin of the NCCL coordinator; tests/unit/test_coordinator_step_costs.cpp
// does the same on one rank):
//   - between selections a step never synchronizes the trainer's stream and launches a constant
//     number of times whatever the number of parameters (one group for its gradients);
//   - reselections, which move each rank's share of the CPU columns, reuse the buffers sized at the
//     first one;
//   - the padding after each rank's columns in the blocks a reduce-scatter reads is zero, whatever
//     the blocks held before (NCCL reduces it; uninitialized, compute-sanitizer's initcheck flags it).
#include <zenflow/coordinator.hpp>
#include <zenflow/mpi_communicator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../support/counting_communicator.hpp"
#include "../support/data_parallel_model.hpp"
#include "mpi_doctest.hpp"

using namespace std::chrono_literals;
using zenflow::host_stream;
using zenflow::index_t;
using zenflow_test::counting_backend;
using zenflow_test::counting_communicator;
using zenflow_test::wide_model;
using zenflow_test::world_rank;
using zenflow_test::world_size;

namespace {

using counted_mpi = counting_communicator<zenflow::mpi_communicator>;
using coordinator = zenflow::basic_coordinator<counting_backend, zenflow::cpu_adam, counted_mpi>;

zenflow::mpi_communicator_options test_options() {
  zenflow::mpi_communicator_options o;
  o.timeout = 20s;
  return o;
}

zenflow::zenflow_options options() {
  auto o = zenflow_test::data_parallel_test_options(0.0f);
  o.select_interval = zenflow::interval_option::fixed(3);
  return o;
}

}  // namespace

TEST_CASE("N ranks: a step between selections never synchronizes the trainer's stream and launches <= 4 times") {
  const int rank = world_rank();
  zenflow::mpi_communicator mpi(MPI_COMM_WORLD, test_options());
  counted_mpi comm(mpi);
  const int matrices = 8, vectors = 4;
  coordinator dp(comm, options());
  wide_model m(matrices, vectors);
  m.register_with(dp);
  host_stream s;
  counting_backend::trainer = &s;
  int checked = 0;
  for (int t = 0; t < 16; ++t) {
    s.synchronize();
    m.make_gradients(t, rank);
    m.submit(dp, &s);
    counting_backend::trainer_syncs = 0;
    comm.collectives = comm.launches = 0;
    const auto& metrics = dp.step(&s);
    CAPTURE(t);
    if (t == 0 || metrics.reselected) continue;  // the first step and selections synchronize
    ++checked;
    CHECK(counting_backend::trainer_syncs.load() == 0);
    CHECK(comm.launches <= 4);
    CHECK(comm.collectives >= 2 * matrices + vectors);
  }
  CHECK(checked >= 8);
  dp.finish(&s);
  counting_backend::trainer = nullptr;
}

TEST_CASE("N ranks: reselections reuse the buffers of the first one, and the reduce-scatter's padding is zero") {
  const int rank = world_rank(), ranks = world_size();
  zenflow::mpi_communicator mpi(MPI_COMM_WORLD, test_options());
  counted_mpi comm(mpi);
  coordinator dp(comm, options());
  wide_model m(4, 2);
  m.register_with(dp);
  host_stream s;
  // Each reduce-scatter's send buffer as the stream reads it (one per 2-D parameter and step).
  std::vector<std::vector<std::byte>> sent;
  comm.on_reduce_scatter = [&](std::span<const std::byte> send, std::size_t, host_stream* stream) {
    stream->enqueue([&sent, send] { sent.emplace_back(send.begin(), send.end()); });
  };
  int selections = 0, padded = 0;
  std::int64_t after_first = -1;
  for (int t = 0; t < 24; ++t) {
    s.synchronize();
    m.make_gradients(t, rank);
    m.submit(dp, &s);
    sent.clear();
    const auto& metrics = dp.step(&s);
    s.synchronize();
    CAPTURE(t);
    REQUIRE(sent.size() == m.w.size());
    for (std::size_t i = 0; i < m.w.size(); ++i) {
      // Rank r's piece: its owned columns that are not selected; blocks of the largest piece.
      const auto selected = dp.gpu_columns(i);
      std::vector<std::size_t> piece(static_cast<std::size_t>(ranks));
      for (int r = 0; r < ranks; ++r)
        for (index_t c = wide_model::cols * r / ranks; c < wide_model::cols * (r + 1) / ranks; ++c)
          piece[static_cast<std::size_t>(r)] += !std::binary_search(selected.begin(), selected.end(), c);
      const std::size_t block = *std::max_element(piece.begin(), piece.end()) * wide_model::rows;
      REQUIRE(sent[i].size() == static_cast<std::size_t>(ranks) * block * sizeof(float));
      for (int r = 0; r < ranks; ++r) {
        const std::size_t used = piece[static_cast<std::size_t>(r)] * wide_model::rows;
        const auto* first = sent[i].data() + (static_cast<std::size_t>(r) * block + used) * sizeof(float);
        const std::size_t bytes = (block - used) * sizeof(float);
        padded += bytes > 0;
        CHECK(std::all_of(first, first + bytes, [](std::byte b) { return b == std::byte{0}; }));
      }
    }
    if (!metrics.reselected) continue;
    if (++selections == 1) after_first = counting_backend::allocations;
    CHECK(counting_backend::allocations.load() == after_first);
  }
  CHECK(selections >= 6);
  CHECK(padded > 0);  // the pieces were unequal, so some blocks had padding
  dp.finish(&s);
}
