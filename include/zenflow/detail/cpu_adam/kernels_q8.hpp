// The Adam step over blockwise 8-bit moments with an fp32 master
// (cpu_state_format::blockwise8_moments), in the scalar reference (compact_math.hpp), AVX2 and
// AVX-512 versions. Per block (up to q8_block_rows rows of one column): pass 1 decodes m and v,
// runs the bounded Adam (adam_core<true>, the quotient clamped), writes p and the copy-out, and
// keeps the new m and v in a stack buffer with their largest |m| and v; the block's scales follow
// (q8_make_scales, shared); pass 2 encodes with stochastic rounding from sr_bits. Every operation
// is an integer operation or a single IEEE-rounded fp32 operation, in the scalar order, so every
// version is bit-identical to the scalar one. Bytes per element: read p, g, m, v and write p, m,
// v: 4 + 4 + 1 + 1 + 4 + 1 + 1 = 16 (fp32 gradient), plus 16 bytes of scales per block.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zenflow/detail/cpu_adam/compact_math.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"

namespace zenflow::detail {

/// A run of consecutive 8-bit blocks of one tensor, in element order (the unit a pool task gets).
struct q8_run {
  float* p = nullptr;                ///< master of the run's first element
  const unsigned char* g = nullptr;  ///< gradient of the run's first element
  std::uint8_t* qm = nullptr;        ///< m codes of the run's first element
  std::uint8_t* qv = nullptr;        ///< v codes of the run's first element
  float* dm = nullptr;               ///< m scale of the run's first block
  float* dv = nullptr;               ///< v scale of the run's first block
  unsigned char* out = nullptr;      ///< copy-out of the run's first element, or nullptr
  std::size_t rows = 0;              ///< the tensor's rows (elements per column)
  std::size_t first_row = 0;         ///< row of the first block's first element
  std::size_t blocks = 0;            ///< blocks in the run
  std::uint64_t first_block = 0;     ///< index of the first block in the tensor (for its key)
};

/// cpu_adam on an SSD: calls fn(j, s, i, n) for each 8-bit block of a piece of tensor ts (a run of
/// whole blocks in one state-file block holding q8_per_block of them): j the block's index in the
/// tensor, s its scales' index in the state-file block, i its first element's place in the piece,
/// n its length.
template <class Tensor, class Piece, class Fn>
void for_each_q8_block(const Tensor& ts, const Piece& x, std::size_t q8_per_block, Fn&& fn) {
  const std::size_t first_scale = (x.block - ts.first_block) * q8_per_block;
  for (std::size_t i = 0; i < x.n;) {
    const std::size_t j = ts.q8_block_of(x.elem + i);
    const std::size_t n = std::min(x.n - i, ts.q8_block_start(j + 1) - (x.elem + i));
    fn(j, j - first_scale, i, n);
    i += n;
  }
}

template <class G, class O>
inline void q8_adam_run_scalar(const q8_run& r, const G* g, O* out, const adam_step_constants& c,
                               const compact_step_constants& k) noexcept {
  std::size_t row = r.first_row, off = 0;
  for (std::size_t b = 0; b < r.blocks; ++b) {  // blocks in element order; a column's last may be short
    const std::size_t n = std::min(q8_block_rows, r.rows - row);
    q8_adam_block_scalar(r.p + off, g + off, r.qm + off, r.qv + off, r.dm[b], r.dv[b], offset(out, off), n, c,
                         k.max_ratio, sr_range_key(k.key, r.first_block + b));
    off += n;
    row = row + n == r.rows ? 0 : row + n;
  }
}

#if ZENFLOW_CPU_ADAM_X86
#define ZENFLOW_SIMD_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, see kernels.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace avx512 {
struct q8_decoder {
  __m512 dm, ndm, dv, ndv;
};
/// c: the m codes sign-extended to 32 bits (bit 31 = the code's sign bit).
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512 q8_decode_m(__m512i c, __m512 d, __m512 nd) {
  const __m512i mag = _mm512_add_epi32(_mm512_srli_epi32(_mm512_slli_epi32(c, 25), 5), _mm512_set1_epi32(q8_m_base));
  const __m512i x = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(mag), d, nd));
  return _mm512_castsi512_ps(  // x | (c & sign bit)
      _mm512_ternarylogic_epi32(x, c, _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xf8));
}
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512 q8_decode_v(__m512i c, __m512 d, __m512 nd) {
  const __m512i x = _mm512_add_epi32(_mm512_slli_epi32(c, 20), _mm512_set1_epi32(q8_v_base));
  return _mm512_fmadd_ps(_mm512_castsi512_ps(x), d, nd);
}
/// 16 codes widened to 32 bits: sign-extended (m) or zero-extended (v).
template <bool Masked, bool Signed>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE __m512i load_codes(const std::uint8_t* x, __mmask16 k) {
  const __m128i b = Masked ? _mm_maskz_loadu_epi8(k, x) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

// Pass 1 on 16 lanes at element i of the block.
template <bool Masked, bool Stream, class G, class O>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void q8_pass1(float* p, const G* g, const std::uint8_t* qm,
                                                        const std::uint8_t* qv, O* out, float* sm, float* sv,
                                                        const constants& c, const q8_decoder& d, const __m512& bound,
                                                        __m512i& max_m, __m512i& max_v, __mmask16 k) {
  __m512 pv = load<Masked>(p, k);
  __m512 mv = q8_decode_m(load_codes<Masked, true>(qm, k), d.dm, d.ndm);
  __m512 vv = q8_decode_v(load_codes<Masked, false>(qv, k), d.dv, d.ndv);
  adam_core<true>(pv, load<Masked>(g, k), mv, vv, c, &bound);
  store<Masked>(p, pv, k);
  if constexpr (!std::is_same_v<O, no_output>) store<Masked, Stream>(out, pv, k);
  _mm512_storeu_ps(sm, mv);  // the stack buffer has a vector of slack
  _mm512_storeu_ps(sv, vv);
  // largest |m| and v as integers: NaN and infinity compare above every finite value
  max_m =
      _mm512_mask_max_epu32(max_m, k, max_m, _mm512_and_si512(_mm512_castps_si512(mv), _mm512_set1_epi32(0x7fffffff)));
  max_v = _mm512_mask_max_epu32(max_v, k, max_v, _mm512_castps_si512(vv));
}

// Pass 2 on 16 lanes: s = the lanes' sr_bits inputs (pos * 0x10001 + key).
template <bool Masked>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void q8_pass2(const float* sm, const float* sv, std::uint8_t* qm,
                                                        std::uint8_t* qv, __m512i s, __m512 inv_m, __m512 inv_v,
                                                        __mmask16 k) {
  const __m512 mn = _mm512_loadu_ps(sm), vn = _mm512_loadu_ps(sv);
  const __m512i h = _mm512_mullo_epi16(s, _mm512_set1_epi32(static_cast<int>(sr_multipliers)));
  const __m512i mb = _mm512_castps_si512(mn);
  const __m512 am = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(mb, _mm512_set1_epi32(0x7fffffff))), inv_m,
                                    _mm512_set1_ps(q8_m_offset));
  const __m512i ym = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(am), _mm512_srli_epi32(h, 12)), 20);
  // (ym & 0x7f) | ((sign bit >> 24) & 0x80): a bitwise select by the constant
  const __m512i cm = _mm512_ternarylogic_epi32(ym, _mm512_srli_epi32(mb, 24), _mm512_set1_epi32(0x7f), 0xe4);
  const __m512 av = _mm512_fmadd_ps(vn, inv_v, _mm512_set1_ps(q8_v_offset));
  __m512i cv =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(av), _mm512_and_si512(h, _mm512_set1_epi32(0xfffff))), 20);
  // a positive v: at least code 1 (768 + 1 before the low byte is taken)
  cv = _mm512_mask_max_epu32(cv, _mm512_cmp_ps_mask(vn, _mm512_setzero_ps(), _CMP_GT_OQ), cv, _mm512_set1_epi32(769));
  if constexpr (Masked) {  // vpmovdb keeps the low byte
    _mm512_mask_cvtepi32_storeu_epi8(qm, k, cm);
    _mm512_mask_cvtepi32_storeu_epi8(qv, k, cv);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qm), _mm512_cvtepi32_epi8(cm));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qv), _mm512_cvtepi32_epi8(cv));
  }
}

