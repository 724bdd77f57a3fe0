// mlock with a diagnosis: when the process may not lock the memory, say what the limit is, what
// is locked already and how to change it.
#pragma once

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "zenflow/error.hpp"

namespace zenflow::detail {

/// VmLck of this process in bytes (from /proc/self/status), or -1 when it cannot be read.
inline long long locked_bytes_of_process() noexcept {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, "VmLck:", 6) == 0) {
      kib = std::strtoll(line + 6, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

/// "8388608 bytes", "unlimited".
inline std::string rlimit_text(rlim_t value) {
  return value == RLIM_INFINITY ? std::string("unlimited") : concat(static_cast<unsigned long long>(value), " bytes");
}

/// Locks [data, data + bytes). Returns "" on success, else what failed and why.
inline std::string try_mlock(void* data, std::size_t bytes) {
  if (::mlock(data, bytes) == 0) return {};
  const int err = errno;
  std::string why = concat("mlock of ", bytes, " bytes failed: ", std::strerror(err));
  rlimit limit{};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
    why += concat(" (RLIMIT_MEMLOCK is ", rlimit_text(limit.rlim_cur));
    const long long locked = locked_bytes_of_process();
    if (locked >= 0) why += concat(", ", locked, " bytes already locked by this process");
    why += "; raise it (ulimit -l, systemd LimitMEMLOCK=, docker --ulimit memlock=) or grant CAP_IPC_LOCK)";
  }
  return why;
}

inline void unlock(void* data, std::size_t bytes) noexcept {
  (void)::munlock(data, bytes);
}

}  // namespace zenflow::detail
