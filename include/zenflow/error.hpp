// Error handling: one exception type for every host-side failure.
//
// - Host code throws `zenflow::error` naming the argument that was wrong and why, before any
//   state is modified.
// - `ZENFLOW_CUDA_TRY(call)` throws `zenflow::cuda_error` with file, line and CUDA's error name.
// - `ZENFLOW_CUDA_ASSERT(call)` is the variant for destructors and noexcept paths: it never
//   throws; it reports to stderr and aborts in debug builds.
// - Device code never throws.
//
// This header does not include any CUDA header: the CUDA macros expand to calls that are only
// resolved in translation units which include the CUDA runtime.
#pragma once

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "zenflow/config.hpp"

namespace zenflow {

/// The exception every zenflow host API throws for bad input or a failed operation.
/// `argument()` names the offending parameter (or field, or operation); `reason()` says what was
/// expected. `what()` is "zenflow: <argument>: <reason>".
class error : public std::runtime_error {
 public:
  error(std::string argument, std::string reason)
      : std::runtime_error("zenflow: " + argument + ": " + reason),
        argument_(std::move(argument)),
        reason_(std::move(reason)) {}

  [[nodiscard]] const std::string& argument() const noexcept { return argument_; }
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

 private:
  std::string argument_;
  std::string reason_;
};

/// A failed CUDA runtime call: `argument()` is the call's text, `code()` CUDA's error value.
class cuda_error : public error {
 public:
  cuda_error(int code, const std::string& name, const std::string& description, const std::string& call,
             const char* file, int line)
      : error(call, name + " (" + description + ") at " + file + ":" + std::to_string(line)), code_(code) {}

  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace detail {
/// Joins values (strings, numbers, bools) into a message without <format> (g++ 12 lacks it) or a third-party
/// dependency.
template <class... Ts>
std::string concat(const Ts&... parts) {
  std::string out;
  auto append = [&out](const auto& part) {
    if constexpr (std::is_arithmetic_v<std::decay_t<decltype(part)>>) {
      if constexpr (std::is_same_v<std::decay_t<decltype(part)>, bool>) {
        out += part ? "true" : "false";
      } else if constexpr (std::is_floating_point_v<std::decay_t<decltype(part)>>) {
        // The shortest decimal that reads back as the value: "-1e-09", "1.0000001", "0.001"
        // (std::to_string's six fixed decimals would print them "-0.000000", "1.000000", "0.001000").
        char text[64];
        out.append(text, std::to_chars(text, text + sizeof text, part).ptr);
      } else {
        out += std::to_string(part);
      }
    } else {
      out += part;
    }
  };
  (append(parts), ...);
  return out;
}

/// An errno value as its text and number: "No space left on device (errno 28)".
inline std::string errno_text(int err) {
  return concat(std::strerror(err), " (errno ", err, ")");
}
}  // namespace detail

/// Throws `zenflow::error(argument, reason...)` unless `condition` holds.
/// The reason parts are concatenated (strings and numbers).
template <class... Reason>
inline void expects(bool condition, const char* argument, const Reason&... reason) {
  if (!condition) [[unlikely]]
    throw error(argument, detail::concat(reason...));
}

}  // namespace zenflow

/// Evaluates a CUDA runtime call and throws `zenflow::cuda_error` if it did not return
/// cudaSuccess. Needs the CUDA runtime header in the including translation unit.
#define ZENFLOW_CUDA_TRY(call)                                                                            \
  do {                                                                                                    \
    const auto zenflow_cuda_status_ = (call);                                                             \
    if (zenflow_cuda_status_ != cudaSuccess) [[unlikely]] {                                               \
      (void)cudaGetLastError();                                                                           \
      throw ::zenflow::cuda_error(static_cast<int>(zenflow_cuda_status_), cudaGetErrorName(zenflow_cuda_status_), \
                                  cudaGetErrorString(zenflow_cuda_status_), #call, __FILE__, __LINE__);   \
    }                                                                                                     \
  } while (0)

/// Like ZENFLOW_CUDA_TRY but never throws: for destructors and noexcept paths. A failure is
/// printed to stderr; debug builds (NDEBUG not defined) then abort.
#define ZENFLOW_CUDA_ASSERT(call)                                                                   \
  do {                                                                                              \
    const auto zenflow_cuda_status_ = (call);                                                       \
    if (zenflow_cuda_status_ != cudaSuccess) [[unlikely]] {                                         \
      std::fprintf(stderr, "zenflow: %s failed: %s at %s:%d\n", #call,                              \
                   cudaGetErrorName(zenflow_cuda_status_), __FILE__, __LINE__);                     \
      ZENFLOW_DEBUG_ABORT();                                                                        \
    }                                                                                               \
  } while (0)

#if defined(NDEBUG)
#define ZENFLOW_DEBUG_ABORT() ((void)0)
#else
#define ZENFLOW_DEBUG_ABORT() std::abort()
#endif
