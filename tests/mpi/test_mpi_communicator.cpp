// mpi_communicator under mpirun (2 and 3 ranks): every collective with exact values on every rank
// (distinct per-rank patterns, every element type, in place, unequal partitions padded to equal
// blocks, staging rounds), bitwise agreement across ranks, ordering on host streams, argument
// checks, and the failure story: a rank that stops participating, aborts, or whose stream fails
// makes every rank fail with a clear error within the timeout, never a hang.
#include <zenflow/mpi_communicator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../support/error_text.hpp"
#include "mpi_doctest.hpp"
#include "rank_patterns.hpp"

using namespace std::chrono_literals;
using zenflow::bfloat16;
using zenflow::float16;
using zenflow::host_stream;
using zenflow::mpi_communicator;
using zenflow::reduce_op;
using zenflow_test::contains;
using zenflow_test::error_of;
using zenflow_test::make;
using zenflow_test::pattern;
using zenflow_test::patterned;
using zenflow_test::reduced;
using zenflow_test::value;
using zenflow_test::world_rank;
using zenflow_test::world_size;

namespace {

// The communicators of the passing tests: a bug shows up as a 20 s timeout, not a hang.
zenflow::mpi_communicator_options test_options() {
  zenflow::mpi_communicator_options o;
  o.timeout = 20s;
  return o;
}

template <class T>
std::span<const T> in(const std::vector<T>& v) {
  return std::span<const T>(v);
}

// Every rank's copy of `local` (as bytes), to compare results across ranks bit for bit.
template <class T>
std::vector<std::vector<std::byte>> gather_bytes(const std::vector<T>& local) {
  const auto bytes = static_cast<int>(local.size() * sizeof(T));
  std::vector<std::byte> all(static_cast<std::size_t>(bytes) * static_cast<std::size_t>(world_size()));
  MPI_Allgather(local.data(), bytes, MPI_BYTE, all.data(), bytes, MPI_BYTE, MPI_COMM_WORLD);
  std::vector<std::vector<std::byte>> out;
  for (int r = 0; r < world_size(); ++r) out.emplace_back(all.begin() + r * bytes, all.begin() + (r + 1) * bytes);
  return out;
}

}  // namespace

TEST_CASE("construction: rank and size are MPI's; the communicator is a duplicate") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  CHECK(comm.rank() == world_rank());
  CHECK(comm.size() == world_size());
  int compare = MPI_IDENT;
  MPI_Comm_compare(comm.native_handle(), MPI_COMM_WORLD, &compare);
  CHECK(compare == MPI_CONGRUENT);  // same group, its own context: our traffic never meets the caller's
  CHECK(comm.timeout() == 20s);
  comm.check();
}

TEST_CASE("the smallest staging size of all ranks is used") {
  auto options = test_options();
  options.staging_bytes = 4096 + 64 * static_cast<std::size_t>(world_rank());
  mpi_communicator comm(MPI_COMM_WORLD, options);
  CHECK(comm.staging_bytes() == 4096);
}

TEST_CASE_TEMPLATE("all_reduce: sum, max and min of distinct per-rank patterns, exact on every rank", T, float, double,
                   std::int32_t, std::int64_t, bfloat16, float16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  const std::size_t n = 1000;
  for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
    CAPTURE(zenflow::reduce_op_name(op));
    const std::vector<T> send = patterned<T>(comm.rank(), n);
    std::vector<T> recv(n, make<T>(-99));
    comm.all_reduce(in(send), std::span<T>(recv), op, &stream);
    stream.synchronize();
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(recv[i]) == reduced(op, i));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(send[i]) == pattern(comm.rank(), i));  // send untouched
  }
}

TEST_CASE_TEMPLATE("all_reduce in place", T, float, std::int64_t, bfloat16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  std::vector<T> buffer = patterned<T>(comm.rank(), 257);
  comm.all_reduce(in(buffer), std::span<T>(buffer), reduce_op::sum, &stream);
  stream.synchronize();
  for (std::size_t i = 0; i < buffer.size(); ++i) REQUIRE(value(buffer[i]) == reduced(reduce_op::sum, i));
}

