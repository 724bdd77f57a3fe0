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
// Compact states (cpu_adam_config::cpu_state), each against the roofline of exactly the bytes its
// format moves, and against fp32 state on the same problem (speedup_vs_fp32), all three timed
// alternately in the same benchmark:
//   roofline_bf16        read p, g, m|v (one 32-bit word), write p, m|v            20 B/param
//   roofline_q8          read p, g, m (u8), v (u8), write p, m, v, 2 scales / 256   16.06 B/param
//                        (both in the step's layout, every stream at full vector width)
//   step_bf16_moments    vs roofline_bf16 (bar 0.90), speedup_vs_fp32 (bar 1.3)
//   step_q8_moments      vs roofline_q8 (bar 0.90), speedup_vs_fp32 (bar 1.6)
//   step_*_mixed         the same with a bf16 gradient in and a bf16 copy-out (fp32: 28 B,
//                        bf16 moments: 20 B, 8-bit: 16.06 B), against rooflines of those bytes
//
// Size: 64M parameters (ZENFLOW_BENCH_PARAMS overrides); threads: every CPU this process may use
// (ZENFLOW_BENCH_THREADS overrides).
#include <zenflow/cpu_adam.hpp>

#include <benchmark/benchmark.h>

#include "bench_env.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using zenflow::bfloat16;
using zenflow::dtype;

