// The Adam step over bf16 moments with an fp32 master (cpu_state_format::bf16_moments), in the
// scalar reference (compact_math.hpp), AVX2 and AVX-512 versions: m and v (one 32-bit word per
// element, bf16_word) widened exactly, the operations of adam_update (the shared adam_core of
// kernels.hpp), then narrowed with stochastic rounding (to_bfloat16_sr). Gradient conversion,
// grad_scale and the copy-out reuse the fp32 kernels' loads and stores, so every version is
// bit-identical to the scalar one. A NaN moment (only from a NaN or infinite input) takes a
// rarely-taken branch that narrows it as to_bfloat16 does. Bytes per element: read p, g, m|v and
// write p, m|v: 4 + 4 + 4 + 4 + 4 = 20 (fp32 gradient).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zenflow/detail/cpu_adam/compact_math.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"

namespace zenflow::detail {

#if ZENFLOW_CPU_ADAM_X86
#define ZENFLOW_SIMD_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, see kernels.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace avx512 {
template <bool Masked>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512i load_words(const std::uint32_t* x, __mmask16 k) {
  if constexpr (Masked)
    return _mm512_maskz_loadu_epi32(k, x);
  else
    return _mm512_loadu_si512(x);
}

/// 16 elements; `s`: the lanes' sr_bits inputs ((pos0 + i + lane) * 0x10001 + key).
template <bool Masked, class G, class O, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void bf16_block(float* p, const G* g, std::uint32_t* mv, O* out,
                                                          const constants& c, __m512i s, __mmask16 k) {
  const __m512i w = load_words<Masked>(mv, k);
  __m512 pv = load<Masked>(p, k);
  __m512 m = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  __m512 v = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  adam_core(pv, load<Masked>(g, k), m, v, c);
  const __m512i h = _mm512_mullo_epi16(s, _mm512_set1_epi32(static_cast<int>(sr_multipliers)));
  const __m512i mb = _mm512_castps_si512(m), vb = _mm512_castps_si512(v);
  __m512i ym = _mm512_srli_epi32(_mm512_add_epi32(mb, _mm512_srli_epi32(h, 16)), 16);
  __m512i yv = _mm512_add_epi32(vb, _mm512_and_si512(h, _mm512_set1_epi32(0xffff)));
  const __mmask16 nan_m = _mm512_fpclass_ps_mask(m, 0x81), nan_v = _mm512_fpclass_ps_mask(v, 0x81);  // QNaN, SNaN
  if (nan_m | nan_v) [[unlikely]] {  // as to_bfloat16: the upper half with the quiet bit
    ym = _mm512_mask_mov_epi32(ym, nan_m, _mm512_or_si512(_mm512_srli_epi32(mb, 16), _mm512_set1_epi32(0x40)));
    yv = _mm512_mask_mov_epi32(yv, nan_v, _mm512_or_si512(vb, _mm512_set1_epi32(0x400000)));
  }
  // 0xffff0000 ? yv : ym, bit by bit
  const __m512i word = _mm512_ternarylogic_epi32(_mm512_set1_epi32(static_cast<int>(0xffff0000u)), yv, ym, 0xca);
  store<Masked>(p, pv, k);
  if constexpr (Masked)
    _mm512_mask_storeu_epi32(mv, k, word);
  else
    _mm512_storeu_si512(mv, word);
  if constexpr (!std::is_same_v<O, no_output>) store<Masked, Stream>(out, pv, k);
}

// The rounding keys of the 16 elements from i on (a function, not a lambda: nvcc's host pass drops
// a lambda's target attribute, and the intrinsics then fail to inline).
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512i lane_keys(__m512i lanes, std::size_t i) {
  return _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(i) * 0x10001u)));
}

