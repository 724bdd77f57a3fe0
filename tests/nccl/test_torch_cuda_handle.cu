// zenflow.torch's CUDA translation unit (python/csrc/cuda_coordinator.cu includes no torch header,
// so this build compiles it as it is): the handle the extension makes for CUDA tensors with a
// process group (one rank on NCCL) against its handle for one process, on the same gradients,
// bit for bit (no clipping). Label "gpu".
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "../support/cuda_test_utils.cuh"
#include "../support/error_text.hpp"
#include "coordinator_handle.hpp"
#include "device_model.cuh"

using namespace std::chrono_literals;
using zenflow_test::contains;
using zenflow_test::device_model;
using zenflow_test::error_of;

namespace {

/// The coordinator calls device_model makes, onto the extension's handle.
struct handle_adapter {
  zenflow_torch::handle& h;
  zenflow::adam_options adam;
  std::size_t register_parameter(std::string name, zenflow::matrix_view p, zenflow::const_matrix_view initial,
                                 zenflow::dtype grad_type) {
    return h.add_matrix(std::move(name), p, initial, grad_type, adam);
  }
  std::size_t register_parameter(std::string name, zenflow::vector_view p, std::span<const float> initial) {
    return h.add_vector(std::move(name), p, initial, adam);
  }
  template <class View>
  void submit_gradient(std::size_t i, View grad, cudaStream_t stream) {
    h.submit(i, grad, stream);
  }
};

}  // namespace

TEST_CASE("zenflow.torch's CUDA handle on NCCL (one rank) equals its one-process handle, bit for bit") {
  const auto options = zenflow_test::data_parallel_test_options(0.0f);
  const zenflow::coordinator_config config;
  const std::vector<std::byte> id = zenflow_torch::make_nccl_unique_id();
  REQUIRE(id.size() == 128);
  const auto dp = zenflow_torch::make_cuda_data_parallel_handle(options, config, id, 0, 1, 60s, nullptr);
  const auto one = zenflow_torch::make_cuda_handle(options, config);
  CHECK(std::string(dp->backend()) == "cuda");
  CHECK(dp->ranks() == 1);
  device_model dp_model, one_model;
  handle_adapter a{*dp, options.optimizer}, b{*one, options.optimizer};
  dp_model.register_with(a);
  one_model.register_with(b);
  zenflow_test::cuda_stream s_dp, s_one;
  for (int t = 0; t < 12; ++t) {
    CAPTURE(t);
    dp_model.make_gradients(t, 0, 1, s_dp.get());
    one_model.make_gradients(t, -1, 1, s_one.get());
    const bool with_w2 = !zenflow_test::w2_missing(t);
    dp_model.submit(a, s_dp.get(), with_w2);
    one_model.submit(b, s_one.get(), with_w2);
    dp->step(s_dp.get());
    one->step(s_one.get());
    CHECK(dp_model.bytes(s_dp.get()) == one_model.bytes(s_one.get()));
    CHECK(dp->gpu_columns(0) == one->gpu_columns(0));
  }
  dp->finish(s_dp.get());
  one->finish(s_one.get());
  CHECK(dp_model.bytes(s_dp.get()) == one_model.bytes(s_one.get()));
  CHECK(dp->owned_columns(0) == std::pair<std::int64_t, std::int64_t>(0, zenflow_test::data_parallel_model::c1));
}

TEST_CASE("zenflow.torch's CUDA handle on NCCL: a wrong id or rank is rejected") {
  const auto options = zenflow_test::data_parallel_test_options(0.0f);
  const std::vector<std::byte> id(100);
  CHECK(contains(
      error_of([&] { (void)zenflow_torch::make_cuda_data_parallel_handle(options, {}, id, 0, 1, 5s, nullptr); }),
      "an ncclUniqueId has 128 bytes, got 100"));
  const std::vector<std::byte> good = zenflow_torch::make_nccl_unique_id();
  CHECK(contains(
      error_of([&] { (void)zenflow_torch::make_cuda_data_parallel_handle(options, {}, good, 1, 1, 5s, nullptr); }),
      "rank: must be in [0, 1), got 1"));
}
