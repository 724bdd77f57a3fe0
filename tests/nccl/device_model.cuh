// The data-parallel test model (support/data_parallel_model.hpp) with its parameters and
// gradients in device memory: the host vectors hold the values, the device copies are what the
// CUDA coordinator registers and reads.
#pragma once

#include <zenflow/error.hpp>

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "../support/cuda_test_utils.cuh"
#include "../support/data_parallel_model.hpp"

namespace zenflow_test {

template <int Scale>
struct basic_device_model {
  basic_data_parallel_model<Scale> host;
  device_vector<zenflow::bfloat16> w1{host.w1}, g1{host.g1};
  device_vector<float> w2{host.w2}, g2{host.g2}, b{host.b}, gb{host.gb};

  basic_device_model() = default;  // device_vector's uploads have landed when it is constructed
  basic_device_model(const basic_device_model&) = delete;
  basic_device_model& operator=(const basic_device_model&) = delete;

  template <class C>
  void register_with(C& c, const std::string& first_name = "w1") {
    host.register_at(c, w1.buffer.data(), w2.buffer.data(), b.buffer.data(), zenflow::memory_space::device, first_name);
  }
  /// host.make_gradients, uploaded on `stream`. The caller synchronizes `stream` between steps:
  /// the coordinator's own streams may still read the previous step's gradients.
  void make_gradients(int t, int rank, int ranks, cudaStream_t stream) {
    host.make_gradients(t, rank, ranks);
    upload_gradients(stream);
  }
  /// host.make_rank_specific_gradients, uploaded on `stream`.
  void make_rank_specific_gradients(int t, int rank, int ranks, cudaStream_t stream) {
    host.make_rank_specific_gradients(t, rank, ranks);
    upload_gradients(stream);
  }
  void upload_gradients(cudaStream_t stream) {
    ZENFLOW_CUDA_TRY(
        cudaMemcpyAsync(g1.buffer.data(), host.g1.data(), host.g1.size() * 2, cudaMemcpyHostToDevice, stream));
    ZENFLOW_CUDA_TRY(
        cudaMemcpyAsync(g2.buffer.data(), host.g2.data(), host.g2.size() * 4, cudaMemcpyHostToDevice, stream));
    ZENFLOW_CUDA_TRY(
        cudaMemcpyAsync(gb.buffer.data(), host.gb.data(), host.gb.size() * 4, cudaMemcpyHostToDevice, stream));
  }
  template <class C>
  void submit(C& c, cudaStream_t stream, bool with_w2 = true) const {
    host.submit_from(c, g1.buffer.data(), g2.buffer.data(), gb.buffer.data(), zenflow::memory_space::device, stream,
                     with_w2);
  }
  /// The device parameters' bytes (w1, w2, b) once `stream` reached this point.
  std::vector<std::byte> bytes(cudaStream_t stream) {
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    host.w1 = w1.download();
    host.w2 = w2.download();
    host.b = b.download();
    return host.bytes();
  }
};

using device_model = basic_device_model<1>;

}  // namespace zenflow_test
