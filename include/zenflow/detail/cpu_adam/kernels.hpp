// The stateless per-range kernels of the CPU Adam: the Adam step, the fused accumulate and the
// non-finite scan, each in a portable scalar version and AVX2+FMA+F16C and AVX-512 versions.
//
// Every version performs exactly the operations of `zenflow::adam_update` (adam_math.hpp), in
// the same order, each a single IEEE-rounded fp32 operation (the vector fma, div and sqrt are
// correctly rounded), so all versions are bit-identical element by element; vector tails are
// masked (AVX-512) or run through a padded local block (AVX2) with the same code as the body.
// bf16/fp16 loads and stores reproduce `to_float` / `from_float` exactly (round to nearest even,
// NaN, infinity, overflow, subnormals): bf16 by integer arithmetic, fp16 with F16C's
// round-to-nearest-even conversion.
//
// No mul feeds an add or sub directly (the mul results are fma addends), so floating-point
// contraction by the compiler cannot change a result.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/thread_pool.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

/// Tag for "no low-precision copy-out".
struct no_output {};

// ----------------------------------------------------------------------------------------------
// Portable scalar versions: the definition the SIMD versions are tested against.
// ----------------------------------------------------------------------------------------------
template <class G, class O>
inline void adam_range_scalar(float* p, const G* g, float* m, float* v, O* out, std::size_t n,
                              const adam_step_constants& c) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    adam_update(p[i], to_float(g[i]), m[i], v[i], c);
    if constexpr (!std::is_same_v<O, no_output>) out[i] = from_float<O>(p[i]);
  }
}

/// acc[i] = fma(scale, g[i], acc[i]) (Overwrite: fma(scale, g[i], +0), the same bits as into a
/// zeroed accumulator, without reading it); returns true when a resulting acc[i] is NaN or infinite.
template <bool Overwrite, class G>
inline bool accumulate_range_scalar(float* acc, const G* g, std::size_t n, float scale) noexcept {
  bool bad = false;
  for (std::size_t i = 0; i < n; ++i) {
    acc[i] = fma_rn(scale, to_float(g[i]), Overwrite ? 0.0f : acc[i]);
    bad |= !is_finite_bits(acc[i]);
  }
  return bad;
}

/// True when some g[i] * scale is NaN or infinite.
template <class G>
inline bool nonfinite_range_scalar(const G* g, std::size_t n, float scale) noexcept {
  bool bad = false;
  for (std::size_t i = 0; i < n; ++i) bad |= !is_finite_bits(mul_rn(to_float(g[i]), scale));
  return bad;
}

