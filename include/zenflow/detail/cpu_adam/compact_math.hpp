// The per-element definitions of the compact CPU states (bf16 and blockwise 8-bit moments): the
// stochastic rounding's random bits, the bf16 and 8-bit codes, the 8-bit block scales and the
// bounded Adam quotient. The scalar kernels below are the reference that the AVX2 and AVX-512
// kernels (kernels_bf16.hpp, kernels_q8.hpp) reproduce bit for bit: every step is an integer
// operation or a single IEEE-rounded fp32 operation.
//
// Stochastic rounding. Rounding an exponential moving average to nearest every step freezes it:
// with beta2 = 0.999, v * beta2 is within half a bf16 ulp of v, so a v stored in bf16 never
// decays (and never grows unless g^2 exceeds v by ~2^8 / (1 - beta2)). Rounding up with
// probability equal to the fraction keeps the stored value unbiased, so the moving average moves
// as in fp32 on average. The random bits are a counter-based hash of (seed, tensor, step, element
// index): the same in every ISA, thread count and chunking, and reproducible from a checkpoint.
//
// 8-bit codes. An "offset float": code c = e * 8 + f (3 mantissa bits f, exponent e) stands for
// 2^(e - B) * (1 + f / 8) - 2^-B times the block's scale, so code 0 is exactly 0, codes below 8
// are linear steps of 2^-(B + 3), and a code step is at most (|x| + 2^-B) / 8 (1/8 to 1/16
// relative for the larger codes). Encoding is one fma (|x| * (1 / scale) + 2^-B) and integer
// arithmetic on its bits; decoding is integer arithmetic and one fma. m: sign bit + 7-bit
// magnitude (exponent 0..15, B = 15: the smallest step is 2^-18 of the largest code); v: 8-bit
// magnitude (exponent 0..31, B = 31: 2^-34). v's range is the square of m's, as v ~ g^2, m ~ g.
// A block's scale maps its largest |m| (largest v) onto the largest code, 1.875 - 2^-15 (1.875);
// the encode multiplier is rounded toward zero so that no code overflows.
//
// Bounded updates. A v that quantizes to 0 while m does not would make m / (sqrt(v) + eps)
// explode. Two guards: a positive v never encodes to 0 (it rounds up to the smallest code), and
// the quotient m / denom of the 8-bit path is clamped to the bound that exact Adam obeys for any
// history of gradients from zero moments, |m| / (sqrt(v) / sqrt(1 - beta2^t)) <= sqrt(C (1 - beta2^t))
// with C = (1 - beta1)^2 / ((1 - beta2) (1 - beta1^2 / beta2)) (Cauchy-Schwarz on the two moving
// averages; beta1 = 0.9, beta2 = 0.999: 7.27 once bias correction is 1). Exact Adam never reaches
// the clamp, so it changes nothing but a quantization excursion.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/detail/cpu_adam/state_format.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

// ----------------------------------------------------------------------------------------------
// Random bits of the stochastic rounding.
// ----------------------------------------------------------------------------------------------

/// splitmix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The key of one tensor's update at one step (the task's bias-correction step t).
constexpr std::uint64_t sr_task_key(std::uint64_t seed, std::uint64_t tensor, std::int64_t step) noexcept {
  return mix64(mix64(mix64(seed) ^ tensor) ^ static_cast<std::uint64_t>(step));
}

/// The 32-bit key of a sub-range of a task: an 8-bit block (sub = the block's index in the
/// tensor) or a 2^32-element range of a bf16 tensor (sub = element index >> 32).
constexpr std::uint32_t sr_range_key(std::uint64_t task_key, std::uint64_t sub) noexcept {
  return static_cast<std::uint32_t>(mix64(task_key + (sub + 1) * 0x9e3779b97f4a7c15ull) >> 32);
}