TEST_CASE("all_reduce of inexact float sums: every rank holds bitwise the same result") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  std::vector<float> send(4096);
  std::uint32_t state = 12345u + 977u * static_cast<std::uint32_t>(comm.rank());
  for (float& x : send) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) * 1e-7f - 0.3f;
  }
  std::vector<float> sum(send.size()), max(send.size());
  std::vector<double> dsum(send.size());
  std::vector<double> dsend(send.begin(), send.end());
  comm.all_reduce(in(send), std::span<float>(sum), reduce_op::sum, &stream);
  comm.all_reduce(in(send), std::span<float>(max), reduce_op::max, &stream);
  comm.all_reduce(in(dsend), std::span<double>(dsum), reduce_op::sum, &stream);
  stream.synchronize();
  for (const auto& other : gather_bytes(sum)) CHECK(std::memcmp(other.data(), sum.data(), other.size()) == 0);
  for (const auto& other : gather_bytes(dsum)) CHECK(std::memcmp(other.data(), dsum.data(), other.size()) == 0);
  for (std::size_t i = 0; i < send.size(); ++i) CHECK(max[i] >= send[i]);
}

TEST_CASE_TEMPLATE("reduce_scatter: rank r receives the reduction of every rank's block r", T, float, double,
                   std::int32_t, std::int64_t, bfloat16, float16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  const std::size_t n = 301;
  const auto blocks = static_cast<std::size_t>(comm.size());
  for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
    CAPTURE(zenflow::reduce_op_name(op));
    const std::vector<T> send = patterned<T>(comm.rank(), blocks * n);
    std::vector<T> recv(n, make<T>(-99));
    comm.reduce_scatter(in(send), std::span<T>(recv), op, &stream);
    stream.synchronize();
    const std::size_t first = static_cast<std::size_t>(comm.rank()) * n;
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(recv[i]) == reduced(op, first + i));
  }
}

TEST_CASE_TEMPLATE("reduce_scatter in place: recv is this rank's block of send", T, float, std::int64_t, float16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  const std::size_t n = 129;
  std::vector<T> buffer = patterned<T>(comm.rank(), static_cast<std::size_t>(comm.size()) * n);
  const std::size_t first = static_cast<std::size_t>(comm.rank()) * n;
  comm.reduce_scatter(in(buffer), std::span<T>(buffer).subspan(first, n), reduce_op::sum, &stream);
  stream.synchronize();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(value(buffer[first + i]) == reduced(reduce_op::sum, first + i));
}

TEST_CASE_TEMPLATE("all_gather: block r of recv is rank r's send", T, float, double, std::int32_t, std::int64_t,
                   bfloat16, float16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  const std::size_t n = 333;
  const std::vector<T> send = patterned<T>(comm.rank(), n);
  std::vector<T> recv(static_cast<std::size_t>(comm.size()) * n, make<T>(-99));
  comm.all_gather(in(send), std::span<T>(recv), &stream);
  stream.synchronize();
  for (int r = 0; r < comm.size(); ++r)
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(recv[static_cast<std::size_t>(r) * n + i]) == pattern(r, i));
}

TEST_CASE_TEMPLATE("all_gather in place: send is this rank's block of recv", T, double, std::int32_t, bfloat16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  const std::size_t n = 65;
  std::vector<T> buffer(static_cast<std::size_t>(comm.size()) * n, make<T>(-99));
  const std::size_t first = static_cast<std::size_t>(comm.rank()) * n;
  const std::vector<T> mine = patterned<T>(comm.rank(), n);
  std::copy(mine.begin(), mine.end(), buffer.begin() + static_cast<std::ptrdiff_t>(first));
  comm.all_gather(in(buffer).subspan(first, n), std::span<T>(buffer), &stream);
  stream.synchronize();
  for (int r = 0; r < comm.size(); ++r)
    for (std::size_t i = 0; i < n; ++i) REQUIRE(value(buffer[static_cast<std::size_t>(r) * n + i]) == pattern(r, i));
}

