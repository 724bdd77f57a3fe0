// Shared by the host and GPU halves of examples/finetune_mlp: the data set, its loader, the
// per-mode result, the printed lines (defined in finetune_mlp.cpp) and the GPU entry points
// (defined in gpu.cu when built with CUDA).
#pragma once

#include <zenflow/coordinator.hpp>
#include <zenflow/options.hpp>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace finetune {

struct dataset {
  std::vector<float> x;  // n x 64, scaled to [0, 1]
  std::vector<int> y;
  std::size_t n = 0;
};

inline dataset load_digits(const std::string& path) {
  std::ifstream in(path);
  zenflow::expects(static_cast<bool>(in), "digits.csv", "cannot open '", path, "'");
  dataset d;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::stringstream ss(line);
    std::string cell;
    std::vector<float> row;
    while (std::getline(ss, cell, ',')) row.push_back(std::stof(cell));
    zenflow::expects(row.size() == 65, "digits.csv", "line ", d.n + 1, " has ", row.size(), " fields, expected 65");
    for (int i = 0; i < 64; ++i) d.x.push_back(row[i] / 16.0f);
    d.y.push_back(static_cast<int>(row[64]));
    ++d.n;
  }
  zenflow::expects(d.n > 100, "digits.csv", "too few samples: ", d.n);
  return d;
}

// One linear layer with bf16 weight W[out, in] (row-major, like nn.Linear), fp32 bias, and their
// gradients in the same dtypes; the coordinator updates them in place.
struct mode_result {
  std::string name;
  double accuracy = 0.0, final_loss = 0.0, stall_ms = 0.0, seconds = 0.0;
  std::uint64_t bytes_d2h = 0, bytes_h2d = 0;
  std::int64_t steps = 0;
  std::uint64_t weights_hash = 0;  ///< FNV-1a of the final weights and biases (host runs)
};

/// Prints the options a run trains with.
void print_options(const std::string& name, const zenflow::zenflow_options& options);
/// Prints one step of a run: loss, stall (and why), bytes moved, update interval.
void print_step(const std::string& name, const zenflow::step_metrics& m, float loss);

/// True when this build has the CUDA half and a CUDA device is present.
bool gpu_available();
/// Trains the same MLP with `options` on the GPU through cuda_coordinator (defined in gpu.cu).
mode_result train_gpu(const std::string& name, zenflow::zenflow_options options, const dataset& data,
                      const std::vector<std::size_t>& train_idx, const std::vector<std::size_t>& test_idx, int epochs,
                      std::ofstream& csv);

}  // namespace finetune
