// End-to-end: a stack of linear layers trained with each mode on the coordinator's HOST backend
// (a host_stream stands in for the GPU stream and runs the layers' GEMMs). Reports step time,
// stall fraction and offload bytes per step, and each mode's speed as a fraction of dense (the
// no-offload roofline, measured in the same binary). On a machine without a GPU this is the
// host-only version of the GPU end-to-end benchmark; the "GPU" and the CPU optimizer share the
// same cores, so it shows the schedule's behaviour, not GPU speed-ups.
//
// Then each piece of the host backend's "device" work (what the host_stream runs in place of GPU
// kernels, on the stream's pool: every CPU this process may use) as a fraction of a memory
// roofline over the same bytes, measured alternately with it in the same run on the same pool:
//   piece_sparse_step/dense     every column, row-major f32 parameter and gradient: 28 B/element
//                               (read gradient, parameter, m, v; write parameter, m, v: an f32
//                               parameter is its own master) vs an Adam-shaped stream (4
//                               contiguous arrays read, 3 written)
//   piece_sparse_step/topk      10% of the columns, bf16 parameter and gradient: 28 B/element
//                               (read gradient, master, m, v; write master, m, v, parameter), vs
//                               the stream with a 2-byte gradient and a 2-byte parameter copy
//   piece_statistics            sum of squares and non-finite count of f32 gradients: 4 B/element,
//                               vs a read-only stream
//   piece_gather/scatter        90% of the columns of a row-major f32 matrix to/from a compact
//                               column-contiguous buffer (x scale on the way out): 8 B/element,
//                               vs a contiguous scaled copy
//   piece_gather_accumulate/L   the same columns scaled and added into a compact fp32 accumulator
//                               (the host backend's offload at step()): 12 B/element, vs a
//                               contiguous acc += x * scale stream; L 0 row-major, 1 each
//                               column's rows contiguous
//   piece_export/import         migration packing of a row-major [rows][k] state to/from the
//                               packed per-column format: 24 B/element, vs a contiguous copy
// Bar: roofline_fraction >= 0.8. Size: a 4096 x 4096 matrix (ZENFLOW_BENCH_ROWS / _COLS override).
// The pieces run the best SIMD path of the CPU (ZENFLOW_BENCH_ISA=scalar|avx2|avx512 overrides).
#include <benchmark/benchmark.h>

#include <zenflow/coordinator.hpp>
#include <zenflow/gradient_stats.hpp>
#include <zenflow/sparse_adam.hpp>
#include "bench_env.hpp"
#include "end_to_end_modes.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using zenflow::bfloat16;
using zenflow::index_t;

constexpr index_t hidden = 384;
constexpr index_t layers = 4;
constexpr index_t batch = 32;

struct stack {
  std::vector<std::vector<bfloat16>> w, g;
  std::vector<std::vector<float>> w0, b, gb;
  std::vector<float> x;
  stack() {
    std::mt19937 rng(1);
    std::normal_distribution<float> n01(0.0f, 0.05f);
    for (index_t l = 0; l < layers; ++l) {
      w0.emplace_back(hidden * hidden);
      for (auto& v : w0.back()) v = n01(rng);
      w.emplace_back(hidden * hidden);
      for (std::size_t i = 0; i < w.back().size(); ++i) w.back()[i] = zenflow::to_bfloat16(w0.back()[i]);
      g.emplace_back(hidden * hidden);
      b.emplace_back(hidden, 0.0f);
      gb.emplace_back(hidden, 0.0f);
    }
    x.resize(batch * hidden);
    for (auto& v : x) v = n01(rng);
  }
  // "Forward and backward" of layer l as the GPU would run it: y = x W^T, then the weight gradient
  // G = dy^T x with dy = y - x (a regression towards the identity), stored in bf16.
  void layer_step(index_t l) {
    std::vector<float> wf(hidden * hidden), y(batch * hidden, 0.0f);
    for (std::size_t i = 0; i < wf.size(); ++i) wf[i] = zenflow::to_float(w[l][i]);
    for (index_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < hidden; ++o) {
        float acc = 0.0f;
        for (index_t i = 0; i < hidden; ++i) acc += wf[o * hidden + i] * x[s * hidden + i];
        y[s * hidden + o] = acc - x[s * hidden + o];
      }
    std::vector<float> grad(hidden * hidden, 0.0f);
    for (index_t s = 0; s < batch; ++s)
      for (index_t o = 0; o < hidden; ++o) {
        const float d = y[s * hidden + o] / batch;
        for (index_t i = 0; i < hidden; ++i) grad[o * hidden + i] += d * x[s * hidden + i];
      }
    for (std::size_t i = 0; i < grad.size(); ++i) g[l][i] = zenflow::to_bfloat16(grad[i]);
    for (index_t o = 0; o < hidden; ++o) gb[l][o] = 0.0f;
  }
};

