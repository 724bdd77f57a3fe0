// The GPU half of examples/finetune_mlp: the same MLP, initial weights, batches and options as
// the host half, with the model on the GPU (cuBLAS fp32 GEMMs from bf16 weights, small kernels
// for bias, ReLU and the loss) and the optimizer in cuda_coordinator.
#include <cublas_v2.h>
#include <zenflow/coordinator.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>

#include "common.hpp"

namespace {

using zenflow::bfloat16;
using zenflow::index_t;

#define FINETUNE_CUBLAS_TRY(call)                                                           \
  do {                                                                                      \
    if ((call) != CUBLAS_STATUS_SUCCESS) throw zenflow::error(#call, "cuBLAS call failed"); \
  } while (0)

template <class T>
struct device_vector {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit device_vector(std::size_t count) : n(count) { ZENFLOW_CUDA_TRY(cudaMalloc(&ptr, count * sizeof(T))); }
  device_vector(const device_vector&) = delete;
  ~device_vector() { ZENFLOW_CUDA_ASSERT(cudaFree(ptr)); }
};

__global__ void widen(const bfloat16* in, float* out, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = zenflow::to_float(in[i]);
}
__global__ void narrow(const float* in, bfloat16* out, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = zenflow::to_bfloat16(in[i]);
}
__global__ void bias_relu(float* y, const float* b, int batch, int out, bool relu) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch * out) return;
  const float v = y[i] + b[i % out];
  y[i] = relu ? fmaxf(v, 0.0f) : v;
}
// Softmax cross-entropy per sample: dy = (softmax - onehot) / batch, loss and correct per sample.
__global__ void softmax_xent(const float* logits, const int* labels, int batch, float* dy, float* loss, int* correct) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= batch) return;
  const float* z = logits + s * 10;
  float mx = z[0];
  int arg = 0;
  for (int c = 1; c < 10; ++c)
    if (z[c] > mx) mx = z[c], arg = c;
  double sum = 0.0;
  for (int c = 0; c < 10; ++c) sum += exp(static_cast<double>(z[c] - mx));
  loss[s] = static_cast<float>(log(sum) - (z[labels[s]] - mx));
  correct[s] = arg == labels[s];
  if (dy != nullptr)
    for (int c = 0; c < 10; ++c)
      dy[s * 10 + c] = static_cast<float>((exp(static_cast<double>(z[c] - mx)) / sum - (c == labels[s])) / batch);
}
__global__ void column_sum(const float* dy, int batch, int out, float* gb) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float acc = 0.0f;
  for (int s = 0; s < batch; ++s) acc += dy[s * out + o];
  gb[o] = acc;
}
__global__ void relu_mask(float* dx, const float* act, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n && act[i] <= 0.0f) dx[i] = 0.0f;
}
unsigned blocks(std::size_t n) {
  return static_cast<unsigned>((n + 255) / 256);
}

struct layer {
  int in, out;
  std::vector<float> w0;
  device_vector<bfloat16> w, gw;
  device_vector<float> wf, gwf, b, gb;
  layer(int in_, int out_, std::mt19937& rng)
      : in(in_), out(out_), w(in_ * out_), gw(in_ * out_), wf(in_ * out_), gwf(in_ * out_), b(out_), gb(out_) {
    std::normal_distribution<float> n01(0.0f, 1.0f);  // the host half's He initialisation, same draws
    const float scale = std::sqrt(2.0f / static_cast<float>(in));
    w0.resize(static_cast<std::size_t>(in) * out);
    std::vector<bfloat16> wb(w0.size());
    for (std::size_t i = 0; i < w0.size(); ++i) {
      w0[i] = scale * n01(rng);
      wb[i] = zenflow::to_bfloat16(w0[i]);
    }
    ZENFLOW_CUDA_TRY(cudaMemcpy(w.ptr, wb.data(), wb.size() * sizeof(bfloat16), cudaMemcpyHostToDevice));
    ZENFLOW_CUDA_TRY(cudaMemset(b.ptr, 0, out * sizeof(float)));
    // Both may return before they ran, on the legacy stream, which the trainer's non-blocking stream
    // does not wait for.
    ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  }
};

