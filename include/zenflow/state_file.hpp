// The NVMe state tier's storage: one preallocated O_DIRECT file per rank, block-aligned, a
// CRC32C per block kept in RAM and verified on every read, an exact-size pinned buffer pool, an
// I/O engine (io_engine.hpp), and the streaming primitive the CPU update of an interval runs on.
//
// Layout. The file holds `block_count()` blocks of `block_bytes()`: block i is the bytes
// [i * block_bytes, (i + 1) * block_bytes). What a block holds is the caller's business (the
// optimizer's state storage maps its columns to blocks). The file is scratch: created (or
// truncated) at construction, preallocated with fallocate (zero-filled), removed at destruction
// unless `keep_file`.
//
// Streaming. `stream(ranges, mode, fn)` runs fn on every block of `ranges`, in order, on the
// calling thread, while the engine reads up to `read_ahead` blocks ahead and writes up to
// `write_behind` finished blocks back:
//
//     read block i+1..i+read_ahead  |  fn(block i)  |  write block i-1..i-write_behind
//
// The pool holds exactly read_ahead + 1 + write_behind buffers of block_bytes (stream_buffers()),
// allocated at construction from the same numbers the stream runs with, and the stream takes a
// buffer only from the free ones: it cannot run out. `read` and `write` move arbitrary byte
// ranges through the same pipeline (a partly covered block is read, modified, written back): what
// checkpoints and column migration need.
//
// Integrity and errors. Every block read is checked against its CRC32C before anyone sees it: a
// mismatch throws `zenflow::error` naming the block, its offset and the file, and the caller's
// function is never called on it. Every completion is checked (io_engine R8); a failed or short
// transfer throws with the engine's description (file, offset, length, errno text). A block
// whose write failed is unreadable until it is written again. Whatever fails — a read, a write,
// a checksum, the caller's function (its exception is rethrown as is) — the stream stops
// submitting, reaps every request in flight, then throws (of several failed transfers, the one
// earliest in stream order): nothing is left in flight when a call returns or throws. Blocks whose write completed
// before the failure hold their new contents; the others hold their old ones.
//
// One thread at a time calls a state file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <stop_token>
#include <string>
#include <vector>

#include "zenflow/crc32c.hpp"
#include "zenflow/detail/state_file/checksums.hpp"
#include "zenflow/detail/state_file/scratch_file.hpp"
#include "zenflow/error.hpp"
#include "zenflow/io_engine.hpp"
#include "zenflow/pinned_pool.hpp"