void BM_end_to_end(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  stack model;
  zenflow::host_stream stream(1);  // one core plays the GPU
  zenflow::coordinator_config config;
  config.cpu_threads = 1;  // the other core the CPU
  config.d2h_slot_bytes = 1 << 20;
  config.h2d_slot_bytes = 1 << 20;
  zenflow::host_coordinator c(zenflow_bench::mode_options(mode, 1e-3f), config);
  for (index_t l = 0; l < layers; ++l) {
    c.register_parameter("w" + std::to_string(l),
                         zenflow::matrix_view::row_major(model.w[l].data(), hidden, hidden, zenflow::dtype::bf16),
                         zenflow::const_matrix_view::row_major(model.w0[l].data(), hidden, hidden, zenflow::dtype::f32),
                         zenflow::dtype::bf16);
    c.register_parameter("b" + std::to_string(l), zenflow::vector_view{model.b[l].data(), hidden, zenflow::dtype::f32},
                         model.b[l]);
  }
  double stall = 0.0, total = 0.0;
  std::uint64_t d2h = 0, h2d = 0, steps = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (index_t l = layers; l-- > 0;) {
      stream.enqueue([&model, l] { model.layer_step(l); });  // backward of layer l on the "GPU"
      c.submit_gradient(2 * l,
                        zenflow::const_matrix_view::row_major(model.g[l].data(), hidden, hidden, zenflow::dtype::bf16),
                        &stream);
      c.submit_gradient(2 * l + 1, zenflow::const_vector_view{model.gb[l].data(), hidden, zenflow::dtype::f32},
                        &stream);
    }
    const auto& m = c.step(&stream);
    stream.synchronize();  // the step is done when the "GPU" is done
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stall += m.stall_seconds;
    d2h += m.bytes_device_to_host;
    h2d += m.bytes_host_to_device;
    ++steps;
  }
  c.finish(&stream);
  const double per_step = total / static_cast<double>(steps);
  zenflow_bench::step_seconds()[mode] = per_step;
  zenflow_bench::stall_seconds()[mode] = stall / static_cast<double>(steps);
  state.counters["step_ms"] = per_step * 1e3;
  state.counters["stall_fraction"] = stall / total;
  state.counters["d2h_MB_per_step"] = static_cast<double>(d2h) / static_cast<double>(steps) / 1e6;
  state.counters["h2d_MB_per_step"] = static_cast<double>(h2d) / static_cast<double>(steps) / 1e6;
  if (zenflow_bench::step_seconds().count(0))
    state.counters["fraction_of_dense"] = zenflow_bench::step_seconds()[0] / per_step;
  if (mode == zenflow_bench::zenflow_async && zenflow_bench::stall_seconds().count(zenflow_bench::zero_offload))
    state.counters["stall_over_zero_offload"] =  // the bar: <= 0.15
        zenflow_bench::stall_seconds()[zenflow_bench::zenflow_async] /
        std::max(1e-12, zenflow_bench::stall_seconds()[zenflow_bench::zero_offload]);
  state.SetLabel(zenflow_bench::mode_name(mode));
}

