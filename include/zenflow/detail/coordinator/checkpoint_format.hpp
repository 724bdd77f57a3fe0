// The coordinator's checkpoint file: its header, scalars and arrays, the writer and the reader,
// and the option fields a checkpoint must be resumed with (checkpoint_io.hpp writes and
// checkpoint_load.hpp reads the coordinator's state through them; the layout of that state is
// documented in checkpoint_io.hpp).
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
#include <iterator>
#include <map>
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

/// Where an array of a checkpoint lies: its elements are in the file (the reader checked its
/// length against what remains), read when they are needed (checkpoint_reader::read).
template <checkpoint_scalar T>
struct checkpoint_array {
  std::uint64_t offset = 0;  ///< of its first element, in the file
  std::size_t size = 0;      ///< elements
  [[nodiscard]] bool empty() const noexcept { return size == 0; }
  /// Elements [first, first + n) (within the array: checked).
  [[nodiscard]] checkpoint_array part(std::size_t first, std::size_t n) const {
    expects(first <= size && n <= size - first, "checkpoint", "elements [", first, ", ", first + n, ") of an array of ",
            size);
    return {offset + first * sizeof(T), n};
  }
};

/// When a checkpoint_reader checks the payload's checksum.
enum class checkpoint_verification : std::uint8_t {
  /// In the constructor, by streaming the whole payload through the buffer, before any field is
  /// parsed.
  upfront,
  /// In verify(): the reader keeps the CRC32C of every part of the payload it reads meanwhile (the
  /// fields parsed, the arrays read), and verify() reads only the parts never read and combines
  /// the pieces (crc32c_combine). A caller that validates the file's arrays before using them
  /// reads the payload once for both, and calls verify() before anything it parsed takes effect
  /// (and after a failure, to name a corrupted file as such). A format 7 file (FNV-1a, which does
  /// not combine) is verified upfront all the same.
  deferred,
};

/// Reads a checkpoint: the constructor checks the header (size, magic, version) and verifies the
/// payload's checksum (upfront) or leaves it to verify() (deferred); get and get_array parse the
/// payload in order through a buffer of buffer_bytes, and get_array_ref skips an array, to be
/// read later by read (any part of it, in any order). So the reader holds no more than the buffer
/// and what the caller reads: a checkpoint larger than the host's memory can be parsed and applied
/// one array (or part of one) at a time. The reader keeps the file it opened open: replacing the
/// path (a checkpoint_writer's rename) does not change what it reads; writing the file in place
/// while it is read does, and a read that finds it shorter than it was throws.
class checkpoint_reader {
 public:
  static constexpr std::size_t buffer_bytes = std::size_t{4} << 20;