namespace zenflow {

/// What a file system that refuses O_DIRECT gets.
enum class direct_io : std::uint8_t {
  required,             ///< a zenflow::error at construction
  fallback_to_buffered  ///< buffered I/O through the page cache; status() says so
};

/// Construction settings of a state file.
struct state_file_config {
  std::filesystem::path directory;                 ///< an existing, writable directory on the SSD
  std::string file_name;                           ///< "" : "zenflow_state.rank<rank>.bin"
  int rank = 0;                                    ///< names the default file: one file per rank
  std::uint64_t bytes = 0;                         ///< state bytes; the file holds them in whole blocks
  std::size_t block_bytes = std::size_t{1} << 20;  ///< unit of I/O and of checksums, a multiple of 4096
  std::size_t read_ahead = 4;                      ///< blocks read ahead of the one being processed
  std::size_t write_behind = 4;                    ///< block writes in flight behind it
  direct_io direct = direct_io::required;          ///< what a file system without O_DIRECT gets
  bool allow_memory_backed = false;                ///< accept tmpfs / ramfs (tests; the state then uses RAM)
  bool keep_file = false;                          ///< leave the file in place at destruction
  pin_policy pin = pin_policy::automatic;          ///< how the pool is pinned
  pin_hook hook;                                   ///< replaces mlock (cudaHostRegister in a CUDA build)
};

/// The pool buffers a stream with these depths needs: read_ahead + 1 + write_behind.
constexpr std::size_t stream_buffers(std::size_t read_ahead, std::size_t write_behind) noexcept {
  return read_ahead + 1 + write_behind;
}

/// Blocks [first, first + count).
struct block_range {
  std::uint64_t first = 0;  ///< first block index
  std::uint64_t count = 0;  ///< number of blocks
};

/// What a stream does with each block.
enum class stream_mode : std::uint8_t {
  read,   ///< read and verify, call fn; nothing is written
  write,  ///< call fn on a buffer to fill (its prior contents are unspecified), write it
  update  ///< read and verify, call fn to modify it in place, write it back
};

/// The block the caller's function gets.
struct stream_block {
  std::uint64_t position = 0;  ///< 0, 1, 2, ... in stream order
  std::uint64_t index = 0;     ///< block index in the file
  std::uint64_t offset = 0;    ///< index * block_bytes
  std::span<std::byte> data;   ///< the block, block_bytes long, in a pool buffer
};

/// What a stream did.
struct stream_result {
  std::uint64_t blocks = 0;  ///< blocks handed to fn
  bool stopped = false;      ///< stopped early by the stop token
};

/// The state file's I/O accounting since construction (or reset_counters).
struct state_file_counters {
  std::uint64_t bytes_read = 0;         ///< bytes read from the file (verified)
  std::uint64_t bytes_written = 0;      ///< bytes written to the file (completed)
  std::uint64_t checksum_failures = 0;  ///< blocks that failed their CRC32C check
  double wait_seconds = 0;              ///< time the calling thread waited on the disk
};

/// One rank's state file on an SSD, over I/O engine `Engine`. Not copyable or movable.
template <io_engine Engine = any_io_engine>
class basic_state_file {
 public:
  /// Checks `config` and the engine's queue depth (>= stream_buffers), the directory (exists,
  /// is a directory, not memory-backed, the target is not a directory) and the free space
  /// (statvfs) before creating anything; then maps and pins the pool, creates and locks the file,
  /// preallocates it and registers the pool with the engine. Throws `zenflow::error` naming the
  /// config field (`directory`, `file_name`, `bytes` — disk full names the path, the bytes
  /// needed and the bytes free — `block_bytes`, `read_ahead`, `write_behind`, `queue_depth`,
  /// `pin`) and leaves no file behind.
  basic_state_file(const state_file_config& config, Engine engine);
  /// As above with make_io_engine(engine) (any_io_engine only).
  explicit basic_state_file(const state_file_config& config,
                            const io_engine_config& engine = {}) requires std::same_as<Engine, any_io_engine>
      : basic_state_file(config, make_io_engine(engine)) {}
  basic_state_file(const basic_state_file&) = delete;
  basic_state_file& operator=(const basic_state_file&) = delete;
  /// Closes the file and removes it (unless keep_file). Nothing is in flight between calls.
  ~basic_state_file() = default;

  /// The file's path: directory / file_name.
  [[nodiscard]] const std::string& path() const noexcept { return file_.path(); }
  /// The state bytes asked for.
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  /// block_count() x block_bytes(): the file's size, and the range read/write may address.
  [[nodiscard]] std::uint64_t capacity() const noexcept { return block_count_ * block_bytes_; }
  /// The unit of I/O and checksums.
  [[nodiscard]] std::size_t block_bytes() const noexcept { return block_bytes_; }
  /// Blocks in the file.
  [[nodiscard]] std::uint64_t block_count() const noexcept { return block_count_; }
  /// Blocks read ahead by a stream.
  [[nodiscard]] std::size_t read_ahead() const noexcept { return read_ahead_; }
  /// Block writes in flight behind a stream.
  [[nodiscard]] std::size_t write_behind() const noexcept { return write_behind_; }
  /// Whether the file is open with O_DIRECT (false only with direct_io::fallback_to_buffered).
  [[nodiscard]] bool direct() const noexcept { return file_.direct(); }
  /// The blocks that hold bytes [offset, offset + bytes) (count 0 when bytes is 0).
  [[nodiscard]] block_range blocks_of(std::uint64_t offset, std::uint64_t bytes) const noexcept {
    if (bytes == 0) return {offset / block_bytes_, 0};
    return {offset / block_bytes_, (offset + bytes - 1) / block_bytes_ - offset / block_bytes_ + 1};
  }
  /// One line on the file, the I/O mode, the engine and the pool.
  [[nodiscard]] std::string status() const;
  /// The engine (its status, queue depth).
  [[nodiscard]] const Engine& engine() const noexcept { return engine_; }
  /// The pool: stream_buffers(read_ahead, write_behind) buffers of block_bytes.
  [[nodiscard]] const pinned_buffer_pool& pool() const noexcept { return pool_; }
  /// The I/O accounting.
  [[nodiscard]] const state_file_counters& counters() const noexcept { return counters_; }
  /// Zeroes the I/O accounting.
  void reset_counters() noexcept { counters_ = {}; }
  /// The CRC32C block i must have when read. Throws `zenflow::error` naming `i` if out of range.
  [[nodiscard]] std::uint32_t block_checksum(std::uint64_t i) const {
    expects(i < block_count_, "i", "block ", i, " out of range (", block_count_, " blocks)");
    return sums_.crc[i];
  }