// One block of n <= q8_block_rows elements: pass 1, scales, pass 2 (see the top of this file).
template <class G, class O>
ZENFLOW_TARGET_AVX512 ZENFLOW_SIMD_INLINE void q8_block(float* p, const G* g, std::uint8_t* qm, std::uint8_t* qv,
                                                        float& dm, float& dv, O* o, std::size_t n, const constants& c,
                                                        const __m512& bound, std::uint32_t key, float* sm, float* sv) {
  constexpr bool has_out = !std::is_same_v<O, no_output>;
  const q8_decoder d{_mm512_set1_ps(dm), _mm512_set1_ps(-(q8_m_offset * dm)), _mm512_set1_ps(dv),
                     _mm512_set1_ps(-(q8_v_offset * dv))};
  __m512i max_m = _mm512_setzero_si512(), max_v = _mm512_setzero_si512();
  std::size_t i = 0;
  if constexpr (has_out) {  // a masked head aligns the copy-out for streaming stores
    const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(o) % (16 * sizeof(O));
    if (misalignment != 0) {
      i = std::min(n, (16 * sizeof(O) - misalignment) / sizeof(O));
      q8_pass1<true, false>(p, g, qm, qv, o, sm, sv, c, d, bound, max_m, max_v, static_cast<__mmask16>((1u << i) - 1u));
    }
  }
  for (; i + 16 <= n; i += 16) {
    prefetch(p + i), prefetch(g + i), prefetch(qm + i), prefetch(qv + i);
    q8_pass1<false, has_out>(p + i, g + i, qm + i, qv + i, offset(o, i), sm + i, sv + i, c, d, bound, max_m, max_v,
                             0xffff);
  }
  if (i < n)
    q8_pass1<true, false>(p + i, g + i, qm + i, qv + i, offset(o, i), sm + i, sv + i, c, d, bound, max_m, max_v,
                          static_cast<__mmask16>((1u << (n - i)) - 1u));
  const q8_scales s = q8_make_scales(_mm512_reduce_max_epu32(max_m), _mm512_reduce_max_epu32(max_v));
  dm = s.dm;
  dv = s.dv;
  if (s.poisoned) {
    std::memset(qm, 0, n);
    std::memset(qv, 0, n);
    return;
  }
  const __m512 inv_m = _mm512_set1_ps(s.inv_m), inv_v = _mm512_set1_ps(s.inv_v);
  __m512i sr =
      _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(0x10001)),
                       _mm512_set1_epi32(static_cast<int>(key)));
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16, sr = _mm512_add_epi32(sr, _mm512_set1_epi32(16 * 0x10001)))
    q8_pass2<false>(sm + j, sv + j, qm + j, qv + j, sr, inv_m, inv_v, 0xffff);
  if (j < n)
    q8_pass2<true>(sm + j, sv + j, qm + j, qv + j, sr, inv_m, inv_v, static_cast<__mmask16>((1u << (n - j)) - 1u));
}