  /// Opens `path` and checks its header (and, `upfront`, its payload's checksum); throws
  /// zenflow::error("checkpoint", ...) if it is not a complete (uncorrupted) zenflow checkpoint of a
  /// supported version.
  explicit checkpoint_reader(const std::string& path, checkpoint_verification when = checkpoint_verification::upfront)
      : path_(path) {
    // A directory opens on Linux and reports a nonsense size; so would a FIFO or a device (and
    // opening a FIFO would block): only a regular file (or a link to one) can be a checkpoint.
    std::error_code status_error;
    const auto status = std::filesystem::status(path, status_error);
    expects(std::filesystem::exists(status), "checkpoint", "cannot open '", path,
            "': ", status_error ? status_error.message() : std::string("no such file"));
    expects(std::filesystem::is_regular_file(status), "checkpoint", "'", path, "' is not a regular file");
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    const int open_error = errno;
    expects(fd_ >= 0, "checkpoint", "cannot open '", path, "': ", errno_text(open_error));
    try {
      struct stat st {};
      const int stated = ::fstat(fd_, &st);
      const int stat_error = errno;
      expects(stated == 0, "checkpoint", "cannot determine the size of '", path, "': ", errno_text(stat_error));
      expects(S_ISREG(st.st_mode), "checkpoint", "'", path, "' is not a regular file");  // (replaced since)
      const auto file_size = static_cast<std::uint64_t>(st.st_size);
      expects(file_size >= checkpoint_header_bytes, "checkpoint", "'", path, "' is truncated (", file_size,
              " bytes, the header alone is ", checkpoint_header_bytes, ")");
      std::byte header[checkpoint_header_bytes];
      read_at(header, 0);
      expects(std::memcmp(header, checkpoint_magic, 8) == 0, "checkpoint", "'", path,
              "' is not a zenflow checkpoint (bad magic)");
      std::uint32_t version;
      std::uint64_t size, hash;
      std::memcpy(&version, header + 8, 4);
      std::memcpy(&size, header + 16, 8);
      std::memcpy(&hash, header + 24, 8);
      expects(version >= checkpoint_oldest_version && version <= checkpoint_version, "checkpoint", "'", path,
              "' has format version ", version, ", which this build does not read (it reads ",
              checkpoint_oldest_version, " to ", checkpoint_version, ")");
      expects(size == file_size - checkpoint_header_bytes, "checkpoint", "'", path,
              "' is truncated or has trailing data (", file_size - checkpoint_header_bytes,
              " payload bytes, header says ", size, ")");
      end_ = file_size;
      version_ = version;
      hash_ = hash;
      // (The buffer is allocated only now: a bad header allocates nothing.)
      buffer_.resize(static_cast<std::size_t>(std::min<std::uint64_t>(buffer_bytes, size)));
      pos_ = checkpoint_header_bytes;
      if (when == checkpoint_verification::upfront || version < 8) {
        verify();
      } else {
        tracking_ = true;
      }
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  checkpoint_reader(const checkpoint_reader&) = delete;
  checkpoint_reader& operator=(const checkpoint_reader&) = delete;
  ~checkpoint_reader() { ::close(fd_); }

  template <checkpoint_scalar T>
  T get() {
    if constexpr (std::is_same_v<T, bool>) {
      const auto byte = get<std::uint8_t>();
      expects(byte <= 1, "checkpoint", "a flag holds ", static_cast<int>(byte), " (expected 0 or 1)");
      return byte == 1;
    } else {
      expects(sizeof(T) <= end_ - pos_, "checkpoint", "payload ends early");
      T value;
      parse(std::as_writable_bytes(std::span<T>(&value, 1)));
      return value;
    }
  }
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) std::vector<T> get_array() {
    const auto at = get_array_ref<T>();
    // A length from a payload not verified yet (deferred) allocates no more than the buffer's size:
    // a longer array waits for the checksum (a corrupted length must not take the host's memory).
    if (at.size > buffer_bytes / sizeof(T)) verify();
    std::vector<T> values(at.size);
    read(at, 0, std::span<T>(values));
    return values;
  }
  /// Skips an array, checked to lie in the file: read it (or parts of it) with read.
  template <checkpoint_scalar T>
  requires(!std::is_same_v<T, bool>) checkpoint_array<T> get_array_ref() {
    const auto n = get<std::uint64_t>();
    expects(n <= (end_ - pos_) / sizeof(T), "checkpoint", "array length ", n, " exceeds the payload");
    const checkpoint_array<T> at{pos_, static_cast<std::size_t>(n)};
    pos_ += n * sizeof(T);
    return at;
  }
  std::string get_string() {
    auto chars = get_array<char>();
    return {chars.begin(), chars.end()};
  }
  [[nodiscard]] bool at_end() const noexcept { return pos_ == end_; }

  /// True once the payload's checksum was verified (always, for a reader verifying upfront).
  [[nodiscard]] bool verified() const noexcept { return verified_; }
  /// Bytes read from the file so far (the header, parsing, reads and verification).
  [[nodiscard]] std::uint64_t bytes_read() const noexcept { return bytes_read_; }
  /// Verifies the payload's checksum, reading what was not read yet (all of it, upfront); throws
  /// zenflow::error("checkpoint", "... is corrupted (checksum mismatch)") if it does not match the
  /// header's. Once verified, does nothing. Parsing goes on where it was.
  void verify() {
    if (verified_) return;
    checkpoint_checksum h(version_);
    std::vector<std::byte> gap;  // (not the parse buffer: parsing goes on after)
    const auto read_gap = [&](std::uint64_t from, std::uint64_t to) {
      if (from < to && gap.empty())
        gap.resize(static_cast<std::size_t>(std::min<std::uint64_t>(buffer_bytes, to - from)));
      for (std::uint64_t at = from; at < to;) {
        const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(gap.size(), to - at));
        read_at(std::span<std::byte>(gap).first(n), at, false);
        h.update(std::span<const std::byte>(gap).first(n));
        at += n;
      }
    };
    if (!tracking_) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
    std::uint64_t at = checkpoint_header_bytes;
    for (const auto& [first, part] : read_) {  // the parts read, in file order, and the gaps between
      read_gap(at, first);
      h.append(part.crc, part.end - first);
      at = part.end;
    }
    read_gap(at, end_);
    if (!tracking_) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_NORMAL);
    expects(h.value() == hash_, "checkpoint", "'", path_, "' is corrupted (checksum mismatch)");
    verified_ = true;
    tracking_ = false;
    read_.clear();
  }

  /// Elements [first, first + out.size()) of `array` into `out`.
  template <checkpoint_scalar T>
  void read(const checkpoint_array<T>& array, std::size_t first, std::span<T> out) {
    expects(first <= array.size && out.size() <= array.size - first, "checkpoint", "elements [", first, ", ",
            first + out.size(), ") of an array of ", array.size);
    if (out.empty()) return;  // (an empty vector's data() may be null)
    const std::uint64_t at = array.offset + first * sizeof(T);
    const auto bytes = std::as_writable_bytes(out);
    if (at >= buffered_ && at + bytes.size() <= buffered_ + filled_) {  // in the buffer already
      std::memcpy(bytes.data(), buffer_.data() + (at - buffered_), bytes.size());
      return;
    }
    read_at(bytes, at);
  }
  template <checkpoint_scalar T>
  std::vector<T> read(const checkpoint_array<T>& array) {
    std::vector<T> values(array.size);
    read(array, 0, std::span<T>(values));
    return values;
  }

 private:
  /// The next out.size() bytes of the payload (in the file: checked by the caller), through the buffer.
  void parse(std::span<std::byte> out) {
    while (!out.empty()) {
      if (pos_ < buffered_ || pos_ >= buffered_ + filled_) {
        buffered_ = pos_;
        filled_ = static_cast<std::size_t>(std::min<std::uint64_t>(buffer_.size(), end_ - pos_));
        read_at(std::span<std::byte>(buffer_).first(filled_), pos_);
      }
      const auto n = std::min<std::size_t>(out.size(), static_cast<std::size_t>(buffered_ + filled_ - pos_));
      std::memcpy(out.data(), buffer_.data() + (pos_ - buffered_), n);
      out = out.subspan(n);
      pos_ += n;
    }
  }
  /// Exactly out.size() bytes of the file from `offset`; while verification is deferred, their
  /// checksum is kept (`track`; the header and verify()'s own reads are not).
  void read_at(std::span<std::byte> out, std::uint64_t offset, bool track = true) {
    if (tracking_ && track && offset >= checkpoint_header_bytes) {
      read_at(out, offset, false);
      note(out, offset);
      return;
    }
    while (!out.empty()) {
      const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
      const int read_error = errno;
      if (n < 0 && read_error == EINTR) continue;
      expects(n >= 0, "checkpoint", "reading '", path_, "' failed at offset ", offset, ": ", errno_text(read_error));
      expects(n > 0, "checkpoint", "'", path_, "' ends at offset ", offset, ", before the end it had when opened",
              " (written while it was read)");
      out = out.subspan(static_cast<std::size_t>(n));
      offset += static_cast<std::uint64_t>(n);
      bytes_read_ += static_cast<std::uint64_t>(n);
    }
  }

  /// Keeps the CRC32C of the parts of `bytes` (read from `offset`) not covered by a part kept
  /// before, each joined to a kept part it touches: the parts never overlap, and those read in
  /// order stay one.
  void note(std::span<const std::byte> bytes, std::uint64_t offset) {
    const std::uint64_t end = offset + bytes.size();
    std::uint64_t at = offset;
    auto next = read_.upper_bound(at);  // the first part starting after `at`
    while (at < end) {
      if (next != read_.begin() && std::prev(next)->second.end > at) {  // `at` lies in a kept part
        at = std::min(end, std::prev(next)->second.end);
        next = read_.upper_bound(at);
        continue;
      }
      const std::uint64_t to = next == read_.end() ? end : std::min(end, next->first);
      const std::uint32_t crc =
          crc32c(bytes.subspan(static_cast<std::size_t>(at - offset), static_cast<std::size_t>(to - at)));
      auto it = next;
      if (next != read_.begin() && std::prev(next)->second.end == at) {  // extends the part before
        it = std::prev(next);
        it->second.crc = crc32c_combine(it->second.crc, crc, to - at);
        it->second.end = to;
      } else {
        it = read_.emplace_hint(next, at, read_part{to, crc});
      }
      if (next != read_.end() && next->first == to) {  // and reaches the part after: one part
        it->second.crc = crc32c_combine(it->second.crc, next->second.crc, next->second.end - next->first);
        it->second.end = next->second.end;
        read_.erase(next);
      }
      at = it->second.end;
      next = read_.upper_bound(at);
    }
  }

  struct read_part {
    std::uint64_t end;  ///< one past its last byte
    std::uint32_t crc;  ///< CRC32C of its bytes
  };

  std::string path_;
  int fd_ = -1;
  std::uint32_t version_ = 0;
  std::uint64_t hash_ = 0;                   ///< the header's checksum of the payload
  bool verified_ = false;                    ///< the payload matched it
  bool tracking_ = false;                    ///< deferred and not verified yet: read_ keeps what was read
  std::map<std::uint64_t, read_part> read_;  ///< the parts of the payload read, by first byte
  std::uint64_t bytes_read_ = 0;
  std::uint64_t end_ = 0;  ///< the file's size
  std::uint64_t pos_ = 0;  ///< where parsing is, in the file
  std::vector<std::byte> buffer_;
  std::uint64_t buffered_ = 0;  ///< the file offset of buffer_[0]
  std::size_t filled_ = 0;      ///< bytes of buffer_ holding the file from buffered_
};