TEST_CASE_TEMPLATE("broadcast from every root", T, float, double, std::int32_t, std::int64_t, bfloat16, float16) {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  for (int root = 0; root < comm.size(); ++root) {
    CAPTURE(root);
    std::vector<T> buffer = patterned<T>(comm.rank(), 77);
    comm.broadcast(std::span<T>(buffer), root, &stream);
    stream.synchronize();
    for (std::size_t i = 0; i < buffer.size(); ++i) REQUIRE(value(buffer[i]) == pattern(root, i));
  }
}

TEST_CASE("staging rounds: collectives larger than the staging buffer are cut into identical rounds") {
  auto options = test_options();
  options.staging_bytes = 64;  // 16 floats: a reduce_scatter round holds (size + 1) blocks
  mpi_communicator comm(MPI_COMM_WORLD, options);
  host_stream stream;
  const auto blocks = static_cast<std::size_t>(comm.size());
  const std::size_t n = 1001;
  const std::vector<float> send = patterned<float>(comm.rank(), blocks * n);
  std::vector<float> all(blocks * n), scattered(n), gathered(blocks * n);
  std::vector<std::int64_t> wide = patterned<std::int64_t>(comm.rank(), 99);
  comm.all_reduce(in(send), std::span<float>(all), reduce_op::sum, &stream);
  comm.reduce_scatter(in(send), std::span<float>(scattered), reduce_op::max, &stream);
  comm.all_gather(in(send).first(n), std::span<float>(gathered), &stream);
  comm.broadcast(std::span<std::int64_t>(wide), comm.size() - 1, &stream);
  stream.synchronize();
  for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(all[i] == reduced(reduce_op::sum, i));
  for (std::size_t i = 0; i < n; ++i)
    REQUIRE(scattered[i] == reduced(reduce_op::max, static_cast<std::size_t>(comm.rank()) * n + i));
  for (std::size_t r = 0; r < blocks; ++r)
    for (std::size_t i = 0; i < n; ++i) REQUIRE(gathered[r * n + i] == pattern(static_cast<int>(r), i));
  for (std::size_t i = 0; i < wide.size(); ++i) REQUIRE(wide[i] == pattern(comm.size() - 1, i));
}

TEST_CASE("unequal partitions: columns balanced by size, padded to equal blocks, scattered and gathered back") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  // Columns of different heights (parameters of different row counts), in schedule order.
  const std::vector<std::int64_t> rows = {5, 3, 8, 1, 7, 2, 6, 4, 9, 1, 1, 3};
  const zenflow::block_partition part = zenflow::partition_by_size(rows, comm.size());
  REQUIRE(part.parts() == comm.size());
  std::int64_t total = 0;
  for (const std::int64_t r : rows) total += r;

  // This rank's gradient of every column (column-major), packed into the padded layout.
  const std::vector<float> grad = patterned<float>(comm.rank(), static_cast<std::size_t>(total));
  std::vector<float> packed(static_cast<std::size_t>(part.block) * static_cast<std::size_t>(comm.size()), 0.0f);
  std::int64_t source = 0;
  for (std::size_t c = 0; c < rows.size(); ++c) {
    std::copy_n(grad.begin() + source, rows[c], packed.begin() + part.offsets[c]);
    source += rows[c];
  }
  // Reduce-scatter: this rank's block holds the sum of its columns; then gather every block back
  // in place (what the schedule does with the updated columns).
  const auto block = static_cast<std::size_t>(part.block);
  const std::size_t mine = static_cast<std::size_t>(comm.rank()) * block;
  std::vector<float> owned(block, -1.0f);
  comm.reduce_scatter(in(packed), std::span<float>(owned), reduce_op::sum, &stream);
  stream.synchronize();
  std::int64_t first_element = 0;
  for (std::int64_t c = 0; c < part.bounds[static_cast<std::size_t>(comm.rank())]; ++c)
    first_element += rows[static_cast<std::size_t>(c)];
  const auto own_size = static_cast<std::size_t>(part.sizes[static_cast<std::size_t>(comm.rank())]);
  for (std::size_t i = 0; i < own_size; ++i)
    REQUIRE(owned[i] == reduced(reduce_op::sum, static_cast<std::size_t>(first_element) + i));
  for (std::size_t i = own_size; i < block; ++i) REQUIRE(owned[i] == 0.0f);  // padding stays zero

  std::vector<float> everything(packed.size(), -1.0f);
  std::copy(owned.begin(), owned.end(), everything.begin() + static_cast<std::ptrdiff_t>(mine));
  comm.all_gather(in(everything).subspan(mine, block), std::span<float>(everything), &stream);
  stream.synchronize();
  std::int64_t element = 0;
  for (std::size_t c = 0; c < rows.size(); ++c)
    for (std::int64_t i = 0; i < rows[c]; ++i, ++element)
      REQUIRE(everything[static_cast<std::size_t>(part.offsets[c] + i)] ==
              reduced(reduce_op::sum, static_cast<std::size_t>(element)));
}