// ---------------------------------------------------------------------------------------------
// The pieces of the host backend's device work against same-run rooflines.
// ---------------------------------------------------------------------------------------------

index_t env_size(const char* name, index_t fallback) {
  if (const char* s = std::getenv(name)) return std::strtoll(s, nullptr, 10);
  return fallback;
}
const index_t piece_rows = env_size("ZENFLOW_BENCH_ROWS", 4096), piece_cols = env_size("ZENFLOW_BENCH_COLS", 4096);

// 2 MiB-aligned, huge-page-advised, touched buffers (as the CPU Adam's state).
template <class T>
struct buffer {
  struct deleter {
    void operator()(T* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<T[], deleter> data;
  explicit buffer(std::size_t n) {
    const std::size_t a = std::size_t{2} << 20, bytes = std::max(a, (n * sizeof(T) + a - 1) / a * a);
    data.reset(static_cast<T*>(std::aligned_alloc(a, bytes)));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data.get(), bytes, MADV_HUGEPAGE);
#endif
    std::uint32_t x = 12345;
    for (std::size_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      data[i] = zenflow::from_float<T>(1e-3f * (static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f));
    }
  }
  T* get() const {
    return data.get();
  }
};

// Roofline streams: the same loads and stores with trivial arithmetic, AVX-512 when the CPU has it
// (the read stream: AVX2 too; the others are element-wise loops the compiler vectorizes).
#if ZENFLOW_CPU_ADAM_X86
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 bug 105593, see kernels.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace k512 = zenflow::detail::avx512;
template <class G, class O>
ZENFLOW_TARGET_AVX512 void adam_stream_512(float* p, const G* g, float* m, float* v, O* out, std::size_t n) {
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    const __m512 gv = k512::load<false>(g + i, 0xffff);
    const __m512 pv = _mm512_add_ps(k512::load<false>(p + i, 0xffff), gv);
    _mm512_storeu_ps(p + i, pv);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gv));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gv));
    if (out != nullptr) k512::store<false, true>(out + i, pv, 0xffff);  // streamed, as the step's parameter copy
  }
  _mm_sfence();
}
ZENFLOW_TARGET_AVX512 double read_stream_512(const float* x, std::size_t n) {
  __m512 a = _mm512_setzero_ps(), b = a;
  for (std::size_t i = 0; i + 32 <= n; i += 32) {
    a = _mm512_add_ps(a, _mm512_loadu_ps(x + i));
    b = _mm512_add_ps(b, _mm512_loadu_ps(x + i + 16));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
// A sum of floats cannot be vectorized by the compiler (the order is fixed), so the read roofline
// has an AVX2 version too: four independent 8-lane sums keep the loads, not the adds, the bound.
ZENFLOW_TARGET_AVX2 double read_stream_256(const float* x, std::size_t n) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (std::size_t i = 0; i + 32 <= n; i += 32) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(x + i));
    b = _mm256_add_ps(b, _mm256_loadu_ps(x + i + 8));
    c = _mm256_add_ps(c, _mm256_loadu_ps(x + i + 16));
    d = _mm256_add_ps(d, _mm256_loadu_ps(x + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  double s = 0.0;
  for (float f : lanes) s += f;
  return s;
}
ZENFLOW_TARGET_AVX512 void copy_stream_512(const float* x, float* y, std::size_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (std::size_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), s));
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
template <class G, class O>
void adam_stream(float* p, const G* g, float* m, float* v, O* out, std::size_t n) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512) return adam_stream_512(p, g, m, v, out, n);
#endif
  for (std::size_t i = 0; i < n; ++i) {
    const float x = zenflow::to_float(g[i]);
    p[i] += x, m[i] += x, v[i] += x;
    if (out != nullptr) out[i] = zenflow::from_float<O>(p[i]);
  }
}
double read_stream(const float* x, std::size_t n) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512) return read_stream_512(x, n);
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx2) return read_stream_256(x, n);
#endif
  double s = 0.0;
  for (std::size_t i = 0; i < n; ++i) s += x[i];
  return s;
}
void copy_stream(const float* x, float* y, std::size_t n, float scale) {
#if ZENFLOW_CPU_ADAM_X86
  if (zenflow::detect_cpu_isa() == zenflow::cpu_isa::avx512) return copy_stream_512(x, y, n, scale);
#endif
  for (std::size_t i = 0; i < n; ++i) y[i] = x[i] * scale;
}