std::size_t param_count() {
  // At least 4096: the shapes are n / 1024 x 1024 and 4096 x n / 4096.
  return zenflow_bench::env_count("ZENFLOW_BENCH_PARAMS", std::size_t{1} << 26, 4096);  // 64M
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
  c.threads = zenflow_bench::env_count("ZENFLOW_BENCH_THREADS", c.threads, 0, 4096);
  c.chunk_elements = zenflow_bench::env_count("ZENFLOW_BENCH_CHUNK", c.chunk_elements, 1);
  c.isa = zenflow_bench::env_isa(c.isa);
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

// run_paired with a third body, the same update on fp32 state, timed in the same rotation:
// speedup_vs_fp32 = the step's rate / fp32 state's rate.
template <class Step, class Roof, class Base>
void run_vs_fp32(benchmark::State& state, std::size_t params, double bytes_per_param, Step&& step, Roof&& roof,
                 Base&& base) {
  double step_seconds = 0, roof_seconds = 0, base_seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    const auto t1 = std::chrono::steady_clock::now();
    roof();
    const auto t2 = std::chrono::steady_clock::now();
    base();
    const auto t3 = std::chrono::steady_clock::now();
    step_seconds += std::chrono::duration<double>(t1 - t0).count();
    roof_seconds += std::chrono::duration<double>(t2 - t1).count();
    base_seconds += std::chrono::duration<double>(t3 - t2).count();
  }
  const double n = static_cast<double>(params) * static_cast<double>(state.iterations());
  state.counters["params_per_s"] = n / step_seconds;
  state.counters["GB_per_s"] = n / step_seconds * bytes_per_param * 1e-9;
  state.counters["roofline_params_per_s"] = n / roof_seconds;
  state.counters["roofline_fraction"] = roof_seconds / step_seconds;
  state.counters["fp32_params_per_s"] = n / base_seconds;
  state.counters["speedup_vs_fp32"] = base_seconds / step_seconds;
  state.SetLabel(std::string(zenflow::cpu_isa_name(zenflow::detail::resolve_isa(bench_config().isa))));
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
// Compact-state shapes, in the step's layout, every stream at full vector width: p and g as
// above; bf16 moments (MomentBytes 2): m and v of an element in one 32-bit word (one 64-byte load
// and store per 16 elements); 8-bit (MomentBytes 1): a byte array each for m and v, one 64-byte
// load and store per 64 elements, and two fp32 scales per 256 elements read and written as the
// step does. G: the gradient type; Out: a streamed bf16 copy-out.
template <class G, bool Out, bool Masked>
ZENFLOW_TARGET_AVX512 inline __attribute__((always_inline)) __m512i compact_pg_512(float* p, const G* g, bfloat16* out,
                                                                                   __mmask16 k) {
  __m512 gv;
  if constexpr (std::is_same_v<G, float>)
    gv = Masked ? _mm512_maskz_loadu_ps(k, g) : _mm512_loadu_ps(g);
  else
    gv = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(Masked ? _mm256_maskz_loadu_epi16(k, g)
                                                       : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g))),
                          16));
  const __m512 pv = _mm512_add_ps(Masked ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p), gv);
  if constexpr (Masked)
    _mm512_mask_storeu_ps(p, k, pv);
  else
    _mm512_storeu_ps(p, pv);
  if constexpr (Out) {
    const __m256i o = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(pv), 16));
    if constexpr (Masked)
      _mm256_mask_storeu_epi16(out, k, o);
    else
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out), o);
  }
  return _mm512_castps_si512(gv);
}
// 16 elements at once; bf16: the moment word; 8-bit (head and tail only): m and v bytes, masked.
template <int MomentBytes, class G, bool Out, bool Masked>
ZENFLOW_TARGET_AVX512 inline __attribute__((always_inline)) void compact_block_512(float* p, const G* g,
                                                                                   unsigned char* m, unsigned char* v,
                                                                                   bfloat16* out, __mmask16 k) {
  const __m512i gi = compact_pg_512<G, Out, Masked>(p, g, out, k);
  if constexpr (MomentBytes == 2) {
    const __m512i w = Masked ? _mm512_maskz_loadu_epi32(k, m) : _mm512_loadu_si512(m);
    if constexpr (Masked)
      _mm512_mask_storeu_epi32(m, k, _mm512_add_epi32(w, gi));
    else
      _mm512_storeu_si512(m, _mm512_add_epi32(w, gi));
  } else {
    const __m128i a = _mm_add_epi8(_mm_maskz_loadu_epi8(k, m), _mm512_castsi512_si128(gi));
    const __m128i b = _mm_add_epi8(_mm_maskz_loadu_epi8(k, v), _mm512_castsi512_si128(gi));
    _mm_mask_storeu_epi8(m, k, a);
    _mm_mask_storeu_epi8(v, k, b);
  }
}
template <int MomentBytes, class G, bool Out>
ZENFLOW_TARGET_AVX512 void shape_compact_512(float* p, const G* g, unsigned char* m, unsigned char* v, float* scales,
                                             bfloat16* out, std::size_t n) {
  constexpr std::size_t mb = MomentBytes == 2 ? 4 : 1;  // bytes at m per element
  std::size_t i = 0;
  if constexpr (Out) {  // a masked head aligns the streamed copy-out, as the step does
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(out) % 32;
    if (misalignment != 0 && n > 0) {
      i = std::min<std::size_t>(n, (32 - misalignment) / 2);
      compact_block_512<MomentBytes, G, Out, true>(p, g, m, v, out, static_cast<__mmask16>((1u << i) - 1u));
    }
  }
  if constexpr (MomentBytes == 2) {
    for (; i + 16 <= n; i += 16) {
      ahead(p + i), ahead(g + i), ahead(m + i * mb);
      compact_block_512<MomentBytes, G, Out, false>(p + i, g + i, m + i * mb, v, Out ? out + i : nullptr, 0xffff);
    }
  } else {
    for (; i + 64 <= n; i += 64) {
      ahead(m + i), ahead(v + i);
      if ((i & 255) == 0) scales[2 * (i / 256)] += 1.0f, scales[2 * (i / 256) + 1] += 1.0f;
      __m512i gi = _mm512_setzero_si512();
      for (std::size_t j = 0; j < 64; j += 16) {
        ahead(p + i + j), ahead(g + i + j);
        gi = _mm512_add_epi32(gi,
                              compact_pg_512<G, Out, false>(p + i + j, g + i + j, Out ? out + i + j : nullptr, 0xffff));
      }
      _mm512_storeu_si512(m + i, _mm512_add_epi8(_mm512_loadu_si512(m + i), gi));
      _mm512_storeu_si512(v + i, _mm512_add_epi8(_mm512_loadu_si512(v + i), gi));
    }
  }
  for (; i < n; i += 16) {
    const std::size_t left = std::min<std::size_t>(16, n - i);
    compact_block_512<MomentBytes, G, Out, true>(p + i, g + i, m + i * mb, v + i * (MomentBytes == 1),
                                                 Out ? out + i : nullptr, static_cast<__mmask16>((1u << left) - 1u));
  }
  if constexpr (Out) _mm_sfence();
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
template <int MomentBytes, class G, bool Out>
void shape_compact(float* p, const G* g, unsigned char* m, unsigned char* v, float* scales, bfloat16* out,
                   std::size_t n) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512)
    return shape_compact_512<MomentBytes, G, Out>(p, g, m, v, scales, out, n);
#endif
  constexpr std::size_t mb = MomentBytes == 2 ? 4 : 1;  // bytes at m per element (bf16: the m|v word)
  for (std::size_t i = 0; i < n; ++i) {
    const float gf = zenflow::to_float(g[i]);
    p[i] += gf;
    for (std::size_t b = 0; b < mb; ++b) m[i * mb + b] += 1;
    if (MomentBytes == 1) v[i] += 1;
    if (MomentBytes == 1 && i % 256 == 0) scales[2 * (i / 256)] += 1.0f, scales[2 * (i / 256) + 1] += 1.0f;
    if (Out) out[i].bits = static_cast<std::uint16_t>(zenflow::detail::float_to_bits(p[i]) >> 16);
  }
}
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