TEST_CASE("stream order: a collective runs after the work before it and the call does not wait for it") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  std::promise<void> go;
  std::shared_future<void> ready = go.get_future().share();
  std::vector<float> buffer(64, -1.0f);
  stream.enqueue([&] {
    if (ready.wait_for(30s) != std::future_status::ready) throw std::runtime_error("the call blocked the test");
    const std::vector<float> values = patterned<float>(comm.rank(), buffer.size());
    std::copy(values.begin(), values.end(), buffer.begin());  // in place: the collective holds buffer.data()
  });
  comm.all_reduce(in(buffer), std::span<float>(buffer), reduce_op::sum, &stream);
  std::vector<float> seen;
  stream.enqueue([&] { seen = buffer; });
  CHECK(!stream.query());  // nothing ran yet: all_reduce returned while the stream was held
  go.set_value();
  stream.synchronize();
  REQUIRE(seen.size() == buffer.size());
  for (std::size_t i = 0; i < seen.size(); ++i) REQUIRE(seen[i] == reduced(reduce_op::sum, i));
}

TEST_CASE("call order, not stream order: collectives on two streams meet in the order they were called") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream first, second;
  // Rank 0 holds the stream of the first call, every other rank the stream of the second, so the
  // streams reach them in opposite orders on different ranks.
  std::promise<void> go;
  std::shared_future<void> ready = go.get_future().share();
  host_stream& held = comm.rank() == 0 ? first : second;
  held.enqueue([ready] {
    if (ready.wait_for(30s) != std::future_status::ready) throw std::runtime_error("never released");
  });
  const std::vector<float> a = patterned<float>(comm.rank(), 100);
  const std::vector<double> b = patterned<double>(comm.rank(), 7);
  std::vector<float> ra(a.size());
  std::vector<double> rb(b.size());
  comm.all_reduce(in(a), std::span<float>(ra), reduce_op::sum, &first);
  comm.all_reduce(in(b), std::span<double>(rb), reduce_op::max, &second);
  go.set_value();
  first.synchronize();
  second.synchronize();
  for (std::size_t i = 0; i < ra.size(); ++i) REQUIRE(ra[i] == reduced(reduce_op::sum, i));
  for (std::size_t i = 0; i < rb.size(); ++i) REQUIRE(rb[i] == reduced(reduce_op::max, i));
}