#if ZENFLOW_CPU_ADAM_X86
#define ZENFLOW_SIMD_INLINE inline __attribute__((always_inline))
// GCC 12's intrinsic headers start many AVX-512 results from `_mm512_undefined_*()`, which
// -Wmaybe-uninitialized reports once inlined (GCC bug 105593); the values are fully written.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// ----------------------------------------------------------------------------------------------
// AVX-512: 16 floats per vector, masked tails.
// ----------------------------------------------------------------------------------------------
namespace avx512 {
struct constants {
  __m512 beta1, beta2, omb1, omb2, eps, step_size, inv_sqrt_bc2, lr_wd, l2, grad_scale;
};
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE constants broadcast(const adam_step_constants& c) {
  return {_mm512_set1_ps(c.beta1),           _mm512_set1_ps(c.beta2), _mm512_set1_ps(c.one_minus_beta1),
          _mm512_set1_ps(c.one_minus_beta2), _mm512_set1_ps(c.eps),   _mm512_set1_ps(c.step_size),
          _mm512_set1_ps(c.inv_sqrt_bc2),    _mm512_set1_ps(c.lr_wd), _mm512_set1_ps(c.l2),
          _mm512_set1_ps(c.grad_scale)};
}

template <bool Masked>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512 load(const float* x, __mmask16 k) {
  if constexpr (Masked)
    return _mm512_maskz_loadu_ps(k, x);
  else
    return _mm512_loadu_ps(x);
}
template <bool Masked>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m256i load_half(const void* x, __mmask16 k) {
  if constexpr (Masked)
    return _mm256_maskz_loadu_epi16(k, x);
  else
    return _mm256_loadu_si256(static_cast<const __m256i*>(x));
}
template <bool Masked>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512 load(const bfloat16* x, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_half<Masked>(x, k)), 16));
}
template <bool Masked>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512 load(const float16* x, __mmask16 k) {
  return _mm512_cvtph_ps(load_half<Masked>(x, k));
}
template <bool Masked, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void store(float* x, __m512 a, __mmask16 k) {
  if constexpr (Masked)
    _mm512_mask_storeu_ps(x, k, a);
  else if constexpr (Stream)
    _mm512_stream_ps(x, a);  // x is 64-byte aligned
  else
    _mm512_storeu_ps(x, a);
}
template <bool Masked, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void store_half(void* x, __m256i h, __mmask16 k) {
  if constexpr (Masked)
    _mm256_mask_storeu_epi16(x, k, h);
  else if constexpr (Stream)
    _mm256_stream_si256(static_cast<__m256i*>(x), h);  // x is 32-byte aligned
  else
    _mm256_storeu_si256(static_cast<__m256i*>(x), h);
}
/// to_bfloat16 on 16 lanes: NaN -> (bits >> 16) | 0x40, else round to nearest even.
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m256i to_bf16(__m512 a) {
  const __m512i x = _mm512_castps_si512(a);
  const __m512i hi = _mm512_srli_epi32(x, 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, bias), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
template <bool Masked, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void store(bfloat16* x, __m512 a, __mmask16 k) {
  store_half<Masked, Stream>(x, to_bf16(a), k);
}
template <bool Masked, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void store(float16* x, __m512 a, __mmask16 k) {
  store_half<Masked, Stream>(x, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), k);
}
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __mmask16 nonfinite(__m512 a) {
  const __m512i e = _mm512_set1_epi32(0x7f800000);
  return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), e), e);
}

// Stream: the copy-out (write-only, typically a pinned staging slot read by DMA) bypasses the
// caches: no read-for-ownership of its lines. p, m, v are read first, so they are stored normally.
/// Software prefetch distance in elements: keeps more misses in flight than the hardware
/// prefetchers alone while the divider is busy (measured: +15% for the Adam step, +1% for a
/// plain stream). Prefetches never fault, so running past the end of a range is harmless.
inline constexpr std::size_t prefetch_distance = 512;
template <class T>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void prefetch(const T* x) {
  _mm_prefetch(reinterpret_cast<const char*>(x + prefetch_distance), _MM_HINT_T0);
}
// One cache line of fp32 ahead for 16 elements of each stream.
template <class G>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void prefetch_adam(const float* p, const G* g, const float* m,
                                                             const float* v) {
  prefetch(p);
  prefetch(g);
  prefetch(m);
  prefetch(v);
}

/// The operations of `adam_update` on 16 lanes, in registers: p, m, v in, updated in place.
/// `Clamp`: the quotient m / denom is limited to [-*max_ratio, *max_ratio] (the 8-bit state's
/// bound, compact_math.hpp), a NaN quotient kept, as the scalar version.
template <bool Clamp = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void adam_core(__m512& pv, __m512 graw, __m512& mv, __m512& vv,
                                                         const constants& c, const __m512* max_ratio = nullptr) {
  __m512 gv = _mm512_mul_ps(graw, c.grad_scale);
  gv = _mm512_fmadd_ps(c.l2, pv, gv);
  mv = _mm512_fmadd_ps(c.beta1, mv, _mm512_mul_ps(c.omb1, gv));
  vv = _mm512_fmadd_ps(c.beta2, vv, _mm512_mul_ps(_mm512_mul_ps(c.omb2, gv), gv));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), c.inv_sqrt_bc2, c.eps);
  __m512 q = _mm512_div_ps(mv, denom);
  if constexpr (Clamp)  // min(R, q) then max(-R, .): a NaN q stays NaN (vrangeps would drop it)
    q = _mm512_max_ps(_mm512_xor_ps(*max_ratio, _mm512_set1_ps(-0.0f)), _mm512_min_ps(*max_ratio, q));
  pv = _mm512_sub_ps(pv, _mm512_fmadd_ps(c.step_size, q, _mm512_mul_ps(c.lr_wd, pv)));
}