/// 32 random bits for position `pos` of a range with key `key`: s = pos * 0x10001 + key, each
/// 16-bit half of s multiplied by an odd constant modulo 2^16 (one 16-bit vector multiply). For a
/// given element the key is uniform from step to step, so the two halves of the result are
/// uniform and independent (s is uniform, and each half of the result is a bijection of the same
/// half of s); within a range each half is a Weyl sequence over the positions (evenly spread).
constexpr std::uint32_t sr_bits(std::uint32_t pos, std::uint32_t key) noexcept {
  const std::uint32_t s = pos * 0x10001u + key;
  return ((((s >> 16) * 0x79b9u) & 0xffffu) << 16) | (((s & 0xffffu) * 0x9e37u) & 0xffffu);
}
/// The vector form of sr_bits' multiplier: 0x79b9 for the upper halves, 0x9e37 for the lower.
inline constexpr std::uint32_t sr_multipliers = 0x79b99e37u;

// ----------------------------------------------------------------------------------------------
// bf16 moments.
// ----------------------------------------------------------------------------------------------

/// float -> bfloat16 rounding up with probability (dropped bits) / 2^16 given 16 uniform random
/// bits r16 (< 2^16); NaN as to_bfloat16 (quiet, sign kept), infinity stays, overflow to infinity.
ZENFLOW_FORCEINLINE bfloat16 to_bfloat16_sr(float f, std::uint32_t r16) noexcept {
  const std::uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bfloat16{static_cast<std::uint16_t>((x >> 16) | 0x0040u)};
  return bfloat16{static_cast<std::uint16_t>((x + r16) >> 16)};
}

/// The bf16 format holds m and v of an element in one 32-bit word: m's bf16 bits in the lower
/// half, v's in the upper (one load and one store per element, no narrowing shuffles).
ZENFLOW_FORCEINLINE float bf16_word_m(std::uint32_t w) noexcept {
  return bits_to_float(w << 16);
}
ZENFLOW_FORCEINLINE float bf16_word_v(std::uint32_t w) noexcept {
  return bits_to_float(w & 0xffff0000u);
}
/// m and v rounded stochastically with the upper (m) and lower (v) 16 bits of h = sr_bits(...).
ZENFLOW_FORCEINLINE std::uint32_t bf16_word(float m, float v, std::uint32_t h) noexcept {
  return to_bfloat16_sr(m, h >> 16).bits | (static_cast<std::uint32_t>(to_bfloat16_sr(v, h & 0xffffu).bits) << 16);
}
/// The same, rounded to nearest (import).
ZENFLOW_FORCEINLINE std::uint32_t bf16_word_nearest(float m, float v) noexcept {
  return to_bfloat16(m).bits | (static_cast<std::uint32_t>(to_bfloat16(v).bits) << 16);
}

// ----------------------------------------------------------------------------------------------
// 8-bit codes.
// ----------------------------------------------------------------------------------------------

inline constexpr std::uint32_t q8_m_base = (127u - 15u) << 23;  ///< fp32 bits of 2^-15 (m's offset)
inline constexpr std::uint32_t q8_v_base = (127u - 31u) << 23;  ///< fp32 bits of 2^-31 (v's offset)
inline constexpr float q8_m_offset = 0x1p-15f;
inline constexpr float q8_v_offset = 0x1p-31f;
/// The value of the largest code at scale 1: 1.875 - 2^-15 (m, exact) and 1.875 (v: 1.875 - 2^-31
/// rounded to fp32). A block's scale maps its largest magnitude onto it.
inline constexpr float q8_m_max = 1.875f - 0x1p-15f;
inline constexpr float q8_v_max = 1.875f;
/// A block whose largest |m| (or v) is below this is stored as zeros (its scale 0): keeps
/// 2^-31 * scale a normal float, so that code 0 decodes to exactly 0.
inline constexpr float q8_flush_below = 0x1p-90f;

