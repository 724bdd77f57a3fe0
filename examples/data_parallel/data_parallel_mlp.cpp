// Data parallel on the host backend: a 2-layer MLP (64 -> 128 -> 10, f32) trained on the UCI
// optical digits (examples/data) by N processes, one data_parallel_host_coordinator each:
//
//   mpiexec -n 4 --oversubscribe build/default/examples/data_parallel_mlp [digits.csv] [epochs]
//
// Every rank starts from the same weights and walks the same shuffled order; each global batch of
// 96 samples is cut into one micro-batch per rank. A rank computes its micro-batch's gradients,
// submits them, and step() applies the mean over the ranks (ZenFlow async: the top 10% of columns
// every step, the others every 4 steps on the CPU, overlapped). Each rank holds the CPU Adam state
// of 1/N of every weight's columns only. Rank 0 prints the training loss over the global batches
// and the held-out accuracy per epoch, then one line per rank: its columns, its CPU state and a
// checksum of its parameters. Exits non-zero on every rank if the ranks' parameters differ or the
// held-out loss did not go down.
#include <mpi.h>

#include <zenflow/coordinator.hpp>
#include <zenflow/format.hpp>
#include <zenflow/mpi_communicator.hpp>

#include "../finetune_mlp/common.hpp"  // finetune::load_digits

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#ifndef ZENFLOW_DIGITS_CSV
#define ZENFLOW_DIGITS_CSV "examples/data/optdigits.csv"
#endif

namespace {

using zenflow::index_t;

constexpr std::size_t global_batch = 96;  // cut into one micro-batch per rank

// y = x W^T + b with W[out, in] row-major (like nn.Linear); the coordinator updates W and b in place.
struct linear {
  index_t in, out;
  std::vector<float> w, gw, b, gb;
  linear(index_t in_, index_t out_, std::mt19937& rng)
      : in(in_), out(out_), w(in * out), gw(in * out), b(out), gb(out) {
    std::normal_distribution<float> he(0.0f, std::sqrt(2.0f / static_cast<float>(in)));
    for (auto& v : w) v = he(rng);
  }
  void forward(const float* x, std::size_t batch, float* y) const {
    for (std::size_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < out; ++o)
        y[s * out + o] = std::inner_product(&w[o * in], &w[o * in] + in, x + s * in, b[o]);
  }
  // From dy: gW = dy^T x, gb = sum of dy, and dx = dy W when dx is given.
  void backward(const float* x, const float* dy, std::size_t batch, float* dx) {
    std::fill(gw.begin(), gw.end(), 0.0f);
    std::fill(gb.begin(), gb.end(), 0.0f);
    if (dx != nullptr) std::fill(dx, dx + batch * in, 0.0f);
    for (std::size_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < out; ++o) {
        const float d = dy[s * out + o];
        gb[o] += d;
        for (index_t i = 0; i < in; ++i) {
          gw[o * in + i] += d * x[s * in + i];
          if (dx != nullptr) dx[s * in + i] += d * w[o * in + i];
        }
      }
  }
};

struct mlp {
  std::mt19937 rng{1234};  // the same seed on every rank: the same initial weights
  linear fc0{64, 128, rng}, fc1{128, 10, rng};

  // The cross-entropy summed over the samples; counts the correct predictions (if `correct`).
  // With `scale`, also the gradients of scale x that sum.
  double run(const float* x, const int* y, std::size_t batch, int* correct, float scale = 0.0f) {
    std::vector<float> h(batch * 128), z(batch * 10), dz(batch * 10), dh(batch * 128);
    fc0.forward(x, batch, h.data());
    for (auto& v : h) v = std::max(v, 0.0f);  // ReLU
    fc1.forward(h.data(), batch, z.data());
    double loss = 0.0;
    for (std::size_t s = 0; s < batch; ++s) {
      const float* zs = &z[s * 10];
      const float top = *std::max_element(zs, zs + 10);
      double sum = 0.0;
      for (int c = 0; c < 10; ++c) sum += std::exp(static_cast<double>(zs[c] - top));
      loss += std::log(sum) - (zs[y[s]] - top);
      if (correct != nullptr && std::max_element(zs, zs + 10) - zs == y[s]) ++*correct;
      for (int c = 0; c < 10; ++c)
        dz[s * 10 + c] = scale * static_cast<float>(std::exp(static_cast<double>(zs[c] - top)) / sum - (c == y[s]));
    }
    if (scale != 0.0f) {
      fc1.backward(h.data(), dz.data(), batch, dh.data());
      for (std::size_t i = 0; i < h.size(); ++i)
        if (h[i] <= 0.0f) dh[i] = 0.0f;
      fc0.backward(x, dh.data(), batch, nullptr);
    }
    return loss;
  }
};

// FNV-1a over the bytes of the parameters: equal on every rank when they hold the same values.
std::uint64_t checksum(const mlp& m) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto* v : {&m.fc0.w, &m.fc0.b, &m.fc1.w, &m.fc1.b}) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(v->data());
    for (std::size_t i = 0; i < v->size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  return h;
}