template <bool Masked, class G, class O, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void adam_block(float* p, const G* g, float* m, float* v, O* out,
                                                          const constants& c, __mmask16 k) {
  __m512 pv = load<Masked>(p, k);
  __m512 mv = load<Masked>(m, k), vv = load<Masked>(v, k);
  adam_core(pv, load<Masked>(g, k), mv, vv, c);
  store<Masked>(p, pv, k);
  store<Masked>(m, mv, k);
  store<Masked>(v, vv, k);
  if constexpr (!std::is_same_v<O, no_output>) store<Masked, Stream>(out, pv, k);
}

template <class G, class O>
ZENFLOW_TARGET_AVX512 inline void adam_range(float* p, const G* g, float* m, float* v, O* out, std::size_t n,
                                             const adam_step_constants& sc) noexcept {
  const constants c = broadcast(sc);
  std::size_t i = 0;
  if constexpr (std::is_same_v<O, no_output>) {
    for (; i + 32 <= n; i += 32) {
      prefetch_adam(p + i, g + i, m + i, v + i);
      prefetch_adam(p + i + 16, g + i + 16, m + i + 16, v + i + 16);
      adam_block<false>(p + i, g + i, m + i, v + i, out, c, 0xffff);
      adam_block<false>(p + i + 16, g + i + 16, m + i + 16, v + i + 16, out, c, 0xffff);
    }
    for (; i + 16 <= n; i += 16) adam_block<false>(p + i, g + i, m + i, v + i, out, c, 0xffff);
    if (i < n) adam_block<true>(p + i, g + i, m + i, v + i, out, c, static_cast<__mmask16>((1u << (n - i)) - 1u));
  } else {
    // A masked head aligns the copy-out for streaming stores; then full streaming blocks; then a
    // masked tail. Every element goes through the same arithmetic whichever block holds it.
    constexpr std::size_t vector_bytes = 16 * sizeof(O);
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(out) % vector_bytes;  // multiple of sizeof(O)
    if (misalignment != 0 && n > 0) {
      i = std::min(n, (vector_bytes - misalignment) / sizeof(O));
      adam_block<true>(p, g, m, v, out, c, static_cast<__mmask16>((1u << i) - 1u));
    }
    for (; i + 32 <= n; i += 32) {
      prefetch_adam(p + i, g + i, m + i, v + i);
      prefetch_adam(p + i + 16, g + i + 16, m + i + 16, v + i + 16);
      adam_block<false, G, O, true>(p + i, g + i, m + i, v + i, out + i, c, 0xffff);
      adam_block<false, G, O, true>(p + i + 16, g + i + 16, m + i + 16, v + i + 16, out + i + 16, c, 0xffff);
    }
    for (; i + 16 <= n; i += 16) adam_block<false, G, O, true>(p + i, g + i, m + i, v + i, out + i, c, 0xffff);
    if (i < n) adam_block<true>(p + i, g + i, m + i, v + i, out + i, c, static_cast<__mmask16>((1u << (n - i)) - 1u));
    _mm_sfence();  // streaming stores are weakly ordered: make them visible before the pool's release
  }
}

