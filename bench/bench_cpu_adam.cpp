// CPU Adam at the memory roofline. Every step mode reports params/s, effective GB/s from its byte
// count and its fraction of an Adam-shaped roofline measured in the same binary: the same loads
// and stores (same buffers' shape, same thread pool, same chunking), with trivial arithmetic.
//
//   roofline_adam        read p, g, m, v (fp32), write p, m, v         28 B/param
//   roofline_mixed       read p, g (bf16), m, v, write p, m, v, out (bf16)  28 B/param
//   roofline_accumulate  read acc, g (bf16), write acc                 10 B/param
//   step_fp32            vs roofline_adam (bar 0.90)
//   step_mixed           vs roofline_mixed (bar 0.90)
//   accumulate_bf16      vs roofline_accumulate (bar 0.90)
//   step_masked_90pct    90% of the columns, full-layout grad, vs roofline_adam per param
//   step_multi_tensor    4096 tensors of 16K params in one call, vs roofline_adam (bar 0.80)
//   step_fp32_checked    step_fp32 with the non-finite pre-pass (32 B/param read+written)
//
// Size: 64M parameters (ZENFLOW_BENCH_PARAMS overrides); threads: every CPU this process may use.
#include <zenflow/cpu_adam.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using zenflow::bfloat16;
using zenflow::dtype;

std::size_t param_count() {
  if (const char* s = std::getenv("ZENFLOW_BENCH_PARAMS")) return std::strtoull(s, nullptr, 10);
  return std::size_t{1} << 26;  // 64M
}

// 2 MiB-aligned, huge-page-advised buffers, as cpu_adam allocates its state.
template <class T>
struct big_buffer {
  struct deleter {
    void operator()(T* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<T[], deleter> data;
  std::size_t n = 0;
  explicit big_buffer(std::size_t count) : n(count) {
    const std::size_t a = std::size_t{2} << 20, bytes = (count * sizeof(T) + a - 1) / a * a;
    data.reset(static_cast<T*>(std::aligned_alloc(a, bytes)));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data.get(), bytes, MADV_HUGEPAGE);
#endif
    std::memset(static_cast<void*>(data.get()), 0, bytes);
  }
  T* get() const {
    return data.get();
  }
};

void fill_random(float* x, std::size_t n, std::uint32_t seed, float scale) {
  std::uint32_t s = seed;
  for (std::size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = scale * (static_cast<float>(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
}
void fill_random(bfloat16* x, std::size_t n, std::uint32_t seed, float scale) {
  std::uint32_t s = seed;
  for (std::size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = zenflow::to_bfloat16(scale * (static_cast<float>(s >> 8) * (1.0f / 16777216.0f) - 0.5f));
  }
}

// All CPUs, default chunk, automatic ISA (ZENFLOW_BENCH_ISA=scalar|avx2|avx512 overrides).
zenflow::cpu_adam_config bench_config() {
  zenflow::cpu_adam_config c;
  if (const char* s = std::getenv("ZENFLOW_BENCH_ISA")) {
    const std::string_view v(s);
    c.isa = v == "scalar" ? zenflow::cpu_isa::scalar : v == "avx2" ? zenflow::cpu_isa::avx2 : zenflow::cpu_isa::avx512;
  }
  return c;
}

// Runs `body` per iteration, timing it, and reports params/s and GB/s.
template <class Body>
void run_timed(benchmark::State& state, std::size_t params, double bytes_per_param, Body&& body) {
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double rate = static_cast<double>(params) * static_cast<double>(state.iterations()) / seconds;
  state.counters["params_per_s"] = rate;
  state.counters["GB_per_s"] = rate * bytes_per_param * 1e-9;
}

// Runs the step and its roofline alternately, each timed on its own, so that both see the same
// machine state (other load, frequency, memory traffic drift) and the fraction is robust.
// `roof_params` is the roofline's parameter count per run (its rate is per parameter).
template <class Step, class Roof>
void run_paired(benchmark::State& state, std::size_t params, double bytes_per_param, Step&& step,
                std::size_t roof_params, Roof&& roof) {
  double step_seconds = 0, roof_seconds = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    auto t1 = std::chrono::steady_clock::now();
    roof();
    auto t2 = std::chrono::steady_clock::now();
    step_seconds += std::chrono::duration<double>(t1 - t0).count();
    roof_seconds += std::chrono::duration<double>(t2 - t1).count();
  }
  const auto it = static_cast<double>(state.iterations());
  const double rate = static_cast<double>(params) * it / step_seconds;
  const double roof_rate = static_cast<double>(roof_params) * it / roof_seconds;
  state.counters["params_per_s"] = rate;
  state.counters["GB_per_s"] = rate * bytes_per_param * 1e-9;
  state.counters["roofline_params_per_s"] = roof_rate;
  state.SetLabel(std::string(zenflow::cpu_isa_name(zenflow::detail::resolve_isa(bench_config().isa))));
  state.counters["roofline_fraction"] = rate / roof_rate;
}

// ---------------------------------------------------------------------------------------------
// Roofline kernels: the step's memory traffic with one add per stream. AVX-512 when available
// (as fast as this machine streams), else plain loops.
// ---------------------------------------------------------------------------------------------
#if ZENFLOW_CPU_ADAM_X86
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 bug 105593, see kernels.hpp
#endif
// The rooflines prefetch like the step (measured here: 1% faster than without, at every distance
// from 128 to 1024 elements).
template <class T>
ZENFLOW_TARGET_AVX512 inline void ahead(const T* x) {
  _mm_prefetch(reinterpret_cast<const char*>(x + zenflow::detail::avx512::prefetch_distance), _MM_HINT_T0);
}
ZENFLOW_TARGET_AVX512 void shape_adam_512(float* p, const float* g, float* m, float* v, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    ahead(p + i), ahead(g + i), ahead(m + i), ahead(v + i);
    const __m512 gv = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gv));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gv));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gv));
  }
  for (; i < n; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}
