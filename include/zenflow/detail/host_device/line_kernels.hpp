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
