// The coordinator's checkpoint file: its header, scalars and arrays, the payload's checksum, the
// writer and what it puts of the options a checkpoint must be resumed with (the reader and its
// side of those: checkpoint_reader.hpp). checkpoint_io.hpp writes and checkpoint_load.hpp reads
// the coordinator's state through them; the layout of that state is documented in
// checkpoint_io.hpp.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "zenflow/crc32c.hpp"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/state_slots.hpp"

namespace zenflow::detail {

inline constexpr char checkpoint_magic[8] = {'Z', 'E', 'N', 'F', 'L', 'O', 'W', '\x01'};
inline constexpr std::uint32_t checkpoint_version = 8;
inline constexpr std::size_t checkpoint_header_bytes = 32;

/// What a checkpoint scalar may be: a number or an enum (never a struct: its padding would reach the file).
template <class T>
concept checkpoint_scalar = std::is_arithmetic_v<T> || std::is_enum_v<T>;

inline constexpr std::uint64_t fnv1a64_basis = 0xcbf29ce484222325ull;

/// FNV-1a over `data`, continuing from `h` (the hash of what came before it, or the basis).
inline std::uint64_t fnv1a64(std::span<const std::byte> data, std::uint64_t h = fnv1a64_basis) noexcept {
  for (std::byte b : data) {
    h ^= static_cast<std::uint64_t>(b);
    h *= 0x100000001b3ull;
  }
  return h;
}

/// Bytes of a parameter's state a save exports and a load applies at a time (a run of columns).
inline constexpr std::size_t checkpoint_run_bytes = std::size_t{16} << 20;

/// The oldest format a reader accepts: format 7 is format 8 with another checksum.
inline constexpr std::uint32_t checkpoint_oldest_version = 7;

/// The payload's checksum in the header (bytes 24-31) of a checkpoint of `version`: from format 8
/// the CRC32C of the payload (crc32c.hpp: the crc32 instruction where the CPU has it, over 10 GB/s),
/// zero-extended to 64 bits; format 7's FNV-1a 64 (about 1 GB/s, byte by byte) is kept to read its
/// files. Fed the payload in pieces, in order.
class checkpoint_checksum {
 public:
  explicit checkpoint_checksum(std::uint32_t version = checkpoint_version) noexcept
      : fnv_(version < 8), value_(fnv_ ? fnv1a64_basis : 0) {}
  void update(std::span<const std::byte> bytes) {
    value_ = fnv_ ? fnv1a64(bytes, value_) : crc32c(bytes, static_cast<std::uint32_t>(value_));
  }
  /// As update(bytes) given crc32c(bytes) and their length (format 8 only).
  void append(std::uint32_t crc, std::uint64_t size) {
    expects(!fnv_, "checkpoint_checksum", "format 7's FNV-1a cannot be combined");
    value_ = crc32c_combine(static_cast<std::uint32_t>(value_), crc, size);
  }
  [[nodiscard]] std::uint64_t value() const noexcept { return value_; }

 private:
  bool fnv_;
  std::uint64_t value_;
};

/// Writes a checkpoint as it is put together: the payload streams through a buffer of
/// buffer_bytes into path.tmp (its size and checksum kept as it goes by), and commit() writes the
/// header and renames path.tmp to path. So a checkpoint of any size costs no more memory than
/// the buffer. Throws zenflow::error naming the file; path.tmp is removed unless committed (path
/// is left as it was).
class checkpoint_writer {
 public:
  static constexpr std::size_t buffer_bytes = std::size_t{4} << 20;

