// cpu_adam's moments on an SSD (declared in zenflow/cpu_adam.hpp): the state file, the mapping of
// a tensor's elements to its blocks, and the stream every step, export and import runs on.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "zenflow/cpu_adam.hpp"

namespace zenflow {

inline std::unique_ptr<state_file> cpu_adam::make_state_file(std::uint64_t bytes) const {
  state_file_config c = nvme_->file;
  c.bytes = bytes;
  try {
    return std::make_unique<state_file>(c, nvme_->engine);
  } catch (const error& e) {
    // The state file names its own config's field; the caller set cpu_adam_config::nvme.
    throw error(detail::concat("config.nvme.", e.argument()), e.reason());
  }
}

inline void cpu_adam::split_into_blocks(std::size_t t, std::size_t elem, std::size_t n, std::size_t tag,
                                        std::size_t off, std::vector<nvme_piece>& out) const {
  const tensor_state& ts = tensors_[t];
  while (n > 0) {
    const std::size_t slot = elem % slots_;
    const std::size_t count = std::min(n, slots_ - slot);
    out.push_back({ts.first_block + elem / slots_, slot, count, tag, off});
    elem += count, off += count, n -= count;
  }
}

template <class Fn>
void cpu_adam::nvme_stream(std::vector<nvme_piece>& pieces, stream_mode mode, Fn&& fn) const {
  if (pieces.empty()) return;
  if (!sized_) {  // replace the one-block file made at construction (fresh: it reads as zeros)
    if (file_->block_count() < blocks_) {
      file_.reset();
      file_ = make_state_file(blocks_ * nvme_->file.block_bytes);
    }
    sized_ = true;
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const nvme_piece& a, const nvme_piece& b) {
    return a.block != b.block ? a.block < b.block : a.slot < b.slot;
  });
  std::vector<block_range> ranges;
  for (const nvme_piece& p : pieces) {
    if (!ranges.empty() && ranges.back().first + ranges.back().count - 1 == p.block) continue;  // same block
    if (!ranges.empty() && ranges.back().first + ranges.back().count == p.block)
      ++ranges.back().count;
    else
      ranges.push_back({p.block, 1});
  }
  std::size_t next = 0;
  file_->stream(ranges, mode, [&](const stream_block& b) {
    const std::size_t first = next;
    while (next < pieces.size() && pieces[next].block == b.index) ++next;
    auto* base = reinterpret_cast<float*>(b.data.data());
    nvme_arrays a;
    if (master_on_nvme()) a.p = base, base += slots_;
    if (format_ == cpu_state_format::fp32)
      a.m = base, a.v = base + slots_;
    else
      a.words = reinterpret_cast<std::uint32_t*>(base);
    fn(std::span<const nvme_piece>(pieces.data() + first, next - first), a);
  });
}

inline void cpu_adam::nvme_add_tensor(tensor_state& ts, std::span<const float> initial) {
  const std::uint64_t blocks = (ts.size + slots_ - 1) / slots_;
  const std::size_t block_bytes = nvme_->file.block_bytes;
  try {
    file_->grow((blocks_ + blocks) * block_bytes);
  } catch (const error& e) {
    throw error(detail::concat("config.nvme.", e.argument()), e.reason());
  }
  ts.first_block = blocks_;
  const block_range range{blocks_, blocks};
  file_->stream({&range, 1}, stream_mode::write, [&](const stream_block& b) {
    std::fill(b.data.begin(), b.data.end(), std::byte{0});  // moments 0, and the padding
    const std::size_t elem = b.position * slots_;
    const std::size_t n = std::min(slots_, ts.size - elem);
    std::memcpy(b.data.data(), initial.data() + elem, n * sizeof(float));
  });
  blocks_ += blocks;
  sized_ = true;
}

inline auto cpu_adam::column_pieces(std::size_t t, std::span<const std::int32_t> columns) const
    -> std::vector<nvme_piece> {
  const auto rows = static_cast<std::size_t>(tensors_[t].rows);
  std::vector<nvme_piece> pieces;
  for (std::size_t j = 0; j < columns.size(); ++j)
    split_into_blocks(t, static_cast<std::size_t>(columns[j]) * rows, rows, 0, j * rows, pieces);
  return pieces;
}

inline void cpu_adam::nvme_read_state(std::vector<nvme_piece>& pieces, std::byte* p_out, std::byte* m_out,
                                      std::byte* v_out, bool raw) const {
  nvme_stream(pieces, stream_mode::read, [&](std::span<const nvme_piece> block, const nvme_arrays& a) {
    for (const nvme_piece& x : block) {
      const std::size_t at = x.off * sizeof(float), bytes = x.n * sizeof(float);
      if (a.p != nullptr) std::memcpy(p_out + at, a.p + x.slot, bytes);
      if (a.words == nullptr) {
        std::memcpy(m_out + at, a.m + x.slot, bytes);
        std::memcpy(v_out + at, a.v + x.slot, bytes);
      } else if (raw) {
        std::memcpy(m_out + at, a.words + x.slot, bytes);
      } else {
        for (std::size_t i = 0; i < x.n; ++i) {
          const float m = detail::bf16_word_m(a.words[x.slot + i]), v = detail::bf16_word_v(a.words[x.slot + i]);
          std::memcpy(m_out + at + i * sizeof(float), &m, sizeof m);
          std::memcpy(v_out + at + i * sizeof(float), &v, sizeof v);
        }
      }
    }
  });
}

inline void cpu_adam::nvme_write_state(std::vector<nvme_piece>& pieces, const std::byte* p_in, const std::byte* m_in,
                                       const std::byte* v_in, bool raw) {
  nvme_stream(pieces, stream_mode::update, [&](std::span<const nvme_piece> block, const nvme_arrays& a) {
    for (const nvme_piece& x : block) {
      const std::size_t at = x.off * sizeof(float), bytes = x.n * sizeof(float);
      if (a.p != nullptr) std::memcpy(a.p + x.slot, p_in + at, bytes);
      if (a.words == nullptr) {
        std::memcpy(a.m + x.slot, m_in + at, bytes);
        std::memcpy(a.v + x.slot, v_in + at, bytes);
      } else if (raw) {
        std::memcpy(a.words + x.slot, m_in + at, bytes);
      } else {
        for (std::size_t i = 0; i < x.n; ++i) {
          float m, v;
          std::memcpy(&m, m_in + at + i * sizeof(float), sizeof m);
          std::memcpy(&v, v_in + at + i * sizeof(float), sizeof v);
          a.words[x.slot + i] = detail::bf16_word_nearest(m, v);
        }
      }
    }
  });
}

}  // namespace zenflow
