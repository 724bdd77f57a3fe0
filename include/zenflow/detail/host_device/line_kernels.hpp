// The strided element copies of the host backend's "device" work: one line of a tensor (a row, a
// column, or a list of columns of a row) to another, converting between f32/bf16/f16 and
// optionally multiplying by a scale, in a scalar version and AVX2 and AVX-512 versions chosen at
// run time (the CPU Adam's dispatch and load/store conversions, detail/cpu_adam/). Not a public
// header.
//
// Every version computes, per element, exactly `from_float<D>(mul_rn(to_float(src), scale))`
// (without the product when unscaled): the conversions are exact or round to nearest even as
// types.hpp's, the product is one IEEE-rounded fp32 multiplication (never an addend: nothing to
// contract), so all versions are bit-identical. The SIMD versions reach strided elements with
// gather and scatter instructions; 16-bit elements are gathered as the aligned 32-bit words that
// hold them (an aligned word never crosses a page, so reading its other half cannot fault) and
// scattered one by one. They take 32-bit offsets: a line whose largest offset reaches
// `max_simd_offset` runs the scalar version (select_copy_line).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::host_device {

/// The positions q = 0, 1, ... of a line: element offset (index ? index[q] : q) * stride from the
/// line's first element.
struct line {
  const std::int32_t* index = nullptr;
  index_t stride = 1;
  [[nodiscard]] bool contiguous() const noexcept { return index == nullptr && stride == 1; }
  [[nodiscard]] index_t offset(index_t q) const noexcept { return (index != nullptr ? index[q] : q) * stride; }
};

/// Largest element offset (from a line's base) the SIMD versions take: byte offsets of 16-bit
/// elements, plus the alignment slack, stay below 2^31.
inline constexpr index_t max_simd_offset = (index_t{1} << 30) - 8;

/// Copies n elements: dst[ld.offset(q)] = D(src[ls.offset(q)] (* scale)).
using copy_line_fn = void (*)(const void* src, line ls, void* dst, line ld, index_t n, float scale);

template <class S, class D, bool Scale>
void copy_line_scalar(const void* src, line ls, void* dst, line ld, index_t n, float scale) noexcept {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  for (index_t q = 0; q < n; ++q) {
    float x = to_float(s[ls.offset(q)]);
    if constexpr (Scale) x = mul_rn(x, scale);
    d[ld.offset(q)] = from_float<D>(x);
  }
}

#if ZENFLOW_CPU_ADAM_X86
#define ZENFLOW_LINE_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, see kernels.hpp
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

/// The 16-bit bits of an element type (bfloat16, float16).
template <class T>
ZENFLOW_LINE_INLINE std::uint16_t& bits_of(T& x) noexcept {
  return x.bits;
}

namespace avx512 {
namespace k = zenflow::detail::avx512;  // the CPU Adam's loads, stores and conversions

ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE __m512i offsets(const line& l, index_t q, __mmask16 m) {
  const __m512i i = l.index != nullptr
                        ? _mm512_maskz_loadu_epi32(m, l.index + q)
                        : _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(q)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_mullo_epi32(i, _mm512_set1_epi32(static_cast<int>(l.stride)));
}

template <class G>
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE __m512 gather(const G* base, __m512i off, __mmask16 m) {
  if constexpr (std::is_same_v<G, float>) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, off, base, 4);
  } else {
    const auto a = reinterpret_cast<std::uintptr_t>(base);  // 2-byte aligned
    const __m512i bytes = _mm512_add_epi32(_mm512_add_epi32(off, off), _mm512_set1_epi32(static_cast<int>(a & 3u)));
    const __m512i words =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, _mm512_andnot_si512(_mm512_set1_epi32(3), bytes),
                                    reinterpret_cast<const void*>(a & ~std::uintptr_t{3}), 1);
    const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(2)), 3);
    const __m512i h = _mm512_and_si512(_mm512_srlv_epi32(words, shift), _mm512_set1_epi32(0xffff));
    if constexpr (std::is_same_v<G, bfloat16>)
      return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    else
      return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
  }
}

template <class T>
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE void scatter(T* base, __m512i off, __m512 x, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_i32scatter_ps(base, m, off, x, 4);  // lanes in order: a repeated offset keeps the last
  } else {
    alignas(32) std::uint16_t h[16];
    alignas(64) std::int32_t o[16];
    if constexpr (std::is_same_v<T, bfloat16>)
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), k::to_bf16(x));
    else
      _mm256_store_si256(reinterpret_cast<__m256i*>(h),
                         _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm512_store_si512(o, off);
    for (unsigned left = m; left != 0; left &= left - 1) {
      const int i = __builtin_ctz(left);
      bits_of(base[o[i]]) = h[i];
    }
  }
}

