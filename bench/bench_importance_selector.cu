// GPU benchmarks of the importance selector (needs a GPU to run; compiled in CI).
//
//   BM_column_scores/<rows>/<cols>/<row_major>  bf16 gradient; counters: GB/s, and
//       roofline_fraction = time of a read-only streaming kernel over the same bytes / time of the
//       score kernel (bar: >= 0.85 for 4096 x 4096 and 8192 x 28672); waves = blocks / (blocks
//       the device keeps resident).
//   BM_topk_batched  100 parameters, 4096..65536 columns each, k = 10%, one launch; counters us,
//       thrust_us (the same selection with thrust::stable_sort_by_key, then a second sort for
//       ascending output, temporaries from a caching allocator) and speedup_vs_thrust (bar: >= 5x).
// Timing: device_timer.cuh (device time with the stream held, L2 flushed before each call, the
// mean of 10 calls per iteration, 5 iterations). The thrust pipeline is timed without the hold
// (thrust may synchronize), after a warm-up.
#include <benchmark/benchmark.h>
#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/sort.h>

#include <zenflow/importance_selector.cuh>

#include "device_timer.cuh"

#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace sel = zenflow::detail::selector;

namespace {

/// A bf16 "gradient" from a hash of the index (device-side: no host setup time).
__global__ void fill_bf16_kernel(std::uint16_t* p, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ static_cast<unsigned>(i >> 32);
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    const float v = (static_cast<float>(x & 0xffffu) - 32768.0f) / 32768.0f;  // [-1, 1)
    p[i] = static_cast<std::uint16_t>(__float_as_uint(v) >> 16);              // truncated to bf16
  }
}

void BM_column_scores(benchmark::State& state) {
  const long long rows = state.range(0), cols = state.range(1);
  const bool row_major = state.range(2) != 0;
  const std::size_t bytes = static_cast<std::size_t>(rows * cols) * 2;
  const zenflow_test::device_buffer grad_buffer(bytes);
  void* grad = grad_buffer.data();
  fill_bf16_kernel<<<zenflow_bench::streaming_blocks(), 256>>>(static_cast<std::uint16_t*>(grad), rows * cols);
  const auto view = row_major ? zenflow::const_matrix_view::row_major(grad, rows, cols, zenflow::dtype::bf16,
                                                                      zenflow::memory_space::device)
                              : zenflow::const_matrix_view::column_contiguous(grad, rows, cols, zenflow::dtype::bf16,
                                                                              zenflow::memory_space::device);
  const long long resident = sel::score_resident_blocks(zenflow::score_norm::l1);
  const long long seg_rows = sel::row_sweep_seg_rows(rows, cols, resident);
  const long long segments = sel::row_sweep_segments(rows, seg_rows);
  const sel::score_desc desc = sel::make_score_desc(view, 0, 0, 0, 0, seg_rows);
  const long long blocks = sel::score_blocks(desc);
  const zenflow_test::device_buffer d_desc_buffer(sizeof desc), scores_buffer(cols * 4),
      partials_buffer(std::max<long long>(1, segments * cols) * 4), counters_buffer(sel::row_sweep_max_tiles(cols) * 4);
  auto* d_desc = d_desc_buffer.data<sel::score_desc>();
  auto* scores = scores_buffer.data<float>();
  auto* partials = partials_buffer.data<float>();
  auto* counters = counters_buffer.data<unsigned>();
  ZENFLOW_CUDA_TRY(cudaMemcpy(d_desc, &desc, sizeof desc, cudaMemcpyHostToDevice));
  ZENFLOW_CUDA_TRY(cudaMemset(counters, 0, sel::row_sweep_max_tiles(cols) * 4));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());  // the setup above ran on the legacy stream
  const zenflow_test::cuda_stream stream;
  const cudaStream_t s = stream.get();
  {
    zenflow_bench::device_timer timer(s);
    double total_ms = 0, roof_ms = 0;
    long long n = 0;
    for (auto _ : state) {
      try {
        roof_ms += timer.read_roofline_ms(grad, bytes);
        const double ms = timer.mean_ms([&] {
          sel::column_scores_kernel<zenflow::score_norm::l1>
              <<<static_cast<unsigned>(blocks), sel::score_threads, 0, s>>>(d_desc, 1, scores, partials, counters);
        });
        state.SetIterationTime(ms * 1e-3);
        total_ms += ms, ++n;
      } catch (const std::exception& e) {
        state.SkipWithError(e.what());
        break;
      }
    }
    ZENFLOW_CUDA_TRY(cudaGetLastError());
    if (n > 0) {
      const double mean = total_ms / static_cast<double>(n) * 1e-3, roof = roof_ms / static_cast<double>(n) * 1e-3;
      state.counters["GB/s"] = static_cast<double>(bytes) / mean * 1e-9;
      state.counters["roofline_GB/s"] = static_cast<double>(bytes) / roof * 1e-9;
      state.counters["roofline_fraction"] = roof / mean;
      state.counters["us"] = mean * 1e6;
      state.counters["waves"] = static_cast<double>(blocks) / static_cast<double>(resident);
    }
  }
}
BENCHMARK(BM_column_scores)
    ->Args({4096, 4096, 1})
    ->Args({4096, 4096, 0})
    ->Args({8192, 28672, 1})
    ->Args({8192, 28672, 0})
    ->Args({28672, 8192, 1})
    ->Iterations(5)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

