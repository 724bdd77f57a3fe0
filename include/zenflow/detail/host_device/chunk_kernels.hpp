// The host sparse step's copies of a row's listed columns (a row-major parameter's selection) in
// 16-element chunks: a chunk is one masked load and a compress (gather into a contiguous f32 line)
// or an expand and one masked store (scatter back), on AVX-512, where line_kernels.hpp's gathers
// and scatters take an instruction per lane's cache line. The same bits as copy_line without a
// scale (the conversions are the CPU Adam's). Not a public header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::host_device {

/// A listed line of strictly ascending positions on a contiguous line (stride 1), as the 16-element
/// chunks of the line that hold listed elements: chunk [first, first + 16) holds `count` of them,
/// element first + e when bit e of `mask` is set, the first of them at position `pos` of the list.
/// The AVX-512 chunk copies load or store a chunk with one masked access and compress or expand its
/// lanes, where a gather or scatter would take an instruction per lane's cache line.
struct line_chunk {
  index_t pos = 0;
  std::int32_t first = 0;
  std::uint16_t mask = 0;
  std::uint16_t count = 0;
};

/// The chunks of the n-entry list `index` (strictly ascending, entries >= 0).
inline std::vector<line_chunk> make_line_chunks(const std::int32_t* index, index_t n) {
  std::vector<line_chunk> chunks;
  for (index_t q = 0; q < n; ++q) {
    const std::int32_t first = index[q] & ~std::int32_t{15};
    if (chunks.empty() || chunks.back().first != first) chunks.push_back({q, first, 0, 0});
    chunks.back().mask = static_cast<std::uint16_t>(chunks.back().mask | (1u << (index[q] - first)));
    ++chunks.back().count;
  }
  return chunks;
}

/// The chunk holding position q of a chunked list.
inline const line_chunk* chunk_at(const std::vector<line_chunk>& chunks, index_t q) noexcept {
  const auto after =
      std::upper_bound(chunks.begin(), chunks.end(), q, [](index_t x, const line_chunk& c) { return x < c.pos; });
  return chunks.data() + (after - chunks.begin()) - 1;
}

/// Copies positions [q0, q0 + n) of a chunked list (chunk `c` holds q0) between the listed line
/// and a contiguous f32 one: gather dst[q] = to_float(line[index[q0 + q]]), scatter
/// line[index[q0 + q]] = from_float(src[q]); copy_line's bits (no scale). A gather writes up to
/// 15 floats past dst[n - 1]: dst has room for n + 15.
using chunk_copy_fn = void (*)(const void* src, void* dst, const line_chunk* c, index_t q0, index_t n);

#if ZENFLOW_CPU_ADAM_X86
#define ZENFLOW_CHUNK_INLINE inline __attribute__((always_inline))
namespace avx512 {
namespace k = zenflow::detail::avx512;  // the CPU Adam's loads, stores and conversions

/// Calls fn(first, mask, q, count) for the chunks of positions [q0, q0 + n) from chunk c (which
/// holds q0): the chunk's first element, the mask of its positions in the range, the first one's
/// index in the range and how many there are.
template <class Fn>
ZENFLOW_TARGET_AVX512 ZENFLOW_CHUNK_INLINE void for_each_chunk(const line_chunk* c, index_t q0, index_t n, Fn&& fn) {
  std::uint32_t m = c->mask;
  for (index_t skip = q0 - c->pos; skip > 0; --skip) m &= m - 1;  // drop the listed elements before q0
  index_t count = c->count - (q0 - c->pos);
  for (index_t q = 0; q < n;) {
    if (count > n - q) m = _pdep_u32((1u << (n - q)) - 1u, m), count = n - q;  // the lowest n - q only
    fn(c->first, static_cast<__mmask16>(m), q, count);
    q += count;
    ++c;
    if (q < n) m = c->mask, count = c->count;
  }
}

// The two chunk copies, as function objects (nvcc drops a lambda's target attribute).
template <class S>
struct chunk_gather {
  const S* s;
  float* d;
  ZENFLOW_TARGET_AVX512 ZENFLOW_CHUNK_INLINE void operator()(std::int32_t first, __mmask16 m, index_t q,
                                                             index_t /*count*/) const {
    // A full store: a masked one would hold the next chunk's load until this one's data arrived
    // (memory disambiguation), one memory latency per chunk.
    _mm512_storeu_ps(d + q, _mm512_maskz_compress_ps(m, k::load<true>(s + first, m)));
  }
};
template <class D>
struct chunk_scatter {
  const float* s;
  D* d;
  ZENFLOW_TARGET_AVX512 ZENFLOW_CHUNK_INLINE void operator()(std::int32_t first, __mmask16 m, index_t q,
                                                             index_t count) const {
    const __m512 x = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), s + q);
    k::store<true>(d + first, _mm512_maskz_expand_ps(m, x), m);
  }
};

template <class S>
ZENFLOW_TARGET_AVX512 void gather_chunks(const void* src, void* dst, const line_chunk* c, index_t q0,
                                         index_t n) noexcept {
  for_each_chunk(c, q0, n, chunk_gather<S>{static_cast<const S*>(src), static_cast<float*>(dst)});
}
template <class D>
ZENFLOW_TARGET_AVX512 void scatter_chunks(const void* src, void* dst, const line_chunk* c, index_t q0,
                                          index_t n) noexcept {
  for_each_chunk(c, q0, n, chunk_scatter<D>{static_cast<const float*>(src), static_cast<D*>(dst)});
}
}  // namespace avx512
#undef ZENFLOW_CHUNK_INLINE
#endif  // ZENFLOW_CPU_ADAM_X86

/// The chunk copies (AVX-512 only: nullptr on the other paths, which gather and scatter): gather
/// from a listed line of `type` into f32, or scatter from f32 into it.
inline chunk_copy_fn select_chunk_copy(cpu_isa isa, dtype type, bool gather) noexcept {
#if ZENFLOW_CPU_ADAM_X86
  if (isa == cpu_isa::avx512)
    return dispatch_dtype(type, [&](auto t) -> chunk_copy_fn {
      using T = decltype(t);
      return gather ? &avx512::gather_chunks<T> : &avx512::scatter_chunks<T>;
    });
#endif
  (void)isa, (void)type, (void)gather;
  return nullptr;
}

}  // namespace zenflow::detail::host_device