TEST_CASE("bad arguments are rejected before anything is enqueued, and are not collectives") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  std::vector<float> a(12), b(12), small(5);
  const std::size_t blocks = static_cast<std::size_t>(comm.size());
  std::vector<float> big(blocks * 4);
  CHECK(contains(error_of([&] { comm.all_reduce(in(a), std::span<float>(small), reduce_op::sum, &stream); }),
                 "zenflow: recv: all_reduce needs recv.size() == send.size()"));
  CHECK(contains(
      error_of([&] { comm.all_reduce(in(a).first(11), std::span<float>(a).subspan(1, 11), reduce_op::sum, &stream); }),
      "zenflow: recv: all_reduce: recv overlaps send without being the same buffer"));
  CHECK(contains(error_of([&] { comm.all_reduce(in(a), std::span<float>(b), reduce_op::sum, nullptr); }),
                 "zenflow: stream: must not be null"));
  CHECK(contains(error_of([&] { comm.all_reduce(in(a), std::span<float>(b), static_cast<reduce_op>(7), &stream); }),
                 "zenflow: op: unknown reduce_op value 7"));
  CHECK(contains(error_of([&] { comm.reduce_scatter(in(a), std::span<float>(small), reduce_op::sum, &stream); }),
                 "zenflow: send: reduce_scatter needs send.size() == size() * recv.size()"));
  CHECK(contains(
      error_of([&] { comm.reduce_scatter(in(big), std::span<float>(big).subspan(1, 4), reduce_op::sum, &stream); }),
      "zenflow: recv: reduce_scatter: recv overlaps send"));
  CHECK(contains(error_of([&] { comm.all_gather(in(a), std::span<float>(small), &stream); }),
                 "zenflow: recv: all_gather needs recv.size() == size() * send.size()"));
  CHECK(contains(error_of([&] { comm.broadcast(std::span<float>(a), comm.size(), &stream); }), "zenflow: root:"));
  CHECK(contains(error_of([&] { comm.broadcast(std::span<float>(a), -1, &stream); }), "zenflow: root:"));
  CHECK(contains(error_of([&] { comm.broadcast(std::span<float>(static_cast<float*>(nullptr), 3), 0, &stream); }),
                 "zenflow: buffer: data is null"));
  // Zero elements: not a collective (only rank 0 makes one here, and nothing waits for it).
  if (comm.rank() == 0) comm.all_reduce(in(a).first(0), std::span<float>(b).first(0), reduce_op::sum, &stream);
  // Nothing was enqueued and no collective is pending: the next one meets on every rank.
  std::vector<float> send = patterned<float>(comm.rank(), 12), recv(12);
  comm.all_reduce(in(send), std::span<float>(recv), reduce_op::sum, &stream);
  stream.synchronize();
  for (std::size_t i = 0; i < recv.size(); ++i) REQUIRE(recv[i] == reduced(reduce_op::sum, i));
  comm.check();
}

// --- the failure story ----------------------------------------------------------------------------