// The write-only bf16 stream uses streaming stores (no read-for-ownership), as the step does.
ZENFLOW_TARGET_AVX512 void shape_mixed_512(float* p, const bfloat16* g, float* m, float* v, bfloat16* out,
                                           std::size_t n) {
  std::size_t i = 0;
  for (; i < n && reinterpret_cast<std::uintptr_t>(out + i) % 32 != 0; ++i) {
    const float gf = zenflow::to_float(g[i]);
    p[i] += gf, m[i] += gf, v[i] += gf;
    out[i].bits = static_cast<std::uint16_t>(zenflow::detail::float_to_bits(p[i]) >> 16);
  }
  for (; i + 16 <= n; i += 16) {
    ahead(p + i), ahead(g + i), ahead(m + i), ahead(v + i);
    const __m512 gv = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i))), 16));
    const __m512 pv = _mm512_add_ps(_mm512_loadu_ps(p + i), gv);
    _mm512_storeu_ps(p + i, pv);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gv));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gv));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(pv), 16)));
  }
  for (; i < n; ++i) {
    const float gf = zenflow::to_float(g[i]);
    p[i] += gf, m[i] += gf, v[i] += gf;
    out[i].bits = static_cast<std::uint16_t>(zenflow::detail::float_to_bits(p[i]) >> 16);
  }
  _mm_sfence();
}
ZENFLOW_TARGET_AVX512 inline __attribute__((always_inline)) void accumulate_block_512(float* acc, const bfloat16* g) {
  const __m512 gv = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g))), 16));
  _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), gv));
}
ZENFLOW_TARGET_AVX512 void shape_accumulate_512(float* acc, const bfloat16* g, std::size_t n) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {  // one line of g and two of acc per iteration, as the step
    ahead(acc + i), ahead(acc + i + 16), ahead(g + i);
    accumulate_block_512(acc + i, g + i);
    accumulate_block_512(acc + i + 16, g + i + 16);
  }
  for (; i + 16 <= n; i += 16) accumulate_block_512(acc + i, g + i);
  for (; i < n; ++i) acc[i] += zenflow::to_float(g[i]);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
void shape_adam(float* p, const float* g, float* m, float* v, std::size_t n) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512) return shape_adam_512(p, g, m, v, n);
#endif
  for (std::size_t i = 0; i < n; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}