// The compact step's bytes: p, g (G), the moments (bf16: one m|v word; 8-bit: a byte each and the
// scales), a bf16 copy-out.
template <int MomentBytes, class G, bool Out>
struct compact_shape {
  std::size_t n;
  big_buffer<float> p{n}, scales{2 * (n / 256 + 1)};
  big_buffer<G> g{n};
  big_buffer<unsigned char> m{MomentBytes == 2 ? 4 * n : n}, v{MomentBytes == 2 ? 1 : n};  // bf16: m|v words
  big_buffer<bfloat16> out{Out ? n : 1};
  explicit compact_shape(std::size_t count) : n(count) { fill_random(g.get(), n, 1, 1e-3f); }
  void run(zenflow::thread_pool& pool, std::size_t chunk) {
    chunk = (chunk + 255) / 256 * 256;  // whole 256-element blocks per task, as the step
    chunked(pool, n, chunk, [&](std::size_t lo, std::size_t c) {
      shape_compact<MomentBytes, G, Out>(p.get() + lo, g.get() + lo, m.get() + lo * (MomentBytes == 2 ? 4 : 1),
                                         v.get() + (MomentBytes == 2 ? 0 : lo), scales.get() + 2 * (lo / 256),
                                         Out ? out.get() + lo : nullptr, c);
    });
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
void roofline_bf16(benchmark::State& state) {
  roofline<compact_shape<2, float, false>>(state, 20);
}
void roofline_q8(benchmark::State& state) {
  roofline<compact_shape<1, float, false>>(state, 16 + 16.0 / 256);
}

// ---------------------------------------------------------------------------------------------
// The optimizer.
// ---------------------------------------------------------------------------------------------
std::unique_ptr<zenflow::cpu_adam> make_optimizer(std::size_t tensors, zenflow::index_t rows, zenflow::index_t cols,
                                                  zenflow::cpu_state_format format = zenflow::cpu_state_format::fp32) {
  zenflow::adam_options o;
  o.weight_decay = 0.01f;
  zenflow::cpu_adam_config config = bench_config();
  config.cpu_state = format;
  auto opt = std::make_unique<zenflow::cpu_adam>(o, config);
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

// A compact state against its roofline and against fp32 state, all on 64M parameters in columns of
// 4096 rows (16 blocks of 256 per column for the 8-bit format). Mixed: bf16 gradient, bf16 copy-out.
template <int MomentBytes, bool Mixed>
void step_compact(benchmark::State& state) {
  using G = std::conditional_t<Mixed, bfloat16, float>;
  const std::size_t n = param_count();
  const auto rows = static_cast<zenflow::index_t>(4096), cols = static_cast<zenflow::index_t>(n / 4096);
  const auto format =
      MomentBytes == 2 ? zenflow::cpu_state_format::bf16_moments : zenflow::cpu_state_format::blockwise8_moments;
  auto opt = make_optimizer(1, rows, cols, format);
  auto base = make_optimizer(1, rows, cols);
  big_buffer<G> g(n);
  big_buffer<bfloat16> out(Mixed ? n : 1);
  fill_random(g.get(), n, 3, 1e-2f);
  zenflow::cpu_adam_task task{0, g.get(), Mixed ? dtype::bf16 : dtype::f32, {}};
  if (Mixed) task.copy_out = out.get();
  compact_shape<MomentBytes, G, Mixed> roof(n);
  const double bytes = MomentBytes == 2 ? 20 : 16 + 16.0 / 256;
  run_vs_fp32(
      state, n, bytes,
      [&] {
        opt->step({&task, 1}, 1.0f, false);
      },
      [&] { roof.run(opt->pool(), opt->chunk_elements()); },
      [&] {
        base->step({&task, 1}, 1.0f, false);
      });
  state.counters["threads"] = static_cast<double>(opt->pool().size());
  state.counters["bytes_held_per_param"] = static_cast<double>(opt->state_bytes()) / static_cast<double>(n);
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
BENCHMARK(roofline_bf16)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(roofline_q8)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_compact<2, false>)
    ->Name("step_bf16_moments")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK(step_compact<1, false>)->Name("step_q8_moments")->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(step_compact<2, true>)
    ->Name("step_bf16_moments_mixed")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK(step_compact<1, true>)
    ->Name("step_q8_moments_mixed")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

BENCHMARK_MAIN();
