// The per-element Adam/AdamW math: one definition shared by the CPU optimizer (scalar and SIMD
// paths reproduce exactly this operation order), the GPU kernels and the tests.
//
// Per element, with c = adam_step_constants for step t:
//   g  = g_raw * grad_scale
//   g  = fma(l2, p, g)                          (Adam's L2 decay; l2 = 0 for AdamW)
//   m  = fma(beta1, m, (1 - beta1) * g)
//   v  = fma(beta2, v, ((1 - beta2) * g) * g)
//   d  = fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)
//   p  = p - fma(lr / (1 - beta1^t), m / d, (lr * wd) * p)   (lr * wd = 0 for Adam)
// The whole change of p is formed first and p is rounded once per step. The decoupled decay is
// (lr*wd)*p, not p * (1 - lr*wd): the float nearest to 1 - 1e-5 is off by up to 0.6% of the decay.
// Every operation is a single IEEE-rounded fp32 operation (fma, sqrt and division included), so
// any implementation that keeps this order is bit-identical to every other.
//
// The one rule on fused multiply-adds, which every implementation of zenflow's element math
// follows (this file, the CPU Adam's scalar and SIMD kernels, the host backend's device work, the
// CUDA kernels):
//   - a product is fused with an addition exactly where the definition says fma: fma_rn on the
//     host and the device, _mm*_fmadd_ps in the SIMD kernels;
//   - every other product is rounded on its own: mul_rn (__fmul_rn on the device, which nvcc never
//     contracts), _mm*_mul_ps. Such a product is never the operand of a plain addition or
//     subtraction that a compiler could contract with it (-ffp-contract=fast on an FMA target, or
//     nvcc's default --fmad=true): it is an fma's addend, a factor, a conversion's input, or stored;
//   - the one exception is a product that is exact, so that fusing it cannot change a bit: the
//     gradient statistics add g*g in double, where the square of a float is exact (24 significant
//     bits squared fit in 53), so sum + g*g and fma(g, g, sum) are the same value.
// A build may therefore target FMA (or not) without changing a result. The host build does not
// target it (-march is left to the user): std::fma is then the libm call, which the SIMD paths
// reproduce with their fused instructions.
#pragma once

#include <cmath>
#include <cstdint>

#include "zenflow/config.hpp"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

/// The scalar constants of one Adam step, computed in double and rounded once to float.
struct adam_step_constants {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float one_minus_beta1 = 0.1f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float step_size = 1e-3f;    ///< lr / (1 - beta1^t)   (lr without bias correction)
  float inv_sqrt_bc2 = 1.0f;  ///< 1 / sqrt(1 - beta2^t) (1 without bias correction)
  float lr_wd = 0.0f;         ///< lr * weight_decay for AdamW, 0 for Adam
  float l2 = 0.0f;            ///< weight_decay for Adam (L2), 0 for AdamW
  float grad_scale = 1.0f;    ///< multiplies the raw gradient (1/accumulation count, unscale, clip)
};

/// The first bias correction, 1 - beta1^t (1 without bias correction), in double.
ZENFLOW_HOST_DEVICE inline double adam_bias_correction1(const adam_options& o, std::int64_t step) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  using ::pow;
#else
  using std::pow;
#endif
  return o.bias_correction ? 1.0 - pow(static_cast<double>(o.beta1), static_cast<double>(step)) : 1.0;
}

/// Sets the constants that depend on the learning rate and the weight decay (parameter groups
/// differ in these only), from the first bias correction `bc1`.
ZENFLOW_HOST_DEVICE inline void set_lr_and_weight_decay(adam_step_constants& c, bool adamw_mode, float lr,
                                                        float weight_decay, double bc1) noexcept {
  c.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  c.lr_wd = adamw_mode ? static_cast<float>(static_cast<double>(lr) * weight_decay) : 0.0f;
  c.l2 = adamw_mode ? 0.0f : weight_decay;
}

/// make_adam_step_constants without validation, callable in device code (the GPU sparse Adam
/// computes the bias corrections of each launch from its device-side step counter). The bias
/// corrections are computed in double and rounded once; CUDA's double pow may differ from glibc's
/// in the last bit, far below that rounding.
ZENFLOW_HOST_DEVICE inline adam_step_constants adam_step_constants_unchecked(const adam_options& o, std::int64_t step,
                                                                             float grad_scale) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  using ::pow;
  using ::sqrt;
#else
  using std::pow;
  using std::sqrt;
#endif
  adam_step_constants c;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(o.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(o.beta2));
  c.eps = o.eps;
  const double t = static_cast<double>(step);
  const double bc2 = o.bias_correction ? 1.0 - pow(static_cast<double>(o.beta2), t) : 1.0;
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / sqrt(bc2));
  set_lr_and_weight_decay(c, o.adamw_mode, o.lr, o.weight_decay, adam_bias_correction1(o, step));
  c.grad_scale = grad_scale;
  return c;
}

/// Constants for step `step` (1-based: the first update is step 1) and a gradient scale factor.
/// Throws `zenflow::error` for step < 1 or a non-finite / negative grad_scale; options are
/// validated too.
inline adam_step_constants make_adam_step_constants(const adam_options& o, std::int64_t step, float grad_scale = 1.0f) {
  o.validate();
  expects(step >= 1, "step", "must be >= 1 (1-based), got ", step);
  expects(std::isfinite(grad_scale) && grad_scale >= 0.0f, "grad_scale", "must be finite and >= 0, got ", grad_scale);
  return adam_step_constants_unchecked(o, step, grad_scale);
}

namespace detail {
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float fma_rn(float a, float b, float c) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float mul_rn(float a, float b) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __fmul_rn(a, b);  // never contracted into an fma by the compiler
#else
  return a * b;
#endif
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float sub_rn(float a, float b) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float div_rn(float a, float b) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float sqrt_rn(float a) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
}  // namespace detail

/// True when x is neither NaN nor infinite (bit test: immune to -ffast-math).
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE bool is_finite_bits(float x) noexcept {
  return (detail::float_to_bits(x) & 0x7f800000u) != 0x7f800000u;
}

/// The gradient as the update sees it: raw * grad_scale (then L2 added inside adam_update).
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float scale_gradient(float g_raw, const adam_step_constants& c) noexcept {
  return detail::mul_rn(g_raw, c.grad_scale);
}

/// One element of Adam/AdamW, in place. The single source of truth for the update.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE void adam_update(float& p, float g_raw, float& m, float& v,
                                                         const adam_step_constants& c) noexcept {
  using detail::div_rn;
  using detail::fma_rn;
  using detail::mul_rn;
  using detail::sqrt_rn;
  using detail::sub_rn;
  float g = mul_rn(g_raw, c.grad_scale);
  g = fma_rn(c.l2, p, g);
  m = fma_rn(c.beta1, m, mul_rn(c.one_minus_beta1, g));
  v = fma_rn(c.beta2, v, mul_rn(mul_rn(c.one_minus_beta2, g), g));
  const float denom = fma_rn(sqrt_rn(v), c.inv_sqrt_bc2, c.eps);
  p = sub_rn(p, fma_rn(c.step_size, div_rn(m, denom), mul_rn(c.lr_wd, p)));
}

}  // namespace zenflow