  /// Extends the file to hold at least `bytes` (whole blocks; preallocated, zero-filled, so the new
  /// blocks read as zeros); a size it already holds changes nothing. Throws `zenflow::error`
  /// (argument `bytes`; disk full names the path, the bytes needed and the bytes free) with the
  /// file as it was.
  void grow(std::uint64_t bytes);

  /// Reads bytes [offset, offset + out.size()) into `out` (any host memory), verifying every
  /// block. Throws `zenflow::error` naming `offset` (outside capacity(), or a block whose last
  /// write failed) before any I/O, or with the engine's description or the checksum mismatch;
  /// `out` then holds the blocks that verified, and never a byte of one that did not.
  /// Synchronizes.
  void read(std::uint64_t offset, std::span<std::byte> out);
  /// Writes `in` to bytes [offset, offset + in.size()); a partly covered block is read (and
  /// verified), modified and written back. Throws as read does. Synchronizes.
  void write(std::uint64_t offset, std::span<const std::byte> in);

  /// Runs `fn(const stream_block&)` on every block of `ranges`, in order, on the calling thread,
  /// pipelined as the header describes. Ranges may not overlap in write and update modes.
  /// Checks the ranges (inside the file; no overlap; no unreadable block to read) before any
  /// I/O and throws `zenflow::error` naming `ranges`. `stop`: when a stop is requested the
  /// stream finishes the writes in flight and returns with `stopped` (blocks after the last one
  /// handed to fn are untouched). Synchronizes: returns or throws with nothing in flight.
  template <class Fn>
  requires std::invocable<Fn&, const stream_block&> stream_result stream(std::span<const block_range> ranges,
                                                                         stream_mode mode, Fn&& fn,
                                                                         std::stop_token stop = {});

 private:
  struct step {
    std::uint64_t block = 0;
    bool read = false;
    bool write = false;
  };
  template <class StepAt, class Fn>
  stream_result run(std::uint64_t n, StepAt&& step_at, Fn&& fn, std::stop_token stop);
  void check_readable(std::uint64_t block, const char* argument) const;

  std::uint64_t bytes_ = 0;
  std::size_t block_bytes_ = 0;
  std::uint64_t block_count_ = 0;
  std::size_t read_ahead_ = 0;
  std::size_t write_behind_ = 0;
  pinned_buffer_pool pool_;
  detail::scratch_file file_;
  Engine engine_;  // destroyed first: it waits for its transfers before the file closes and the pool unmaps
  std::uint32_t file_id_ = 0;
  std::string directory_;
  std::uint32_t zero_crc_ = 0;  // the CRC32C of a block of zeros (a preallocated, never written block)
  bool registered_ = false;
  std::string io_note_;
  detail::block_checksums sums_;
  state_file_counters counters_;
};

/// The state file over whichever engine make_io_engine chose.
using state_file = basic_state_file<any_io_engine>;

}  // namespace zenflow

#include "zenflow/detail/state_file/state_file_impl.hpp"