template <class G, class O>
ZENFLOW_TARGET_AVX512 inline void bf16_adam_range(float* p, const G* g, std::uint32_t* mv, O* out, std::size_t n,
                                                  const adam_step_constants& sc, std::uint32_t pos0,
                                                  std::uint32_t key) noexcept {
  const constants c = broadcast(sc);
  const __m512i lanes =
      _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(0x10001)),
                       _mm512_set1_epi32(static_cast<int>(pos0 * 0x10001u + key)));
  std::size_t i = 0;
  constexpr bool has_out = !std::is_same_v<O, no_output>;
  if constexpr (has_out) {  // a masked head aligns the copy-out for streaming stores (see adam_range)
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(out) % (16 * sizeof(O));
    if (misalignment != 0 && n > 0) {
      i = std::min(n, (16 * sizeof(O) - misalignment) / sizeof(O));
      bf16_block<true>(p, g, mv, out, c, lane_keys(lanes, 0), static_cast<__mmask16>((1u << i) - 1u));
    }
  }
  for (; i + 32 <= n; i += 32) {
    prefetch(p + i), prefetch(p + i + 16), prefetch(g + i), prefetch(g + i + 16), prefetch(mv + i),
        prefetch(mv + i + 16);
    bf16_block<false, G, O, has_out>(p + i, g + i, mv + i, offset(out, i), c, lane_keys(lanes, i), 0xffff);
    bf16_block<false, G, O, has_out>(p + i + 16, g + i + 16, mv + i + 16, offset(out, i + 16), c,
                                     lane_keys(lanes, i + 16), 0xffff);
  }
  for (; i + 16 <= n; i += 16)
    bf16_block<false, G, O, has_out>(p + i, g + i, mv + i, offset(out, i), c, lane_keys(lanes, i), 0xffff);
  if (i < n)
    bf16_block<true>(p + i, g + i, mv + i, offset(out, i), c, lane_keys(lanes, i),
                     static_cast<__mmask16>((1u << (n - i)) - 1u));
  if constexpr (has_out) _mm_sfence();
}
}  // namespace avx512

namespace avx2 {
template <class G, class O>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void bf16_block(float* p, const G* g, std::uint32_t* mv, O* out,
                                                        const constants& c, __m256i s) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mv));
  __m256 pv = load(p);
  __m256 m = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  __m256 v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  adam_core(pv, load(g), m, v, c);
  const __m256i h = _mm256_mullo_epi16(s, _mm256_set1_epi32(static_cast<int>(sr_multipliers)));
  const __m256i mb = _mm256_castps_si256(m), vb = _mm256_castps_si256(v);
  __m256i ym = _mm256_srli_epi32(_mm256_add_epi32(mb, _mm256_srli_epi32(h, 16)), 16);
  __m256i yv = _mm256_add_epi32(vb, _mm256_and_si256(h, _mm256_set1_epi32(0xffff)));
  const __m256 nan_m = _mm256_cmp_ps(m, m, _CMP_UNORD_Q), nan_v = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(_mm256_or_ps(nan_m, nan_v)) != 0) [[unlikely]] {
    ym = _mm256_blendv_epi8(ym, _mm256_or_si256(_mm256_srli_epi32(mb, 16), _mm256_set1_epi32(0x40)),
                            _mm256_castps_si256(nan_m));
    yv = _mm256_blendv_epi8(yv, _mm256_or_si256(vb, _mm256_set1_epi32(0x400000)), _mm256_castps_si256(nan_v));
  }
  const __m256i word = _mm256_or_si256(ym, _mm256_and_si256(yv, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  store(p, pv);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(mv), word);
  if constexpr (!std::is_same_v<O, no_output>) store(out, pv);
}

