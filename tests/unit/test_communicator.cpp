// The communicator concept (positive and negative), the one-rank self_communicator, and the
// column partition the equal-block collectives carry (partition_by_size). The MPI communicator
// runs under mpirun in tests/mpi, the NCCL one on GPUs in tests/nccl.
#include <zenflow/communicator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../support/error_text.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::bfloat16;
using zenflow::float16;
using zenflow::reduce_op;

using zenflow_test::contains;
using zenflow_test::error_of;

namespace {

// A minimal model: every collective as a template over the element type.
struct model_communicator {
  using stream_type = int;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void all_reduce(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void reduce_scatter(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>, int) {}
  template <class T>
  void broadcast(std::span<T>, int, int) {}
  void abort(std::string_view) noexcept {}
  void check() const {}
};

// Each negative model lacks exactly one requirement of model_communicator.
struct communicator_without_stream_type {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void all_reduce(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void reduce_scatter(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>, int) {}
  template <class T>
  void broadcast(std::span<T>, int, int) {}
  void abort(std::string_view) noexcept {}
  void check() const {}
};
struct communicator_without_reduce_scatter {
  using stream_type = int;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void all_reduce(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>, int) {}
  template <class T>
  void broadcast(std::span<T>, int, int) {}
  void abort(std::string_view) noexcept {}
  void check() const {}
};
struct communicator_without_check {
  using stream_type = int;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void all_reduce(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void reduce_scatter(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>, int) {}
  template <class T>
  void broadcast(std::span<T>, int, int) {}
  void abort(std::string_view) noexcept {}
};
// all_reduce for float only: no double sum of squares, no int64 count of non-finite values.
struct communicator_with_float_all_reduce_only {
  using stream_type = int;
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(std::span<const float>, std::span<float>, reduce_op, int) {}
  template <class T>
  void reduce_scatter(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>, int) {}
  template <class T>
  void broadcast(std::span<T>, int, int) {}
  void abort(std::string_view) noexcept {}
  void check() const {}
};
// broadcast without a root.
struct communicator_with_rootless_broadcast {
  using stream_type = int;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T>
  void all_reduce(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void reduce_scatter(std::span<const T>, std::span<T>, reduce_op, int) {}
  template <class T>
  void all_gather(std::span<const T>, std::span<T>, int) {}
  template <class T>
  void broadcast(std::span<T>, int) {}
  void abort(std::string_view) noexcept {}
  void check() const {}
};

static_assert(zenflow::communicator<model_communicator>);
static_assert(zenflow::communicator<zenflow::self_communicator>);
static_assert(!zenflow::communicator<communicator_without_stream_type>);
static_assert(!zenflow::communicator<communicator_without_reduce_scatter>);
static_assert(!zenflow::communicator<communicator_without_check>);
static_assert(!zenflow::communicator<communicator_with_float_all_reduce_only>);
static_assert(zenflow::communicates<communicator_with_float_all_reduce_only, float> &&
              !zenflow::communicates<communicator_with_float_all_reduce_only, double>);
static_assert(!zenflow::communicator<communicator_with_rootless_broadcast>);
static_assert(!zenflow::communicator<int>);

static_assert(zenflow::communicable<float> && zenflow::communicable<double> && zenflow::communicable<std::int32_t> &&
              zenflow::communicable<std::int64_t> && zenflow::communicable<bfloat16> && zenflow::communicable<float16>);
static_assert(!zenflow::communicable<char> && !zenflow::communicable<std::uint64_t> &&
              !zenflow::communicable<long double> && !zenflow::communicable<const float>);

}  // namespace

TEST_CASE("self_communicator: one rank, every collective is a copy on the stream") {
  zenflow::self_communicator comm;
  zenflow::host_stream stream;
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  const std::vector<float> send = {1.0f, -2.0f, 3.5f};
  std::vector<float> recv(3, 0.0f), gathered(3, 0.0f), scattered(3, 0.0f);
  std::vector<double> in_place = {0.25, 0.5};
  comm.all_reduce(std::span<const float>(send), std::span<float>(recv), reduce_op::sum, &stream);
  comm.reduce_scatter(std::span<const float>(send), std::span<float>(scattered), reduce_op::max, &stream);
  comm.all_gather(std::span<const float>(send), std::span<float>(gathered), &stream);
  comm.all_reduce(std::span<const double>(in_place), std::span<double>(in_place), reduce_op::min, &stream);
  comm.broadcast(std::span<double>(in_place), 0, &stream);
  stream.synchronize();
  CHECK(recv == send);
  CHECK(scattered == send);
  CHECK(gathered == send);
  CHECK(in_place == std::vector<double>{0.25, 0.5});
}

TEST_CASE("self_communicator: arguments are checked before anything is enqueued") {
  zenflow::self_communicator comm;
  zenflow::host_stream stream;
  std::vector<float> a(4), b(3);
  CHECK(contains(
      error_of([&] { comm.all_reduce(std::span<const float>(a), std::span<float>(b), reduce_op::sum, &stream); }),
      "zenflow: recv: all_reduce needs recv.size() == send.size(), got 3 and 4"));
  CHECK(contains(error_of([&] { comm.all_gather(std::span<const float>(a), std::span<float>(a), nullptr); }),
                 "zenflow: stream: must not be null"));
  CHECK(contains(error_of([&] { comm.broadcast(std::span<float>(a), 1, &stream); }),
                 "zenflow: root: must be in [0, 1), got 1"));
  CHECK(contains(error_of([&] {
                   comm.all_reduce(std::span<const float>(a).first(3), std::span<float>(a).last(3), reduce_op::sum,
                                   &stream);
                 }),
                 "zenflow: recv: all_reduce: recv overlaps send without being the same buffer"));
}

TEST_CASE("self_communicator: abort fails it for good with the first reason") {
  zenflow::self_communicator comm;
  zenflow::host_stream stream;
  comm.check();
  comm.abort("bad input");
  comm.abort("second");
  CHECK(error_of([&] { comm.check(); }) == "zenflow: self_communicator: rank 0 of 1 aborted: bad input");
  std::vector<float> a(2);
  CHECK(contains(
      error_of([&] { comm.all_reduce(std::span<const float>(a), std::span<float>(a), reduce_op::sum, &stream); }),
      "aborted: bad input"));
}

TEST_CASE("partition_by_size: contiguous parts, balanced, padded to the largest") {
  const std::vector<std::int64_t> rows = {5, 3, 8, 1, 7, 2, 6, 4, 9, 1, 1, 3};  // total 50
  for (int parts = 1; parts <= 7; ++parts) {
    CAPTURE(parts);
    const zenflow::block_partition p = zenflow::partition_by_size(rows, parts);
    REQUIRE(p.parts() == parts);
    REQUIRE(p.bounds.size() == static_cast<std::size_t>(parts) + 1);
    CHECK(p.bounds.front() == 0);
    CHECK(p.bounds.back() == static_cast<std::int64_t>(rows.size()));
    std::int64_t used = 0;
    for (int r = 0; r < parts; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      CHECK(p.bounds[ur] <= p.bounds[ur + 1]);
      std::int64_t size = 0;
      for (std::int64_t i = p.bounds[ur]; i < p.bounds[ur + 1]; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        CHECK(p.part_of(i) == r);
        // Items of a part are consecutive in its block, starting at r * block.
        CHECK(p.offsets[ui] == static_cast<std::int64_t>(r) * p.block + size);
        size += rows[ui];
      }
      CHECK(p.sizes[ur] == size);
      CHECK(size <= p.block);
      used += size;
      // Balanced: no part exceeds total/parts by more than the largest item.
      CHECK(size * parts <= 50 + 9 * parts);
    }
    CHECK(used == 50);
    CHECK(p.block == *std::max_element(p.sizes.begin(), p.sizes.end()));
    CHECK(p.padding() == static_cast<std::int64_t>(parts) * p.block - 50);
  }
}

TEST_CASE("partition_by_size: exact cuts, ties to the earlier boundary, more parts than items, empty input") {
  const std::vector<std::int64_t> equal = {4, 4, 4, 4, 4, 4};
  const zenflow::block_partition three = zenflow::partition_by_size(equal, 3);
  CHECK(three.bounds == std::vector<std::int64_t>{0, 2, 4, 6});
  CHECK(three.block == 8);
  CHECK(three.padding() == 0);
  // Target 7.5 of 15 lies between the boundaries 5 and 10 (distance 2.5 each): the earlier one.
  const std::vector<std::int64_t> tie = {5, 5, 5};
  CHECK(zenflow::partition_by_size(tie, 2).bounds == std::vector<std::int64_t>{0, 1, 3});
  const std::vector<std::int64_t> two = {3, 9};
  const zenflow::block_partition many = zenflow::partition_by_size(two, 4);
  CHECK(many.sizes == std::vector<std::int64_t>{3, 0, 9, 0});
  CHECK(many.block == 9);
  const zenflow::block_partition none = zenflow::partition_by_size({}, 3);
  CHECK(none.sizes == std::vector<std::int64_t>{0, 0, 0});
  CHECK(none.block == 0);
}

TEST_CASE("partition_by_size: a 7B-like column set over 8 ranks pads by less than one column per rank") {
  // 32 layers of q, k, v, o (4096 columns of 4096 rows), gate and up (4096 columns of 11008
  // rows), down (11008 columns of 4096 rows): 90% of each on the CPU, in that order.
  std::vector<std::int64_t> rows;
  for (int layer = 0; layer < 32; ++layer) {
    for (int m = 0; m < 4; ++m) rows.insert(rows.end(), 3687, 4096);
    for (int m = 0; m < 2; ++m) rows.insert(rows.end(), 3687, 11008);
    rows.insert(rows.end(), 9908, 4096);
  }
  const zenflow::block_partition p = zenflow::partition_by_size(rows, 8);
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t{0});
  CHECK(p.padding() < 8 * 11008);
  CHECK(static_cast<double>(p.padding()) / static_cast<double>(total) < 1e-4);
}

TEST_CASE("partition_by_size: bad arguments") {
  const std::vector<std::int64_t> rows = {1, -2};
  CHECK(error_of([&] { (void)zenflow::partition_by_size(rows, 0); }) == "zenflow: parts: must be >= 1, got 0");
  CHECK(error_of([&] { (void)zenflow::partition_by_size(rows, 2); }) ==
        "zenflow: sizes: item 1 has a negative size -2");
}

TEST_CASE("reduce_op names") {
  CHECK(zenflow::reduce_op_name(reduce_op::sum) == "sum");
  CHECK(zenflow::reduce_op_name(reduce_op::max) == "max");
  CHECK(zenflow::reduce_op_name(reduce_op::min) == "min");
}

}  // namespace ZENFLOW_TEST_FILE_ID
