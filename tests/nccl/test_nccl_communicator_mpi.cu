// nccl_communicator with one rank per GPU under mpirun, bootstrapped over an mpi_communicator:
// every collective with exact values on every rank (distinct per-rank patterns, every element
// type, in place, an unequal partition padded to equal blocks), bitwise agreement across ranks,
// and the failure story: a rank that stops participating makes the others fail within their
// timeout, never hang; a rank that aborts makes them fail at once with its reason (the MPI
// bootstrap is the abort channel). Skipped (exit 77) with fewer GPUs than ranks.
#include <zenflow/mpi_communicator.hpp>
#include <zenflow/nccl_communicator.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../support/cuda_test_utils.cuh"
#include "../support/error_text.hpp"
#include "mpi_bootstrap.cuh"
#include "mpi_doctest.hpp"
#include "rank_patterns.hpp"

using namespace std::chrono_literals;
using zenflow::bfloat16;
using zenflow::float16;
using zenflow::nccl_communicator;
using zenflow::reduce_op;
using zenflow_test::contains;
using zenflow_test::device_vector;
using zenflow_test::error_of;
using zenflow_test::make;
using zenflow_test::make_communicator;
using zenflow_test::pattern;
using zenflow_test::patterned;
using zenflow_test::reduced;
using zenflow_test::value;
using zenflow_test::world_rank;
using zenflow_test::world_size;

namespace {

// Waits (at most `limit`) until check() throws; returns its message ("" if it never did).
std::string failure_within(const nccl_communicator& comm, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::string message;
  while (message.empty() && std::chrono::steady_clock::now() < deadline) {
    message = error_of([&] { comm.check(); });
    std::this_thread::sleep_for(10ms);
  }
  return message;
}

}  // namespace

TEST_CASE_TEMPLATE("all_reduce, reduce_scatter, all_gather, broadcast: exact on every rank", T, float, double,
                   std::int32_t, std::int64_t, bfloat16, float16) {
  nccl_communicator comm = make_communicator();
  REQUIRE(comm.rank() == world_rank());
  REQUIRE(comm.size() == world_size());
  zenflow_test::cuda_stream s;
  const std::size_t n = 1000;
  const auto blocks = static_cast<std::size_t>(comm.size());
  for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
    CAPTURE(zenflow::reduce_op_name(op));
    device_vector<T> send(patterned<T>(comm.rank(), blocks * n)), all{std::vector<T>(blocks * n)},
        part{std::vector<T>(n)};
    comm.all_reduce(send.cspan(), all.span(), op, s.get());
    comm.reduce_scatter(send.cspan(), part.span(), op, s.get());
    s.synchronize();
    const std::vector<T> a = all.download(), p = part.download();
    for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(value(a[i]) == reduced(op, i));
    for (std::size_t i = 0; i < n; ++i)
      REQUIRE(value(p[i]) == reduced(op, static_cast<std::size_t>(comm.rank()) * n + i));
    // In place: all_reduce over the same buffer, reduce_scatter into this rank's block.
    comm.all_reduce(send.cspan(), send.span(), op, s.get());
    s.synchronize();
    CHECK(std::memcmp(send.download().data(), a.data(), a.size() * sizeof(T)) == 0);
  }
  device_vector<T> mine(patterned<T>(comm.rank(), n)), gathered{std::vector<T>(blocks * n)};
  comm.all_gather(mine.cspan(), gathered.span(), s.get());
  s.synchronize();
  const std::vector<T> g = gathered.download();
  for (std::size_t r = 0; r < blocks; ++r)
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(g[r * n + i]) == pattern(static_cast<int>(r), i));
  for (int root = 0; root < comm.size(); ++root) {
    device_vector<T> buffer(patterned<T>(comm.rank(), n));
    comm.broadcast(buffer.span(), root, s.get());
    s.synchronize();
    const std::vector<T> b = buffer.download();
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(b[i]) == pattern(root, i));
  }
  comm.check();
}

