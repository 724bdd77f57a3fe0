// nccl_communicator with one rank on one GPU: every collective of every element type (with one
// rank each is a copy: the wiring of types, ops and in-place layouts), the argument checks,
// abort, the bootstrap helpers, an initialization that a missing rank never completes, the abort
// channel (both ways) and groups of collectives.
#include <zenflow/nccl_communicator.cuh>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "../support/cuda_test_utils.cuh"
#include "../support/error_text.hpp"

using namespace std::chrono_literals;
using zenflow::bfloat16;
using zenflow::float16;
using zenflow::nccl_communicator;
using zenflow::reduce_op;
using zenflow_test::contains;
using zenflow_test::device_vector;
using zenflow_test::error_of;

namespace {

template <class T>
T make(double x) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>)
    return zenflow::from_float<T>(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

template <class T>
std::vector<T> pattern(std::size_t n, double offset) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(static_cast<double>(i % 37) - 11.0 + offset);
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

TEST_CASE_TEMPLATE("one rank: every collective, every element type, in place too", T, float, double, std::int32_t,
                   std::int64_t, bfloat16, float16) {
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  zenflow_test::cuda_stream s;
  const std::size_t n = 1000;
  const std::vector<T> values = pattern<T>(n, 0.0);
  for (const reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::min}) {
    device_vector<T> send(values), recv(pattern<T>(n, 100.0));
    comm.all_reduce(send.cspan(), recv.span(), op, s.get());
    s.synchronize();
    CHECK(same_bits(recv.download(), values));
    comm.all_reduce(send.cspan(), send.span(), op, s.get());  // in place
    comm.reduce_scatter(send.cspan(), recv.span(), op, s.get());
    s.synchronize();
    CHECK(same_bits(send.download(), values));
    CHECK(same_bits(recv.download(), values));
  }
  device_vector<T> send(values), recv(pattern<T>(n, 100.0));
  comm.all_gather(send.cspan(), recv.span(), s.get());
  comm.all_gather(send.cspan(), send.span(), s.get());  // in place
  comm.broadcast(send.span(), 0, s.get());
  s.synchronize();
  CHECK(same_bits(recv.download(), values));
  CHECK(same_bits(send.download(), values));
  comm.check();
}

TEST_CASE("one rank: bad arguments are rejected before anything is enqueued") {
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
  zenflow_test::cuda_stream s;
  device_vector<float> a(pattern<float>(8, 0.0)), b(pattern<float>(4, 0.0));
  CHECK(contains(error_of([&] { comm.all_reduce(a.cspan(), b.span(), reduce_op::sum, s.get()); }),
                 "zenflow: recv: all_reduce needs recv.size() == send.size(), got 4 and 8"));
  CHECK(contains(error_of([&] { comm.reduce_scatter(a.cspan(), b.span(), reduce_op::sum, s.get()); }),
                 "zenflow: send: reduce_scatter needs send.size() == size() * recv.size()"));
  CHECK(contains(error_of([&] { comm.broadcast(a.span(), 1, s.get()); }), "zenflow: root: must be in [0, 1), got 1"));
  CHECK(contains(error_of([&] { comm.all_reduce(a.cspan(), a.span(), static_cast<reduce_op>(9), s.get()); }),
                 "zenflow: op: unknown reduce_op value 9"));
  // The legacy default stream is a valid CUDA stream.
  comm.all_reduce(a.cspan(), a.span(), reduce_op::sum, nullptr);
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  comm.check();
}

TEST_CASE("one rank: abort fails the communicator for good") {
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
  zenflow_test::cuda_stream s;
  device_vector<float> a(pattern<float>(8, 0.0));
  comm.abort("bad input");
  comm.abort("ignored");
  CHECK(comm.native_handle() == nullptr);
  CHECK(error_of([&] { comm.check(); }) == "zenflow: nccl_communicator: aborted on rank 0 of 1: bad input");
  CHECK(contains(error_of([&] { comm.all_reduce(a.cspan(), a.span(), reduce_op::sum, s.get()); }),
                 "all_reduce called after the communicator failed: aborted on rank 0 of 1: bad input"));
}