/// Stochastic-rounding increments (20 bits, below a code's lowest bit) from sr_bits: m takes the
/// upper 20 bits, v the lower 20 (they share 8 low-order bits, which move a rounding probability
/// by at most 2^-12).
ZENFLOW_FORCEINLINE std::uint32_t q8_random_m(std::uint32_t h) noexcept {
  return h >> 12;
}
ZENFLOW_FORCEINLINE std::uint32_t q8_random_v(std::uint32_t h) noexcept {
  return h & 0xfffffu;
}
/// The increment that rounds bits(a) to the nearest code, ties to even.
ZENFLOW_FORCEINLINE std::uint32_t q8_nearest(float a) noexcept {
  return 0x7ffffu + ((float_to_bits(a) >> 20) & 1u);
}

/// Encode m with inv <= q8_m_max / the block's largest |m| (q8_make_scales; 0 for a flushed
/// block), so a = |x| * inv + 2^-15 <= 1.875 and the code, (bits(a) + r) / 2^20 - bits(2^-15) /
/// 2^20, is at most 127: its low 7 bits are (bits(a) + r) >> 20 (bits(2^-15) / 2^20 = 7 * 128).
/// The sign is x's sign bit. r: 20 random bits, or q8_nearest for round to nearest even.
ZENFLOW_FORCEINLINE std::uint8_t q8_encode_m(float x, float inv, std::uint32_t r, bool nearest = false) noexcept {
  const std::uint32_t bits = float_to_bits(x);
  const float a = fma_rn(bits_to_float(bits & 0x7fffffffu), inv, q8_m_offset);
  if (nearest) r = q8_nearest(a);
  return static_cast<std::uint8_t>((((float_to_bits(a) + r) >> 20) & 0x7fu) | ((bits >> 24) & 0x80u));
}
/// Encode v >= 0 with inv <= q8_v_max / the block's largest v: the code is the low byte of
/// (bits(a) + r) >> 20 (bits(2^-31) / 2^20 = 3 * 256). A positive v never encodes to 0.
ZENFLOW_FORCEINLINE std::uint8_t q8_encode_v(float x, float inv, std::uint32_t r, bool nearest = false) noexcept {
  const float a = fma_rn(x, inv, q8_v_offset);
  if (nearest) r = q8_nearest(a);
  const std::uint32_t c = ((float_to_bits(a) + r) >> 20) & 0xffu;
  return static_cast<std::uint8_t>(c == 0u && x > 0.0f ? 1u : c);
}
/// Decode with the block's scale d and nd = -(offset * d) (exact: d is 0, NaN or >= 2^-91).
ZENFLOW_FORCEINLINE float q8_decode_m(std::uint8_t c, float d, float nd) noexcept {
  const float mag = fma_rn(bits_to_float(((c & 0x7fu) << 20) + q8_m_base), d, nd);
  return bits_to_float(float_to_bits(mag) | ((c & 0x80u) << 24));
}
ZENFLOW_FORCEINLINE float q8_decode_v(std::uint8_t c, float d, float nd) noexcept {
  return fma_rn(bits_to_float((static_cast<std::uint32_t>(c) << 20) + q8_v_base), d, nd);
}

/// num / den rounded toward zero (num, den > 0 finite): the encode multiplier, so that the
/// largest element times it never exceeds the largest code.
inline float ratio_toward_zero(float num, float den) noexcept {
  const float q = num / den;
  return fma_rn(q, den, -num) > 0.0f ? bits_to_float(float_to_bits(q) - 1u) : q;
}

