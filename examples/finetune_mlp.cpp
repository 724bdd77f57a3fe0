// The main job: fine-tune a 3-layer MLP (64 -> 256 -> 256 -> 10, bf16 weights and gradients) on
// the UCI optical digits (examples/data) with four optimizer set-ups from the same seed and the
// same held-out split, and compare them:
//   dense          every column updated on the "GPU" every step (the no-offload reference)
//   zero-offload   every column on the CPU, every step, synchronously (ZeRO-Offload)
//   zenflow-sync   top 10% of columns on the GPU, the rest every 4 steps on the CPU, synchronously
//   zenflow-async  the same with the CPU update overlapped and written back one interval later
// then ZenFlow async again with the CPU columns' moments in bf16 and in 8-bit blocks
// (coordinator_config::cpu_state), each within 0.5 point of zenflow-async's held-out accuracy,
// and with the moments in a state file on disk (coordinator_config::nvme), bit-identical to it.
// This build runs the coordinator's host backend (a host_stream stands in for the GPU stream).
// It prints the options of each run, per-step loss, stall time and bytes moved, writes
// finetune_mlp.csv (one row per mode and step; docs/plot_finetune.py turns it into
// docs/finetune.png) and a final table, and exits non-zero if ZenFlow's held-out accuracy is not
// within 1 percentage point of dense, or the run on disk is not bit-identical to the run in RAM.
//
// Usage: finetune_mlp [digits.csv] [epochs]
// The accuracy comparisons hold for the default 20 epochs or more; a shorter run (the sanitizer
// builds run 4 epochs) still checks bit-identity and says that it skipped them.
#include <zenflow/coordinator.hpp>
#include <zenflow/format.hpp>

#include "finetune_mlp/common.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#ifndef ZENFLOW_DIGITS_CSV
#define ZENFLOW_DIGITS_CSV "examples/data/optdigits.csv"
#endif

