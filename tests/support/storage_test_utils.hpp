// Shared by the NVMe state tier's tests: a scratch directory on a disk file system, byte
// patterns, a forked child that reports back, and the process's locked memory.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <vector>

namespace zenflow_test {

/// A fresh directory for one test, removed with its contents at scope exit. Under
/// $ZENFLOW_TEST_STATE_DIR when set, else under the working directory (ctest runs in the build
/// tree, on disk: never tmpfs, whatever /tmp is).
class scratch_dir {
 public:
  scratch_dir() {
    const char* base = std::getenv("ZENFLOW_TEST_STATE_DIR");
    std::string templ =
        (base != nullptr && *base != '\0' ? std::filesystem::path(base) : std::filesystem::current_path()) /
        "zenflow_state_test.XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp");
    path_ = templ;
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

/// n pseudo-random bytes (xorshift32 from seed).
inline std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1u;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(x >> 24);
  }
  return v;
}

/// What a forked child reported: its exit status (-1: killed by a signal) and what it wrote.
struct child_result {
  int exit_code = -1;
  int signal = 0;
  std::string output;
};

/// Runs `body` in a forked child (which must not use doctest). The child's return value is its
/// exit code; `report(text)` sends text back. Exceptions escaping body become exit code 99 with
/// what() as output. With `kill_at`: once the child has reported text containing it, the child
/// is killed with SIGKILL `kill_delay_ms` later (child_result::signal is then SIGKILL). Call only
/// while this process runs no other threads.
inline child_result run_in_child(const std::function<int(const std::function<void(const std::string&)>&)>& body,
                                 const std::string& kill_at = "", int kill_delay_ms = 0) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
  if (pid == 0) {
    ::close(fds[0]);
    const auto report = [fd = fds[1]](const std::string& text) {
      std::size_t off = 0;
      while (off < text.size()) {
        const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
        if (n <= 0) break;
        off += static_cast<std::size_t>(n);
      }
    };
    int code = 98;
    try {
      code = body(report);
    } catch (const std::exception& e) {
      report(e.what());
      code = 99;
    } catch (...) {
      code = 99;
    }
    ::close(fds[1]);
    ::_exit(code);
  }
  ::close(fds[1]);
  child_result r;
  bool killed = false;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      r.output.append(buf, static_cast<std::size_t>(n));
      if (!killed && !kill_at.empty() && r.output.find(kill_at) != std::string::npos) {
        ::usleep(static_cast<useconds_t>(kill_delay_ms) * 1000);
        ::kill(pid, SIGKILL);
        killed = true;
      }
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

/// True in an AddressSanitizer or ThreadSanitizer build: their allocators and interceptors change
/// what the process's memory figures mean.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool sanitizer_build = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool sanitizer_build = true;
#else
inline constexpr bool sanitizer_build = false;
#endif
#else
inline constexpr bool sanitizer_build = false;
#endif
/// AddressSanitizer and ThreadSanitizer (sanitizer_common) intercept mlock and munlock and do
/// nothing (they "succeed"): in such a build the process's locked memory cannot be checked.
inline constexpr bool mlock_is_intercepted = sanitizer_build;

/// The "<key>:" field of /proc/self/status (VmRSS, VmHWM, ...) in bytes, or -1.
inline long long status_bytes(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  const std::size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, key, n) == 0 && line[n] == ':') kib = std::strtoll(line + n + 1, nullptr, 10);
  std::fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

/// VmLck of this process in bytes, or -1.
inline long long locked_bytes() {
  return status_bytes("VmLck");
}

}  // namespace zenflow_test