template <bool Masked, class S, class D, bool Scale>
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE void copy16(const S* s, const line& ls, D* d, const line& ld, index_t q,
                                                      __m512 scale, __mmask16 m) {
  __m512 x = ls.contiguous() ? k::load<Masked>(s + q, m) : gather(s, offsets(ls, q, m), m);
  if constexpr (Scale) x = _mm512_mul_ps(x, scale);
  if (ld.contiguous())
    k::store<Masked>(d + q, x, m);
  else
    scatter(d, offsets(ld, q, m), x, m);
}

template <class S, class D, bool Scale>
ZENFLOW_TARGET_AVX512 void copy_line(const void* src, line ls, void* dst, line ld, index_t n, float scale) noexcept {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  const __m512 sc = _mm512_set1_ps(scale);
  index_t q = 0;
  for (; q + 16 <= n; q += 16) copy16<false, S, D, Scale>(s, ls, d, ld, q, sc, 0xffff);
  if (q < n) copy16<true, S, D, Scale>(s, ls, d, ld, q, sc, static_cast<__mmask16>((1u << (n - q)) - 1u));
}

/// r[c] becomes column c of the 16 x 16 block whose row i was r[i].
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE void transpose(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

/// True when the 16 entries of `index` from its start are consecutive (or there is no index).
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE bool consecutive(const std::int32_t* index) {
  if (index == nullptr) return true;
  const __m512i i = _mm512_loadu_si512(index);
  const __m512i want = _mm512_add_epi32(_mm512_set1_epi32(index[0]),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpneq_epi32_mask(i, want) == 0;
}

/// How a tile reaches 16 listed entries of a row: consecutive (a plain load or store), within a
/// window of 32 elements from the first (two masked loads and a permutation; for a store, strictly
/// ascending: two masked expanding stores), or anywhere (a gather or a scatter).
struct listed16 {
  enum kind_t { run, window, spread } kind = run;
  __m512i off;               // entries - entry 0
  __mmask16 lo = 0, hi = 0;  // window: the lanes loaded or stored at entry 0 and entry 0 + 16
  int lo_count = 0;          // store window: entries that fall in the first 16 elements
};
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE listed16 classify(const std::int32_t* index, bool store) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  listed16 l;
  l.off = lanes;
  if (index == nullptr) return l;
  l.off = _mm512_sub_epi32(_mm512_loadu_si512(index), _mm512_set1_epi32(index[0]));
  if (_mm512_cmpneq_epi32_mask(l.off, lanes) == 0) return l;
  l.kind = listed16::spread;
  if (_mm512_cmpge_epu32_mask(l.off, _mm512_set1_epi32(32)) != 0) return l;  // negative or too far
  if (store) {
    const __m512i next = _mm512_permutexvar_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(1)), l.off);
    if ((_mm512_cmpgt_epi32_mask(next, l.off) & 0x7fff) != 0x7fff) return l;  // a repeat or out of order
    const auto bits =
        static_cast<std::uint32_t>(_mm512_reduce_or_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), l.off)));
    l.lo = static_cast<__mmask16>(bits & 0xffffu);
    l.hi = static_cast<__mmask16>(bits >> 16);
    l.lo_count = __builtin_popcount(bits & 0xffffu);
  } else {
    const int last = _mm512_reduce_max_epi32(l.off);
    l.lo = static_cast<__mmask16>(last >= 15 ? 0xffffu : (1u << (last + 1)) - 1u);
    l.hi = static_cast<__mmask16>(last >= 16 ? (1u << (last - 15)) - 1u : 0u);
  }
  l.kind = listed16::window;
  return l;
}

