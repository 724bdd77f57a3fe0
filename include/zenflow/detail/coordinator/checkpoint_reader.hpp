// The coordinator's checkpoint file, read: where an array lies, the reader (the header checked,
// the payload parsed through a buffer, arrays read in parts, the checksum verified upfront or on
// the reads the caller makes anyway), and the reader's side of the options a checkpoint must be
// resumed with (checkpoint_format.hpp has the file's layout constants, the checksum and the
// writer). checkpoint_load.hpp reads the coordinator's state through it.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "zenflow/crc32c.hpp"
#include "zenflow/detail/coordinator/checkpoint_format.hpp"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/state_slots.hpp"

namespace zenflow::detail {

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
  /// header's (at once, without reading, once a verification found it so). Once verified, does
  /// nothing. Parsing goes on where it was.
  void verify() {
    if (verified_) return;
    expects(!mismatched_, "checkpoint", "'", path_, "' is corrupted (checksum mismatch)");  // (found before)
    checkpoint_checksum h(version_);
    filled_ = 0;  // the gaps are read through the parse buffer: parsing reads its window again
    const auto read_gap = [&](std::uint64_t from, std::uint64_t to) {
      for (std::uint64_t at = from; at < to;) {
        const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer_.size(), to - at));
        read_at(std::span<std::byte>(buffer_).first(n), at, false);
        h.update(std::span<const std::byte>(buffer_).first(n));
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
    mismatched_ = h.value() != hash_;
    expects(!mismatched_, "checkpoint", "'", path_, "' is corrupted (checksum mismatch)");
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
  bool mismatched_ = false;                  ///< a verification found that it did not
  bool tracking_ = false;                    ///< deferred and not verified yet: read_ keeps what was read
  std::map<std::uint64_t, read_part> read_;  ///< the parts of the payload read, by first byte
  std::uint64_t bytes_read_ = 0;
  std::uint64_t end_ = 0;  ///< the file's size
  std::uint64_t pos_ = 0;  ///< where parsing is, in the file
  std::vector<std::byte> buffer_;
  std::uint64_t buffered_ = 0;  ///< the file offset of buffer_[0]
  std::size_t filled_ = 0;      ///< bytes of buffer_ holding the file from buffered_
};

/// Reads what put_fields wrote into those fields of `h` (the others are left as they are).
template <class HyperParameters>
void get_fields(checkpoint_reader& r, HyperParameters& h, bool per_group) {
  for_each_value(h, per_group, [&](auto& value) { value = r.get<std::remove_reference_t<decltype(value)>>(); });
}

/// Reads what put_options wrote; throws naming the first field that differs from `o` (and its
/// two values), another optimizer, field table or state slots, or a shared hyper-parameter that
/// differs.
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

}  // namespace zenflow::detail