struct gpu_mlp {
  cublasHandle_t handle{};
  cudaStream_t stream{};
  std::vector<std::unique_ptr<layer>> layers;
  explicit gpu_mlp(std::uint32_t seed) {
    ZENFLOW_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    FINETUNE_CUBLAS_TRY(cublasCreate(&handle));
    FINETUNE_CUBLAS_TRY(cublasSetStream(handle, stream));
    std::mt19937 rng(seed);
    layers.push_back(std::make_unique<layer>(64, 256, rng));
    layers.push_back(std::make_unique<layer>(256, 256, rng));
    layers.push_back(std::make_unique<layer>(256, 10, rng));
  }
  ~gpu_mlp() {
    cublasDestroy(handle);
    ZENFLOW_CUDA_ASSERT(cudaStreamDestroy(stream));
  }
  // Activations and gradient scratch, allocated once for the largest batch seen (cudaMalloc and
  // cudaFree inside a step would synchronize the device and distort the stall figures).
  int capacity = 0;
  std::vector<std::unique_ptr<device_vector<float>>> acts;
  std::unique_ptr<device_vector<float>> dy, dx[2], loss;
  std::unique_ptr<device_vector<int>> correct;
  void reserve(int batch) {
    if (batch <= capacity) return;
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // the old buffers may still be in use
    const auto rows = static_cast<std::size_t>(batch);
    acts.clear();
    int widest = 0;
    for (auto& L : layers) {
      acts.push_back(std::make_unique<device_vector<float>>(rows * L->out));
      widest = std::max(widest, L->in);
    }
    dy = std::make_unique<device_vector<float>>(rows * layers.back()->out);
    for (auto& d : dx) d = std::make_unique<device_vector<float>>(rows * widest);
    loss = std::make_unique<device_vector<float>>(rows);
    correct = std::make_unique<device_vector<int>>(rows);
    capacity = batch;
  }

  // Forward (and backward when train) of one batch already on the device; returns the mean loss
  // and the number of correct predictions (synchronizes with the stream).
  std::pair<float, int> run(const float* x, const int* labels, int batch, bool train) {
    reserve(batch);
    const float one = 1.0f, zero = 0.0f;
    const float* in = x;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto& L = *layers[l];
      widen<<<blocks(L.w.n), 256, 0, stream>>>(L.w.ptr, L.wf.ptr, L.w.n);
      // Y[B, out] = X[B, in] W^T (column-major: Y^T = op_T(W^T) X^T)
      FINETUNE_CUBLAS_TRY(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, L.out, batch, L.in, &one, L.wf.ptr, L.in, in,
                                      L.in, &zero, acts[l]->ptr, L.out));
      bias_relu<<<blocks(static_cast<std::size_t>(batch) * L.out), 256, 0, stream>>>(acts[l]->ptr, L.b.ptr, batch,
                                                                                     L.out, l + 1 < layers.size());
      in = acts[l]->ptr;
    }
    softmax_xent<<<blocks(batch), 256, 0, stream>>>(in, labels, batch, train ? dy->ptr : nullptr, loss->ptr,
                                                    correct->ptr);
    if (train) {
      const float* d = dy->ptr;
      for (std::size_t l = layers.size(); l-- > 0;) {
        auto& L = *layers[l];
        const float* x_l = l == 0 ? x : acts[l - 1]->ptr;
        // dW[out, in] = dY^T X (column-major: dW^T = X^T op_T(dY^T))
        FINETUNE_CUBLAS_TRY(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, L.in, L.out, batch, &one, x_l, L.in, d, L.out,
                                        &zero, L.gwf.ptr, L.in));
        narrow<<<blocks(L.gw.n), 256, 0, stream>>>(L.gwf.ptr, L.gw.ptr, L.gw.n);
        column_sum<<<blocks(L.out), 256, 0, stream>>>(d, batch, L.out, L.gb.ptr);
        if (l > 0) {
          float* dx_l = dx[l % 2]->ptr;  // never the buffer `d` points into (that is dx[(l + 1) % 2] or dy)
          const std::size_t n = static_cast<std::size_t>(batch) * L.in;
          // dX[B, in] = dY W (column-major: dX^T = W^T dY^T)
          FINETUNE_CUBLAS_TRY(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, L.in, batch, L.out, &one, L.wf.ptr, L.in, d,
                                          L.out, &zero, dx_l, L.in));
          relu_mask<<<blocks(n), 256, 0, stream>>>(dx_l, acts[l - 1]->ptr, n);
          d = dx_l;
        }
      }
    }
    std::vector<float> h_loss(batch);
    std::vector<int> h_correct(batch);
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(h_loss.data(), loss->ptr, batch * sizeof(float), cudaMemcpyDeviceToHost, stream));
    ZENFLOW_CUDA_TRY(
        cudaMemcpyAsync(h_correct.data(), correct->ptr, batch * sizeof(int), cudaMemcpyDeviceToHost, stream));
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    double sum = 0.0;
    int right = 0;
    for (int s = 0; s < batch; ++s) {
      sum += h_loss[s];
      right += h_correct[s];
    }
    return {static_cast<float>(sum / batch), right};
  }
};

}  // namespace

bool finetune::gpu_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