template <class S>
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE __m512 load_listed(const S* row, const listed16& l) {
  switch (l.kind) {
    case listed16::run:
      return k::load<false>(row, 0xffff);
    case listed16::window:
      return _mm512_permutex2var_ps(k::load<true>(row, l.lo), l.off, k::load<true>(row + 16, l.hi));
    default:
      return gather(row, l.off, 0xffff);
  }
}
template <class D>
ZENFLOW_TARGET_AVX512 ZENFLOW_LINE_INLINE void store_listed(D* row, __m512 x, const listed16& l) {
  switch (l.kind) {
    case listed16::run:
      k::store<false>(row, x, 0xffff);
      break;
    case listed16::window: {
      const __m512i rest = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(l.lo_count));
      k::store<true>(row, _mm512_maskz_expand_ps(l.lo, x), l.lo);
      k::store<true>(row + 16, _mm512_maskz_expand_ps(l.hi, _mm512_permutexvar_ps(rest, x)), l.hi);
      break;
    }
    default:
      scatter(row, l.off, x, 0xffff);  // lanes in order: a repeated entry keeps the last
  }
}

/// What transpose_tiles does with a transposed row: stores it (scaled by `scale` on load when
/// Scale), or, into an fp32 destination with no index, accumulates it as accumulate_range does
/// (fma(scale, x, dst); overwrite: fma(scale, x, +0), without reading dst).
enum class tile_store { plain, accumulate, overwrite };

template <class S, class D, bool Scale, tile_store Store = tile_store::plain>
ZENFLOW_TARGET_AVX512 void transpose_tiles(const void* src, index_t s_outer, const std::int32_t* s_index, void* dst,
                                           index_t d_outer, const std::int32_t* d_index, index_t outer, index_t inner,
                                           float scale) noexcept {
  static_assert(Store == tile_store::plain || (std::is_same_v<D, float> && !Scale));
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  const __m512 sc = _mm512_set1_ps(scale);
  // The source rows' span over the whole block (elements from a row's start), for prefetching.
  index_t span_lo = 0, span_hi = inner - 1;
  if (s_index != nullptr) {
    span_lo = *std::min_element(s_index, s_index + inner);
    span_hi = *std::max_element(s_index, s_index + inner);
  }
  const bool prefetch = span_hi - span_lo < 1024;
  // Blocks of 32 inner entries, each swept over every outer one: a destination row is written
  // 128 bytes at a time, in order; the source rows are prefetched whole on the first sweep (so
  // that memory serves them in long runs), and come from the cache on the next ones.
  for (index_t bb = 0; bb < inner; bb += 32) {
    const index_t b_end = std::min(inner, bb + 32);
    for (index_t a0 = 0; a0 < outer; a0 += 16) {
      if (prefetch && a0 + 32 < outer) {
        if (bb == 0)
          for (index_t a = a0 + 32; a < std::min(outer, a0 + 48); ++a)
            for (index_t e = span_lo; e <= span_hi + 15; e += 64 / static_cast<index_t>(sizeof(S)))
              _mm_prefetch(reinterpret_cast<const char*>(s + a * s_outer + e), _MM_HINT_T0);
        const index_t e = d_index != nullptr ? d_index[a0 + 32] : a0 + 32;
        for (index_t b = bb; b < b_end; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(d + b * d_outer + e), _MM_HINT_ET0);
      }
      const listed16 dl = classify(d_index != nullptr ? d_index + a0 : nullptr, true);
      D* d_base = d + (d_index != nullptr ? d_index[a0] : a0);
      for (index_t b0 = bb; b0 < b_end; b0 += 16) {
        const listed16 sl = classify(s_index != nullptr ? s_index + b0 : nullptr, false);
        const S* s_base = s + (s_index != nullptr ? s_index[b0] : b0);
        __m512 r[16];
        for (int a = 0; a < 16; ++a) {
          r[a] = load_listed(s_base + (a0 + a) * s_outer, sl);
          if constexpr (Scale) r[a] = _mm512_mul_ps(r[a], sc);
        }
        transpose(r);
        for (int b = 0; b < 16; ++b) {
          D* row = d_base + (b0 + b) * d_outer;
          if constexpr (Store == tile_store::plain)
            store_listed(row, r[b], dl);
          else if constexpr (Store == tile_store::overwrite)
            _mm512_storeu_ps(row, _mm512_fmadd_ps(sc, r[b], _mm512_setzero_ps()));
          else
            _mm512_storeu_ps(row, _mm512_fmadd_ps(sc, r[b], _mm512_loadu_ps(row)));
        }
      }
    }
  }
}
}  // namespace avx512

namespace avx2 {
namespace k = zenflow::detail::avx2;

ZENFLOW_TARGET_AVX2 ZENFLOW_LINE_INLINE __m256i offsets(const line& l, index_t q) {
  const __m256i i = l.index != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l.index + q))
                                       : _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(q)),
                                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_mullo_epi32(i, _mm256_set1_epi32(static_cast<int>(l.stride)));
}