// Runs fn(offset, count) over [0, n) in pieces of 64K elements on the pool.
template <class Fn>
void chunked(zenflow::thread_pool& pool, std::size_t n, Fn&& fn) {
  constexpr std::size_t chunk = std::size_t{1} << 16;
  pool.parallel_for((n + chunk - 1) / chunk, [&](std::size_t k) {
    const std::size_t lo = k * chunk;
    fn(lo, std::min(n, lo + chunk) - lo);
  });
}

// The piece and its roofline alternately, each timed on its own (see bench_cpu_adam.cpp); with
// `other`, a third function timed in turn with them, reported as `other_name`_ms and as
// `other_name`_over_piece (its time / the piece's).
template <class Piece, class Roof, class Other = std::nullptr_t>
void run_paired(benchmark::State& state, double elements, double bytes_per_element, Piece&& piece, Roof&& roof,
                Other&& other = nullptr, const std::string& other_name = {}) {
  double piece_seconds = 0, roof_seconds = 0, other_seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    piece();
    const auto t1 = std::chrono::steady_clock::now();
    roof();
    const auto t2 = std::chrono::steady_clock::now();
    piece_seconds += std::chrono::duration<double>(t1 - t0).count();
    roof_seconds += std::chrono::duration<double>(t2 - t1).count();
    if constexpr (!std::is_same_v<std::decay_t<Other>, std::nullptr_t>) {
      other();
      other_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
    }
  }
  const auto it = static_cast<double>(state.iterations());
  if constexpr (!std::is_same_v<std::decay_t<Other>, std::nullptr_t>) {
    state.counters[other_name + "_ms"] = other_seconds / it * 1e3;
    state.counters[other_name + "_over_piece"] = other_seconds / piece_seconds;
  }
  state.counters["GB_per_s"] = elements * bytes_per_element * it / piece_seconds * 1e-9;
  state.counters["roofline_GB_per_s"] = elements * bytes_per_element * it / roof_seconds * 1e-9;
  state.counters["roofline_fraction"] = roof_seconds / piece_seconds;
  state.counters["ms"] = piece_seconds / it * 1e3;
}

// The pieces' SIMD path: the best this CPU has (ZENFLOW_BENCH_ISA=scalar|avx2|avx512 overrides).
zenflow::cpu_isa piece_isa() {
  static const zenflow::cpu_isa isa = zenflow_bench::env_isa();
  return isa;
}

zenflow::thread_pool& piece_pool() {
  static zenflow::thread_pool pool;  // every CPU this process may use, as a host_stream's
  return pool;
}

std::vector<std::int32_t> every_tenth(index_t cols, bool selected) {
  std::vector<std::int32_t> out;
  for (std::int32_t c = 0; c < cols; ++c)
    if ((c % 10 == 3) == selected) out.push_back(c);
  return out;
}

