// Host reference of the importance selector: column scores (bf16, both layouts) reported as a
// fraction of a read-only streaming pass over the same bytes measured in the same binary, and
// topk_columns over 65536 scores. The host backend is the CI oracle; these figures say what it
// costs when the host pipeline uses it.
#include <benchmark/benchmark.h>

#include <zenflow/importance_selector.hpp>

#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

namespace {

std::vector<std::uint16_t> random_bf16(std::size_t n) {
  std::vector<std::uint16_t> h(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& x : h) x = zenflow::to_bfloat16(nd(rng)).bits;
  return h;
}

double read_pass_seconds(const std::vector<std::uint16_t>& data) {
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t acc = 0;
    const auto* p = reinterpret_cast<const std::uint64_t*>(data.data());
    for (std::size_t j = 0; j < data.size() / 4; ++j) acc ^= p[j];
    benchmark::DoNotOptimize(acc);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void BM_host_column_scores(benchmark::State& state) {
  const long long rows = state.range(0), cols = state.range(1);
  const bool row_major = state.range(2) != 0;
  const auto data = random_bf16(static_cast<std::size_t>(rows * cols));
  const auto view = row_major
                        ? zenflow::const_matrix_view::row_major(data.data(), rows, cols, zenflow::dtype::bf16)
                        : zenflow::const_matrix_view::column_contiguous(data.data(), rows, cols, zenflow::dtype::bf16);
  std::vector<float> scores(static_cast<std::size_t>(cols));
  const double roof = read_pass_seconds(data);
  for (auto _ : state) {
    zenflow::column_scores(view, zenflow::score_norm::l1, scores);
    benchmark::DoNotOptimize(scores.data());
  }
  const double bytes = static_cast<double>(rows * cols * 2);
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["read_pass_GB/s"] = bytes / roof * 1e-9;
}
BENCHMARK(BM_host_column_scores)->Args({1024, 1024, 1})->Args({1024, 1024, 0})->Unit(benchmark::kMillisecond);

void BM_host_topk(benchmark::State& state) {
  const auto cols = state.range(0);
  std::vector<float> scores(static_cast<std::size_t>(cols));
  std::mt19937 rng(2);
  std::exponential_distribution<float> ed(1.0f);
  for (auto& x : scores) x = ed(rng);
  const auto k = zenflow::topk_count(0.1, cols);
  std::vector<std::int32_t> out(static_cast<std::size_t>(k));
  for (auto _ : state) {
    zenflow::topk_columns(scores, k, out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_host_topk)->Arg(4096)->Arg(65536)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
