// A fixed pool of exact-size, block-aligned, pinned host buffers: the staging memory of the NVMe
// state tier (state_file.hpp), usable on its own.
//
// `pinned_buffer_pool(count, buffer_bytes)` maps count x buffer_bytes bytes in one anonymous
// mapping (detail::mapped_region: page-aligned, pre-faulted) and hands out `count` buffers of
// exactly buffer_bytes each. Nothing is rounded to a power of two and nothing is added: with a
// 4 KiB page, `total_bytes()` is the mapping's size and, when pinned, `pinned_bytes()` is what
// the process's locked memory (VmLck) grows by.
//
// Pinning (`pin_policy`):
//   automatic  mlock when the process may (RLIMIT_MEMLOCK or CAP_IPC_LOCK); when it may not, the
//              pool works unpinned and `status()` says why and what to change
//   required   as automatic, but a pool that cannot be pinned is a `zenflow::error`
//   none       never pinned
// A `pin_hook` replaces mlock: a CUDA build registers the buffers with cudaHostRegister (and
// unregisters them with cudaHostUnregister) so that copies to the GPU run at full speed, e.g.
//
//   zenflow::pin_hook cuda{"cudaHostRegister",
//       [](void* p, std::size_t n) { ZENFLOW_CUDA_TRY(cudaHostRegister(p, n, cudaHostRegisterDefault)); },
//       [](void* p, std::size_t) noexcept { (void)cudaHostUnregister(p); }};
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "zenflow/detail/pinned_pool/memlock.hpp"
#include "zenflow/detail/transfer_queue/mapped_region.hpp"
#include "zenflow/error.hpp"

namespace zenflow {

/// Whether a pinned_buffer_pool locks its memory; see the header comment.
enum class pin_policy : std::uint8_t { automatic, required, none };

/// "automatic", "required", "none".
constexpr std::string_view pin_policy_name(pin_policy p) noexcept {
  switch (p) {
    case pin_policy::automatic:
      return "automatic";
    case pin_policy::required:
      return "required";
    case pin_policy::none:
      return "none";
  }
  return "unknown";
}

/// A replacement for mlock: `pin(data, bytes)` pins the pool's memory (throws on failure),
/// `unpin(data, bytes)` releases it (must not throw). `name` is what status() reports.
struct pin_hook {
  std::string name;                               ///< e.g. "cudaHostRegister"
  std::function<void(void*, std::size_t)> pin;    ///< pins [data, data + bytes); throws on failure
  std::function<void(void*, std::size_t)> unpin;  ///< releases what pin pinned; never throws
  /// True when a hook is set (pin is callable).
  explicit operator bool() const noexcept { return static_cast<bool>(pin); }
};

/// A fixed set of equal host buffers, aligned to `alignment`, optionally pinned. Not copyable;
/// movable. The buffers are shared memory for the caller to use; the pool does no hand-out
/// bookkeeping (the NVMe stream owns which buffer holds what).
class pinned_buffer_pool {
 public:
  /// Every buffer starts at a multiple of this many bytes (the O_DIRECT alignment of common
  /// devices); buffer_bytes must be a multiple of it.
  static constexpr std::size_t alignment = 4096;

  pinned_buffer_pool() noexcept = default;