TEST_CASE("a rank that stops participating: the others fail within the timeout, and it learns why") {
  auto options = test_options();
  options.timeout = 500ms;
  mpi_communicator comm(MPI_COMM_WORLD, options);
  host_stream stream;
  const int absent = 1;
  std::vector<float> buffer = patterned<float>(comm.rank(), 16);
  if (comm.rank() != absent) {
    const auto start = std::chrono::steady_clock::now();
    comm.all_reduce(in(buffer), std::span<float>(buffer), reduce_op::sum, &stream);
    const std::string message = error_of([&] { stream.synchronize(); });
    const auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK(contains(message, "zenflow: mpi_communicator: "));
    CHECK(contains(message, "all_reduce #0 (16 x float, sum)"));
    CHECK(contains(message, "did not complete within 500 ms"));
    CHECK(elapsed < 15s);
    // Failed for good: check() and every later call throw, without waiting.
    CHECK(contains(error_of([&] { comm.check(); }), "did not complete within 500 ms"));
    CHECK(contains(error_of([&] { comm.broadcast(std::span<float>(buffer), 0, &stream); }),
                   "broadcast called after the communicator failed"));
  } else {
    // It called nothing; the peers' abort messages reach it.
    std::string message;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (message.empty() && std::chrono::steady_clock::now() < deadline) {
      message = error_of([&] { comm.check(); });
      std::this_thread::sleep_for(10ms);
    }
    CHECK(contains(message, "aborted the communicator: all_reduce #0 (16 x float, sum) did not complete within"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("abort(reason): the peers fail at once with the reason, long before their timeout") {
  auto options = test_options();
  options.timeout = 60s;
  mpi_communicator comm(MPI_COMM_WORLD, options);
  host_stream stream;
  std::vector<double> buffer = patterned<double>(comm.rank(), 8);
  if (comm.rank() == 0) {
    comm.abort("bad input: gradient 3 has 5 rows, expected 4");
    comm.abort("a second reason is ignored");
    CHECK(contains(error_of([&] { comm.check(); }), "aborted on rank 0 of"));
    CHECK(contains(error_of([&] { comm.all_reduce(in(buffer), std::span<double>(buffer), reduce_op::sum, &stream); }),
                   "all_reduce called after the communicator failed: aborted on rank 0"));
  } else {
    // The abort reaches this rank while it calls, or while the collective waits for rank 0.
    const auto start = std::chrono::steady_clock::now();
    const std::string message = error_of([&] {
      comm.all_reduce(in(buffer), std::span<double>(buffer), reduce_op::sum, &stream);
      stream.synchronize();
    });
    CHECK((contains(message, "all_reduce #0 (8 x double, sum) failed: rank 0 of ") ||
           contains(message, "all_reduce called after the communicator failed: rank 0 of ")));
    CHECK(contains(message, "aborted the communicator: bad input: gradient 3 has 5 rows, expected 4"));
    CHECK(std::chrono::steady_clock::now() - start < 15s);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("host_abort_channel: a rank's published reason reaches every peer's poll, without a collective") {
  // What the NCCL communicator of the multi-rank GPU tests is bootstrapped with: NCCL has no
  // channel of its own, so its watchdog polls this one.
  auto channel = std::make_shared<zenflow::host_abort_channel<mpi_communicator>>(
      std::make_unique<mpi_communicator>(MPI_COMM_WORLD, test_options()));
  CHECK(channel->poll().empty());
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  if (world_rank() == 1) {
    channel->publish("rank 1 lost its GPU");
  } else {
    std::string message;
    while (message.empty() && std::chrono::steady_clock::now() - start < 10s) message = channel->poll();
    CHECK(message == "rank 1 of " + std::to_string(world_size()) + " aborted the communicator: rank 1 lost its GPU");
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a collective its stream skips (an earlier task threw) fails every rank at once") {
  auto options = test_options();
  options.timeout = 60s;
  mpi_communicator comm(MPI_COMM_WORLD, options);
  host_stream stream;
  std::vector<std::int64_t> buffer = patterned<std::int64_t>(comm.rank(), 8);
  const auto start = std::chrono::steady_clock::now();
  if (comm.rank() == 0) stream.enqueue([] { throw std::runtime_error("the trainer's work failed"); });
  std::string message;
  try {
    comm.all_reduce(in(buffer), std::span<std::int64_t>(buffer), reduce_op::sum, &stream);
    stream.synchronize();
  } catch (const std::exception& e) {
    message = e.what();
  }
  if (comm.rank() == 0) {
    CHECK(message == "the trainer's work failed");  // the stream reports its own first error
    CHECK(contains(error_of([&] { comm.check(); }), "all_reduce #0 (8 x int64, sum) was not run on rank 0 of"));
  } else {
    CHECK(contains(message, "rank 0 of "));
    CHECK(contains(message, "aborted the communicator: all_reduce #0 (8 x int64, sum) was not run on rank 0"));
  }
  CHECK(std::chrono::steady_clock::now() - start < 15s);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a rank that never constructs the communicator: construction fails within the timeout") {
  // On a private duplicate: the abandoned construction stays pending on it, not on MPI_COMM_WORLD.
  MPI_Comm scratch = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &scratch);
  if (world_rank() != 1) {
    auto options = test_options();
    options.timeout = 300ms;
    const std::string message = error_of([&] { mpi_communicator comm(scratch, options); });
    CHECK(contains(message, "did not complete within 300 ms"));
    CHECK(contains(message, "every rank of the communicator must construct it"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("after failures, new communicators work") {
  mpi_communicator comm(MPI_COMM_WORLD, test_options());
  host_stream stream;
  std::vector<float> buffer = patterned<float>(comm.rank(), 10);
  comm.all_reduce(in(buffer), std::span<float>(buffer), reduce_op::sum, &stream);
  stream.synchronize();
  for (std::size_t i = 0; i < buffer.size(); ++i) REQUIRE(buffer[i] == reduced(reduce_op::sum, i));
}

TEST_CASE("argument checks of construction") {
  auto options = test_options();
  options.timeout = 0ms;
  CHECK(contains(error_of([&] { mpi_communicator comm(MPI_COMM_WORLD, options); }), "zenflow: timeout: must be > 0"));
  CHECK(contains(error_of([] { mpi_communicator comm(MPI_COMM_NULL); }), "zenflow: comm: must not be MPI_COMM_NULL"));
  static_assert(zenflow::communicator<mpi_communicator>);
}
