// Data parallel on the HOST backend, run under `mpiexec -n <ranks>`: every rank is one
// data_parallel_host_coordinator<mpi_communicator> training the same parameters (4 bf16 matrices
// of 1024 x 1024 with bf16 gradients and one f32 vector of 1024) in ZenFlow async mode (topk 0.1,
// update_interval 4, select_interval 100, no warm-up) on its own gradients. Each rank holds the CPU
// optimizer state of 1/ranks of every matrix's columns; the counters show that state per rank, as
// a fraction of one process's, next to the step time and the CPU update time per rank.
//
// All ranks run the same benchmarks for a fixed number of iterations (the steps are collective);
// rank 0 prints (the others' reporter prints nothing) and reports the figures of every rank,
// gathered over MPI: the counters are rank 0's, with the extremes over the ranks next to them,
// and one line per rank follows the table.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <zenflow/coordinator.hpp>
#include <zenflow/mpi_communicator.hpp>
#include "end_to_end_modes.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <string>
#include <vector>

namespace {

using zenflow::bfloat16;
using zenflow::index_t;

constexpr index_t rows = 1024;
constexpr index_t cols = 1024;
constexpr index_t matrices = 4;
constexpr index_t vector_size = 1024;
constexpr int steps = 40;  // 10 whole update intervals

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// The parameters and this rank's gradients. The "backward" of a step copies one of two gradient
// sets drawn per rank (distinct micro-batches) into the gradient buffers on the stream.
struct model {
  std::vector<std::vector<bfloat16>> w, g;
  std::vector<std::vector<float>> w0;
  std::vector<std::vector<bfloat16>> grads[2];
  std::vector<float> b, gb, gb_src[2];
  explicit model(int rank) {
    std::mt19937 init(1);  // the same initial values on every rank
    std::normal_distribution<float> n01(0.0f, 0.05f);
    std::mt19937 rng(1000 + static_cast<unsigned>(rank));
    std::normal_distribution<float> gn(0.0f, 1e-2f);
    for (index_t l = 0; l < matrices; ++l) {
      w0.emplace_back(rows * cols);
      for (auto& v : w0.back()) v = n01(init);
      w.emplace_back(rows * cols);
      for (std::size_t i = 0; i < w.back().size(); ++i) w.back()[i] = zenflow::to_bfloat16(w0.back()[i]);
      g.emplace_back(rows * cols);
      for (auto& set : grads) {
        set.emplace_back(rows * cols);
        for (auto& v : set.back()) v = zenflow::to_bfloat16(gn(rng));
      }
    }
    b.assign(vector_size, 0.0f);
    gb.assign(vector_size, 0.0f);
    for (auto& set : gb_src) {
      set.resize(vector_size);
      for (auto& v : set) v = gn(rng);
    }
  }
  void backward(int step) {
    for (index_t l = 0; l < matrices; ++l)
      std::copy(grads[step % 2][l].begin(), grads[step % 2][l].end(), g[l].begin());
    std::copy(gb_src[step % 2].begin(), gb_src[step % 2].end(), gb.begin());
  }
};

// One rank's figures, gathered to rank 0.
struct rank_figures {
  double step_ms = 0.0;
  double cpu_update_ms = 0.0;  // mean of metrics().cpu_update_seconds over the steps where it is > 0
  double d2h_bytes_per_step = 0.0;
  double h2d_bytes_per_step = 0.0;
  double cpu_state_bytes = 0.0;  // 3 x 4 bytes per element of the host optimizer's tensors
  double owned_columns = 0.0;    // summed over the matrices
};

std::vector<rank_figures>& gathered() {
  static std::vector<rank_figures> figures;
  return figures;
}

void BM_data_parallel_host(benchmark::State& state) {
  const int rank = world_rank();
  constexpr bool with_vector = true;  // a 1-D parameter too (its gradient is all-reduced)
  zenflow::mpi_communicator_options comm_options;
  comm_options.timeout = std::chrono::seconds(120);
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, comm_options);
  model m(rank);
  zenflow::host_stream stream;
  zenflow::coordinator_config config;
  config.cpu_threads = 1;
  config.d2h_slot_bytes = 1 << 20;
  config.h2d_slot_bytes = 1 << 20;
  rank_figures mine;
  try {
    zenflow::data_parallel_host_coordinator<zenflow::mpi_communicator> c(
        comm, zenflow_bench::mode_options(zenflow_bench::zenflow_async, 1e-3f), config);
    for (index_t l = 0; l < matrices; ++l)
      c.register_parameter(
          "w" + std::to_string(l), zenflow::matrix_view::row_major(m.w[l].data(), rows, cols, zenflow::dtype::bf16),
          zenflow::const_matrix_view::row_major(m.w0[l].data(), rows, cols, zenflow::dtype::f32), zenflow::dtype::bf16);
    if (with_vector) c.register_parameter("b", zenflow::vector_view{m.b.data(), vector_size, zenflow::dtype::f32}, m.b);
    double total = 0.0, cpu_update = 0.0;
    std::uint64_t d2h = 0, h2d = 0;
    int n = 0, updates = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      stream.enqueue([&m, n] { m.backward(n); });  // this rank's backward on the "GPU"
      for (index_t l = 0; l < matrices; ++l)
        c.submit_gradient(static_cast<std::size_t>(l),
                          zenflow::const_matrix_view::row_major(m.g[l].data(), rows, cols, zenflow::dtype::bf16),
                          &stream);
      if (with_vector)
        c.submit_gradient(static_cast<std::size_t>(matrices),
                          zenflow::const_vector_view{m.gb.data(), vector_size, zenflow::dtype::f32}, &stream);
      const auto& metrics = c.step(&stream);
      stream.synchronize();  // the step is done when the "GPU" is done
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      d2h += metrics.bytes_device_to_host;
      h2d += metrics.bytes_host_to_device;
      if (metrics.cpu_update_seconds > 0.0) {
        cpu_update += metrics.cpu_update_seconds;
        ++updates;
      }
      ++n;
    }
    c.finish(&stream);
    stream.synchronize();
    mine.step_ms = total / n * 1e3;
    mine.cpu_update_ms = updates > 0 ? cpu_update / updates * 1e3 : 0.0;
    mine.d2h_bytes_per_step = static_cast<double>(d2h) / n;
    mine.h2d_bytes_per_step = static_cast<double>(h2d) / n;
    const auto& opt = c.host_optimizer();
    for (std::size_t t = 0; t < opt.tensor_count(); ++t)
      mine.cpu_state_bytes +=
          4.0 * static_cast<double>(opt.params(t).size() + opt.exp_avg(t).size() + opt.exp_avg_sq(t).size());
    for (std::size_t i = 0; i < c.parameter_count(); ++i)
      mine.owned_columns += static_cast<double>(c.owned_columns(i).size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    state.SkipWithError(e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks would wait for this one's collectives
  }

  const int ranks = world_size();
  std::vector<rank_figures> all(static_cast<std::size_t>(ranks));
  MPI_Gather(&mine, sizeof(rank_figures), MPI_BYTE, all.data(), sizeof(rank_figures), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  gathered() = all;
  const double single = 3.0 * 4.0 * static_cast<double>(matrices * rows * cols);  // one process's CPU state
  auto extreme = [&](auto field, bool max) {
    double v = all[0].*field;
    for (const auto& f : all) v = max ? std::max(v, f.*field) : std::min(v, f.*field);
    return v;
  };
  state.counters["ranks"] = ranks;
  state.counters["step_ms"] = mine.step_ms;
  state.counters["step_ms_max_rank"] = extreme(&rank_figures::step_ms, true);
  state.counters["cpu_update_ms"] = mine.cpu_update_ms;
  state.counters["cpu_update_ms_max_rank"] = extreme(&rank_figures::cpu_update_ms, true);
  state.counters["cpu_state_bytes_per_rank"] = mine.cpu_state_bytes;
  state.counters["cpu_state_fraction_of_single"] = extreme(&rank_figures::cpu_state_bytes, true) / single;
  state.counters["cpu_state_fraction_min_rank"] = extreme(&rank_figures::cpu_state_bytes, false) / single;
  state.counters["d2h_bytes_per_step"] = mine.d2h_bytes_per_step;
  state.counters["h2d_bytes_per_step"] = mine.h2d_bytes_per_step;
  state.SetLabel(std::to_string(ranks) + " ranks");
}

// Rank != 0: runs the benchmarks in lockstep with rank 0 and prints nothing.
class null_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

BENCHMARK(BM_data_parallel_host)->Iterations(steps)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int rank = world_rank();
  if (provided != MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "rank %d: MPI does not provide MPI_THREAD_MULTIPLE (got %d)\n", rank, provided);
    MPI_Finalize();
    return 1;
  }
  // Only rank 0 writes --benchmark_out; the other ranks drop it (and every other output flag).
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (rank == 0 || std::string(argv[i]).rfind("--benchmark_out", 0) != 0) args.push_back(argv[i]);
  int args_count = static_cast<int>(args.size());
  benchmark::Initialize(&args_count, args.data());
  if (benchmark::ReportUnrecognizedArguments(args_count, args.data())) {
    MPI_Finalize();
    return 1;
  }
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
    std::printf(
        "per rank: rank, owned columns (all matrices), CPU state bytes, fraction of one process, step ms, "
        "CPU update ms, D2H bytes/step, H2D bytes/step\n");
    const double single = 3.0 * 4.0 * static_cast<double>(matrices * rows * cols);
    for (std::size_t r = 0; r < gathered().size(); ++r) {
      const auto& f = gathered()[r];
      std::printf("  %zu, %.0f, %.0f, %.4f, %.2f, %.2f, %.0f, %.0f\n", r, f.owned_columns, f.cpu_state_bytes,
                  f.cpu_state_bytes / single, f.step_ms, f.cpu_update_ms, f.d2h_bytes_per_step, f.h2d_bytes_per_step);
    }
  } else {
    null_reporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