finetune::mode_result finetune::train_gpu(const std::string& name, zenflow::zenflow_options options,
                                          const dataset& data, const std::vector<std::size_t>& train_idx,
                                          const std::vector<std::size_t>& test_idx, int epochs, std::ofstream& csv) {
  options.optimizer.lr = 2e-3f;  // the host half's settings
  options.optimizer.weight_decay = 0.01f;
  options.optimizer.adamw_mode = true;
  finetune::print_options(name, options);
  gpu_mlp model(1234);
  zenflow::coordinator_config config;
  config.d2h_slot_bytes = 64 << 10;
  config.h2d_slot_bytes = 64 << 10;
  zenflow::cuda_coordinator coordinator(options, config);
  for (std::size_t l = 0; l < model.layers.size(); ++l) {
    auto& L = *model.layers[l];
    coordinator.register_parameter(
        "fc" + std::to_string(l) + ".weight",
        zenflow::matrix_view::row_major(L.w.ptr, L.out, L.in, zenflow::dtype::bf16, zenflow::memory_space::device),
        zenflow::const_matrix_view::row_major(L.w0.data(), L.out, L.in, zenflow::dtype::f32), zenflow::dtype::bf16);
    std::vector<float> b0(L.out, 0.0f);
    coordinator.register_parameter(
        "fc" + std::to_string(l) + ".bias",
        zenflow::vector_view{L.b.ptr, L.out, zenflow::dtype::f32, zenflow::memory_space::device}, b0);
  }
  const int batch = 64;
  std::mt19937 shuffle_rng(99);
  std::vector<std::size_t> order = train_idx;
  std::vector<float> xb(batch * 64);
  std::vector<int> yb(batch);
  device_vector<float> x_dev(batch * 64);
  device_vector<int> y_dev(batch);
  mode_result result{name};
  const auto t0 = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < epochs; ++epoch) {
    std::shuffle(order.begin(), order.end(), shuffle_rng);
    for (std::size_t start = 0; start + batch <= order.size(); start += batch) {
      for (int s = 0; s < batch; ++s) {
        const std::size_t i = order[start + s];
        std::copy_n(&data.x[i * 64], 64, &xb[s * 64]);
        yb[s] = data.y[i];
      }
      ZENFLOW_CUDA_TRY(cudaMemcpyAsync(x_dev.ptr, xb.data(), xb.size() * 4, cudaMemcpyHostToDevice, model.stream));
      ZENFLOW_CUDA_TRY(cudaMemcpyAsync(y_dev.ptr, yb.data(), yb.size() * 4, cudaMemcpyHostToDevice, model.stream));
      const float loss = model.run(x_dev.ptr, y_dev.ptr, batch, true).first;
      for (std::size_t l = 0; l < model.layers.size(); ++l) {
        auto& L = *model.layers[l];
        coordinator.submit_gradient(2 * l,
                                    zenflow::const_matrix_view::row_major(L.gw.ptr, L.out, L.in, zenflow::dtype::bf16,
                                                                          zenflow::memory_space::device),
                                    model.stream);
        coordinator.submit_gradient(
            2 * l + 1, zenflow::const_vector_view{L.gb.ptr, L.out, zenflow::dtype::f32, zenflow::memory_space::device},
            model.stream);
      }
      const auto& m = coordinator.step(model.stream);
      result.stall_ms += m.stall_seconds * 1e3;
      result.bytes_d2h += m.bytes_device_to_host;
      result.bytes_h2d += m.bytes_host_to_device;
      result.final_loss = loss;
      csv << name << ',' << m.step << ',' << loss << ',' << m.stall_seconds * 1e3 << ',' << m.bytes_device_to_host
          << ',' << m.bytes_host_to_device << ',' << m.interval << ',' << m.selection_overlap << '\n';
      if (m.step % 50 == 0) finetune::print_step(name, m, loss);
      ++result.steps;
    }
  }
  coordinator.finish(model.stream);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<float> xt;
  std::vector<int> yt;
  for (std::size_t i : test_idx) {
    xt.insert(xt.end(), &data.x[i * 64], &data.x[i * 64] + 64);
    yt.push_back(data.y[i]);
  }
  device_vector<float> xt_dev(xt.size());
  device_vector<int> yt_dev(yt.size());
  ZENFLOW_CUDA_TRY(cudaMemcpy(xt_dev.ptr, xt.data(), xt.size() * 4, cudaMemcpyHostToDevice));
  ZENFLOW_CUDA_TRY(cudaMemcpy(yt_dev.ptr, yt.data(), yt.size() * 4, cudaMemcpyHostToDevice));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());  // the uploads may still be in flight on the legacy stream
  const int right = model.run(xt_dev.ptr, yt_dev.ptr, static_cast<int>(yt.size()), false).second;
  result.accuracy = 100.0 * right / static_cast<double>(yt.size());
  return result;
}