namespace {

using finetune::dataset;
using finetune::load_digits;
using finetune::mode_result;
using zenflow::bfloat16;
using zenflow::index_t;

struct linear {
  index_t in, out;
  std::vector<bfloat16> w, gw;
  std::vector<float> b, gb;
  std::vector<float> w0;  // fp32 initial values (the optimizer's master starts from these)
  linear(index_t in_, index_t out_, std::mt19937& rng)
      : in(in_), out(out_), w(in_ * out_), gw(in_ * out_), b(out_), gb(out_) {
    std::normal_distribution<float> n01(0.0f, 1.0f);
    const float scale = std::sqrt(2.0f / static_cast<float>(in));  // He initialisation
    w0.resize(w.size());
    for (std::size_t i = 0; i < w.size(); ++i) {
      w0[i] = scale * n01(rng);
      w[i] = zenflow::to_bfloat16(w0[i]);
    }
  }
  // y[batch, out] = x[batch, in] W^T + b
  void forward(const float* x, std::size_t batch, float* y) const {
    std::vector<float> wf(w.size());
    for (std::size_t i = 0; i < w.size(); ++i) wf[i] = zenflow::to_float(w[i]);
    for (std::size_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < out; ++o) {
        float acc = b[o];
        const float* wr = &wf[o * in];
        const float* xr = x + s * in;
        for (index_t i = 0; i < in; ++i) acc += wr[i] * xr[i];
        y[s * out + o] = acc;
      }
  }
  // From dy[batch, out]: gW = dy^T x, gb = sum dy, dx = dy W (if dx).
  void backward(const float* x, const float* dy, std::size_t batch, float* dx) {
    std::vector<float> g(w.size(), 0.0f);
    std::fill(gb.begin(), gb.end(), 0.0f);
    for (std::size_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < out; ++o) {
        const float d = dy[s * out + o];
        if (d == 0.0f) continue;
        gb[o] += d;
        float* gr = &g[o * in];
        const float* xr = x + s * in;
        for (index_t i = 0; i < in; ++i) gr[i] += d * xr[i];
      }
    for (std::size_t i = 0; i < g.size(); ++i) gw[i] = zenflow::to_bfloat16(g[i]);
    if (dx != nullptr) {
      std::fill(dx, dx + batch * in, 0.0f);
      for (std::size_t s = 0; s < batch; ++s)
        for (index_t o = 0; o < out; ++o) {
          const float d = dy[s * out + o];
          if (d == 0.0f) continue;
          for (index_t i = 0; i < in; ++i) dx[s * in + i] += d * zenflow::to_float(w[o * in + i]);
        }
    }
  }
};

struct mlp {
  std::vector<linear> layers;
  explicit mlp(std::uint32_t seed) {
    std::mt19937 rng(seed);
    layers.emplace_back(64, 256, rng);
    layers.emplace_back(256, 256, rng);
    layers.emplace_back(256, 10, rng);
  }
  // Returns the mean cross-entropy; fills gradients when train is set; counts correct predictions.
  float run(const float* x, const int* y, std::size_t batch, bool train, int* correct) {
    std::vector<std::vector<float>> acts{std::vector<float>(x, x + batch * 64)};
    for (std::size_t l = 0; l < layers.size(); ++l) {
      std::vector<float> out(batch * layers[l].out);
      layers[l].forward(acts.back().data(), batch, out.data());
      if (l + 1 < layers.size())
        for (auto& v : out) v = std::max(v, 0.0f);
      acts.push_back(std::move(out));
    }
    auto& logits = acts.back();
    std::vector<float> dy(logits.size());
    double loss = 0.0;
    for (std::size_t s = 0; s < batch; ++s) {
      float* z = &logits[s * 10];
      const float mx = *std::max_element(z, z + 10);
      double sum = 0.0;
      for (int c = 0; c < 10; ++c) sum += std::exp(static_cast<double>(z[c] - mx));
      loss += std::log(sum) - (z[y[s]] - mx);
      if (correct != nullptr && std::max_element(z, z + 10) - z == y[s]) ++*correct;
      for (int c = 0; c < 10; ++c)
        dy[s * 10 + c] = static_cast<float>((std::exp(static_cast<double>(z[c] - mx)) / sum - (c == y[s])) /
                                            static_cast<double>(batch));
    }
    if (train) {
      for (std::size_t l = layers.size(); l-- > 0;) {
        std::vector<float> dx(l > 0 ? batch * layers[l].in : 0);
        layers[l].backward(acts[l].data(), dy.data(), batch, l > 0 ? dx.data() : nullptr);
        if (l > 0) {
          for (std::size_t i = 0; i < dx.size(); ++i)
            if (acts[l][i] <= 0.0f) dx[i] = 0.0f;  // ReLU
          dy = std::move(dx);
        }
      }
    }
    return static_cast<float>(loss / static_cast<double>(batch));
  }
};

mode_result train(const std::string& name, zenflow::zenflow_options options, const dataset& data,
                  const std::vector<std::size_t>& train_idx, const std::vector<std::size_t>& test_idx, int epochs,
                  std::ofstream& csv, zenflow::cpu_state_format cpu_state = zenflow::cpu_state_format::fp32,
                  const std::filesystem::path& nvme_dir = {}) {
  options.optimizer.lr = 2e-3f;
  options.optimizer.weight_decay = 0.01f;
  options.optimizer.adamw_mode = true;
  finetune::print_options(name, options);
  mlp model(1234);  // the same initial weights for every mode
  zenflow::host_stream stream;
  zenflow::coordinator_config config;
  config.cpu_threads = 2;
  config.d2h_slot_bytes = 64 << 10;
  config.h2d_slot_bytes = 64 << 10;
  config.cpu_state = cpu_state;
  if (!nvme_dir.empty()) {  // the CPU columns' moments in a state file on disk
    zenflow::nvme_state_config nvme;
    nvme.file.directory = nvme_dir;
    nvme.file.block_bytes = 64 << 10;  // 8192 parameters' m and v per block: fc1 spans 8
    config.nvme = nvme;
  }
  zenflow::host_coordinator coordinator(options, config);
  if (!nvme_dir.empty()) fmt::print("[{}] {}\n", name, coordinator.host_optimizer().nvme_status());
  for (std::size_t l = 0; l < model.layers.size(); ++l) {
    auto& L = model.layers[l];
    coordinator.register_parameter("fc" + std::to_string(l) + ".weight",
                                   zenflow::matrix_view::row_major(L.w.data(), L.out, L.in, zenflow::dtype::bf16),
                                   zenflow::const_matrix_view::row_major(L.w0.data(), L.out, L.in, zenflow::dtype::f32),
                                   zenflow::dtype::bf16);
    coordinator.register_parameter("fc" + std::to_string(l) + ".bias",
                                   zenflow::vector_view{L.b.data(), L.out, zenflow::dtype::f32}, L.b);
  }
  const std::size_t batch = 64;
  std::mt19937 shuffle_rng(99);
  std::vector<std::size_t> order = train_idx;
  std::vector<float> xb(batch * 64);
  std::vector<int> yb(batch);
  mode_result result{name};
  const auto t0 = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < epochs; ++epoch) {
    std::shuffle(order.begin(), order.end(), shuffle_rng);
    for (std::size_t start = 0; start + batch <= order.size(); start += batch) {
      for (std::size_t s = 0; s < batch; ++s) {
        const std::size_t i = order[start + s];
        std::copy_n(&data.x[i * 64], 64, &xb[s * 64]);
        yb[s] = data.y[i];
      }
      stream.synchronize();  // "backward" reads the weights the previous step wrote
      const float loss = model.run(xb.data(), yb.data(), batch, true, nullptr);
      for (std::size_t l = 0; l < model.layers.size(); ++l) {
        auto& L = model.layers[l];
        coordinator.submit_gradient(
            2 * l, zenflow::const_matrix_view::row_major(L.gw.data(), L.out, L.in, zenflow::dtype::bf16), &stream);
        coordinator.submit_gradient(2 * l + 1, zenflow::const_vector_view{L.gb.data(), L.out, zenflow::dtype::f32},
                                    &stream);
      }
      const auto& m = coordinator.step(&stream);
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
  coordinator.finish(&stream);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int correct = 0;
  std::vector<float> xt;
  std::vector<int> yt;
  for (std::size_t i : test_idx) {
    xt.insert(xt.end(), &data.x[i * 64], &data.x[i * 64] + 64);
    yt.push_back(data.y[i]);
  }
  model.run(xt.data(), yt.data(), yt.size(), false, &correct);
  result.accuracy = 100.0 * correct / static_cast<double>(yt.size());
  result.weights_hash = 0xcbf29ce484222325ull;
  const auto hash = [&](const void* bytes_of, std::size_t bytes) {
    for (std::size_t b = 0; b < bytes; ++b)
      result.weights_hash = (result.weights_hash ^ static_cast<const unsigned char*>(bytes_of)[b]) * 0x100000001b3ull;
  };
  for (const auto& L : model.layers) {
    hash(L.w.data(), L.w.size() * sizeof(L.w[0]));
    hash(L.b.data(), L.b.size() * sizeof(L.b[0]));
  }
  return result;
}

}  // namespace

#if !defined(ZENFLOW_FINETUNE_GPU)
// Built without CUDA: the GPU half is absent.
bool finetune::gpu_available() {
  return false;
}
finetune::mode_result finetune::train_gpu(const std::string&, zenflow::zenflow_options, const dataset&,
                                          const std::vector<std::size_t>&, const std::vector<std::size_t>&, int,
                                          std::ofstream&) {
  throw zenflow::error("train_gpu", "this build has no CUDA");
}
#endif

// What a run trains with and, every 50 steps, what it did: for the host and the GPU runs alike
// (gpu.cu calls these, so fmt stays out of nvcc).
void finetune::print_options(const std::string& name, const zenflow::zenflow_options& options) {
  fmt::print("[{}] {}\n", name, options);
}

void finetune::print_step(const std::string& name, const zenflow::step_metrics& m, float loss) {
  fmt::print("  [{}] step {:4}  loss {:.4f}  stall {:.3f} ms{}{}  d2h {} B  h2d {} B  interval {}\n", name, m.step,
             loss, m.stall_seconds * 1e3, m.stall_reason.empty() ? "" : " ", m.stall_reason, m.bytes_device_to_host,
             m.bytes_host_to_device, m.interval);
}

namespace {
void print_table(const std::vector<mode_result>& results) {
  fmt::print("\n{:<18} {:>9} {:>10} {:>12} {:>14} {:>14} {:>8}\n", "mode", "accuracy", "final loss", "stall ms",
             "D2H bytes", "H2D bytes", "seconds");
  for (const auto& r : results)
    fmt::print("{:<18} {:>8.2f}% {:>10.4f} {:>12.2f} {:>14} {:>14} {:>8.2f}\n", r.name, r.accuracy, r.final_loss,
               r.stall_ms, r.bytes_d2h, r.bytes_h2d, r.seconds);
}
}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : ZENFLOW_DIGITS_CSV;
  constexpr int default_epochs = 20;
  int epochs = default_epochs;
  if (argc > 2) {
    const std::string arg = argv[2];
    const auto [end, err] = std::from_chars(arg.data(), arg.data() + arg.size(), epochs);
    if (err != std::errc{} || end != arg.data() + arg.size() || epochs < 1) {
      fmt::print(stderr, "finetune_mlp: epochs (the second argument) must be a whole number >= 1, got '{}'\n", arg);
      return 2;
    }
  }
  // Fewer epochs than the default leave the modes too far from convergence to compare accuracy.
  const bool compare_accuracy = epochs >= default_epochs;
  const dataset data = load_digits(path);
  // The same held-out split for every mode: 20% of the samples, chosen by a fixed seed.
  std::vector<std::size_t> idx(data.n);
  std::iota(idx.begin(), idx.end(), 0);
  std::mt19937 split_rng(2024);
  std::shuffle(idx.begin(), idx.end(), split_rng);
  const std::size_t n_test = data.n / 5;
  const std::vector<std::size_t> test_idx(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n_test));
  const std::vector<std::size_t> train_idx(idx.begin() + static_cast<std::ptrdiff_t>(n_test), idx.end());
  fmt::print(
      "zenflow {}.{}.{} fine-tune: 3-layer MLP 64-256-256-10 ({}) on {} optical digits ({} train, {} held out), {} "
      "epochs, host backend\n",
      zenflow::version_major, zenflow::version_minor, zenflow::version_patch, zenflow::dtype::bf16, data.n,
      train_idx.size(), n_test, epochs);

  std::ofstream csv("finetune_mlp.csv");
  csv << "mode,step,loss,stall_ms,bytes_d2h,bytes_h2d,interval,selection_overlap\n";

  zenflow::zenflow_options zenflow_async;  // DeepSpeed-style defaults, then the demo's settings
  zenflow_async.topk_ratio = 0.1f;
  zenflow_async.update_interval = zenflow::interval_option::fixed(4);
  zenflow_async.select_interval = zenflow::interval_option::fixed(100);
  zenflow_async.overlap_step = true;
  auto zenflow_sync = zenflow_async;
  zenflow_sync.overlap_step = false;

  std::vector<mode_result> results;
  results.push_back(train("dense", zenflow::zenflow_options::dense(), data, train_idx, test_idx, epochs, csv));
  results.push_back(
      train("zero-offload", zenflow::zenflow_options::zero_offload(), data, train_idx, test_idx, epochs, csv));
  results.push_back(train("zenflow-sync", zenflow_sync, data, train_idx, test_idx, epochs, csv));
  results.push_back(train("zenflow-async", zenflow_async, data, train_idx, test_idx, epochs, csv));

  const bool on_gpu = finetune::gpu_available();
  if (on_gpu) {
    fmt::print("\nA CUDA GPU is present: the same four runs through cuda_coordinator.\n");
    results.push_back(
        finetune::train_gpu("gpu-dense", zenflow::zenflow_options::dense(), data, train_idx, test_idx, epochs, csv));
    results.push_back(finetune::train_gpu("gpu-zero-offload", zenflow::zenflow_options::zero_offload(), data, train_idx,
                                          test_idx, epochs, csv));
    results.push_back(finetune::train_gpu("gpu-zenflow-sync", zenflow_sync, data, train_idx, test_idx, epochs, csv));
    results.push_back(finetune::train_gpu("gpu-zenflow-async", zenflow_async, data, train_idx, test_idx, epochs, csv));
  } else {
    fmt::print("\n(no CUDA GPU in this build or on this machine: host backend only)\n");
  }
  // ZenFlow async with the CPU columns' moments held compactly (coordinator_config::cpu_state).
  const std::size_t compact = results.size();
  for (const auto format : {zenflow::cpu_state_format::bf16_moments, zenflow::cpu_state_format::blockwise8_moments})
    results.push_back(
        train(fmt::format("zenflow-async-{}", format == zenflow::cpu_state_format::bf16_moments ? "bf16" : "8bit"),
              zenflow_async, data, train_idx, test_idx, epochs, csv, format));
  // ZenFlow async with the CPU columns' moments in a state file on disk (coordinator_config::nvme),
  // in a directory under the working directory (a disk file system, not tmpfs).
  const std::filesystem::path nvme_dir = std::filesystem::current_path() / "finetune_mlp_state";
  std::filesystem::create_directories(nvme_dir);
  const std::size_t on_disk = results.size();
  results.push_back(train("zenflow-async-nvme", zenflow_async, data, train_idx, test_idx, epochs, csv,
                          zenflow::cpu_state_format::fp32, nvme_dir));
  std::filesystem::remove_all(nvme_dir);
  print_table(results);
  fmt::print("per-step rows written to finetune_mlp.csv (plot: python3 docs/plot_finetune.py finetune_mlp.csv)\n");
  bool ok = true;
  if (!compare_accuracy)
    fmt::print("{} epochs (fewer than {}): the accuracy comparisons are skipped, bit-identity is checked\n", epochs,
               default_epochs);
  for (std::size_t base = 0; compare_accuracy && base < compact; base += 4) {
    const double gap = results[base].accuracy - results[base + 3].accuracy;
    const bool within = gap <= 1.0;
    fmt::print("{} held-out accuracy is {:.2f} points {} {}: {}\n", results[base + 3].name, std::fabs(gap),
               gap >= 0 ? "below" : "above", results[base].name,
               within ? "within 1 point (pass)" : "NOT within 1 point (fail)");
    ok = ok && within;
  }
  {
    // Moments on disk must train bit-identically to moments in RAM.
    const bool same =
        results[on_disk].weights_hash == results[3].weights_hash && results[on_disk].accuracy == results[3].accuracy;
    fmt::print("{} final weights are {} {}'s: {}\n", results[on_disk].name, same ? "bit-identical to" : "NOT",
               results[3].name, same ? "pass" : "fail");
    ok = ok && same;
  }
  for (std::size_t i = compact; compare_accuracy && i < on_disk; ++i) {
    // Compact moments must train as fp32 moments do: 0.5 point is 2 of the 360 test digits.
    const double gap = results[3].accuracy - results[i].accuracy;
    const bool within = gap <= 0.5;
    fmt::print("{} held-out accuracy is {:.2f} points {} {}: {}\n", results[i].name, std::fabs(gap),
               gap >= 0 ? "below" : "above", results[3].name,
               within ? "within 0.5 point (pass)" : "NOT within 0.5 point (fail)");
    ok = ok && within;
  }
  if (compare_accuracy && compact == 8) {
    // The GPU run must also learn what the host run learns (a GPU half that barely updated its
    // weights would sit near chance in every mode and still pass the gap check above). Different
    // GEMM summation orders make the runs differ slightly; 2 points is ~7 of the 360 test digits.
    for (std::size_t i = 0; i < 4; ++i) {
      const double diff = std::fabs(results[4 + i].accuracy - results[i].accuracy);
      const bool close = diff <= 2.0;
      fmt::print("{} is {:.2f} points from {}: {}\n", results[4 + i].name, diff, results[i].name,
                 close ? "within 2 points (pass)" : "NOT within 2 points (fail)");
      ok = ok && close;
    }
  }
  return ok ? 0 : 1;
}