  explicit checkpoint_writer(const std::string& path) : path_(path), tmp_(path + ".tmp") {
    // POSIX calls rather than a stream: a failure (a full disk, a quota, an I/O error) says why.
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int open_error = errno;  // (read before anything else may set it)
    expects(fd_ >= 0, "path", "cannot open '", tmp_, "' for writing: ", errno_text(open_error));
    buffer_.reserve(buffer_bytes);
    buffer_.resize(checkpoint_header_bytes);  // the header's place: commit() fills it in
  }
  checkpoint_writer(const checkpoint_writer&) = delete;
  checkpoint_writer& operator=(const checkpoint_writer&) = delete;
  ~checkpoint_writer() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) std::remove(tmp_.c_str());
  }

  template <checkpoint_scalar T>
  void put(const T& value) {
    expects(array_left_ == 0, "checkpoint_writer", "a value put before the array begun has its elements");
    if constexpr (std::is_same_v<T, bool>) {
      put<std::uint8_t>(value ? 1 : 0);
    } else {
      append({reinterpret_cast<const std::byte*>(&value), sizeof(T)});
    }
  }
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) void put_array(std::span<const T> values) {
    begin_array<T>(values.size());
    put_elements(values);
  }
  /// An array put in parts: its length, then exactly `n` elements through put_elements.
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) void begin_array(std::size_t n) {
    put<std::uint64_t>(n);
    array_left_ = n * sizeof(T);
  }
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) void put_elements(std::span<const T> values) {
    expects(values.size_bytes() <= array_left_, "checkpoint_writer", values.size(),
            " elements past the end of the array begun");
    array_left_ -= values.size_bytes();
    append(std::as_bytes(values));
  }
  void put_string(const std::string& s) { put_array(std::span<const char>(s.data(), s.size())); }

  /// Arrays written side by side (a parameter's state slots, exported a run of columns at a time):
  /// their lengths now, their elements through put_part, each array's in order but the arrays in any
  /// interleaving, each written straight to its place in the file; end_arrays closes them once
  /// every element is put, and nothing else may be put before. The checksum covers the file in
  /// order all the same: each array's CRC32C, kept as its parts come, is combined in at its place.
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) void begin_arrays(std::span<const std::size_t> sizes) {
    expects(array_left_ == 0 && side_.empty(), "checkpoint_writer", "arrays begun before the last ones have ended");
    flush();
    std::uint64_t at = written_;
    for (const std::size_t n : sizes) {
      const std::uint64_t count = n;
      write_at(std::as_bytes(std::span<const std::uint64_t>(&count, 1)), at);
      side_.push_back({at + sizeof count, n * sizeof(T), 0, 0, sizeof(T)});
      at += sizeof count + n * sizeof(T);
    }
  }
  /// The next elements of array `array` of those begun (begin_arrays).
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) void put_part(std::size_t array, std::span<const T> values) {
    expects(array < side_.size(), "checkpoint_writer", "array ", array, " of ", side_.size(), " begun");
    side_array& a = side_[array];
    expects(sizeof(T) == a.element, "checkpoint_writer", "elements of ", sizeof(T), " bytes put in an array of ",
            a.element);
    expects(values.size_bytes() <= a.bytes - a.filled, "checkpoint_writer", values.size(),
            " elements past the end of array ", array);
    write_at(std::as_bytes(values), a.offset + a.filled);
    a.crc = crc32c(std::as_bytes(values), a.crc);
    a.filled += values.size_bytes();
  }
  /// Closes the arrays begun, every one of them whole.
  void end_arrays() {
    for (std::size_t i = 0; i < side_.size(); ++i)
      expects(side_[i].filled == side_[i].bytes, "checkpoint_writer", "array ", i, " ended with ",
              (side_[i].bytes - side_[i].filled) / side_[i].element, " elements missing");
    for (const side_array& a : side_) {
      const std::uint64_t count = a.bytes / a.element;
      hash_.update(std::as_bytes(std::span<const std::uint64_t>(&count, 1)));
      hash_.append(a.crc, a.bytes);
      size_ += sizeof count + a.bytes;
      written_ = a.offset + a.bytes;
    }
    side_.clear();
  }

  /// Writes what is buffered and the header, then renames path.tmp to path.
  void commit() {
    expects(array_left_ == 0 && side_.empty(), "checkpoint_writer",
            "committed before the arrays begun have their elements");
    flush();
    std::byte header[checkpoint_header_bytes] = {};
    std::memcpy(header, checkpoint_magic, 8);
    const std::uint32_t version = checkpoint_version, reserved = 0;
    std::memcpy(header + 8, &version, 4);
    std::memcpy(header + 12, &reserved, 4);
    std::memcpy(header + 16, &size_, 8);
    const std::uint64_t hash = hash_.value();
    std::memcpy(header + 24, &hash, 8);
    write_at(header, 0);
    const int closed = ::close(fd_);
    const int close_error = errno;
    fd_ = -1;
    expects(closed == 0, "path", "writing '", tmp_, "' failed at close: ", errno_text(close_error));
    const int renamed = std::rename(tmp_.c_str(), path_.c_str());
    const int rename_error = errno;
    expects(renamed == 0, "path", "cannot rename '", tmp_, "' to '", path_, "': ", errno_text(rename_error));
    committed_ = true;
  }

 private:
  void append(std::span<const std::byte> bytes) {
    expects(side_.empty(), "checkpoint_writer", "a value put before the arrays begun have ended");
    size_ += bytes.size();
    hash_.update(bytes);
    if (buffer_.size() + bytes.size() > buffer_bytes) {
      flush();
      if (bytes.size() >= buffer_bytes) {  // a large array goes to the file as it is
        write_all(bytes);
        return;
      }
    }
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  void flush() {
    write_all(buffer_);
    buffer_.clear();
  }
  /// Appends `bytes` to the file (after what was written so far, header's place included).
  void write_all(std::span<const std::byte> bytes) {
    write_at(bytes, written_);
    written_ += bytes.size();
  }
  void write_at(std::span<const std::byte> bytes, std::uint64_t offset) {
    while (!bytes.empty()) {
      const ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(offset));
      const int write_error = n < 0 ? errno : EIO;
      if (n < 0 && write_error == EINTR) continue;
      expects(n > 0, "path", "writing '", tmp_, "' failed: ", errno_text(write_error));
      bytes = bytes.subspan(static_cast<std::size_t>(n));
      offset += static_cast<std::uint64_t>(n);
    }
  }

  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<std::byte> buffer_;
  std::uint64_t written_ = 0;           ///< bytes in the file so far
  std::uint64_t size_ = 0;              ///< payload bytes put so far
  checkpoint_checksum hash_;            ///< their checksum
  std::size_t array_left_ = 0;          ///< bytes the array begun still needs (begin_array)
  struct side_array {
    std::uint64_t offset, bytes, filled;  ///< of its first element in the file; its bytes; those put
    std::uint32_t crc;                    ///< CRC32C of those put
    std::size_t element;                  ///< bytes per element
  };
  std::vector<side_array> side_;  ///< the arrays begun side by side (begin_arrays)
};