// The rounding keys of the 8 elements from i on (see the AVX-512 lane_keys).
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE __m256i lane_keys(__m256i lanes, std::size_t i) {
  return _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(i) * 0x10001u)));
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 inline void bf16_adam_range(float* p, const G* g, std::uint32_t* mv, O* out, std::size_t n,
                                                const adam_step_constants& sc, std::uint32_t pos0,
                                                std::uint32_t key) noexcept {
  const constants c = broadcast(sc);
  const __m256i lanes =
      _mm256_add_epi32(_mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(0x10001)),
                       _mm256_set1_epi32(static_cast<int>(pos0 * 0x10001u + key)));
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch(p + i), prefetch(g + i), prefetch(mv + i);
    bf16_block(p + i, g + i, mv + i, offset(out, i), c, lane_keys(lanes, i));
    bf16_block(p + i + 8, g + i + 8, mv + i + 8, offset(out, i + 8), c, lane_keys(lanes, i + 8));
  }
  for (; i + 8 <= n; i += 8) bf16_block(p + i, g + i, mv + i, offset(out, i), c, lane_keys(lanes, i));
  if (i < n) {  // the same block on a zero-padded copy of the tail
    const std::size_t left = n - i;
    alignas(32) float tp[8] = {};
    std::uint32_t tmv[8] = {};
    G tg[8] = {};
    std::memcpy(tp, p + i, left * sizeof(float));
    std::memcpy(tmv, mv + i, left * sizeof(std::uint32_t));
    std::memcpy(tg, g + i, left * sizeof(G));
    if constexpr (std::is_same_v<O, no_output>) {
      bf16_block(tp, tg, tmv, out, c, lane_keys(lanes, i));
    } else {
      O to[8] = {};
      bf16_block(tp, tg, tmv, to, c, lane_keys(lanes, i));
      std::memcpy(out + i, to, left * sizeof(O));
    }
    std::memcpy(p + i, tp, left * sizeof(float));
    std::memcpy(mv + i, tmv, left * sizeof(std::uint32_t));
  }
}
}  // namespace avx2

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef ZENFLOW_SIMD_INLINE
#endif  // ZENFLOW_CPU_ADAM_X86

/// The bf16-moment kernel over one range that does not cross a multiple of 2^32 elements:
/// pos0 = the low 32 bits of its first element's tensor index, key = sr_range_key(task key,
/// index >> 32).
using bf16_adam_range_fn = void (*)(float*, const void*, std::uint32_t*, void*, std::size_t, const adam_step_constants&,
                                    std::uint32_t, std::uint32_t);

template <cpu_isa Isa, class G, class O>
void bf16_adam_range_erased(float* p, const void* g, std::uint32_t* mv, void* out, std::size_t n,
                            const adam_step_constants& c, std::uint32_t pos0, std::uint32_t key) noexcept {
  const G* gt = static_cast<const G*>(g);
  O* ot = nullptr;
  if constexpr (!std::is_same_v<O, no_output>) ot = static_cast<O*>(out);
  (void)out;
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) return avx512::bf16_adam_range(p, gt, mv, ot, n, c, pos0, key);
  if constexpr (Isa == cpu_isa::avx2) return avx2::bf16_adam_range(p, gt, mv, ot, n, c, pos0, key);
#endif
  bf16_adam_range_scalar(p, gt, mv, ot, n, c, pos0, key);
}

template <cpu_isa Isa>
bf16_adam_range_fn select_bf16_adam_range_for(dtype g, bool has_out, dtype out) noexcept {
  return dispatch_dtype(g, [&](auto gt) -> bf16_adam_range_fn {
    using G = decltype(gt);
    if (!has_out) return &bf16_adam_range_erased<Isa, G, no_output>;
    return dispatch_dtype(out,
                          [](auto ot) -> bf16_adam_range_fn { return &bf16_adam_range_erased<Isa, G, decltype(ot)>; });
  });
}

/// The bf16-moment kernel for a concrete, supported `isa`, a gradient type and an optional
/// copy-out type.
inline bf16_adam_range_fn select_bf16_adam_range(cpu_isa isa, dtype g, bool has_out, dtype out) noexcept {
  switch (isa) {
    case cpu_isa::avx512:
      return select_bf16_adam_range_for<cpu_isa::avx512>(g, has_out, out);
    case cpu_isa::avx2:
      return select_bf16_adam_range_for<cpu_isa::avx2>(g, has_out, out);
    default:
      return select_bf16_adam_range_for<cpu_isa::scalar>(g, has_out, out);
  }
}

}  // namespace zenflow::detail