  /// Maps count x buffer_bytes bytes (pre-faulted), then pins them per `policy` / `hook`.
  /// Throws `zenflow::error` naming `count` or `buffer_bytes` (0, not a multiple of alignment,
  /// overflow), `hook` (given with pin_policy::none), or `policy` (required and the pin failed),
  /// before anything is mapped when the arguments are wrong. Synchronizes.
  pinned_buffer_pool(std::size_t count, std::size_t buffer_bytes, pin_policy policy = pin_policy::automatic,
                     pin_hook hook = {}) {
    expects(count > 0, "count", "must be at least 1, got 0");
    expects(buffer_bytes > 0 && buffer_bytes % alignment == 0, "buffer_bytes", "must be a positive multiple of ",
            alignment, " bytes, got ", buffer_bytes);
    expects(buffer_bytes <= ~std::size_t{0} / count, "buffer_bytes", count, " x ", buffer_bytes,
            " bytes overflows size_t");
    expects(!(hook && policy == pin_policy::none), "hook", "a pin hook (", hook.name,
            ") was given with pin_policy::none");
    region_ = detail::mapped_region(count * buffer_bytes);
    count_ = count;
    buffer_bytes_ = buffer_bytes;
    policy_ = policy;
    if (policy == pin_policy::none) {
      status_ = "not pinned (pin_policy::none)";
      return;
    }
    std::string failure;
    if (hook) {
      try {
        hook.pin(region_.data(), total_bytes());
        hook_ = std::move(hook);
        pinned_ = true;
        status_ = detail::concat("pinned by ", hook_.name.empty() ? std::string("a pin hook") : hook_.name, ": ",
                                 total_bytes(), " bytes");
      } catch (const std::exception& e) {
        failure = detail::concat(hook.name.empty() ? std::string("the pin hook") : hook.name, " failed: ", e.what());
      }
    } else {
      failure = detail::try_mlock(region_.data(), total_bytes());
      if (failure.empty()) {
        pinned_ = true;
        status_ = detail::concat("mlock: ", total_bytes(), " bytes locked");
      }
    }
    if (!pinned_) {
      expects(policy != pin_policy::required, "policy", "pin_policy::required but ", failure);
      status_ = "not pinned: " + failure;
    }
  }

  pinned_buffer_pool(const pinned_buffer_pool&) = delete;
  pinned_buffer_pool& operator=(const pinned_buffer_pool&) = delete;
  pinned_buffer_pool(pinned_buffer_pool&& other) noexcept { *this = std::move(other); }
  pinned_buffer_pool& operator=(pinned_buffer_pool&& other) noexcept {
    if (this != &other) {
      release();
      region_ = std::move(other.region_);
      count_ = std::exchange(other.count_, 0);
      buffer_bytes_ = std::exchange(other.buffer_bytes_, 0);
      policy_ = other.policy_;
      pinned_ = std::exchange(other.pinned_, false);
      hook_ = std::move(other.hook_);
      status_ = std::move(other.status_);
    }
    return *this;
  }
  /// Unpins (munlock or the hook's unpin) and unmaps.
  ~pinned_buffer_pool() { release(); }

  /// Number of buffers.
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  /// Bytes of each buffer, exactly as asked.
  [[nodiscard]] std::size_t buffer_bytes() const noexcept { return buffer_bytes_; }
  /// size() x buffer_bytes(): the bytes the pool holds.
  [[nodiscard]] std::size_t total_bytes() const noexcept { return count_ * buffer_bytes_; }
  /// The bytes mapped for the pool: total_bytes() rounded up to the page size (equal to it with
  /// 4 KiB pages).
  [[nodiscard]] std::size_t mapped_bytes() const noexcept { return region_.mapped_bytes(); }
  /// The bytes pinned: total_bytes() when pinned, else 0.
  [[nodiscard]] std::size_t pinned_bytes() const noexcept { return pinned_ ? total_bytes() : 0; }
  /// Whether the buffers are pinned (by mlock or the hook).
  [[nodiscard]] bool pinned() const noexcept { return pinned_; }
  /// The policy the pool was built with.
  [[nodiscard]] pin_policy policy() const noexcept { return policy_; }
  /// What pinning did, e.g. "mlock: 9437184 bytes locked" or "not pinned: mlock of ... failed: ...".
  [[nodiscard]] const std::string& status() const noexcept { return status_; }

  /// Buffer i (alignment-aligned, buffer_bytes() long). Throws `zenflow::error` naming `i` when
  /// out of range.
  [[nodiscard]] std::span<std::byte> buffer(std::size_t i) const {
    expects(i < count_, "i", "buffer index ", i, " out of range (", count_, " buffers)");
    return {region_.data() + i * buffer_bytes_, buffer_bytes_};
  }

 private:
  void release() noexcept {
    if (pinned_) {
      if (hook_) {
        if (hook_.unpin) hook_.unpin(region_.data(), total_bytes());
      } else {
        detail::unlock(region_.data(), total_bytes());
      }
    }
    pinned_ = false;
    region_.reset();
    count_ = 0;
    buffer_bytes_ = 0;
  }

  detail::mapped_region region_;
  std::size_t count_ = 0;
  std::size_t buffer_bytes_ = 0;
  pin_policy policy_ = pin_policy::automatic;
  bool pinned_ = false;
  pin_hook hook_;
  std::string status_ = "empty";
};

}  // namespace zenflow
