// The benchmarks' settings from the environment: a value that is not a whole number in range ends
// the run at once with a message naming the variable (not an error from deep inside a component,
// after files were created, or a silently different setting).
#pragma once

#include <zenflow/detail/cpu_adam/isa.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace zenflow_bench {

/// The whole number in environment variable `name` (unset or empty: `fallback`), in [lo, hi].
inline std::uint64_t env_count(const char* name, std::uint64_t fallback, std::uint64_t lo = 0,
                               std::uint64_t hi = UINT64_MAX) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (*s == '-' || *end != '\0' || errno != 0 || v < lo || v > hi) {
    std::fprintf(stderr, "%s: must be a whole number in [%llu, %llu], got '%s'\n", name,
                 static_cast<unsigned long long>(lo), static_cast<unsigned long long>(hi), s);
    std::exit(2);
  }
  return v;
}

/// The SIMD path in ZENFLOW_BENCH_ISA (scalar, avx2 or avx512; unset or empty: `fallback`).
inline zenflow::cpu_isa env_isa(zenflow::cpu_isa fallback = zenflow::cpu_isa::automatic) {
  const char* s = std::getenv("ZENFLOW_BENCH_ISA");
  if (s == nullptr || *s == '\0') return fallback;
  const std::string_view v(s);
  if (v != "scalar" && v != "avx2" && v != "avx512") {
    std::fprintf(stderr, "ZENFLOW_BENCH_ISA: must be scalar, avx2 or avx512, got '%s'\n", s);
    std::exit(2);
  }
  return v == "scalar" ? zenflow::cpu_isa::scalar : v == "avx2" ? zenflow::cpu_isa::avx2 : zenflow::cpu_isa::avx512;
}

}  // namespace zenflow_bench