/// The fields of hyper-parameters `h` whose per_group flag is `per_group`, in table order (the
/// shared ones once per checkpoint, the per-group ones per parameter).
template <class HyperParameters>
void put_fields(checkpoint_writer& w, const HyperParameters& h, bool per_group) {
  for_each_value(h, per_group, [&](const auto& value) { w.put(value); });
}
/// Reads what put_fields wrote into those fields of `h` (the others are left as they are).
template <class HyperParameters>
void get_fields(checkpoint_reader& r, HyperParameters& h, bool per_group) {
  for_each_value(h, per_group, [&](auto& value) { value = r.get<std::remove_reference_t<decltype(value)>>(); });
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
template <state_slots Slots, class HyperParameters>
void check_options(checkpoint_reader& r, const basic_zenflow_options<HyperParameters>& o) {
  // Every field is read (the reader's position); the first that differs is named with both values.
  std::string mismatch;
  const auto compare = [&](const char* field, const auto& saved, const auto& ours) {
    if (!mismatch.empty() || saved == ours) return;
    const auto text = [](const auto& v) -> std::string {
      using V = std::decay_t<decltype(v)>;
      if constexpr (std::is_same_v<V, offload_mode>)
        return std::string(offload_mode_name(v));
      else if constexpr (std::is_same_v<V, selection_strategy>)
        return std::string(selection_strategy_name(v));
      else
        return concat(v);
    };
    mismatch = concat(field, " = ", text(saved), ", this coordinator's is ", text(ours));
  };
  compare("mode", static_cast<offload_mode>(r.get<std::uint8_t>()), o.mode);
  compare("topk_ratio", r.get<float>(), o.topk_ratio);
  compare("select_strategy (resolved)", static_cast<selection_strategy>(r.get<std::uint8_t>()), o.resolved_strategy());
  compare("select_interval (in steps)", r.get<std::int64_t>(), o.select_interval_steps());
  const bool update_auto = r.get<bool>();
  const std::int64_t update_value = r.get<std::int64_t>();
  compare("update_interval", update_auto ? std::string("auto") : std::to_string(update_value),
          o.update_interval.is_auto ? std::string("auto") : std::to_string(o.update_interval.value));
  compare("full_warm_up_rounds", r.get<std::int64_t>(), o.full_warm_up_rounds);
  compare("overlap_step", r.get<bool>(), o.overlap_step);
  compare("max_update_interval", r.get<std::int64_t>(), o.max_update_interval);
  // Another optimizer's state, or this optimizer's from a build whose field table or state slots
  // differ, is read no further: its values would be read as other fields.
  const std::string optimizer = r.get_string(), table = r.get_string(), slots = r.get_string();
  const std::string our_table = field_table_text<HyperParameters>(), our_slots = slot_names<Slots>();
  expects(optimizer == HyperParameters::name, "checkpoint", "was written for optimizer '", optimizer,
          "', this coordinator's is '", HyperParameters::name, "'");
  expects(table == our_table, "checkpoint", "was written with ", optimizer, "'s hyper-parameter fields [", table,
          "], this coordinator's ", optimizer, " has [", our_table, "]");
  expects(slots == our_slots, "checkpoint", "holds ", optimizer, " state in slots [", slots,
          "], this coordinator's optimizers keep [", our_slots, "]");
  expects(mismatch.empty(), "checkpoint", "was written with zenflow option ", mismatch,
          " (mode, topk_ratio, the intervals, warm-up and overlap_step must agree)");
  // The moments were computed with these: resuming with others would silently change the
  // optimizer (torch.optim would restore them; here they are fixed at construction).
  HyperParameters saved = o.optimizer;
  get_fields(r, saved, false);
  if (const char* field = shared_field_mismatch(saved, o.optimizer))
    throw error("checkpoint",
                concat("was written with ", HyperParameters::name, " ", field, " = ", field_text(saved, field),
                       ", this coordinator's is ", field_text(o.optimizer, field), " (",
                       field_names<HyperParameters>(false), " must agree)"));
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