template <bool Masked, bool Overwrite, class G>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __mmask16 accumulate_block(float* acc, const G* g, __m512 scale,
                                                                     __mmask16 k) {
  const __m512 a = _mm512_fmadd_ps(scale, load<Masked>(g, k), Overwrite ? _mm512_setzero_ps() : load<Masked>(acc, k));
  store<Masked>(acc, a, k);
  return nonfinite(a) & k;
}
template <bool Overwrite, class G>
ZENFLOW_TARGET_AVX512 inline bool accumulate_range(float* acc, const G* g, std::size_t n, float scale) noexcept {
  const __m512 s = _mm512_set1_ps(scale);
  __mmask16 bad = 0;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (!Overwrite) {
      prefetch(acc + i);
      prefetch(acc + i + 16);
    }
    prefetch(g + i);
    bad |= accumulate_block<false, Overwrite>(acc + i, g + i, s, 0xffff);
    bad |= accumulate_block<false, Overwrite>(acc + i + 16, g + i + 16, s, 0xffff);
  }
  for (; i < n; i += 16) {
    const std::size_t left = n - i;
    if (left >= 16)
      bad |= accumulate_block<false, Overwrite>(acc + i, g + i, s, 0xffff);
    else
      bad |= accumulate_block<true, Overwrite>(acc + i, g + i, s, static_cast<__mmask16>((1u << left) - 1u));
  }
  return bad != 0;
}
template <class G>
ZENFLOW_TARGET_AVX512 inline bool nonfinite_range(const G* g, std::size_t n, float scale) noexcept {
  const __m512 s = _mm512_set1_ps(scale);
  __mmask16 bad = 0;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) bad |= nonfinite(_mm512_mul_ps(load<false>(g + i, 0xffff), s));
  if (i < n) {
    const auto k = static_cast<__mmask16>((1u << (n - i)) - 1u);
    bad = static_cast<__mmask16>(bad | (nonfinite(_mm512_mul_ps(load<true>(g + i, k), s)) & k));
  }
  return bad != 0;
}
}  // namespace avx512