/// A block's scales from the bits of its largest |m| and largest v (as unsigned integers, so
/// NaN and infinity compare above every finite value).
struct q8_scales {
  float dm = 0, dv = 0;        ///< stored: decode multipliers
  float inv_m = 0, inv_v = 0;  ///< encode multipliers
  bool poisoned = false;       ///< a non-finite m or v: the block is stored as NaN (codes 0, scales NaN)
};
inline q8_scales q8_make_scales(std::uint32_t max_abs_m_bits, std::uint32_t max_v_bits) noexcept {
  q8_scales s;
  if (max_abs_m_bits >= 0x7f800000u || max_v_bits >= 0x7f800000u) {
    s.dm = s.dv = std::numeric_limits<float>::quiet_NaN();
    s.poisoned = true;
    return s;
  }
  const float am = bits_to_float(max_abs_m_bits), av = bits_to_float(max_v_bits);
  if (am >= q8_flush_below) s.dm = am / q8_m_max, s.inv_m = ratio_toward_zero(q8_m_max, am);
  if (av >= q8_flush_below) s.dv = av / q8_v_max, s.inv_v = ratio_toward_zero(q8_v_max, av);
  return s;
}

/// The bound of |m / denom| (see the top of this file): +infinity when exact Adam has none
/// (beta1^2 >= beta2), else sqrt(C * (1 - beta2^t)) (1 - beta2^t = 1 without bias correction)
/// widened by 2^-10 so that fp32 rounding of an exact-Adam state never meets it.
inline float adam_quotient_bound(const adam_options& o, std::int64_t step) noexcept {
  const double b1 = o.beta1, b2 = o.beta2;
  if (!(b2 > 0.0) || b1 * b1 >= b2) return std::numeric_limits<float>::infinity();
  const double c = (1.0 - b1) * (1.0 - b1) / ((1.0 - b2) * (1.0 - b1 * b1 / b2));
  const double bc2 = o.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
  return static_cast<float>(std::sqrt(c * bc2) * (1.0 + 0x1p-10));
}

/// adam_update with the quotient clamped to [-max_ratio, max_ratio]: the same operations in the
/// same order, the clamp written as the SIMD min/max evaluate it (a NaN quotient stays NaN).
/// With max_ratio = +infinity it is adam_update bit for bit.
ZENFLOW_FORCEINLINE void adam_update_bounded(float& p, float g_raw, float& m, float& v, const adam_step_constants& c,
                                             float max_ratio) noexcept {
  float g = mul_rn(g_raw, c.grad_scale);
  g = fma_rn(c.l2, p, g);
  m = fma_rn(c.beta1, m, mul_rn(c.one_minus_beta1, g));
  v = fma_rn(c.beta2, v, mul_rn(mul_rn(c.one_minus_beta2, g), g));
  const float denom = fma_rn(sqrt_rn(v), c.inv_sqrt_bc2, c.eps);
  float q = div_rn(m, denom);
  q = max_ratio < q ? max_ratio : q;
  q = -max_ratio > q ? -max_ratio : q;
  p = sub_rn(p, fma_rn(c.step_size, q, mul_rn(c.lr_wd, p)));
}

/// o + i, or the no-output tag unchanged.
template <class O>
ZENFLOW_FORCEINLINE O* offset(O* o, std::size_t i) noexcept {
  if constexpr (std::is_same_v<O, no_output>)
    return o;
  else
    return o + i;
}

/// What a compact-state step needs besides adam_step_constants.
struct compact_step_constants {
  std::uint64_t key = 0;                                     ///< sr_task_key(seed, tensor, step)
  float max_ratio = std::numeric_limits<float>::infinity();  ///< adam_quotient_bound (8-bit only)
};

// ----------------------------------------------------------------------------------------------
// Scalar reference kernels.
// ----------------------------------------------------------------------------------------------

/// bf16 moments over n elements whose first has tensor index pos0 + 2^32 * (the range's high
/// half, folded into key = sr_range_key): m, v decoded exactly, adam_update, stochastic rounding.
template <class G, class O>
inline void bf16_adam_range_scalar(float* p, const G* g, std::uint32_t* mv, O* out, std::size_t n,
                                   const adam_step_constants& c, std::uint32_t pos0, std::uint32_t key) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    float m = bf16_word_m(mv[i]), v = bf16_word_v(mv[i]);
    adam_update(p[i], to_float(g[i]), m, v, c);
    mv[i] = bf16_word(m, v, sr_bits(pos0 + static_cast<std::uint32_t>(i), key));
    if constexpr (!std::is_same_v<O, no_output>) out[i] = from_float<O>(p[i]);
  }
}