template <class G>
ZENFLOW_TARGET_AVX2 ZENFLOW_LINE_INLINE __m256 gather(const G* base, __m256i off) {
  if constexpr (std::is_same_v<G, float>) {
    return _mm256_i32gather_ps(base, off, 4);
  } else {
    const auto a = reinterpret_cast<std::uintptr_t>(base);
    const __m256i bytes = _mm256_add_epi32(_mm256_add_epi32(off, off), _mm256_set1_epi32(static_cast<int>(a & 3u)));
    const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(a & ~std::uintptr_t{3}),
                                                 _mm256_andnot_si256(_mm256_set1_epi32(3), bytes), 1);
    const __m256i shift = _mm256_slli_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(2)), 3);
    const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(words, shift), _mm256_set1_epi32(0xffff));
    if constexpr (std::is_same_v<G, bfloat16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    } else {
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xd8);
      return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    }
  }
}

template <class T>
ZENFLOW_TARGET_AVX2 ZENFLOW_LINE_INLINE void scatter(T* base, __m256i off, __m256 x) {
  alignas(32) T v[8];
  alignas(32) std::int32_t o[8];
  k::store(v, x);  // the CPU Adam's narrowing store
  _mm256_store_si256(reinterpret_cast<__m256i*>(o), off);
  for (int i = 0; i < 8; ++i) base[o[i]] = v[i];  // in lane order: a repeated offset keeps the last
}

template <class S, class D, bool Scale>
ZENFLOW_TARGET_AVX2 void copy_line(const void* src, line ls, void* dst, line ld, index_t n, float scale) noexcept {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  const __m256 sc = _mm256_set1_ps(scale);
  const bool sc_contiguous = ls.contiguous(), dc_contiguous = ld.contiguous();
  index_t q = 0;
  for (; q + 8 <= n; q += 8) {
    __m256 x = sc_contiguous ? k::load(s + q) : gather(s, offsets(ls, q));
    if constexpr (Scale) x = _mm256_mul_ps(x, sc);
    if (dc_contiguous)
      k::store(d + q, x);
    else
      scatter(d, offsets(ld, q), x);
  }
  for (; q < n; ++q) {  // the tail: the scalar definition itself
    float x = to_float(s[ls.offset(q)]);
    if constexpr (Scale) x = mul_rn(x, scale);
    d[ld.offset(q)] = from_float<D>(x);
  }
}

/// r[c] becomes column c of the 8 x 8 block whose row i was r[i].
ZENFLOW_TARGET_AVX2 ZENFLOW_LINE_INLINE void transpose(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

/// The 8 floats at row + off[i] for offsets in [0, 16): the lanes with off < 8 from one load, the
/// others (`from_hi`) from a second at row + 8, masked to `hi_mask` (its lanes that may be read):
/// two loads and two permutes instead of a gather, which is slow on some x86 CPUs.
ZENFLOW_TARGET_AVX2 ZENFLOW_LINE_INLINE __m256 window(const float* row, __m256i off, __m256i hi_mask, __m256i from_hi) {
  const __m256 lo = _mm256_loadu_ps(row);
  const __m256 hi = _mm256_maskload_ps(row + 8, hi_mask);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, off), _mm256_permutevar8x32_ps(hi, off),
                          _mm256_castsi256_ps(from_hi));
}

