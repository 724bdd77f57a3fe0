// The block kernel of host_gradient_stats: the sum of squares (double) and the non-finite count of
// up to stats_block_elements contiguous elements, in a scalar version and AVX2 and AVX-512
// versions chosen at run time (the CPU Adam's dispatch, detail/cpu_adam/isa.hpp). Not a public
// header.
//
// The order, which every version follows: element q of the block goes to lane q % 16 (16 double
// partial sums, each over its elements in order, skipping the non-finite ones); then lane l adds
// lane l + w for w = 8, 4, 2, 1 and lane 0 is the block's sum. A square of a float is exact in
// double (24 significant bits squared fit in 53), so a contracted fma(x, x, sum) and the rounded
// sum + x*x are the same value: contraction cannot change a bit here (the rule in adam_math.hpp).
//
// The SIMD versions first run that order without masks (`finite_squares`: a load, a conversion
// and a fused multiply-add per 8 or 16 elements); a non-finite element makes that sum non-finite
// (squares are >= 0 and a finite float's square is finite in double, as is a block's sum of
// them), and only then does the block run again with the non-finite elements masked out and
// counted. With every element finite the two add the same values in the same order: the same
// bits, at about a third of the instructions per element. Both prefetch prefetch_distance elements
// ahead (as the CPU Adam does): the fixed order's dependent adds otherwise leave too few loads in
// flight to keep up with memory (measured: 0.57-0.59 of a read-only stream without, see BENCHMARKS.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/detail/gradient_stats/math.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::stats {

/// Elements per block: the unit of the order (and of the parallel split).
inline constexpr index_t stats_block_elements = 16384;

/// One block's statistics.
struct block_stats {
  double sum = 0.0;
  std::int64_t nonfinite = 0;
};

using stats_block_fn = block_stats (*)(const void* data, index_t n);

/// Lane l += lane l + w for w = 8, 4, 2, 1; returns lane 0.
inline double fold_lanes(double (&lane)[16]) noexcept {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

template <class T>
block_stats stats_block_scalar(const void* data, index_t n) noexcept {
  const T* x = static_cast<const T*>(data);
  double lane[16] = {};
  block_stats out;
  for (index_t q = 0; q < n; ++q) {
    const float f = to_float(x[q]);
    if (is_nonfinite_bits(float_to_bits(f))) {
      ++out.nonfinite;
    } else {
      const double d = f;
      lane[q % 16] += d * d;
    }
  }
  out.sum = fold_lanes(lane);
  return out;
}

#if ZENFLOW_CPU_ADAM_X86
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, see kernels.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace avx512 {
// The lane fold (lane l += lane l + w for w = 8, 4, 2, 1) of lanes 0-7 and 8-15.
ZENFLOW_TARGET_AVX512 inline __attribute__((always_inline)) double fold_lanes(__m512d lo, __m512d hi) {
  const __m512d s8 = _mm512_add_pd(lo, hi);  // w = 8
  const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}
// The documented order over a block assumed finite (see the header comment); the tail's zeroed
// lanes add +0.0, which changes no partial sum (they are never -0.0).
template <class T>
ZENFLOW_TARGET_AVX512 double finite_squares(const void* data, index_t n) noexcept {
  namespace k = zenflow::detail::avx512;
  const T* x = static_cast<const T*>(data);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();  // lanes 0-7, lanes 8-15
  index_t q = 0;
  if constexpr (std::is_same_v<T, float>) {  // each half converted from memory (no extract)
    for (; q + 16 <= n; q += 16) {
      k::prefetch(x + q);
      const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + q)), b = _mm512_cvtps_pd(_mm256_loadu_ps(x + q + 8));
      lo = _mm512_fmadd_pd(a, a, lo);
      hi = _mm512_fmadd_pd(b, b, hi);
    }
  }
  for (; q < n; q += 16) {
    k::prefetch(x + q);
    const __mmask16 m = n - q >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - q)) - 1u);
    const __m512 f = n - q >= 16 ? k::load<false>(x + q, m) : k::load<true>(x + q, m);
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  return fold_lanes(lo, hi);
}
// Masked-off lanes (the tail, the non-finite elements) add nothing.
template <class T>
ZENFLOW_TARGET_AVX512 block_stats stats_block(const void* data, index_t n) noexcept {
  namespace k = zenflow::detail::avx512;
  const T* x = static_cast<const T*>(data);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();  // lanes 0-7, lanes 8-15
  std::int64_t bad = 0;
  for (index_t q = 0; q < n; q += 16) {
    k::prefetch(x + q);
    const __mmask16 m = n - q >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - q)) - 1u);
    const __m512 f = n - q >= 16 ? k::load<false>(x + q, m) : k::load<true>(x + q, m);
    const __mmask16 nonfinite = k::nonfinite(f) & m;
    const __mmask16 add = m & static_cast<__mmask16>(~nonfinite);
    bad += __builtin_popcount(nonfinite);
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    lo = _mm512_mask_add_pd(lo, static_cast<__mmask8>(add), lo, _mm512_mul_pd(a, a));
    hi = _mm512_mask_add_pd(hi, static_cast<__mmask8>(add >> 8), hi, _mm512_mul_pd(b, b));
  }
  return {fold_lanes(lo, hi), bad};
}
}  // namespace avx512