// ----------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: 8 floats per vector; the tail runs through a padded local block.
// ----------------------------------------------------------------------------------------------
namespace avx2 {
struct constants {
  __m256 beta1, beta2, omb1, omb2, eps, step_size, inv_sqrt_bc2, lr_wd, l2, grad_scale;
};
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE constants broadcast(const adam_step_constants& c) {
  return {_mm256_set1_ps(c.beta1),           _mm256_set1_ps(c.beta2), _mm256_set1_ps(c.one_minus_beta1),
          _mm256_set1_ps(c.one_minus_beta2), _mm256_set1_ps(c.eps),   _mm256_set1_ps(c.step_size),
          _mm256_set1_ps(c.inv_sqrt_bc2),    _mm256_set1_ps(c.lr_wd), _mm256_set1_ps(c.l2),
          _mm256_set1_ps(c.grad_scale)};
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE __m256 load(const float* x) {
  return _mm256_loadu_ps(x);
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE __m256 load(const bfloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE __m256 load(const float16* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void store(float* x, __m256 a) {
  _mm256_storeu_ps(x, a);
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void store(bfloat16* x, __m256 a) {
  const __m256i xi = _mm256_castps_si256(a);
  const __m256i hi = _mm256_srli_epi32(xi, 16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(xi, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(xi, bias), 16),
                                       _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(packed));
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void store(float16* x, __m256 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <class T>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void prefetch(const T* x) {
  _mm_prefetch(reinterpret_cast<const char*>(x + avx512::prefetch_distance), _MM_HINT_T0);
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE int nonfinite(__m256 a) {
  const __m256i e = _mm256_set1_epi32(0x7f800000);
  return _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(a), e), e));
}

/// The operations of `adam_update` on 8 lanes (see avx512::adam_core).
template <bool Clamp = false>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void adam_core(__m256& pv, __m256 graw, __m256& mv, __m256& vv,
                                                       const constants& c, const __m256* max_ratio = nullptr) {
  __m256 gv = _mm256_mul_ps(graw, c.grad_scale);
  gv = _mm256_fmadd_ps(c.l2, pv, gv);
  mv = _mm256_fmadd_ps(c.beta1, mv, _mm256_mul_ps(c.omb1, gv));
  vv = _mm256_fmadd_ps(c.beta2, vv, _mm256_mul_ps(_mm256_mul_ps(c.omb2, gv), gv));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), c.inv_sqrt_bc2, c.eps);
  __m256 q = _mm256_div_ps(mv, denom);
  if constexpr (Clamp)
    q = _mm256_max_ps(_mm256_xor_ps(*max_ratio, _mm256_set1_ps(-0.0f)), _mm256_min_ps(*max_ratio, q));
  pv = _mm256_sub_ps(pv, _mm256_fmadd_ps(c.step_size, q, _mm256_mul_ps(c.lr_wd, pv)));
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void adam_block(float* p, const G* g, float* m, float* v, O* out,
                                                        const constants& c) {
  __m256 pv = load(p);
  __m256 mv = load(m), vv = load(v);
  adam_core(pv, load(g), mv, vv, c);
  store(p, pv);
  store(m, mv);
  store(v, vv);
  if constexpr (!std::is_same_v<O, no_output>) store(out, pv);
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 inline void adam_range(float* p, const G* g, float* m, float* v, O* out, std::size_t n,
                                           const adam_step_constants& sc) noexcept {
  const constants c = broadcast(sc);
  const auto o = [out](std::size_t i) {
    if constexpr (std::is_same_v<O, no_output>)
      return out;
    else
      return out + i;
  };
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {  // one fp32 cache line of each stream per iteration
    prefetch(p + i), prefetch(g + i), prefetch(m + i), prefetch(v + i);
    adam_block(p + i, g + i, m + i, v + i, o(i), c);
    adam_block(p + i + 8, g + i + 8, m + i + 8, v + i + 8, o(i + 8), c);
  }
  for (; i + 8 <= n; i += 8) adam_block(p + i, g + i, m + i, v + i, o(i), c);
  if (i < n) {  // the same block on a zero-padded copy of the tail
    const std::size_t left = n - i;
    alignas(32) float tp[8] = {}, tm[8] = {}, tv[8] = {};
    G tg[8] = {};
    std::memcpy(tp, p + i, left * sizeof(float));
    std::memcpy(tm, m + i, left * sizeof(float));
    std::memcpy(tv, v + i, left * sizeof(float));
    std::memcpy(tg, g + i, left * sizeof(G));
    if constexpr (std::is_same_v<O, no_output>) {
      adam_block(tp, tg, tm, tv, out, c);
    } else {
      O to[8] = {};
      adam_block(tp, tg, tm, tv, to, c);
      std::memcpy(out + i, to, left * sizeof(O));
    }
    std::memcpy(p + i, tp, left * sizeof(float));
    std::memcpy(m + i, tm, left * sizeof(float));
    std::memcpy(v + i, tv, left * sizeof(float));
  }
}

template <bool Overwrite, class G>
ZENFLOW_TARGET_AVX2 inline bool accumulate_range(float* acc, const G* g, std::size_t n, float scale) noexcept {
  const __m256 s = _mm256_set1_ps(scale);
  int bad = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) {
      if constexpr (!Overwrite) prefetch(acc + i);
      prefetch(g + i);
    }
    const __m256 a = _mm256_fmadd_ps(s, load(g + i), Overwrite ? _mm256_setzero_ps() : load(acc + i));
    store(acc + i, a);
    bad |= nonfinite(a);
  }
  if (i < n) {
    const std::size_t left = n - i;
    alignas(32) float ta[8] = {};
    G tg[8] = {};
    if constexpr (!Overwrite) std::memcpy(ta, acc + i, left * sizeof(float));
    std::memcpy(tg, g + i, left * sizeof(G));
    const __m256 a = _mm256_fmadd_ps(s, load(tg), load(ta));
    store(ta, a);
    bad |= nonfinite(a) & static_cast<int>((1ull << (4 * left)) - 1u);
    std::memcpy(acc + i, ta, left * sizeof(float));
  }
  return bad != 0;
}
template <class G>
ZENFLOW_TARGET_AVX2 inline bool nonfinite_range(const G* g, std::size_t n, float scale) noexcept {
  const __m256 s = _mm256_set1_ps(scale);
  int bad = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) bad |= nonfinite(_mm256_mul_ps(load(g + i), s));
  if (i < n) {
    G tg[8] = {};
    std::memcpy(tg, g + i, (n - i) * sizeof(G));
    bad |= nonfinite(_mm256_mul_ps(load(tg), s));  // the zero padding is finite
  }
  return bad != 0;
}
}  // namespace avx2
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef ZENFLOW_SIMD_INLINE
#endif  // ZENFLOW_CPU_ADAM_X86

// ----------------------------------------------------------------------------------------------
// Dispatch: pick the instantiation for (isa, gradient type, output type) once per range.
// ----------------------------------------------------------------------------------------------
using adam_range_fn = void (*)(float*, const void*, float*, float*, void*, std::size_t, const adam_step_constants&);
using accumulate_range_fn = bool (*)(float*, const void*, std::size_t, float);
using nonfinite_range_fn = bool (*)(const void*, std::size_t, float);

template <cpu_isa Isa, class G, class O>
void adam_range_erased(float* p, const void* g, float* m, float* v, void* out, std::size_t n,
                       const adam_step_constants& c) noexcept {
  const G* gt = static_cast<const G*>(g);
  O* ot = nullptr;
  if constexpr (!std::is_same_v<O, no_output>) ot = static_cast<O*>(out);
  (void)out;
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) return avx512::adam_range(p, gt, m, v, ot, n, c);
  if constexpr (Isa == cpu_isa::avx2) return avx2::adam_range(p, gt, m, v, ot, n, c);
#endif
  adam_range_scalar(p, gt, m, v, ot, n, c);
}
template <cpu_isa Isa, bool Overwrite, class G>
bool accumulate_range_erased(float* acc, const void* g, std::size_t n, float scale) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512)
    return avx512::accumulate_range<Overwrite>(acc, static_cast<const G*>(g), n, scale);
  if constexpr (Isa == cpu_isa::avx2) return avx2::accumulate_range<Overwrite>(acc, static_cast<const G*>(g), n, scale);