template <class T>
void sparse_step(benchmark::State& state, bool dense) {
  const index_t rows = piece_rows, cols = piece_cols;
  const auto sel = every_tenth(cols, true);
  std::vector<std::int32_t> all(static_cast<std::size_t>(cols));
  std::iota(all.begin(), all.end(), 0);
  const auto& columns = dense ? all : sel;
  const auto n = static_cast<std::size_t>(rows) * columns.size();
  constexpr zenflow::dtype t = std::is_same_v<T, float> ? zenflow::dtype::f32 : zenflow::dtype::bf16;
  buffer<T> param(static_cast<std::size_t>(rows * cols)), grad(static_cast<std::size_t>(rows * cols));
  zenflow::host_sparse_adam opt(zenflow::adam_options{});
  const zenflow::host_execution exec{&piece_pool(), piece_isa()};
  opt.add_matrix(zenflow::matrix_view::row_major(param.get(), rows, cols, t), columns, std::vector<float>(3 * n, 1e-3f),
                 exec);
  const auto g = zenflow::const_matrix_view::row_major(grad.get(), rows, cols, t);
  buffer<float> rp(n), rm(n), rv(n);
  buffer<T> rg(n), rout(n);
  // An f32 parameter is its own master: no copy-out (rout unused).
  constexpr bool own_master = std::is_same_v<T, float>;
  T* const out = own_master ? nullptr : rout.get();
  run_paired(
      state, static_cast<double>(n), own_master ? 28 : 12 + 12 + 2 * sizeof(T),
      [&] {
        opt.step({&g, 1}, {}, 1.0f, nullptr, nullptr, false, exec);
      },
      [&] {
        chunked(piece_pool(), n, [&](std::size_t lo, std::size_t c) {
          adam_stream(rp.get() + lo, rg.get() + lo, rm.get() + lo, rv.get() + lo, out ? out + lo : nullptr, c);
        });
      });
}
void piece_sparse_step_dense(benchmark::State& state) {
  sparse_step<float>(state, true);
}
void piece_sparse_step_topk(benchmark::State& state) {
  sparse_step<bfloat16>(state, false);
}

void piece_statistics(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(piece_rows * piece_cols);
  buffer<float> grad(n), roof(n);
  const auto g = zenflow::const_matrix_view::row_major(grad.get(), piece_rows, piece_cols, zenflow::dtype::f32);
  const zenflow::host_execution exec{&piece_pool(), piece_isa()};
  std::vector<double> sink(1024);
  run_paired(
      state, static_cast<double>(n), 4,
      [&] {
        benchmark::DoNotOptimize(zenflow::host_gradient_stats({&g, 1}, {}, exec));
      },
      [&] {
        chunked(piece_pool(), n,
                [&](std::size_t lo, std::size_t c) { sink[lo / (1 << 16) % 1024] = read_stream(roof.get() + lo, c); });
        benchmark::DoNotOptimize(sink.data());
      });
}