template <class G, class O>
ZENFLOW_TARGET_AVX512 inline void q8_adam_run(const q8_run& r, const G* g, O* out, const adam_step_constants& sc,
                                              const compact_step_constants& k) noexcept {
  const constants c = broadcast(sc);
  const __m512 bound = _mm512_set1_ps(k.max_ratio);
  alignas(64) float sm[q8_block_rows + 16], sv[q8_block_rows + 16];
  std::size_t row = r.first_row, off = 0;
  for (std::size_t b = 0; b < r.blocks; ++b) {
    const std::size_t n = std::min(q8_block_rows, r.rows - row);
    q8_block(r.p + off, g + off, r.qm + off, r.qv + off, r.dm[b], r.dv[b], offset(out, off), n, c, bound,
             sr_range_key(k.key, r.first_block + b), sm, sv);
    off += n;
    row = row + n == r.rows ? 0 : row + n;
  }
  if constexpr (!std::is_same_v<O, no_output>) _mm_sfence();
}
}  // namespace avx512

namespace avx2 {
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE __m256i load_codes(const std::uint8_t* x) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void store_codes(std::uint8_t* x, __m256i c) {       // c: 8 lanes in [0, 255]
  const __m256i t = _mm256_packus_epi16(_mm256_packus_epi32(c, c), _mm256_setzero_si256());  // no saturation
  const std::uint64_t lo = static_cast<std::uint32_t>(_mm256_cvtsi256_si32(t));
  const std::uint64_t hi = static_cast<std::uint32_t>(_mm256_extract_epi32(t, 4));
  const std::uint64_t bytes = lo | (hi << 32);
  std::memcpy(x, &bytes, 8);
}
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE std::uint32_t reduce_max(__m256i x) {
  __m128i y = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  y = _mm_max_epu32(y, _mm_shuffle_epi32(y, 0x4e));
  y = _mm_max_epu32(y, _mm_shuffle_epi32(y, 0xb1));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(y));
}

