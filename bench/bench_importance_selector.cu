// GPU benchmarks of the importance selector (needs a GPU to run; compiled in CI).
//
//   BM_column_scores/<rows>/<cols>/<row_major>  bf16 gradient; counters: GB/s, and
//       roofline_fraction = time of a read-only streaming kernel over the same bytes / time of the
//       score kernel (bar: >= 0.85 for 4096 x 4096 and 8192 x 28672).
//   BM_topk_batched  100 parameters, 4096..65536 columns each, one launch; counter us.
//   BM_topk_thrust_sort  the same selection with thrust::stable_sort_by_key (+ a second sort for
//       ascending output); the ratio of the two is the speed-up (bar: >= 5x).
// Every kernel is timed with CUDA events on one stream; the benchmark reports manual time.
#include <benchmark/benchmark.h>
#include <thrust/device_vector.h>
#include <thrust/sort.h>

#include <zenflow/importance_selector.cuh>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

namespace sel = zenflow::detail::selector;

namespace {

#define BENCH_CUDA(call)                                                      \
  do {                                                                        \
    const cudaError_t e_ = (call);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

__global__ void read_roofline_kernel(const uint4* data, long long n, unsigned* sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}

struct event_timer {
  cudaEvent_t a, b;
  event_timer() {
    BENCH_CUDA(cudaEventCreate(&a));
    BENCH_CUDA(cudaEventCreate(&b));
  }
  ~event_timer() { cudaEventDestroy(a), cudaEventDestroy(b); }
  template <class F>
  double seconds(cudaStream_t s, F&& f) {
    BENCH_CUDA(cudaEventRecord(a, s));
    f();
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e-3;
  }
};

/// Best-of-N time of the read-only streaming kernel over `bytes` bytes at `data`.
double read_roofline_seconds(const void* data, std::size_t bytes, cudaStream_t s) {
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned* sink = nullptr;
  BENCH_CUDA(cudaMalloc(&sink, 4));
  event_timer t;
  double best = 1e30;
  for (int i = 0; i < 20; ++i)
    best = std::min(best, t.seconds(s, [&] {
      read_roofline_kernel<<<sms * 8, 256, 0, s>>>(static_cast<const uint4*>(data), static_cast<long long>(bytes / 16),
                                                   sink);
    }));
  BENCH_CUDA(cudaFree(sink));
  return best;
}

void BM_column_scores(benchmark::State& state) {
  const long long rows = state.range(0), cols = state.range(1);
  const bool row_major = state.range(2) != 0;
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * 2;
  void* grad = nullptr;
  BENCH_CUDA(cudaMalloc(&grad, bytes));
  {
    std::vector<std::uint16_t> h(static_cast<std::size_t>(rows * cols));
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (auto& x : h) x = zenflow::to_bfloat16(nd(rng)).bits;
    BENCH_CUDA(cudaMemcpy(grad, h.data(), bytes, cudaMemcpyHostToDevice));
  }
  const auto view = row_major ? zenflow::const_matrix_view::row_major(grad, rows, cols, zenflow::dtype::bf16,
                                                                      zenflow::memory_space::device)
                              : zenflow::const_matrix_view::column_contiguous(grad, rows, cols, zenflow::dtype::bf16,
                                                                              zenflow::memory_space::device);
  const long long segments = sel::row_sweep_segments(rows, cols);
  const sel::score_desc desc = sel::make_score_desc(view, 0, 0, 0, 0);
  const long long blocks = sel::score_blocks(desc);
  sel::score_desc* d_desc = nullptr;
  float *scores = nullptr, *partials = nullptr;
  unsigned* counters = nullptr;
  BENCH_CUDA(cudaMalloc(&d_desc, sizeof desc));
  BENCH_CUDA(cudaMemcpy(d_desc, &desc, sizeof desc, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&scores, cols * 4));
  BENCH_CUDA(cudaMalloc(&partials, std::max<long long>(1, segments * cols) * 4));
  BENCH_CUDA(cudaMalloc(&counters, sel::row_sweep_max_tiles(cols) * 4));
  BENCH_CUDA(cudaMemset(counters, 0, sel::row_sweep_max_tiles(cols) * 4));
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double roof = read_roofline_seconds(grad, bytes, s);
  event_timer t;
  double total = 0;
  long long n = 0;
  for (auto _ : state) {
    const double sec = t.seconds(s, [&] {
      sel::column_scores_kernel<zenflow::score_norm::l1>
          <<<static_cast<unsigned>(blocks), sel::score_threads, 0, s>>>(d_desc, 1, scores, partials, counters);
    });
    state.SetIterationTime(sec);
    total += sec, ++n;
  }
  BENCH_CUDA(cudaGetLastError());
  const double mean = total / static_cast<double>(n);
  state.counters["GB/s"] = static_cast<double>(bytes) / mean * 1e-9;
  state.counters["roofline_GB/s"] = static_cast<double>(bytes) / roof * 1e-9;
  state.counters["roofline_fraction"] = roof / mean;
  state.counters["us"] = mean * 1e6;
  BENCH_CUDA(cudaStreamDestroy(s));
  cudaFree(grad), cudaFree(d_desc), cudaFree(scores), cudaFree(partials), cudaFree(counters);
}
BENCHMARK(BM_column_scores)
    ->Args({4096, 4096, 1})
    ->Args({4096, 4096, 0})
    ->Args({8192, 28672, 1})
    ->Args({8192, 28672, 0})
    ->Args({28672, 8192, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

/// 100 parameters with 4096..65536 columns, random scores, k = 10%.
struct topk_problem {
  std::vector<sel::topk_desc> descs;
  std::vector<long long> seg_begin;  // for the thrust baseline: unpadded concatenation
  long long total_scores = 0, total_k = 0, total_cols = 0;
  float* scores = nullptr;
  sel::topk_desc* d_descs = nullptr;
  std::int32_t* out = nullptr;
  int* nan = nullptr;
  topk_problem() {
    std::mt19937 rng(42);
    for (int p = 0; p < 100; ++p) {
      const int cols = 4096 + static_cast<int>(rng() % (65536 - 4096 + 1));
      const int k = static_cast<int>(zenflow::topk_count(0.1, cols));
      descs.push_back({total_scores, total_k, cols, k});
      seg_begin.push_back(total_cols);
      total_scores += (cols + 3) / 4 * 4, total_k += k, total_cols += cols;
    }
    std::vector<float> h(static_cast<std::size_t>(total_scores), 0.0f);
    std::exponential_distribution<float> ed(1.0f);
    for (auto& x : h) x = ed(rng) * 100.0f;
    BENCH_CUDA(cudaMalloc(&scores, h.size() * 4));
    BENCH_CUDA(cudaMemcpy(scores, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMalloc(&d_descs, descs.size() * sizeof(sel::topk_desc)));
    BENCH_CUDA(cudaMemcpy(d_descs, descs.data(), descs.size() * sizeof(sel::topk_desc), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMalloc(&out, total_k * 4));
    BENCH_CUDA(cudaMalloc(&nan, descs.size() * 4));
  }
  ~topk_problem() { cudaFree(scores), cudaFree(d_descs), cudaFree(out), cudaFree(nan); }
};

void BM_topk_batched(benchmark::State& state) {
  topk_problem p;
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  event_timer t;
  double total = 0;
  long long n = 0;
  for (auto _ : state) {
    const double sec = t.seconds(s, [&] {
      sel::topk_kernel<<<static_cast<unsigned>(p.descs.size()), sel::topk_threads, 0, s>>>(p.d_descs, p.scores, p.out,
                                                                                           p.nan);
    });
    state.SetIterationTime(sec);
    total += sec, ++n;
  }
  BENCH_CUDA(cudaGetLastError());
  state.counters["us"] = total / static_cast<double>(n) * 1e6;
  state.counters["columns"] = static_cast<double>(p.total_cols);
  BENCH_CUDA(cudaStreamDestroy(s));
}
BENCHMARK(BM_topk_batched)->UseManualTime()->Unit(benchmark::kMicrosecond);

// Thrust baseline: one stable sort of (parameter, descending key) -> column, then the first k of
// each segment re-sorted ascending with a second sort of (parameter, column).
__global__ void make_keys(const sel::topk_desc* descs, const long long* seg_begin, const float* scores,
                          unsigned long long* keys, int* cols_out) {
  const sel::topk_desc d = descs[blockIdx.x];
  for (int c = threadIdx.x; c < d.cols; c += blockDim.x) {
    const unsigned key = zenflow::detail::selector::orderable_key(scores[d.score_offset + c]);
    keys[seg_begin[blockIdx.x] + c] = (static_cast<unsigned long long>(blockIdx.x) << 32) | ~key;
    cols_out[seg_begin[blockIdx.x] + c] = c;
  }
}
__global__ void gather_first_k(const sel::topk_desc* descs, const long long* seg_begin, const int* sorted_cols,
                               unsigned long long* out_keys) {
  const sel::topk_desc d = descs[blockIdx.x];
  for (int j = threadIdx.x; j < d.k; j += blockDim.x)
    out_keys[d.out_offset + j] = (static_cast<unsigned long long>(blockIdx.x) << 32) |
                                 static_cast<unsigned>(sorted_cols[seg_begin[blockIdx.x] + j]);
}

void BM_topk_thrust_sort(benchmark::State& state) {
  topk_problem p;
  thrust::device_vector<long long> seg(p.seg_begin.begin(), p.seg_begin.end());
  thrust::device_vector<unsigned long long> keys(static_cast<std::size_t>(p.total_cols));
  thrust::device_vector<int> cols(static_cast<std::size_t>(p.total_cols));
  thrust::device_vector<unsigned long long> picked(static_cast<std::size_t>(p.total_k));
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto policy = thrust::cuda::par.on(s);
  event_timer t;
  double total = 0;
  long long n = 0;
  for (auto _ : state) {
    const double sec = t.seconds(s, [&] {
      const unsigned grid = static_cast<unsigned>(p.descs.size());
      make_keys<<<grid, 256, 0, s>>>(p.d_descs, thrust::raw_pointer_cast(seg.data()), p.scores,
                                     thrust::raw_pointer_cast(keys.data()), thrust::raw_pointer_cast(cols.data()));
      thrust::stable_sort_by_key(policy, keys.begin(), keys.end(), cols.begin());
      gather_first_k<<<grid, 256, 0, s>>>(p.d_descs, thrust::raw_pointer_cast(seg.data()),
                                          thrust::raw_pointer_cast(cols.data()),
                                          thrust::raw_pointer_cast(picked.data()));
      thrust::sort(policy, picked.begin(), picked.end());
    });
    state.SetIterationTime(sec);
    total += sec, ++n;
  }
  BENCH_CUDA(cudaGetLastError());
  state.counters["us"] = total / static_cast<double>(n) * 1e6;
  BENCH_CUDA(cudaStreamDestroy(s));
}
BENCHMARK(BM_topk_thrust_sort)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