ZENFLOW_TARGET_AVX2 ZENFLOW_LINE_INLINE bool consecutive(const std::int32_t* index) {
  if (index == nullptr) return true;
  const __m256i i = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index));
  const __m256i want = _mm256_add_epi32(_mm256_set1_epi32(index[0]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_movemask_epi8(_mm256_cmpeq_epi32(i, want)) == -1;
}

template <class S, class D, bool Scale>
ZENFLOW_TARGET_AVX2 void transpose_tiles(const void* src, index_t s_outer, const std::int32_t* s_index, void* dst,
                                         index_t d_outer, const std::int32_t* d_index, index_t outer, index_t inner,
                                         float scale) noexcept {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (index_t a0 = 0; a0 < outer; a0 += 8)
    for (index_t b0 = 0; b0 < inner; b0 += 8) {
      __m256 r[8];
      const bool s_run = consecutive(s_index != nullptr ? s_index + b0 : nullptr);
      const S* s_row = s + (s_index != nullptr ? s_index[b0] : b0);
      const __m256i s_off = s_run ? lanes
                                  : _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s_index + b0)),
                                                     _mm256_set1_epi32(s_index[b0]));
      // fp32 columns listed within 16 of the first, the largest at least 7 beyond it (a run with a
      // few columns left out): every element of row[0, largest] is in the matrix, so window()
      // reads no further than the gather would.
      bool s_window = false;
      __m256i hi_mask = _mm256_setzero_si256(), from_hi = hi_mask;
      if constexpr (std::is_same_v<S, float>) {
        if (!s_run) {
          std::int32_t least = 0, largest = 0;
          for (int j = 1; j < 8; ++j) {
            least = std::min(least, s_index[b0 + j] - s_index[b0]);
            largest = std::max(largest, s_index[b0 + j] - s_index[b0]);
          }
          s_window = least >= 0 && largest >= 7 && largest < 16;
          hi_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(largest - 7), lanes);  // lane k: 8 + k <= largest
          from_hi = _mm256_cmpgt_epi32(s_off, _mm256_set1_epi32(7));
        }
      }
      for (int a = 0; a < 8; ++a) {
        const S* row = s_row + (a0 + a) * s_outer;
        if constexpr (std::is_same_v<S, float>) {
          r[a] = s_run ? k::load(row) : s_window ? window(row, s_off, hi_mask, from_hi) : gather(row, s_off);
        } else {
          r[a] = s_run ? k::load(row) : gather(row, s_off);
        }
        if constexpr (Scale) r[a] = _mm256_mul_ps(r[a], sc);
      }
      transpose(r);
      const bool d_run = consecutive(d_index != nullptr ? d_index + a0 : nullptr);
      const index_t d_first = d_index != nullptr ? d_index[a0] : a0;
      const __m256i d_off = d_run ? lanes
                                  : _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d_index + a0)),
                                                     _mm256_set1_epi32(d_index[a0]));
      for (int b = 0; b < 8; ++b) {
        D* row = d + (b0 + b) * d_outer + d_first;
        if (d_run)
          k::store(row, r[b]);
        else
          scatter(row, d_off, r[b]);
      }
    }
}
}  // namespace avx2
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef ZENFLOW_LINE_INLINE
#endif  // ZENFLOW_CPU_ADAM_X86

template <cpu_isa Isa, class S, class D, bool Scale>
void copy_line_erased(const void* src, line ls, void* dst, line ld, index_t n, float scale) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512) return avx512::copy_line<S, D, Scale>(src, ls, dst, ld, n, scale);
  if constexpr (Isa == cpu_isa::avx2) return avx2::copy_line<S, D, Scale>(src, ls, dst, ld, n, scale);
#endif
  copy_line_scalar<S, D, Scale>(src, ls, dst, ld, n, scale);
}

/// Copies the whole tiles of an outer x inner block: source element (a, b) at
/// src + a * s_outer + (s_index ? s_index[b] : b) to destination element (b, a) at
/// dst + b * d_outer + (d_index ? d_index[a] : a) (elements), converting (and scaling) as
/// copy_line does: a transposition, 16 x 16 (AVX-512) or 8 x 8 (AVX2) at a time, the side with
/// an index gathered or scattered along its rows where the listed entries are not consecutive.
/// outer and inner are multiples of transpose_tile(isa); offsets stay below max_simd_offset.
using transpose_tiles_fn = void (*)(const void* src, index_t s_outer, const std::int32_t* s_index, void* dst,
                                    index_t d_outer, const std::int32_t* d_index, index_t outer, index_t inner,
                                    float scale);

/// The tile edge of a path's transposition (0: the path has none, as the scalar one).
constexpr index_t transpose_tile(cpu_isa isa) noexcept {
  return isa == cpu_isa::avx512 ? 16 : isa == cpu_isa::avx2 ? 8 : 0;
}

template <cpu_isa Isa, class S, class D, bool Scale>
void transpose_tiles_erased(const void* src, index_t s_outer, const std::int32_t* s_index, void* dst, index_t d_outer,
                            const std::int32_t* d_index, index_t outer, index_t inner, float scale) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if constexpr (Isa == cpu_isa::avx512)
    return avx512::transpose_tiles<S, D, Scale>(src, s_outer, s_index, dst, d_outer, d_index, outer, inner, scale);
  if constexpr (Isa == cpu_isa::avx2)
    return avx2::transpose_tiles<S, D, Scale>(src, s_outer, s_index, dst, d_outer, d_index, outer, inner, scale);