/// The fields of hyper-parameters `h` whose per_group flag is `per_group`, in table order (the
/// shared ones once per checkpoint, the per-group ones per parameter).
template <class HyperParameters>
void put_fields(checkpoint_writer& w, const HyperParameters& h, bool per_group) {
  for_each_value(h, per_group, [&](const auto& value) { w.put(value); });
}
/// The options a checkpoint must be resumed with (a mismatch is rejected), field by field (no
/// struct padding reaches the file), and the optimizers' state slots (Slots).
template <state_slots Slots, class HyperParameters>
void put_options(checkpoint_writer& w, const basic_zenflow_options<HyperParameters>& o) {
  w.put(static_cast<std::uint8_t>(o.mode));
  w.put(o.topk_ratio);
  w.put(static_cast<std::uint8_t>(o.resolved_strategy()));
  w.put(o.select_interval_steps());
  w.put(o.update_interval.is_auto);
  w.put(o.update_interval.value);
  w.put(o.full_warm_up_rounds);
  w.put(o.overlap_step);
  w.put(o.max_update_interval);
  // Which optimizer, its field table (names, kinds and order of the values below and of the
  // per-parameter ones) and its state slots (the state arrays of every parameter); then the
  // hyper-parameters every parameter shares (Adam: adamw_mode, bias_correction). The per-group
  // ones (Adam: lr, beta1, beta2, eps, weight_decay) are per parameter.
  w.put_string(HyperParameters::name);
  w.put_string(field_table_text<HyperParameters>());
  w.put_string(slot_names<Slots>());
  put_fields(w, o.optimizer, false);
}

/// Waits for `stream` if the scope is left by an exception, so that copies already enqueued
/// never outlive the buffers declared before this guard. Never throws.
template <class Backend>
class synchronize_on_unwind {
 public:
  explicit synchronize_on_unwind(typename Backend::stream_type stream) noexcept : stream_(stream) {}
  synchronize_on_unwind(const synchronize_on_unwind&) = delete;
  synchronize_on_unwind& operator=(const synchronize_on_unwind&) = delete;
  ~synchronize_on_unwind() {
    if (std::uncaught_exceptions() <= exceptions_) return;
    try {
      Backend::synchronize(stream_);
    } catch (...) {
    }
  }

 private:
  typename Backend::stream_type stream_;
  int exceptions_ = std::uncaught_exceptions();
};

}  // namespace zenflow::detail
