// Run-time CPU feature detection (cpuid + xgetbv) and the target attributes of the SIMD paths.
//
// The SIMD functions are compiled with `__attribute__((target(...)))`, so the flags of the build
// machine do not matter: the paths exist in every x86-64 build and are chosen at run time.
#pragma once

#include <cstdint>
#include <string_view>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ZENFLOW_CPU_ADAM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define ZENFLOW_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define ZENFLOW_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")))
#else
#define ZENFLOW_CPU_ADAM_X86 0
#endif

namespace zenflow {

/// The instruction-set paths of the CPU Adam. `automatic` picks the best one the CPU supports.
enum class cpu_isa : std::uint8_t { automatic, scalar, avx2, avx512 };

/// "automatic", "scalar", "avx2" (AVX2 + FMA + F16C), "avx512" (AVX-512 F/BW/VL/DQ).
constexpr std::string_view cpu_isa_name(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::automatic:
      return "automatic";
    case cpu_isa::scalar:
      return "scalar";
    case cpu_isa::avx2:
      return "avx2";
    case cpu_isa::avx512:
      return "avx512";
  }
  return "unknown";
}

namespace detail {
inline cpu_isa detect_cpu_isa_uncached() noexcept {
#if ZENFLOW_CPU_ADAM_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return cpu_isa::scalar;
  const bool fma = (c >> 12) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u, f16c = (c >> 29) & 1u;
  if (!(osxsave && avx && fma && f16c)) return cpu_isa::scalar;
  unsigned xcr0_lo = 0;
  [[maybe_unused]] unsigned xcr0_hi = 0;  // the upper half holds no state we need
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_ymm = (xcr0_lo & 0x6u) == 0x6u;    // SSE and AVX state
  const bool os_zmm = (xcr0_lo & 0xe6u) == 0xe6u;  // plus opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_ymm) return cpu_isa::scalar;
  if (__get_cpuid_max(0, nullptr) < 7) return cpu_isa::scalar;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1u, bmi1 = (b >> 3) & 1u, bmi2 = (b >> 8) & 1u;
  const bool avx512f = (b >> 16) & 1u, avx512dq = (b >> 17) & 1u, avx512bw = (b >> 30) & 1u, avx512vl = (b >> 31) & 1u;
  if (!(avx2 && bmi1 && bmi2)) return cpu_isa::scalar;
  if (os_zmm && avx512f && avx512dq && avx512bw && avx512vl) return cpu_isa::avx512;
  return cpu_isa::avx2;
#else
  return cpu_isa::scalar;
#endif
}
}  // namespace detail

/// The best path this CPU and OS support (cpuid feature bits and the XCR0 register state).
/// Detected once per process (cpuid is slow under a hypervisor).
inline cpu_isa detect_cpu_isa() noexcept {
  static const cpu_isa best = detail::detect_cpu_isa_uncached();
  return best;
}

/// True when `isa` can run here (`automatic` and `scalar` always can).
inline bool cpu_isa_supported(cpu_isa isa) noexcept {
  const cpu_isa best = detect_cpu_isa();
  switch (isa) {
    case cpu_isa::automatic:
    case cpu_isa::scalar:
      return true;
    case cpu_isa::avx2:
      return best == cpu_isa::avx2 || best == cpu_isa::avx512;
    case cpu_isa::avx512:
      return best == cpu_isa::avx512;
  }
  return false;
}

}  // namespace zenflow