#endif
  (void)src, (void)s_outer, (void)s_index, (void)dst, (void)d_outer, (void)d_index, (void)outer, (void)inner,
      (void)scale;
}

/// The tile transposition of a path that has one (transpose_tile(isa) > 0).
inline transpose_tiles_fn select_transpose_tiles(cpu_isa isa, dtype src, dtype dst, bool scale) noexcept {
  return dispatch_dtype(src, [&](auto s) -> transpose_tiles_fn {
    return dispatch_dtype(dst, [&](auto d) -> transpose_tiles_fn {
      using S = decltype(s);
      using D = decltype(d);
      if (isa == cpu_isa::avx512)
        return scale ? &transpose_tiles_erased<cpu_isa::avx512, S, D, true>
                     : &transpose_tiles_erased<cpu_isa::avx512, S, D, false>;
      return scale ? &transpose_tiles_erased<cpu_isa::avx2, S, D, true>
                   : &transpose_tiles_erased<cpu_isa::avx2, S, D, false>;
    });
  });
}

/// acc(b, a) = fma(scale, src(a, b), acc(b, a)) for the whole tiles of an outer x inner block
/// (overwrite: fma(scale, src(a, b), +0)): transpose_tiles' source side (a list of its columns
/// allowed) into a compact fp32 accumulator, acc(b, a) at acc + b * acc_outer + a. The same bits
/// as transpose_tiles into a buffer of the source's type followed by accumulate_range, in one
/// pass. The AVX-512 path only (transpose_tile(cpu_isa::avx512) = 16); same preconditions as
/// transpose_tiles_fn.
using transpose_accumulate_fn = void (*)(const void* src, index_t s_outer, const std::int32_t* s_index, float* acc,
                                         index_t acc_outer, index_t outer, index_t inner, float scale);

template <class S, bool Overwrite>
void transpose_accumulate_erased(const void* src, index_t s_outer, const std::int32_t* s_index, float* acc,
                                 index_t acc_outer, index_t outer, index_t inner, float scale) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  constexpr auto store = Overwrite ? avx512::tile_store::overwrite : avx512::tile_store::accumulate;
  avx512::transpose_tiles<S, float, false, store>(src, s_outer, s_index, acc, acc_outer, nullptr, outer, inner, scale);
#else
  (void)src, (void)s_outer, (void)s_index, (void)acc, (void)acc_outer, (void)outer, (void)inner, (void)scale;
#endif
}

/// The one-pass transposing accumulate for a concrete path, or nullptr where the path has none
/// (every path but AVX-512: the caller transposes into a buffer and accumulates from it).
inline transpose_accumulate_fn select_transpose_accumulate(cpu_isa isa, dtype src, bool overwrite) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if (isa != cpu_isa::avx512) return nullptr;
  return dispatch_dtype(src, [&](auto s) -> transpose_accumulate_fn {
    using S = decltype(s);
    return overwrite ? &transpose_accumulate_erased<S, true> : &transpose_accumulate_erased<S, false>;
  });
#else
  (void)isa, (void)src, (void)overwrite;
  return nullptr;
#endif
}

template <cpu_isa Isa>
copy_line_fn select_copy_line_for(dtype src, dtype dst, bool scale) noexcept {
  return dispatch_dtype(src, [&](auto s) -> copy_line_fn {
    return dispatch_dtype(dst, [&](auto d) -> copy_line_fn {
      using S = decltype(s);
      using D = decltype(d);
      return scale ? &copy_line_erased<Isa, S, D, true> : &copy_line_erased<Isa, S, D, false>;
    });
  });
}

/// The line copy for a concrete path (resolve_isa), element types and scaling. `simd` false (an
/// offset may reach max_simd_offset) picks the scalar version.
inline copy_line_fn select_copy_line(cpu_isa isa, dtype src, dtype dst, bool scale, bool simd = true) noexcept {
  switch (simd ? isa : cpu_isa::scalar) {
    case cpu_isa::avx512:
      return select_copy_line_for<cpu_isa::avx512>(src, dst, scale);
    case cpu_isa::avx2:
      return select_copy_line_for<cpu_isa::avx2>(src, dst, scale);
    default:
      return select_copy_line_for<cpu_isa::scalar>(src, dst, scale);
  }
}

}  // namespace zenflow::detail::host_device