#endif
  return accumulate_range_scalar<Overwrite>(acc, static_cast<const G*>(g), n, scale);
}
template <cpu_isa Isa, class G>
bool nonfinite_range_erased(const void* g, std::size_t n, float scale) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) return avx512::nonfinite_range(static_cast<const G*>(g), n, scale);
  if constexpr (Isa == cpu_isa::avx2) return avx2::nonfinite_range(static_cast<const G*>(g), n, scale);
#endif
  return nonfinite_range_scalar(static_cast<const G*>(g), n, scale);
}

/// A concrete path: `automatic` becomes the detected one; a path the build cannot hold
/// (non-x86) becomes scalar.
inline cpu_isa resolve_isa(cpu_isa isa) noexcept {
  if (isa == cpu_isa::automatic) return detect_cpu_isa();
#if !ZENFLOW_CPU_ADAM_X86
  return cpu_isa::scalar;
#else
  return isa;
#endif
}

template <cpu_isa Isa>
adam_range_fn select_adam_range_for(dtype g, bool has_out, dtype out) noexcept {
  return dispatch_dtype(g, [&](auto gt) -> adam_range_fn {
    using G = decltype(gt);
    if (!has_out) return &adam_range_erased<Isa, G, no_output>;
    return dispatch_dtype(out, [](auto ot) -> adam_range_fn { return &adam_range_erased<Isa, G, decltype(ot)>; });
  });
}

