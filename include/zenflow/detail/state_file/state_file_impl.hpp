// basic_state_file's definitions: construction and the block pipeline every read, write and
// stream runs on. Included by state_file.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <deque>
#include <exception>
#include <optional>
#include <vector>

namespace zenflow {

namespace detail {
inline constexpr std::size_t max_stream_depth = 1024;

/// Checks a state_file_config and the engine's queue depth; returns the file's path.
inline std::string check_state_file_config(const state_file_config& c, std::size_t queue_depth) {
  expects(!c.directory.empty(), "directory", "must name a directory on the SSD, got an empty path");
  const std::string name = c.file_name.empty() ? concat("zenflow_state.rank", c.rank, ".bin") : c.file_name;
  expects(name != "." && name != ".." && name.find('/') == std::string::npos, "file_name",
          "must be a plain file name (no '/'), got \"", name, "\"");
  expects(c.rank >= 0, "rank", "must be >= 0, got ", c.rank);
  // block_bytes first: cpu_adam sizes its first file from it (bytes = block_bytes), and names only it.
  expects(c.block_bytes > 0 && c.block_bytes % pinned_buffer_pool::alignment == 0, "block_bytes",
          "must be a positive multiple of ", pinned_buffer_pool::alignment, " (the O_DIRECT alignment), got ",
          c.block_bytes);
  expects(c.bytes > 0, "bytes", "must be positive, got 0");
  expects(c.block_bytes <= (std::size_t{1} << 30), "block_bytes", "must be at most 1 GiB, got ", c.block_bytes);
  expects(c.bytes <= static_cast<std::uint64_t>(INT64_MAX) - c.block_bytes, "bytes", "too large: ", c.bytes);
  expects(c.read_ahead <= max_stream_depth, "read_ahead", "must be at most ", max_stream_depth, ", got ", c.read_ahead);
  expects(c.write_behind <= max_stream_depth, "write_behind", "must be at most ", max_stream_depth, ", got ",
          c.write_behind);
  expects(c.direct == direct_io::required || c.direct == direct_io::fallback_to_buffered, "direct",
          "must be direct_io::required or direct_io::fallback_to_buffered");
  expects(c.pin == pin_policy::automatic || c.pin == pin_policy::required || c.pin == pin_policy::none, "pin",
          "must be pin_policy::automatic, required or none");
  const std::size_t buffers = stream_buffers(c.read_ahead, c.write_behind);
  expects(queue_depth >= buffers, "queue_depth", "the engine's queue depth ", queue_depth,
          " is below the stream's read_ahead + 1 + write_behind = ", buffers,
          " buffers, every one of which may be in flight");
  return (c.directory / name).string();
}
}  // namespace detail

template <io_engine Engine>
basic_state_file<Engine>::basic_state_file(const state_file_config& config, Engine engine)
    : engine_(std::move(engine)) {
  const std::string path = detail::check_state_file_config(config, engine_.queue_depth());
  block_bytes_ = config.block_bytes;
  block_count_ = (config.bytes + block_bytes_ - 1) / block_bytes_;
  bytes_ = config.bytes;
  read_ahead_ = config.read_ahead;
  write_behind_ = config.write_behind;
  detail::check_before_create(config.directory.string(), path, capacity(), config.allow_memory_backed);
  try {
    pool_ = pinned_buffer_pool(stream_buffers(read_ahead_, write_behind_), block_bytes_, config.pin, config.hook);
  } catch (const error& e) {
    throw error(e.argument() == "policy" ? "pin" : e.argument() == "hook" ? "hook" : e.argument(), e.reason());
  }
  file_ = detail::create_scratch(config.directory.string(), path, capacity(), block_bytes_,
                                 config.direct == direct_io::fallback_to_buffered, config.keep_file, io_note_);
  file_id_ = engine_.add_file(file_.fd(), file_.path());
  std::vector<std::span<std::byte>> buffers;
  for (std::size_t i = 0; i < pool_.size(); ++i) buffers.push_back(pool_.buffer(i));
  registered_ = engine_.register_buffers(buffers);
  // fallocate zero-fills: a block never written reads as zeros and verifies as such.
  std::fill_n(pool_.buffer(0).data(), block_bytes_, std::byte{0});
  zero_crc_ = crc32c(pool_.buffer(0));
  sums_.reset(block_count_, zero_crc_);
  directory_ = config.directory.string();
}

template <io_engine Engine>
void basic_state_file<Engine>::grow(std::uint64_t bytes) {
  expects(bytes <= static_cast<std::uint64_t>(INT64_MAX) - block_bytes_, "bytes", "too large: ", bytes);
  const std::uint64_t blocks = (bytes + block_bytes_ - 1) / block_bytes_;
  if (blocks <= block_count_) return;
  detail::preallocate(file_.fd(), directory_, path(), capacity(), (blocks - block_count_) * block_bytes_);
  sums_.crc.resize(blocks, zero_crc_);
  block_count_ = blocks;
  bytes_ = std::max(bytes_, bytes);
}

template <io_engine Engine>
std::string basic_state_file<Engine>::status() const {
  return detail::concat(path(), ": ", capacity(), " bytes in ", block_count_, " blocks of ", block_bytes_, ", ",
                        direct() ? std::string("O_DIRECT") : io_note_, ", preallocated; stream: read_ahead ",
                        read_ahead_, ", write_behind ", write_behind_, "; engine: ", engine_.status(),
                        "; pool: ", pool_.size(), " x ", pool_.buffer_bytes(), " bytes, ", pool_.status());
}

template <io_engine Engine>
void basic_state_file<Engine>::check_readable(std::uint64_t block, const char* argument) const {
  if (sums_.lost.empty()) return;
  const auto it = sums_.lost.find(block);
  expects(it == sums_.lost.end(), argument, "block ", block, " at offset ", block * block_bytes_, " of ", path(),
          " is unreadable until written again: its last write failed (", it == sums_.lost.end() ? "" : it->second, ")");
}

template <io_engine Engine>
void basic_state_file<Engine>::read(std::uint64_t offset, std::span<std::byte> out) {
  expects(offset <= capacity() && out.size() <= capacity() - offset, "offset", "bytes [", offset, ", ",
          offset + out.size(), ") are outside the file's ", capacity(), " bytes");
  if (out.empty()) return;
  const block_range r = blocks_of(offset, out.size());
  for (std::uint64_t k = 0; k < r.count; ++k) check_readable(r.first + k, "offset");
  run(
      r.count,
      [&](std::uint64_t k) {
        return step{r.first + k, true, false};
      },
      [&](const stream_block& b) {
        const std::uint64_t lo = std::max(offset, b.offset);
        const std::uint64_t hi = std::min<std::uint64_t>(offset + out.size(), b.offset + block_bytes_);
        std::copy_n(b.data.data() + (lo - b.offset), hi - lo, out.data() + (lo - offset));
      },
      {});
}

template <io_engine Engine>
void basic_state_file<Engine>::write(std::uint64_t offset, std::span<const std::byte> in) {
  expects(offset <= capacity() && in.size() <= capacity() - offset, "offset", "bytes [", offset, ", ",
          offset + in.size(), ") are outside the file's ", capacity(), " bytes");
  if (in.empty()) return;
  const block_range r = blocks_of(offset, in.size());
  const auto whole = [&](std::uint64_t block) {
    return block * block_bytes_ >= offset && (block + 1) * block_bytes_ <= offset + in.size();
  };
  for (std::uint64_t k = 0; k < r.count; ++k)
    if (!whole(r.first + k)) check_readable(r.first + k, "offset");
  run(
      r.count,
      [&](std::uint64_t k) {
        const std::uint64_t b = r.first + k;
        return step{b, !whole(b), true};
      },
      [&](const stream_block& b) {
        const std::uint64_t lo = std::max(offset, b.offset);
        const std::uint64_t hi = std::min<std::uint64_t>(offset + in.size(), b.offset + block_bytes_);
        std::copy_n(in.data() + (lo - offset), hi - lo, b.data.data() + (lo - b.offset));
      },
      {});
}

template <io_engine Engine>
template <class Fn>
requires std::invocable<Fn&, const stream_block&> stream_result
basic_state_file<Engine>::stream(std::span<const block_range> ranges, stream_mode mode, Fn&& fn, std::stop_token stop) {
  expects(mode == stream_mode::read || mode == stream_mode::write || mode == stream_mode::update, "mode",
          "must be stream_mode::read, write or update");
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const block_range& r = ranges[i];
    expects(r.first <= block_count_ && r.count <= block_count_ - r.first, "ranges", "range ", i, " (blocks [", r.first,
            ", ", r.first + r.count, ")) is outside the file's ", block_count_, " blocks");
    n += r.count;
  }
  if (mode != stream_mode::read) {
    std::vector<block_range> sorted(ranges.begin(), ranges.end());
    std::sort(sorted.begin(), sorted.end(),
              [](const block_range& a, const block_range& b) { return a.first < b.first; });
    for (std::size_t i = 1; i < sorted.size(); ++i)
      expects(sorted[i].count == 0 || sorted[i - 1].first + sorted[i - 1].count <= sorted[i].first, "ranges",
              "blocks [", sorted[i - 1].first, ", ", sorted[i - 1].first + sorted[i - 1].count, ") and [",
              sorted[i].first, ", ", sorted[i].first + sorted[i].count,
              ") overlap: a block may be written once per stream");
  }
  if (mode != stream_mode::write)
    for (const block_range& r : ranges)
      for (std::uint64_t k = 0; k < r.count; ++k) check_readable(r.first + k, "ranges");
  if (n == 0) return {};
  // Position k -> block: walk the ranges forward (positions are asked for in increasing order).
  std::size_t range = 0;
  std::uint64_t range_start = 0;
  const bool reads = mode != stream_mode::write, writes = mode != stream_mode::read;
  return run(
      n,
      [&](std::uint64_t k) {
        while (k >= range_start + ranges[range].count) range_start += ranges[range++].count;
        return step{ranges[range].first + (k - range_start), reads, writes};
      },
      fn, stop);
}

