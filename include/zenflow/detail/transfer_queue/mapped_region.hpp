// mapped_region: page-aligned anonymous memory the library maps itself, pre-faulted in parallel.
//
// The host backend of the transfer queue uses it for its slots, and the CUDA backend's
// `pinned_allocation::registered` pins it with cudaHostRegister. The mapping is the requested
// size rounded up to the page size (never to a power of two) and is unmapped exactly once.
// Linux / POSIX only (mmap).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "zenflow/error.hpp"

namespace zenflow::detail {

/// The system page size in bytes.
inline std::size_t page_size() noexcept {
  static const std::size_t size = [] {
    const long s = ::sysconf(_SC_PAGESIZE);
    return s > 0 ? static_cast<std::size_t>(s) : std::size_t{4096};
  }();
  return size;
}

/// `value` rounded up to a multiple of `alignment` (a power of two); throws on overflow.
inline std::size_t round_up_checked(std::size_t value, std::size_t alignment, const char* argument) {
  expects(value <= std::numeric_limits<std::size_t>::max() - (alignment - 1), argument, "too large: ", value,
          " bytes overflows size_t when rounded up to ", alignment);
  return (value + alignment - 1) & ~(alignment - 1);
}

/// Owning, move-only anonymous mapping of at least `bytes` bytes (page-aligned, zero-filled,
/// every page touched before the constructor returns, by up to `max_threads` threads).
class mapped_region {
 public:
  mapped_region() noexcept = default;

  /// Maps and pre-faults. Synchronizes (blocks until every page is resident). Throws
  /// zenflow::error naming `bytes` when it is 0 or the mapping fails.
  explicit mapped_region(std::size_t bytes, unsigned max_threads = 8) {
    expects(bytes > 0, "bytes", "must be positive, got 0");
    const std::size_t length = round_up_checked(bytes, page_size(), "bytes");
    void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    expects(p != MAP_FAILED, "bytes", "mmap of ", length, " bytes failed: ", std::strerror(errno));
    data_ = static_cast<std::byte*>(p);
    size_ = bytes;
    mapped_ = length;
#if defined(MADV_HUGEPAGE)
    // Best effort: fewer TLB misses and a cheaper cudaHostRegister for large staging buffers.
    if (length >= (std::size_t{2} << 20)) (void)::madvise(p, length, MADV_HUGEPAGE);
#endif
    try {
      prefault(max_threads);
    } catch (...) {
      reset();
      throw;
    }
  }

  mapped_region(const mapped_region&) = delete;
  mapped_region& operator=(const mapped_region&) = delete;
  mapped_region(mapped_region&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        mapped_(std::exchange(other.mapped_, 0)) {}
  mapped_region& operator=(mapped_region&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      mapped_ = std::exchange(other.mapped_, 0);
    }
    return *this;
  }
  ~mapped_region() { reset(); }

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  /// The size that was asked for.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The size of the mapping: size() rounded up to the page size.
  [[nodiscard]] std::size_t mapped_bytes() const noexcept { return mapped_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  /// Unmaps now (idempotent). Never throws.
  void reset() noexcept {
    if (data_ != nullptr) ::munmap(data_, mapped_);
    data_ = nullptr;
    size_ = 0;
    mapped_ = 0;
  }

 private:
  // Writes one byte per page so the kernel populates the mapping now, not on the first DMA or
  // the first slot write. Threads only pay off for large regions (>= 64 MiB per thread).
  void prefault(unsigned max_threads) {
    const std::size_t page = page_size();
    const std::size_t pages = mapped_ / page;
    constexpr std::size_t pages_per_thread_min = (std::size_t{64} << 20) / 4096;
    const std::size_t hw = std::max(1u, std::thread::hardware_concurrency());
    const std::size_t threads =
        std::clamp<std::size_t>(pages / pages_per_thread_min, 1, std::min<std::size_t>(hw, std::max(1u, max_threads)));
    auto touch = [this, page](std::size_t first, std::size_t last) {
      for (std::size_t i = first; i < last; ++i) *static_cast<volatile std::byte*>(data_ + i * page) = std::byte{0};
    };
    const std::size_t per = (pages + threads - 1) / threads;
    std::vector<std::jthread> workers;  // joined on scope exit, also when a later spawn throws
    workers.reserve(threads - 1);
    for (std::size_t t = 1; t < threads; ++t) {
      const std::size_t first = std::min(pages, t * per), last = std::min(pages, first + per);
      workers.emplace_back(touch, first, last);
    }
    touch(0, std::min(pages, per));
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;
};

}  // namespace zenflow::detail