// What rank 0 prints about each rank at the end.
struct rank_summary {
  std::int64_t columns[2][2];  // owned_columns of fc0.weight and fc1.weight: [first, last)
  double cpu_state_bytes;      // fp32 master, exp_avg and exp_avg_sq of those columns
  std::uint64_t checksum;
};

int train(const std::string& path, int epochs) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const finetune::dataset data = finetune::load_digits(path);  // every rank reads the whole file
  std::vector<std::size_t> order(data.n);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 shuffle_rng(2024);  // the same on every rank: the ranks agree on each global batch
  std::shuffle(order.begin(), order.end(), shuffle_rng);
  const std::vector<std::size_t> test(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(data.n / 5));
  std::vector<std::size_t> train_set(order.begin() + static_cast<std::ptrdiff_t>(data.n / 5), order.end());
  auto gather = [&](const std::vector<std::size_t>& idx, std::size_t first, std::size_t count) {
    std::pair<std::vector<float>, std::vector<int>> xy;
    for (std::size_t k = first; k < first + count; ++k) {
      xy.first.insert(xy.first.end(), &data.x[idx[k] * 64], &data.x[idx[k] * 64] + 64);
      xy.second.push_back(data.y[idx[k]]);
    }
    return xy;
  };
  // Named variables, not a structured binding: the held_out lambda below captures them, which
  // clang accepts from version 16 only.
  const auto test_xy = gather(test, 0, test.size());
  const std::vector<float>& test_x = test_xy.first;
  const std::vector<int>& test_y = test_xy.second;

  zenflow::zenflow_options options;
  options.topk_ratio = 0.1f;
  options.update_interval = zenflow::interval_option::fixed(4);
  options.select_interval = zenflow::interval_option::fixed(50);
  options.optimizer.lr = 1e-2f;
  options.optimizer.weight_decay = 0.01f;
  zenflow::coordinator_config config;
  config.cpu_threads = 1;  // several ranks share the machine's cores
  zenflow::mpi_communicator_options comm_options;
  comm_options.timeout = std::chrono::seconds(60);  // a rank that dies fails the others within a minute
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, comm_options);
  zenflow::data_parallel_host_coordinator<zenflow::mpi_communicator> coordinator(comm, options, config);
  mlp model;
  for (auto [name, layer] : {std::pair{"fc0", &model.fc0}, std::pair{"fc1", &model.fc1}}) {
    auto& L = *layer;
    const auto w = zenflow::matrix_view::row_major(L.w.data(), L.out, L.in, zenflow::dtype::f32);
    coordinator.register_parameter(std::string(name) + ".weight", w, w, zenflow::dtype::f32);
    coordinator.register_parameter(std::string(name) + ".bias",
                                   zenflow::vector_view{L.b.data(), L.out, zenflow::dtype::f32}, L.b);
  }
  zenflow::host_stream stream;  // stands in for the GPU stream
  auto held_out = [&](int* correct) {
    stream.synchronize();  // the weights the last step wrote
    return model.run(test_x.data(), test_y.data(), test_y.size(), correct) / static_cast<double>(test_y.size());
  };
  int correct = 0;
  const double first_loss = held_out(&correct);
  if (rank == 0) {
    fmt::print("zenflow data parallel: {} ranks, MLP 64-128-10 on {} digits ({} train, {} held out), global batch {}\n",
               ranks, data.n, train_set.size(), test.size(), global_batch);
    fmt::print("{}\nbefore training: held-out loss {:.4f}, accuracy {:.2f}%\n", options, first_loss,
               100.0 * correct / static_cast<double>(test.size()));
  }
  // This rank's micro-batch of each global batch: samples [first, last).
  const std::size_t first = global_batch * static_cast<std::size_t>(rank) / static_cast<std::size_t>(ranks);
  const std::size_t last = global_batch * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(ranks);
  const std::size_t batches = train_set.size() / global_batch;  // per epoch (the rest is dropped)
  double last_loss = first_loss;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    std::shuffle(train_set.begin(), train_set.end(), shuffle_rng);
    double loss_sum = 0.0;  // over this rank's micro-batches
    for (std::size_t batch = 0; batch < batches; ++batch) {
      const auto [x, y] = gather(train_set, batch * global_batch + first, last - first);
      stream.synchronize();  // the "backward" reads the weights the previous step wrote
      // The gradient of ranks / global_batch x this micro-batch's summed loss: step() takes the
      // mean over the ranks, which is the gradient of the global batch's mean loss.
      loss_sum += model.run(x.data(), y.data(), y.size(), nullptr, static_cast<float>(ranks) / global_batch);
      for (std::size_t l = 0; l < 2; ++l) {
        auto& L = l == 0 ? model.fc0 : model.fc1;
        coordinator.submit_gradient(
            2 * l, zenflow::const_matrix_view::row_major(L.gw.data(), L.out, L.in, zenflow::dtype::f32), &stream);
        coordinator.submit_gradient(2 * l + 1, zenflow::const_vector_view{L.gb.data(), L.out, zenflow::dtype::f32},
                                    &stream);
      }
      coordinator.step(&stream);
    }
    MPI_Allreduce(MPI_IN_PLACE, &loss_sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    correct = 0;
    last_loss = held_out(&correct);
    if (rank == 0)
      fmt::print("epoch {:2}  step {:4}  train loss {:.4f}  held-out loss {:.4f}  accuracy {:.2f}%\n", epoch,
                 coordinator.step_count(), loss_sum / static_cast<double>(batches * global_batch), last_loss,
                 100.0 * correct / static_cast<double>(test.size()));
  }
  coordinator.finish(&stream);  // completes and writes back the last CPU update
  stream.synchronize();

  rank_summary mine{};
  for (std::size_t l = 0; l < 2; ++l) {
    const auto range = coordinator.owned_columns(2 * l);
    mine.columns[l][0] = range.first;
    mine.columns[l][1] = range.last;
  }
  const auto& cpu = coordinator.host_optimizer();
  for (std::size_t t = 0; t < cpu.tensor_count(); ++t)
    mine.cpu_state_bytes +=
        4.0 * static_cast<double>(cpu.params(t).size() + cpu.exp_avg(t).size() + cpu.exp_avg_sq(t).size());
  mine.checksum = checksum(model);
  std::vector<rank_summary> all(static_cast<std::size_t>(ranks));
  MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, MPI_COMM_WORLD);
  double single = 0.0;  // the ranks together hold one process's CPU state, once
  for (const auto& r : all) single += r.cpu_state_bytes;
  bool same = true;
  for (const auto& r : all) same = same && r.checksum == all[0].checksum;
  const bool learned = last_loss < first_loss;
  if (rank == 0) {
    for (int r = 0; r < ranks; ++r) {
      const auto& s = all[static_cast<std::size_t>(r)];
      fmt::print(
          "rank {}: columns fc0.weight [{}, {}) fc1.weight [{}, {}), CPU optimizer state {:.0f} of {:.0f} bytes "
          "({:.3f}), parameters checksum {:016x}\n",
          r, s.columns[0][0], s.columns[0][1], s.columns[1][0], s.columns[1][1], s.cpu_state_bytes, single,
          s.cpu_state_bytes / single, s.checksum);
    }
    fmt::print("parameters on every rank: {}\n", same ? "identical (pass)" : "DIFFERENT (fail)");
    fmt::print("held-out loss {:.4f} -> {:.4f}: {}\n", first_loss, last_loss,
               learned ? "went down (pass)" : "did NOT go down (fail)");
  }
  return same && learned ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);  // the communicator needs THREAD_MULTIPLE
  int status = 1;
  try {
    status = train(argc > 1 ? argv[1] : ZENFLOW_DIGITS_CSV, argc > 2 ? std::stoi(argv[2]) : 10);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks would wait for this one
  }
  MPI_Finalize();
  return status;
}