// The pipeline. Positions 0..n-1, each a block with whether it is read first and written after.
// Buffers: free, assigned to a position in the window [cur, next) (reading or ready), or being
// written. A position takes a free buffer only while it is at most read_ahead past cur, so the
// window holds at most read_ahead + 1 buffers and the writes the rest: the pool (read_ahead + 1 +
// write_behind) can never be short, and when no buffer is free some request is in flight.
template <io_engine Engine>
template <class StepAt, class Fn>
stream_result basic_state_file<Engine>::run(std::uint64_t n, StepAt&& step_at, Fn&& fn, std::stop_token stop) {
  struct slot {
    std::uint32_t buffer = 0;
    step s;
    bool ready = false;
  };
  struct writing {
    std::uint64_t block = 0;
    std::uint64_t position = 0;
    std::uint32_t crc = 0;
  };
  std::vector<std::uint32_t> free_buffers;
  for (std::size_t i = pool_.size(); i-- > 0;) free_buffers.push_back(static_cast<std::uint32_t>(i));
  std::vector<writing> writes(pool_.size());
  std::deque<slot> window;  // window[0] is position cur
  std::vector<io_completion> done(pool_.size());
  std::optional<error> failure;  // the failure earliest in stream order
  std::uint64_t failure_position = 0;
  std::exception_ptr thrown;
  std::uint64_t cur = 0, next = 0;
  stream_result result;

  const auto request = [&](io_op op, std::uint32_t buffer, std::uint64_t block) {
    io_request r;
    r.op = op;
    r.file = file_id_;
    r.offset = block * block_bytes_;
    r.buffer = pool_.buffer(buffer).data();
    r.bytes = block_bytes_;
    r.buffer_index = static_cast<std::int32_t>(buffer);
    r.user_data = buffer;
    engine_.submit(r);
  };
  const auto fail = [&](std::uint64_t position, error e) {
    if (!failure || position < failure_position) {
      failure.emplace(std::move(e));
      failure_position = position;
    }
  };
  const auto handle = [&](const io_completion& c) {
    const auto buffer = static_cast<std::uint32_t>(c.request.user_data);
    if (c.request.op == io_op::write) {
      const writing& w = writes[buffer];
      if (c.ok()) {
        sums_.written(w.block, w.crc);
        counters_.bytes_written += c.done;
      } else {
        const std::string why = engine_.describe(c);
        sums_.lost[w.block] = why;
        fail(w.position, error("write", why));
      }
      free_buffers.push_back(buffer);
      return;
    }
    for (std::size_t i = 0; i < window.size(); ++i)
      if (window[i].buffer == buffer && !window[i].ready) {
        if (c.ok()) {
          window[i].ready = true;
        } else {
          fail(cur + i, error("read", engine_.describe(c)));
        }
        return;
      }
  };
  const auto reap = [&](std::size_t min) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t got = engine_.wait(done, min);
    if (min > 0) counters_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (std::size_t i = 0; i < got; ++i) handle(done[i]);
  };
  const auto top_up = [&] {
    while (!failure && next < n && next <= cur + read_ahead_ && !free_buffers.empty()) {
      const step s = step_at(next);
      const std::uint32_t buffer = free_buffers.back();
      free_buffers.pop_back();
      window.push_back({buffer, s, !s.read});
      if (s.read) request(io_op::read, buffer, s.block);
      ++next;
    }
  };

  try {
    for (; cur < n; ++cur) {
      top_up();
      while (!failure && (window.empty() || !window.front().ready)) {
        expects(engine_.in_flight() > 0, "stream", "internal error: no buffer free and nothing in flight");
        reap(1);
        top_up();
      }
      if (failure) break;
      if (stop.stop_requested()) {
        result.stopped = true;
        break;
      }
      const slot s = window.front();
      const std::span<std::byte> data = pool_.buffer(s.buffer);
      if (s.s.read) {
        const std::uint32_t got = crc32c(data);
        if (got != sums_.crc[s.s.block]) {
          ++counters_.checksum_failures;
          fail(cur, error("read", detail::concat("block ", s.s.block, " at offset ", s.s.block * block_bytes_, " of ",
                                                 path(), " (", block_bytes_, " bytes) is corrupt: its CRC32C is 0x",
                                                 detail::hex32(got), ", 0x", detail::hex32(sums_.crc[s.s.block]),
                                                 " was written; it was not handed to the caller")));
          break;
        }
        counters_.bytes_read += block_bytes_;
      }
      fn(stream_block{cur, s.s.block, s.s.block * block_bytes_, data});
      window.pop_front();
      if (s.s.write) {
        writes[s.buffer] = {s.s.block, cur, crc32c(data)};
        request(io_op::write, s.buffer, s.s.block);
      } else {
        free_buffers.push_back(s.buffer);
      }
      ++result.blocks;
      reap(0);
    }
  } catch (...) {
    thrown = std::current_exception();
  }
  // Nothing stays in flight: reap every request (a write that completes still commits its checksum).
  while (engine_.in_flight() > 0) reap(engine_.in_flight());
  if (thrown) std::rethrow_exception(thrown);
  if (failure) throw *failure;
  return result;
}

}  // namespace zenflow