void shape_mixed(float* p, const bfloat16* g, float* m, float* v, bfloat16* out, std::size_t n) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512) return shape_mixed_512(p, g, m, v, out, n);
#endif
  for (std::size_t i = 0; i < n; ++i) {
    const float gf = zenflow::to_float(g[i]);
    p[i] += gf, m[i] += gf, v[i] += gf;
    out[i].bits = static_cast<std::uint16_t>(zenflow::detail::float_to_bits(p[i]) >> 16);
  }
}
void shape_accumulate(float* acc, const bfloat16* g, std::size_t n) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512) return shape_accumulate_512(acc, g, n);
#endif
  for (std::size_t i = 0; i < n; ++i) acc[i] += zenflow::to_float(g[i]);
}

// The roofline shapes on their own buffers, run on a given pool with cpu_adam's chunking.
template <class Fn>
void chunked(zenflow::thread_pool& pool, std::size_t n, std::size_t chunk, Fn&& fn) {
  pool.parallel_for((n + chunk - 1) / chunk, [&](std::size_t k) {
    const std::size_t lo = k * chunk;
    fn(lo, std::min(n, lo + chunk) - lo);
  });
}
struct adam_shape {  // read p, g, m, v (fp32); write p, m, v
  std::size_t n;
  big_buffer<float> p{n}, g{n}, m{n}, v{n};
  explicit adam_shape(std::size_t count) : n(count) { fill_random(g.get(), n, 1, 1e-3f); }
  void run(zenflow::thread_pool& pool, std::size_t chunk) {
    chunked(pool, n, chunk, [&](std::size_t lo, std::size_t c) {
      shape_adam(p.get() + lo, g.get() + lo, m.get() + lo, v.get() + lo, c);
    });
  }
};
struct mixed_shape {  // read p, g (bf16), m, v; write p, m, v, out (bf16)
  std::size_t n;
  big_buffer<float> p{n}, m{n}, v{n};
  big_buffer<bfloat16> g{n}, out{n};
  explicit mixed_shape(std::size_t count) : n(count) { fill_random(g.get(), n, 1, 1e-3f); }
  void run(zenflow::thread_pool& pool, std::size_t chunk) {
    chunked(pool, n, chunk, [&](std::size_t lo, std::size_t c) {
      shape_mixed(p.get() + lo, g.get() + lo, m.get() + lo, v.get() + lo, out.get() + lo, c);
    });
  }
};
struct accumulate_shape {  // read acc, g (bf16); write acc
  std::size_t n;
  big_buffer<float> acc{n};
  big_buffer<bfloat16> g{n};
  explicit accumulate_shape(std::size_t count) : n(count) { fill_random(g.get(), n, 1, 1e-3f); }
  void run(zenflow::thread_pool& pool, std::size_t chunk) {
    chunked(pool, n, chunk, [&](std::size_t lo, std::size_t c) { shape_accumulate(acc.get() + lo, g.get() + lo, c); });
  }
};

template <class Shape>
void roofline(benchmark::State& state, double bytes_per_param) {
  zenflow::thread_pool pool(bench_config().threads);
  Shape shape(param_count());
  run_timed(state, shape.n, bytes_per_param, [&] { shape.run(pool, bench_config().chunk_elements); });
  state.counters["threads"] = static_cast<double>(pool.size());
}
void roofline_adam(benchmark::State& state) {
  roofline<adam_shape>(state, 28);
}
void roofline_mixed(benchmark::State& state) {
  roofline<mixed_shape>(state, 28);
}
void roofline_accumulate(benchmark::State& state) {
  roofline<accumulate_shape>(state, 10);
}

// ---------------------------------------------------------------------------------------------
// The optimizer.
// ---------------------------------------------------------------------------------------------
std::unique_ptr<zenflow::cpu_adam> make_optimizer(std::size_t tensors, zenflow::index_t rows, zenflow::index_t cols) {
  zenflow::adam_options o;
  o.weight_decay = 0.01f;
  auto opt = std::make_unique<zenflow::cpu_adam>(o, bench_config());
  std::vector<float> init(static_cast<std::size_t>(rows * cols));
  fill_random(init.data(), init.size(), 7, 0.2f);
  for (std::size_t t = 0; t < tensors; ++t) opt->add_tensor(init, rows, cols);
  return opt;
}