void gather_scatter(benchmark::State& state, bool gather) {
  const index_t rows = piece_rows, cols = piece_cols;
  const auto columns = every_tenth(cols, false);  // the 90% a ZenFlow step offloads
  const auto n = static_cast<std::size_t>(rows) * columns.size();
  buffer<float> matrix(static_cast<std::size_t>(rows * cols)), compact(n), rx(n), ry(n);
  const zenflow::host_execution exec{&piece_pool(), piece_isa()};
  const auto m = zenflow::matrix_view::row_major(matrix.get(), rows, cols, zenflow::dtype::f32);
  run_paired(
      state, static_cast<double>(n), 8,
      [&] {
        if (gather)
          zenflow::gather_columns(m, columns, compact.get(), zenflow::dtype::f32, 0.5f, exec);
        else
          zenflow::scatter_columns(compact.get(), zenflow::dtype::f32, columns, m, exec);
      },
      [&] {
        chunked(piece_pool(), n,
                [&](std::size_t lo, std::size_t c) { copy_stream(rx.get() + lo, ry.get() + lo, c, 0.5f); });
      });
}
void piece_gather(benchmark::State& state) {
  gather_scatter(state, true);
}
// The host backend's offload at step() in one process (host_backend::gather_accumulate): the same
// 90% of the columns, scaled and added into a compact fp32 accumulator, 12 B/element (read the
// gradient, read and write the accumulator), against a contiguous acc += x * scale stream; and,
// timed in turn with both, the staged path it replaces (gather_columns into a compact buffer, then
// the accumulate kernel over it: staged_ms, staged_over_piece = its time / the fused one's).
// Argument: 0 a row-major gradient (a transposition), 1 a column-contiguous one (each column's rows
// contiguous, as an embedding registered with its rows as columns).
void piece_gather_accumulate(benchmark::State& state) {
  namespace hd = zenflow::detail::host_device;
  const index_t rows = piece_rows, cols = piece_cols;
  const bool contiguous = state.range(0) == 1;
  const auto columns = every_tenth(cols, false);
  const auto n = static_cast<std::size_t>(rows) * columns.size();
  buffer<float> matrix(static_cast<std::size_t>(rows * cols)), acc(n), staged(n), rx(n), ry(n);
  const zenflow::host_execution exec{&piece_pool(), piece_isa()};
  const zenflow::cpu_isa isa = zenflow::detail::resolve_isa(piece_isa());
  const auto m = contiguous
                     ? zenflow::const_matrix_view::column_contiguous(matrix.get(), rows, cols, zenflow::dtype::f32)
                     : zenflow::const_matrix_view::row_major(matrix.get(), rows, cols, zenflow::dtype::f32);
  const hd::column_side grad{m.data, m.type, m.row_stride, m.col_stride, columns.data(), hd::max_column(columns)};
  run_paired(
      state, static_cast<double>(n), 12,
      [&] {
        hd::gather_accumulate(grad, rows, static_cast<index_t>(columns.size()), 0.5f, acc.get(), false, exec, isa);
      },
      [&] {
        chunked(piece_pool(), n, [&](std::size_t lo, std::size_t c) {
          float* y = ry.get() + lo;
          const float* x = rx.get() + lo;
          for (std::size_t i = 0; i < c; ++i) y[i] += x[i] * 0.5f;
        });
      },
      [&] {
        zenflow::gather_columns(m, columns, staged.get(), zenflow::dtype::f32, 0.5f, exec);
        (void)zenflow::detail::parallel_accumulate(piece_pool(), isa, std::size_t{1} << 16, acc.get(), staged.get(),
                                                   zenflow::dtype::f32, n, 1.0f, false);
      },
      "staged");
}
void piece_scatter(benchmark::State& state) {
  gather_scatter(state, false);
}

void export_import(benchmark::State& state, bool do_export) {
  const index_t rows = piece_rows, cols = piece_cols;
  std::vector<std::int32_t> all(static_cast<std::size_t>(cols));
  std::iota(all.begin(), all.end(), 0);
  const auto n = static_cast<std::size_t>(rows * cols);
  buffer<float> param(n), packed(3 * n), rx(3 * n), ry(3 * n);
  zenflow::host_sparse_adam opt(zenflow::adam_options{});
  const zenflow::host_execution exec{&piece_pool(), piece_isa()};
  opt.add_matrix(zenflow::matrix_view::row_major(param.get(), rows, cols, zenflow::dtype::f32), all,
                 std::span<const float>(packed.get(), 3 * n), exec);
  const std::span<float> p(packed.get(), 3 * n);
  run_paired(
      state, static_cast<double>(n), 24,
      [&] {
        if (do_export)
          opt.export_state(0, p, exec);
        else
          opt.import_state(0, p, exec);
      },
      [&] {
        chunked(piece_pool(), 3 * n,
                [&](std::size_t lo, std::size_t c) { copy_stream(rx.get() + lo, ry.get() + lo, c, 1.0f); });
      });
}
void piece_export(benchmark::State& state) {
  export_import(state, true);
}
void piece_import(benchmark::State& state) {
  export_import(state, false);
}

}  // namespace

// Dense first: it is the roofline the other modes are reported against.
BENCHMARK(BM_end_to_end)->DenseRange(0, 3)->Iterations(40)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(piece_sparse_step_dense)
    ->Name("piece_sparse_step/dense")
    ->UseRealTime()
    ->MinTime(1.0)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(piece_sparse_step_topk)
    ->Name("piece_sparse_step/topk")
    ->UseRealTime()
    ->MinTime(1.0)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(piece_statistics)->UseRealTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(piece_gather)->UseRealTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(piece_gather_accumulate)->Arg(0)->Arg(1)->UseRealTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(piece_scatter)->UseRealTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(piece_export)->UseRealTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK(piece_import)->UseRealTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