namespace avx2 {
// A non-finite lane adds +0.0, which changes no partial sum (they are never -0.0).
ZENFLOW_TARGET_AVX2 inline __attribute__((always_inline)) void add_squares(__m256d& acc, __m128 f, __m128 finite) {
  const __m256d d = _mm256_cvtps_pd(f);
  acc = _mm256_add_pd(
      acc, _mm256_and_pd(_mm256_mul_pd(d, d), _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_castps_si128(finite)))));
}
// Elements q..q+15 of a block of n as floats, zero past n (+0.0 squares add nothing).
template <class T>
ZENFLOW_TARGET_AVX2 inline __attribute__((always_inline)) void load16(const T* x, index_t q, index_t n, __m256& f0,
                                                                      __m256& f1) {
  namespace k = zenflow::detail::avx2;
  if (n - q >= 16) {
    f0 = k::load(x + q);
    f1 = k::load(x + q + 8);
    return;
  }
  T t[16] = {};
  for (index_t i = 0; i < n - q; ++i) t[i] = x[q + i];
  f0 = k::load(t);
  f1 = k::load(t + 8);
}
// The lane fold (lane l += lane l + w for w = 8, 4, 2, 1) of lanes 0-3, 4-7, 8-11, 12-15.
ZENFLOW_TARGET_AVX2 inline __attribute__((always_inline)) double fold_lanes(__m256d a0, __m256d a1, __m256d a2,
                                                                            __m256d a3) {
  const __m256d s8a = _mm256_add_pd(a0, a2), s8b = _mm256_add_pd(a1, a3);  // w = 8
  const __m256d s4 = _mm256_add_pd(s8a, s8b);                              // w = 4
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}
// The documented order over a block assumed finite (see the header comment).
template <class T>
ZENFLOW_TARGET_AVX2 double finite_squares(const void* data, index_t n) noexcept {
  const T* x = static_cast<const T*>(data);
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;  // lanes 0-3, 4-7, 8-11, 12-15
  for (index_t q = 0; q < n; q += 16) {
    zenflow::detail::avx2::prefetch(x + q);
    __m256 f0, f1;
    load16(x, q, n, f0, f1);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(f0)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(f0, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(f1)), d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(f1, 1));
    a0 = _mm256_fmadd_pd(d0, d0, a0);
    a1 = _mm256_fmadd_pd(d1, d1, a1);
    a2 = _mm256_fmadd_pd(d2, d2, a2);
    a3 = _mm256_fmadd_pd(d3, d3, a3);
  }
  return fold_lanes(a0, a1, a2, a3);
}
template <class T>
ZENFLOW_TARGET_AVX2 block_stats stats_block(const void* data, index_t n) noexcept {
  const T* x = static_cast<const T*>(data);
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;  // lanes 0-3, 4-7, 8-11, 12-15
  std::int64_t bad = 0;
  const __m256i e = _mm256_set1_epi32(0x7f800000);
  for (index_t q = 0; q < n; q += 16) {
    zenflow::detail::avx2::prefetch(x + q);
    __m256 f0, f1;
    load16(x, q, n, f0, f1);
    const __m256i nf0 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(f0), e), e);
    const __m256i nf1 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(f1), e), e);
    bad += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(nf0)))) +
           __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(nf1))));
    const __m256 ok0 = _mm256_castsi256_ps(_mm256_xor_si256(nf0, _mm256_set1_epi32(-1)));
    const __m256 ok1 = _mm256_castsi256_ps(_mm256_xor_si256(nf1, _mm256_set1_epi32(-1)));
    add_squares(a0, _mm256_castps256_ps128(f0), _mm256_castps256_ps128(ok0));
    add_squares(a1, _mm256_extractf128_ps(f0, 1), _mm256_extractf128_ps(ok0, 1));
    add_squares(a2, _mm256_castps256_ps128(f1), _mm256_castps256_ps128(ok1));
    add_squares(a3, _mm256_extractf128_ps(f1, 1), _mm256_extractf128_ps(ok1, 1));
  }
  return {fold_lanes(a0, a1, a2, a3), bad};
}
}  // namespace avx2
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // ZENFLOW_CPU_ADAM_X86

template <cpu_isa Isa, class T>
block_stats stats_block_erased(const void* data, index_t n) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) {
    const double sum = avx512::finite_squares<T>(data, n);
    return std::isfinite(sum) ? block_stats{sum, 0} : avx512::stats_block<T>(data, n);
  }
  if constexpr (Isa == cpu_isa::avx2) {
    const double sum = avx2::finite_squares<T>(data, n);
    return std::isfinite(sum) ? block_stats{sum, 0} : avx2::stats_block<T>(data, n);
  }
#endif
  return stats_block_scalar<T>(data, n);
}

/// The block kernel for a concrete path (resolve_isa) and an element type.
inline stats_block_fn select_stats_block(cpu_isa isa, dtype t) noexcept {
  return dispatch_dtype(t, [&](auto tag) -> stats_block_fn {
    using T = decltype(tag);
    switch (isa) {
      case cpu_isa::avx512:
        return &stats_block_erased<cpu_isa::avx512, T>;
      case cpu_isa::avx2:
        return &stats_block_erased<cpu_isa::avx2, T>;
      default:
        return &stats_block_erased<cpu_isa::scalar, T>;
    }
  });
}

}  // namespace zenflow::detail::stats