void step_fp32(benchmark::State& state, bool check_finite) {
  const std::size_t n = param_count();
  auto opt = make_optimizer(1, static_cast<zenflow::index_t>(n / 1024), 1024);
  big_buffer<float> g(n);
  fill_random(g.get(), n, 3, 1e-2f);
  const zenflow::cpu_adam_task task{0, g.get(), dtype::f32, {}};
  adam_shape roof(n);
  run_paired(
      state, n, check_finite ? 32 : 28,
      [&] {
        opt->step({&task, 1}, 1.0f, check_finite);
      },
      n, [&] { roof.run(opt->pool(), opt->chunk_elements()); });
  state.counters["threads"] = static_cast<double>(opt->pool().size());
}
void step_fp32_plain(benchmark::State& state) {
  step_fp32(state, false);
}
void step_fp32_checked(benchmark::State& state) {
  step_fp32(state, true);
}

void step_mixed(benchmark::State& state) {
  const std::size_t n = param_count();
  auto opt = make_optimizer(1, static_cast<zenflow::index_t>(n / 1024), 1024);
  big_buffer<bfloat16> g(n), out(n);
  fill_random(g.get(), n, 3, 1e-2f);
  zenflow::cpu_adam_task task{0, g.get(), dtype::bf16, {}};
  task.copy_out = out.get();
  task.copy_out_type = dtype::bf16;
  mixed_shape roof(n);
  run_paired(
      state, n, 28,
      [&] {
        opt->step({&task, 1}, 1.0f, false);
      },
      n, [&] { roof.run(opt->pool(), opt->chunk_elements()); });
}

void accumulate_bf16(benchmark::State& state) {
  const std::size_t n = param_count();
  auto opt = std::make_unique<zenflow::cpu_adam>(zenflow::adam_options{}, bench_config());
  big_buffer<float> acc(n);
  big_buffer<bfloat16> g(n);
  fill_random(g.get(), n, 3, 1e-2f);
  accumulate_shape roof(n);
  run_paired(
      state, n, 10,
      [&] {
        benchmark::DoNotOptimize(
            opt->accumulate(acc.get(), g.get(), dtype::bf16, static_cast<zenflow::index_t>(n), 0.25f));
      },
      n, [&] { roof.run(opt->pool(), opt->chunk_elements()); });
}

void step_masked(benchmark::State& state) {
  const std::size_t n = param_count();
  const zenflow::index_t rows = 4096, cols = static_cast<zenflow::index_t>(n / 4096);
  auto opt = make_optimizer(1, rows, cols);
  big_buffer<float> g(n);
  fill_random(g.get(), n, 3, 1e-2f);
  std::vector<std::int32_t> columns;  // 90% of the columns: every 10th one stays on the GPU
  for (std::int32_t c = 0; c < cols; ++c)
    if (c % 10 != 3) columns.push_back(c);
  const zenflow::cpu_adam_task task{0, g.get(), dtype::f32, columns};
  const std::size_t updated = columns.size() * static_cast<std::size_t>(rows);
  adam_shape roof(updated);  // the same bytes per updated parameter, contiguous
  run_paired(
      state, updated, 28,
      [&] {
        opt->step({&task, 1}, 1.0f, false);
      },
      updated, [&] { roof.run(opt->pool(), opt->chunk_elements()); });
}

void step_multi_tensor(benchmark::State& state) {
  const std::size_t per = 16384, tensors = std::max<std::size_t>(1, param_count() / per);
  auto opt = make_optimizer(tensors, 128, 128);
  big_buffer<float> g(tensors * per);
  fill_random(g.get(), tensors * per, 3, 1e-2f);
  std::vector<zenflow::cpu_adam_task> tasks;
  for (std::size_t t = 0; t < tensors; ++t) tasks.push_back({t, g.get() + t * per, dtype::f32, {}});
  adam_shape roof(tensors * per);  // one contiguous stream of the same size
  run_paired(
      state, tensors * per, 28, [&] { opt->step(tasks, 1.0f, false); }, tensors * per,
      [&] { roof.run(opt->pool(), opt->chunk_elements()); });
  state.counters["tensors"] = static_cast<double>(tensors);
}

}  // namespace

// The standalone rooflines are for reference; each step benchmark runs its own roofline shape
// alternately with the step (run_paired) for its roofline_fraction.
BENCHMARK(roofline_adam)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(roofline_mixed)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(roofline_accumulate)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_fp32_plain)->Name("step_fp32")->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_mixed)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(accumulate_bf16)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_masked)->Name("step_masked_90pct")->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_multi_tensor)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_fp32_checked)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);

BENCHMARK_MAIN();