/// The Adam kernel for a gradient type and an optional copy-out type. `isa` must be concrete
/// and supported (see resolve_isa / cpu_isa_supported).
inline adam_range_fn select_adam_range(cpu_isa isa, dtype g, bool has_out, dtype out) noexcept {
  switch (isa) {
    case cpu_isa::avx512:
      return select_adam_range_for<cpu_isa::avx512>(g, has_out, out);
    case cpu_isa::avx2:
      return select_adam_range_for<cpu_isa::avx2>(g, has_out, out);
    default:
      return select_adam_range_for<cpu_isa::scalar>(g, has_out, out);
  }
}
/// `overwrite`: the range's first contribution, acc[i] = fma(scale, g[i], +0) without reading acc
/// (bit-identical to accumulating into zeros).
inline accumulate_range_fn select_accumulate_range(cpu_isa isa, dtype g, bool overwrite = false) noexcept {
  return dispatch_dtype(g, [&](auto gt) -> accumulate_range_fn {
    using G = decltype(gt);
    switch (isa) {
      case cpu_isa::avx512:
        return overwrite ? &accumulate_range_erased<cpu_isa::avx512, true, G>
                         : &accumulate_range_erased<cpu_isa::avx512, false, G>;
      case cpu_isa::avx2:
        return overwrite ? &accumulate_range_erased<cpu_isa::avx2, true, G>
                         : &accumulate_range_erased<cpu_isa::avx2, false, G>;
      default:
        return overwrite ? &accumulate_range_erased<cpu_isa::scalar, true, G>
                         : &accumulate_range_erased<cpu_isa::scalar, false, G>;
    }
  });
}
inline nonfinite_range_fn select_nonfinite_range(cpu_isa isa, dtype g) noexcept {
  return dispatch_dtype(g, [&](auto gt) -> nonfinite_range_fn {
    using G = decltype(gt);
    switch (isa) {
      case cpu_isa::avx512:
        return &nonfinite_range_erased<cpu_isa::avx512, G>;
      case cpu_isa::avx2:
        return &nonfinite_range_erased<cpu_isa::avx2, G>;
      default:
        return &nonfinite_range_erased<cpu_isa::scalar, G>;
    }
  });
}

/// The stateless Adam kernel over one contiguous range, single-threaded: p, m, v fp32 (in place),
/// g of type `g_type`, optional copy-out (out == nullptr: none) of type `out_type`. `isa`
/// `automatic` picks the detected path. Does not validate (see cpu_adam::step). Synchronous.
inline void cpu_adam_kernel(cpu_isa isa, float* p, const void* g, dtype g_type, float* m, float* v, void* out,
                            dtype out_type, std::size_t n, const adam_step_constants& c) noexcept {
  select_adam_range(resolve_isa(isa), g_type, out != nullptr, out_type)(p, g, m, v, out, n, c);
}

/// Stateless fused accumulate over one range: acc[i] = fma(scale, g[i], acc[i]) (`overwrite`:
/// fma(scale, g[i], +0), acc not read); returns true when a resulting element is not finite.
/// Single-threaded, synchronous.
inline bool cpu_accumulate_kernel(cpu_isa isa, float* acc, const void* g, dtype g_type, std::size_t n, float scale,
                                  bool overwrite = false) noexcept {
  return select_accumulate_range(resolve_isa(isa), g_type, overwrite)(acc, g, n, scale);
}

/// cpu_accumulate_kernel over `pool`: pieces of `chunk` elements (a range below two pieces runs on
/// the calling thread, no hand-off). Element-wise, so bit-identical for every pool size and chunk.
/// Returns true when a resulting element is not finite.
inline bool parallel_accumulate(thread_pool& pool, cpu_isa isa, std::size_t chunk, float* acc, const void* g,
                                dtype g_type, std::size_t n, float scale, bool overwrite) {
  const accumulate_range_fn fn = select_accumulate_range(resolve_isa(isa), g_type, overwrite);
  const std::size_t gsz = dtype_size(g_type);
  if (n < 2 * chunk || pool.size() == 1) return fn(acc, g, n, scale);
  std::atomic<bool> bad{false};
  pool.parallel_for((n + chunk - 1) / chunk, [&](std::size_t k) {
    const std::size_t lo = k * chunk, cnt = std::min(n, lo + chunk) - lo;
    if (fn(acc + lo, static_cast<const unsigned char*>(g) + lo * gsz, cnt, scale))
      bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

}  // namespace zenflow::detail