/// Encodes one block of new moments (sm, sv, n <= q8_block_rows) with stochastic rounding (key:
/// the block's sr_range_key) or to nearest (nearest = true), given the bits of its largest |m|
/// and v. Writes the codes and the block's scales.
inline void q8_encode_block(const float* sm, const float* sv, std::size_t n, std::uint32_t max_abs_m_bits,
                            std::uint32_t max_v_bits, std::uint32_t key, bool nearest, std::uint8_t* qm,
                            std::uint8_t* qv, float& dm, float& dv) noexcept {
  const q8_scales s = q8_make_scales(max_abs_m_bits, max_v_bits);
  dm = s.dm;
  dv = s.dv;
  for (std::size_t i = 0; i < n; ++i) {
    if (s.poisoned) {
      qm[i] = qv[i] = 0;
      continue;
    }
    const std::uint32_t h = sr_bits(static_cast<std::uint32_t>(i), key);
    qm[i] = q8_encode_m(sm[i], s.inv_m, q8_random_m(h), nearest);
    qv[i] = q8_encode_v(sv[i], s.inv_v, q8_random_v(h), nearest);
  }
}

/// Export and import of one 8-bit block of n <= q8_block_rows elements in fp32 (cpu_adam's
/// export_columns / import_columns, in RAM and on disk): the moments decoded with the block's
/// scales, or encoded to nearest with scales from their own largest values.
inline void q8_decode_block(const std::uint8_t* qm, const std::uint8_t* qv, float dm, float dv, std::size_t n, float* m,
                            float* v) noexcept {
  for (std::size_t i = 0; i < n; ++i)
    m[i] = q8_decode_m(qm[i], dm, -(q8_m_offset * dm)), v[i] = q8_decode_v(qv[i], dv, -(q8_v_offset * dv));
}
inline void q8_encode_block_nearest(const float* m, const float* v, std::size_t n, std::uint8_t* qm, std::uint8_t* qv,
                                    float& dm, float& dv) noexcept {
  std::uint32_t am = 0, av = 0;
  for (std::size_t i = 0; i < n; ++i)
    am = std::max(am, float_to_bits(m[i]) & 0x7fffffffu), av = std::max(av, float_to_bits(v[i]));
  q8_encode_block(m, v, n, am, av, 0, /*nearest=*/true, qm, qv, dm, dv);
}

/// One 8-bit block of n <= q8_block_rows elements: decode, bounded Adam, copy-out, re-encode
/// with stochastic rounding under the block's key.
template <class G, class O>
inline void q8_adam_block_scalar(float* p, const G* g, std::uint8_t* qm, std::uint8_t* qv, float& dm, float& dv, O* out,
                                 std::size_t n, const adam_step_constants& c, float max_ratio,
                                 std::uint32_t key) noexcept {
  float sm[q8_block_rows], sv[q8_block_rows];
  const float ndm = -(q8_m_offset * dm), ndv = -(q8_v_offset * dv);
  std::uint32_t am = 0, av = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float mf = q8_decode_m(qm[i], dm, ndm), vf = q8_decode_v(qv[i], dv, ndv);
    adam_update_bounded(p[i], to_float(g[i]), mf, vf, c, max_ratio);
    if constexpr (!std::is_same_v<O, no_output>) out[i] = from_float<O>(p[i]);
    sm[i] = mf;
    sv[i] = vf;
    am = std::max(am, float_to_bits(mf) & 0x7fffffffu);
    av = std::max(av, float_to_bits(vf));
  }
  q8_encode_block(sm, sv, n, am, av, key, false, qm, qv, dm, dv);
}

}  // namespace zenflow::detail