/// 100 parameters with 4096..65536 columns, random scores, k = 10%.
struct topk_problem {
  std::vector<sel::topk_desc> descs;
  std::vector<long long> seg_begin;  // for the thrust baseline: unpadded concatenation
  long long total_scores = 0, total_k = 0, total_cols = 0;
  zenflow_test::device_buffer scores_buffer, descs_buffer, out_buffer, nan_buffer;
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
    scores_buffer = zenflow_test::device_buffer(h.size() * 4);
    scores = scores_buffer.data<float>();
    ZENFLOW_CUDA_TRY(cudaMemcpy(scores, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    descs_buffer = zenflow_test::device_buffer(descs.size() * sizeof(sel::topk_desc));
    d_descs = descs_buffer.data<sel::topk_desc>();
    ZENFLOW_CUDA_TRY(cudaMemcpy(d_descs, descs.data(), descs.size() * sizeof(sel::topk_desc), cudaMemcpyHostToDevice));
    out_buffer = zenflow_test::device_buffer(total_k * 4);
    out = out_buffer.data<std::int32_t>();
    nan_buffer = zenflow_test::device_buffer(descs.size() * 4);
    nan = nan_buffer.data<int>();
  }
};

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
/// Thrust's temporary storage from a cache (thrust's custom_temporary_allocation pattern), so the
/// baseline is not charged a cudaMalloc / cudaFree per sort.
class caching_allocator {
 public:
  using value_type = char;
  caching_allocator() = default;
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  ~caching_allocator() {
    for (auto& [bytes, p] : free_) ZENFLOW_CUDA_ASSERT(cudaFree(p));
    for (auto& [p, bytes] : used_) ZENFLOW_CUDA_ASSERT(cudaFree(p));
  }
  char* allocate(std::ptrdiff_t bytes) {
    char* p = nullptr;
    if (auto it = free_.lower_bound(bytes); it != free_.end()) {
      p = it->second;
      bytes = it->first;
      free_.erase(it);
    } else {
      ZENFLOW_CUDA_TRY(cudaMalloc(&p, static_cast<std::size_t>(bytes)));
    }
    used_[p] = bytes;
    return p;
  }
  void deallocate(char* p, std::size_t) {
    const auto it = used_.find(p);
    free_.emplace(it->second, p);
    used_.erase(it);
  }

 private:
  std::multimap<std::ptrdiff_t, char*> free_;
  std::map<char*, std::ptrdiff_t> used_;
};

void BM_topk_batched(benchmark::State& state) {
  topk_problem p;
  thrust::device_vector<long long> seg(p.seg_begin.begin(), p.seg_begin.end());
  thrust::device_vector<unsigned long long> keys(static_cast<std::size_t>(p.total_cols));
  thrust::device_vector<int> cols(static_cast<std::size_t>(p.total_cols));
  thrust::device_vector<unsigned long long> picked(static_cast<std::size_t>(p.total_k));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  const zenflow_test::cuda_stream stream;
  const cudaStream_t s = stream.get();
  {
    caching_allocator alloc;
    const auto policy = thrust::cuda::par_nosync(alloc).on(s);
    const unsigned grid = static_cast<unsigned>(p.descs.size());
    auto ours = [&] { sel::topk_kernel<<<grid, sel::topk_threads, 0, s>>>(p.d_descs, p.scores, p.out, p.nan); };
    auto baseline = [&] {
      make_keys<<<grid, 256, 0, s>>>(p.d_descs, thrust::raw_pointer_cast(seg.data()), p.scores,
                                     thrust::raw_pointer_cast(keys.data()), thrust::raw_pointer_cast(cols.data()));
      thrust::stable_sort_by_key(policy, keys.begin(), keys.end(), cols.begin());
      gather_first_k<<<grid, 256, 0, s>>>(p.d_descs, thrust::raw_pointer_cast(seg.data()),
                                          thrust::raw_pointer_cast(cols.data()),
                                          thrust::raw_pointer_cast(picked.data()));
      thrust::sort(policy, picked.begin(), picked.end());
    };
    zenflow_bench::device_timer timer(s);
    double ours_ms = 0, thrust_ms = 0;
    long long n = 0;
    for (auto _ : state) {
      try {
        const double ms = timer.mean_ms(ours);
        thrust_ms += timer.mean_ms(baseline, 10, /*hold=*/false);
        state.SetIterationTime(ms * 1e-3);
        ours_ms += ms, ++n;
      } catch (const std::exception& e) {
        state.SkipWithError(e.what());
        break;
      }
    }
    ZENFLOW_CUDA_TRY(cudaGetLastError());
    if (n > 0) {
      // The two must agree: the baseline's output is (parameter << 32 | column), ascending.
      std::vector<std::int32_t> got(static_cast<std::size_t>(p.total_k));
      std::vector<unsigned long long> want(got.size());
      ZENFLOW_CUDA_TRY(cudaMemcpy(got.data(), p.out, got.size() * 4, cudaMemcpyDeviceToHost));
      ZENFLOW_CUDA_TRY(
          cudaMemcpy(want.data(), thrust::raw_pointer_cast(picked.data()), want.size() * 8, cudaMemcpyDeviceToHost));
      bool same = true;
      for (std::size_t i = 0; i < got.size(); ++i)
        same &= static_cast<std::uint32_t>(want[i]) == static_cast<std::uint32_t>(got[i]);
      if (!same) state.SkipWithError("top-k and the thrust baseline disagree");
      state.counters["us"] = ours_ms / static_cast<double>(n) * 1e3;
      state.counters["thrust_us"] = thrust_ms / static_cast<double>(n) * 1e3;
      state.counters["speedup_vs_thrust"] = thrust_ms / ours_ms;
      state.counters["columns"] = static_cast<double>(p.total_cols);
    }
  }
}
BENCHMARK(BM_topk_batched)->Iterations(5)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
