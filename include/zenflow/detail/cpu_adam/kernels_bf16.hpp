// The Adam step over bf16 moments with an fp32 master (cpu_state_format::bf16_moments), in the
// scalar reference (compact_math.hpp), AVX2 and AVX-512 versions: m and v widened exactly, the
// operations of adam_update (the shared adam_core of kernels.hpp), then m and v narrowed with
// stochastic rounding (to_bfloat16_sr). Gradient conversion, grad_scale and the copy-out reuse the
// fp32 kernels' loads and stores, so every version is bit-identical to the scalar one. Bytes per
// element: read p, g, m, v and write p, m, v: 4 + 4 + 2 + 2 + 4 + 2 + 2 = 20 (fp32 gradient).
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
/// to_bfloat16_sr on 16 lanes, r16: 16 random bits per lane.
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m256i to_bf16_sr(__m512 a, __m512i r16) {
  const __m512i x = _mm512_castps_si512(a);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, r16), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

/// 16 elements; `pos`: pos0 + i + lane + key (the sr_bits input of each lane).
template <bool Masked, class G, class O, bool Stream = false>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void bf16_block(float* p, const G* g, bfloat16* m, bfloat16* v, O* out,
                                                          const constants& c, __m512i pos, __mmask16 k) {
  __m512 pv = load<Masked>(p, k), mv = load<Masked>(m, k), vv = load<Masked>(v, k);
  adam_core(pv, load<Masked>(g, k), mv, vv, c);
  const __m512i h = _mm512_mullo_epi32(pos, _mm512_set1_epi32(static_cast<int>(0x9e3779b1u)));
  store<Masked>(p, pv, k);
  store_half<Masked>(m, to_bf16_sr(mv, _mm512_srli_epi32(h, 16)), k);
  store_half<Masked>(v, to_bf16_sr(vv, _mm512_and_si512(h, _mm512_set1_epi32(0xffff))), k);
  if constexpr (!std::is_same_v<O, no_output>) store<Masked, Stream>(out, pv, k);
}

template <class G, class O>
ZENFLOW_TARGET_AVX512 inline void bf16_adam_range(float* p, const G* g, bfloat16* m, bfloat16* v, O* out, std::size_t n,
                                                  const adam_step_constants& sc, std::uint32_t pos0,
                                                  std::uint32_t key) noexcept {
  const constants c = broadcast(sc);
  const __m512i lanes = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(pos0 + key)));
  std::size_t i = 0;
  constexpr bool has_out = !std::is_same_v<O, no_output>;
  if constexpr (has_out) {  // a masked head aligns the copy-out for streaming stores (see adam_range)
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(out) % (16 * sizeof(O));
    if (misalignment != 0 && n > 0) {
      i = std::min(n, (16 * sizeof(O) - misalignment) / sizeof(O));
      bf16_block<true>(p, g, m, v, out, c, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(0))),
                       static_cast<__mmask16>((1u << i) - 1u));
    }
  }
  for (; i + 32 <= n; i += 32) {
    prefetch(p + i), prefetch(p + i + 16), prefetch(g + i), prefetch(g + i + 16);
    prefetch(m + i), prefetch(v + i);
    bf16_block<false, G, O, has_out>(p + i, g + i, m + i, v + i, offset(out, i), c,
                                     _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(i))), 0xffff);
    bf16_block<false, G, O, has_out>(p + i + 16, g + i + 16, m + i + 16, v + i + 16, offset(out, i + 16), c,
                                     _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(i + 16))), 0xffff);
  }
  for (; i + 16 <= n; i += 16)
    bf16_block<false, G, O, has_out>(p + i, g + i, m + i, v + i, offset(out, i), c,
                                     _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(i))), 0xffff);
  if (i < n)
    bf16_block<true>(p + i, g + i, m + i, v + i, offset(out, i), c,
                     _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(i))),
                     static_cast<__mmask16>((1u << (n - i)) - 1u));
  if constexpr (has_out) _mm_sfence();
}
}  // namespace avx512