// Pass 1 on 8 lanes (every lane valid: the caller pads the tail).
template <class G, class O>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void q8_pass1(float* p, const G* g, const std::uint8_t* qm,
                                                      const std::uint8_t* qv, O* out, float* sm, float* sv,
                                                      const constants& c, const __m256 (&d)[4], const __m256& bound,
                                                      __m256i& max_m, __m256i& max_v) {
  __m256 pv = load(p);
  const __m256i cm = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qm)));
  const __m256i cv = load_codes(qv);
  const __m256i mag = _mm256_add_epi32(_mm256_srli_epi32(_mm256_slli_epi32(cm, 25), 5), _mm256_set1_epi32(q8_m_base));
  __m256 mv = _mm256_or_ps(_mm256_fmadd_ps(_mm256_castsi256_ps(mag), d[0], d[1]),
                           _mm256_castsi256_ps(_mm256_and_si256(cm, _mm256_set1_epi32(static_cast<int>(0x80000000u)))));
  __m256 vv = _mm256_fmadd_ps(
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(cv, 20), _mm256_set1_epi32(q8_v_base))), d[2], d[3]);
  adam_core<true>(pv, load(g), mv, vv, c, &bound);
  store(p, pv);
  if constexpr (!std::is_same_v<O, no_output>) store(out, pv);
  _mm256_storeu_ps(sm, mv);
  _mm256_storeu_ps(sv, vv);
  max_m = _mm256_max_epu32(max_m, _mm256_and_si256(_mm256_castps_si256(mv), _mm256_set1_epi32(0x7fffffff)));
  max_v = _mm256_max_epu32(max_v, _mm256_castps_si256(vv));
}

ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void q8_pass2(const float* sm, const float* sv, __m256i& cm, __m256i& cv,
                                                      __m256i s, __m256 inv_m, __m256 inv_v) {
  const __m256 mn = _mm256_loadu_ps(sm), vn = _mm256_loadu_ps(sv);
  const __m256i h = _mm256_mullo_epi16(s, _mm256_set1_epi32(static_cast<int>(sr_multipliers)));
  const __m256i mb = _mm256_castps_si256(mn);
  const __m256 am = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(mb, _mm256_set1_epi32(0x7fffffff))), inv_m,
                                    _mm256_set1_ps(q8_m_offset));
  const __m256i ym = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(am), _mm256_srli_epi32(h, 12)), 20);
  cm = _mm256_or_si256(_mm256_and_si256(ym, _mm256_set1_epi32(0x7f)),
                       _mm256_and_si256(_mm256_srli_epi32(mb, 24), _mm256_set1_epi32(0x80)));
  const __m256 av = _mm256_fmadd_ps(vn, inv_v, _mm256_set1_ps(q8_v_offset));
  cv =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(av), _mm256_and_si256(h, _mm256_set1_epi32(0xfffff))), 20);
  cv = _mm256_max_epu32(cv, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(vn, _mm256_setzero_ps(), _CMP_GT_OQ)),
                                             _mm256_set1_epi32(769)));
  cv = _mm256_and_si256(cv, _mm256_set1_epi32(0xff));
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 ZENFLOW_SIMD_INLINE void q8_block(float* p, const G* g, std::uint8_t* qm, std::uint8_t* qv,
                                                      float& dm, float& dv, O* o, std::size_t n, const constants& c,
                                                      const __m256& bound, std::uint32_t key, float* sm, float* sv) {
  constexpr bool has_out = !std::is_same_v<O, no_output>;
  const __m256i iota = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256 d[4] = {_mm256_set1_ps(dm), _mm256_set1_ps(-(q8_m_offset * dm)), _mm256_set1_ps(dv),
                       _mm256_set1_ps(-(q8_v_offset * dv))};
  __m256i max_m = _mm256_setzero_si256(), max_v = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) prefetch(p + i), prefetch(g + i), prefetch(qm + i), prefetch(qv + i);
    q8_pass1(p + i, g + i, qm + i, qv + i, offset(o, i), sm + i, sv + i, c, d, bound, max_m, max_v);
  }
  if (i < n) {  // the same pass on a zero-padded copy of the tail; padding lanes stay out of the maxima
    const std::size_t left = n - i;
    alignas(32) float tp[8] = {};
    std::uint8_t tm[8] = {}, tv[8] = {};
    G tg[8] = {};
    std::memcpy(tp, p + i, left * sizeof(float));
    std::memcpy(tm, qm + i, left);
    std::memcpy(tv, qv + i, left);
    std::memcpy(tg, g + i, left * sizeof(G));
    __m256i tmax_m = _mm256_setzero_si256(), tmax_v = _mm256_setzero_si256();
    if constexpr (has_out) {
      O to[8] = {};
      q8_pass1(tp, tg, tm, tv, to, sm + i, sv + i, c, d, bound, tmax_m, tmax_v);
      std::memcpy(o + i, to, left * sizeof(O));
    } else {
      q8_pass1(tp, tg, tm, tv, o, sm + i, sv + i, c, d, bound, tmax_m, tmax_v);
    }
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), iota);
    max_m = _mm256_max_epu32(max_m, _mm256_and_si256(tmax_m, valid));
    max_v = _mm256_max_epu32(max_v, _mm256_and_si256(tmax_v, valid));
    std::memcpy(p + i, tp, left * sizeof(float));
  }
  const q8_scales s = q8_make_scales(reduce_max(max_m), reduce_max(max_v));
  dm = s.dm;
  dv = s.dv;
  if (s.poisoned) {
    std::memset(qm, 0, n);
    std::memset(qv, 0, n);
    return;
  }
  const __m256 inv_m = _mm256_set1_ps(s.inv_m), inv_v = _mm256_set1_ps(s.inv_v);
  __m256i sr =
      _mm256_add_epi32(_mm256_mullo_epi32(iota, _mm256_set1_epi32(0x10001)), _mm256_set1_epi32(static_cast<int>(key)));
  for (std::size_t j = 0; j < n; j += 8, sr = _mm256_add_epi32(sr, _mm256_set1_epi32(8 * 0x10001))) {
    __m256i cm, cv;
    q8_pass2(sm + j, sv + j, cm, cv, sr, inv_m, inv_v);
    if (j + 8 <= n) {
      store_codes(qm + j, cm);
      store_codes(qv + j, cv);
    } else {
      std::uint8_t tm[8], tv[8];
      store_codes(tm, cm);
      store_codes(tv, cv);
      std::memcpy(qm + j, tm, n - j);
      std::memcpy(qv + j, tv, n - j);
    }
  }
}