TEST_CASE("an initialization a missing rank never joins fails within the timeout") {
  zenflow::nccl_communicator_options options;
  options.timeout = 1000ms;
  const auto start = std::chrono::steady_clock::now();
  const std::string message = error_of([&] { nccl_communicator comm(zenflow::nccl_unique_id(), 0, 2, options); });
  CHECK(contains(message,
                 "zenflow: nccl_communicator: initialization (ncclCommInitRankConfig) did not complete "
                 "within 1000 ms on rank 0 of 2: every rank must construct the communicator"));
  CHECK(std::chrono::steady_clock::now() - start < 30s);
}

TEST_CASE("bootstrap: the id's bytes round-trip; a host communicator or a broadcast callable shares it") {
  const ncclUniqueId id = zenflow::nccl_unique_id();
  const auto bytes = zenflow::nccl_unique_id_bytes(id);
  const ncclUniqueId back = zenflow::nccl_unique_id_from_bytes(bytes);
  CHECK(std::memcmp(&back, &id, sizeof id) == 0);
  CHECK(contains(error_of([&] { (void)zenflow::nccl_unique_id_from_bytes(std::span(bytes).first(100)); }),
                 "zenflow: bytes: an ncclUniqueId has 128 bytes, got 100"));

  zenflow::self_communicator host;
  nccl_communicator a(zenflow::shared_nccl_unique_id(host), host.rank(), host.size());
  int broadcasts = 0;
  const ncclUniqueId shared = zenflow::shared_nccl_unique_id(0, [&](void* data, std::size_t size) {
    CHECK(data != nullptr);
    CHECK(size == 128);
    ++broadcasts;
  });
  CHECK(broadcasts == 1);
  nccl_communicator b(shared, 0, 1);
  a.check();
  b.check();
}

namespace {

/// An abort channel in this process: what poll() returns is set by the test, publish() is recorded.
struct scripted_channel final : zenflow::abort_channel {
  std::mutex mutex;
  std::string incoming;
  std::vector<std::string> published;
  void publish(std::string_view reason) noexcept override {
    std::lock_guard lock(mutex);
    published.emplace_back(reason);
  }
  std::string poll() override {
    std::lock_guard lock(mutex);
    return incoming;
  }
};

}  // namespace

TEST_CASE("one rank: the abort channel carries this rank's reason out and a peer's failure in, at once") {
  zenflow::nccl_communicator_options options;
  options.timeout = 60s;  // a failure seen only at the timeout would fail the elapsed-time checks
  auto in = std::make_shared<scripted_channel>();
  options.abort_channel = in;
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1, options);
  comm.check();
  const auto start = std::chrono::steady_clock::now();
  {
    std::lock_guard lock(in->mutex);
    in->incoming = "rank 3 of 4 aborted the communicator: disk full";
  }
  // The watchdog polls the channel; so does check().
  std::string message;
  while (message.empty() && std::chrono::steady_clock::now() - start < 10s) message = error_of([&] { comm.check(); });
  CHECK(message == "zenflow: nccl_communicator: rank 3 of 4 aborted the communicator: disk full");
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK(comm.native_handle() == nullptr);  // aborted
  CHECK(in->published.empty());            // a peer's failure is not sent back
  auto out = std::make_shared<scripted_channel>();
  options.abort_channel = out;
  nccl_communicator other(zenflow::nccl_unique_id(), 0, 1, options);
  other.abort("bad input");
  REQUIRE(out->published.size() == 1);
  CHECK(out->published[0] == "bad input");
}

TEST_CASE("one rank: a group of collectives is one launch, with the results of the single calls") {
  nccl_communicator comm(zenflow::nccl_unique_id(), 0, 1);
  zenflow_test::cuda_stream s;
  device_vector<float> a(pattern<float>(300, 0.0)), b(pattern<float>(300, 5.0)), c(pattern<float>(300, 9.0));
  comm.group_start();
  comm.all_reduce(a.cspan(), b.span(), reduce_op::sum, s.get());
  comm.group_start();  // nested: launched by the outer group_end
  comm.all_gather(a.cspan(), c.span(), s.get());
  comm.group_end();
  comm.group_end();
  s.synchronize();
  CHECK(same_bits(b.download(), pattern<float>(300, 0.0)));
  CHECK(same_bits(c.download(), pattern<float>(300, 0.0)));
  CHECK(contains(error_of([&] { comm.group_end(); }), "group_end: called without a matching group_start"));
  comm.check();
}