namespace avx2 {
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE __m128i to_bf16_sr(__m256 a, __m256i r16) {
  const __m256i x = _mm256_castps_si256(a);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(x, r16), 16),
                                       _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void bf16_block(float* p, const G* g, bfloat16* m, bfloat16* v, O* out,
                                                        const constants& c, __m256i pos) {
  __m256 pv = load(p), mv = load(m), vv = load(v);
  adam_core(pv, load(g), mv, vv, c);
  const __m256i h = _mm256_mullo_epi32(pos, _mm256_set1_epi32(static_cast<int>(0x9e3779b1u)));
  store(p, pv);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(m), to_bf16_sr(mv, _mm256_srli_epi32(h, 16)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(v), to_bf16_sr(vv, _mm256_and_si256(h, _mm256_set1_epi32(0xffff))));
  if constexpr (!std::is_same_v<O, no_output>) store(out, pv);
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 inline void bf16_adam_range(float* p, const G* g, bfloat16* m, bfloat16* v, O* out, std::size_t n,
                                                const adam_step_constants& sc, std::uint32_t pos0,
                                                std::uint32_t key) noexcept {
  const constants c = broadcast(sc);
  const __m256i lanes =
      _mm256_add_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(static_cast<int>(pos0 + key)));
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch(p + i), prefetch(g + i), prefetch(m + i), prefetch(v + i);
    bf16_block(p + i, g + i, m + i, v + i, offset(out, i), c,
               _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(i))));
    bf16_block(p + i + 8, g + i + 8, m + i + 8, v + i + 8, offset(out, i + 8), c,
               _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(i + 8))));
  }
  for (; i + 8 <= n; i += 8)
    bf16_block(p + i, g + i, m + i, v + i, offset(out, i), c,
               _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(i))));
  if (i < n) {  // the same block on a zero-padded copy of the tail
    const std::size_t left = n - i;
    alignas(32) float tp[8] = {};
    bfloat16 tm[8] = {}, tv[8] = {};
    G tg[8] = {};
    std::memcpy(tp, p + i, left * sizeof(float));
    std::memcpy(tm, m + i, left * sizeof(bfloat16));
    std::memcpy(tv, v + i, left * sizeof(bfloat16));
    std::memcpy(tg, g + i, left * sizeof(G));
    if constexpr (std::is_same_v<O, no_output>) {
      bf16_block(tp, tg, tm, tv, out, c, _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(i))));
    } else {
      O to[8] = {};
      bf16_block(tp, tg, tm, tv, to, c, _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(i))));
      std::memcpy(out + i, to, left * sizeof(O));
    }
    std::memcpy(p + i, tp, left * sizeof(float));
    std::memcpy(m + i, tm, left * sizeof(bfloat16));
    std::memcpy(v + i, tv, left * sizeof(bfloat16));
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
using bf16_adam_range_fn = void (*)(float*, const void*, bfloat16*, bfloat16*, void*, std::size_t,
                                    const adam_step_constants&, std::uint32_t, std::uint32_t);

template <cpu_isa Isa, class G, class O>
void bf16_adam_range_erased(float* p, const void* g, bfloat16* m, bfloat16* v, void* out, std::size_t n,
                            const adam_step_constants& c, std::uint32_t pos0, std::uint32_t key) noexcept {
  const G* gt = static_cast<const G*>(g);
  O* ot = nullptr;
  if constexpr (!std::is_same_v<O, no_output>) ot = static_cast<O*>(out);
  (void)out;
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) return avx512::bf16_adam_range(p, gt, m, v, ot, n, c, pos0, key);
  if constexpr (Isa == cpu_isa::avx2) return avx2::bf16_adam_range(p, gt, m, v, ot, n, c, pos0, key);
#endif
  bf16_adam_range_scalar(p, gt, m, v, ot, n, c, pos0, key);
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