template <class G, class O>
ZENFLOW_TARGET_AVX2 inline void q8_adam_run(const q8_run& r, const G* g, O* out, const adam_step_constants& sc,
                                            const compact_step_constants& k) noexcept {
  const constants c = broadcast(sc);
  const __m256 bound = _mm256_set1_ps(k.max_ratio);
  alignas(32) float sm[q8_block_rows + 8], sv[q8_block_rows + 8];
  std::size_t row = r.first_row, off = 0;
  for (std::size_t b = 0; b < r.blocks; ++b) {
    const std::size_t n = std::min(q8_block_rows, r.rows - row);
    q8_block(r.p + off, g + off, r.qm + off, r.qv + off, r.dm[b], r.dv[b], offset(out, off), n, c, bound,
             sr_range_key(k.key, r.first_block + b), sm, sv);
    off += n;
    row = row + n == r.rows ? 0 : row + n;
  }
}
}  // namespace avx2

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef ZENFLOW_SIMD_INLINE
#endif  // ZENFLOW_CPU_ADAM_X86

using q8_adam_run_fn = void (*)(const q8_run&, const adam_step_constants&, const compact_step_constants&);

template <cpu_isa Isa, class G, class O>
void q8_adam_run_erased(const q8_run& r, const adam_step_constants& c, const compact_step_constants& k) noexcept {
  const G* g = reinterpret_cast<const G*>(r.g);
  O* out = nullptr;
  if constexpr (!std::is_same_v<O, no_output>) out = reinterpret_cast<O*>(r.out);
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) return avx512::q8_adam_run(r, g, out, c, k);
  if constexpr (Isa == cpu_isa::avx2) return avx2::q8_adam_run(r, g, out, c, k);
#endif
  q8_adam_run_scalar(r, g, out, c, k);
}

template <cpu_isa Isa>
q8_adam_run_fn select_q8_adam_run_for(dtype g, bool has_out, dtype out) noexcept {
  return dispatch_dtype(g, [&](auto gt) -> q8_adam_run_fn {
    using G = decltype(gt);
    if (!has_out) return &q8_adam_run_erased<Isa, G, no_output>;
    return dispatch_dtype(out, [](auto ot) -> q8_adam_run_fn { return &q8_adam_run_erased<Isa, G, decltype(ot)>; });
  });
}

/// The 8-bit kernel for a concrete, supported `isa`, a gradient type and an optional copy-out type.
inline q8_adam_run_fn select_q8_adam_run(cpu_isa isa, dtype g, bool has_out, dtype out) noexcept {
  switch (isa) {
    case cpu_isa::avx512:
      return select_q8_adam_run_for<cpu_isa::avx512>(g, has_out, out);
    case cpu_isa::avx2:
      return select_q8_adam_run_for<cpu_isa::avx2>(g, has_out, out);
    default:
      return select_q8_adam_run_for<cpu_isa::scalar>(g, has_out, out);
  }
}

}  // namespace zenflow::detail