TEST_CASE("in place reduce_scatter and all_gather; inexact float sums agree bitwise across ranks") {
  nccl_communicator comm = make_communicator();
  zenflow_test::cuda_stream s;
  const std::size_t n = 4099;
  const auto blocks = static_cast<std::size_t>(comm.size());
  const std::size_t first = static_cast<std::size_t>(comm.rank()) * n;
  std::vector<float> values(blocks * n);
  std::uint32_t state = 777u + 31u * static_cast<std::uint32_t>(comm.rank());
  for (float& x : values) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) * 1e-7f - 0.3f;
  }
  device_vector<float> buffer(values), sum{std::vector<float>(blocks * n)};
  comm.all_reduce(buffer.cspan(), sum.span(), reduce_op::sum, s.get());
  comm.reduce_scatter(buffer.cspan(), buffer.span().subspan(first, n), reduce_op::sum, s.get());
  comm.all_gather(buffer.cspan().subspan(first, n), buffer.span(), s.get());
  s.synchronize();
  const std::vector<float> all = sum.download(), round_trip = buffer.download();
  std::vector<float> everyone(all.size() * blocks);
  MPI_Allgather(all.data(), static_cast<int>(all.size()), MPI_FLOAT, everyone.data(), static_cast<int>(all.size()),
                MPI_FLOAT, MPI_COMM_WORLD);
  for (std::size_t r = 0; r < blocks; ++r)
    CHECK(std::memcmp(everyone.data() + r * all.size(), all.data(), all.size() * sizeof(float)) == 0);
  // reduce_scatter + all_gather delivers the same sums as all_reduce (NCCL's ring order may
  // differ between the two, so compare within float rounding).
  for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(std::abs(round_trip[i] - all[i]) <= 1e-5f);
}

TEST_CASE("unequal partition: padded blocks scatter the sums and gather them back") {
  nccl_communicator comm = make_communicator();
  zenflow_test::cuda_stream s;
  const std::vector<std::int64_t> rows = {5, 3, 8, 1, 7, 2, 6, 4, 9, 1, 1, 3};
  const zenflow::block_partition part = zenflow::partition_by_size(rows, comm.size());
  const auto block = static_cast<std::size_t>(part.block);
  std::vector<float> packed(block * static_cast<std::size_t>(comm.size()), 0.0f);
  std::size_t element = 0;
  for (std::size_t c = 0; c < rows.size(); ++c)
    for (std::int64_t i = 0; i < rows[c]; ++i, ++element)
      packed[static_cast<std::size_t>(part.offsets[c] + i)] = static_cast<float>(pattern(comm.rank(), element));
  device_vector<float> buffer(packed);
  const std::size_t mine = static_cast<std::size_t>(comm.rank()) * block;
  comm.reduce_scatter(buffer.cspan(), buffer.span().subspan(mine, block), reduce_op::sum, s.get());
  comm.all_gather(buffer.cspan().subspan(mine, block), buffer.span(), s.get());
  s.synchronize();
  const std::vector<float> out = buffer.download();
  element = 0;
  for (std::size_t c = 0; c < rows.size(); ++c)
    for (std::int64_t i = 0; i < rows[c]; ++i, ++element)
      REQUIRE(out[static_cast<std::size_t>(part.offsets[c] + i)] == reduced(reduce_op::sum, element));
}

TEST_CASE("a rank that stops participating: the others' watchdog fails them within the timeout") {
  nccl_communicator comm = make_communicator(1000ms);
  zenflow_test::cuda_stream s;
  device_vector<float> buffer(patterned<float>(comm.rank(), 1024));
  if (comm.rank() != 1) {
    const auto start = std::chrono::steady_clock::now();
    comm.all_reduce(buffer.cspan(), buffer.span(), reduce_op::sum, s.get());
    const std::string message = failure_within(comm, 30s);
    CHECK(contains(message,
                   "zenflow: nccl_communicator: all_reduce #0 (1024 x float, sum) did not complete within "
                   "1000 ms"));
    CHECK(std::chrono::steady_clock::now() - start < 30s);
    s.synchronize();  // ncclCommAbort ended the waiting kernel: the stream goes on
    CHECK(contains(error_of([&] { comm.all_reduce(buffer.cspan(), buffer.span(), reduce_op::sum, s.get()); }),
                   "all_reduce called after the communicator failed"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  comm.abort("test over");  // rank 1's communicator is healthy but its peers are gone
}

TEST_CASE("abort(reason) on one rank: every rank fails at once with the reason (the abort channel)") {
  // The timeout is long: a peer that learnt of the abort only by its own timeout would fail the
  // elapsed-time check. Without an abort channel NCCL tells a peer nothing.
  nccl_communicator comm = make_communicator(60s);
  zenflow_test::cuda_stream s;
  device_vector<double> buffer(patterned<double>(comm.rank(), 64));
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  if (comm.rank() == 0) {
    comm.abort("bad input on rank 0");
    CHECK(contains(error_of([&] { comm.check(); }), "aborted on rank 0 of"));
  } else {
    // The abort may arrive before this call (then it throws) or while its kernel waits for rank 0.
    (void)error_of([&] { comm.all_reduce(buffer.cspan(), buffer.span(), reduce_op::sum, s.get()); });
    const std::string message = failure_within(comm, 30s);
    CHECK(contains(message,
                   "rank 0 of " + std::to_string(comm.size()) + " aborted the communicator: bad input on rank 0"));
    CHECK(std::chrono::steady_clock::now() - start < 15s);
    s.synchronize();  // ncclCommAbort ended the waiting kernel
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
