// cpu_adam's moments on an SSD (declared in zenflow/cpu_adam.hpp): the state file, the mapping of
// a tensor's elements to its blocks (8-bit state: whole 8-bit blocks per state-file block), and
// the stream every step, export and import runs on.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
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

inline std::uint64_t cpu_adam::nvme_blocks(const tensor_state& ts) const {
  if (format_ == cpu_state_format::blockwise8_moments) return (ts.blocks + q8_per_block_ - 1) / q8_per_block_;
  return (ts.size + slots_ - 1) / slots_;
}

inline std::pair<std::size_t, std::size_t> cpu_adam::nvme_block_elements(const tensor_state& ts,
                                                                         std::uint64_t d) const {
  if (format_ == cpu_state_format::blockwise8_moments) {  // whole 8-bit blocks [d Q, (d + 1) Q)
    const std::size_t j0 = d * q8_per_block_, j1 = std::min(ts.blocks, j0 + q8_per_block_);
    const std::size_t first = ts.q8_block_start(j0);
    return {first, ts.q8_block_start(j1) - first};
  }
  const std::size_t first = d * slots_;
  return {first, std::min(slots_, ts.size - first)};
}

inline void cpu_adam::split_into_blocks(std::size_t t, std::size_t elem, std::size_t n, std::size_t tag,
                                        std::size_t off, std::vector<nvme_piece>& out) const {
  const tensor_state& ts = tensors_[t];
  while (n > 0) {
    const std::uint64_t d =
        format_ == cpu_state_format::blockwise8_moments ? ts.q8_block_of(elem) / q8_per_block_ : elem / slots_;
    const auto [first, count] = nvme_block_elements(ts, d);
    const std::size_t slot = elem - first;
    const std::size_t k = std::min(n, count - slot);
    out.push_back({ts.first_block + d, slot, k, tag, off, elem});
    elem += k, off += k, n -= k;
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
    switch (format_) {
      case cpu_state_format::fp32:
        a.m = base, a.v = base + slots_;
        break;
      case cpu_state_format::bf16_moments:
        a.words = reinterpret_cast<std::uint32_t*>(base);
        break;
      case cpu_state_format::blockwise8_moments:
        a.qm = reinterpret_cast<std::uint8_t*>(base), a.qv = a.qm + slots_;
        a.dm = reinterpret_cast<float*>(a.qv + slots_), a.dv = a.dm + q8_per_block_;
        break;
    }
    fn(std::span<const nvme_piece>(pieces.data() + first, next - first), a);
  });
}

inline void cpu_adam::nvme_add_tensor(tensor_state& ts, std::span<const float> initial) {
  const std::uint64_t blocks = nvme_blocks(ts);
  const std::size_t block_bytes = nvme_->file.block_bytes;
  try {
    file_->grow((blocks_ + blocks) * block_bytes);
  } catch (const error& e) {
    throw error(detail::concat("config.nvme.", e.argument()), e.reason());
  }
  ts.first_block = blocks_;
  const block_range range{blocks_, blocks};
  file_->stream({&range, 1}, stream_mode::write, [&](const stream_block& b) {
    std::fill(b.data.begin(), b.data.end(), std::byte{0});  // moments 0 (8-bit: codes and scales 0), padding
    const auto [elem, n] = nvme_block_elements(ts, b.position);
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

inline void cpu_adam::nvme_read_state(std::size_t t, std::vector<nvme_piece>& pieces,
                                      const nvme_buffers<std::byte>& to) const {
  const tensor_state& ts = tensors_[t];
  nvme_stream(pieces, stream_mode::read, [&](std::span<const nvme_piece> block, const nvme_arrays& a) {
    for (const nvme_piece& x : block) {
      const std::size_t at = x.off * sizeof(float), bytes = x.n * sizeof(float);
      if (a.p != nullptr) std::memcpy(to.p + at, a.p + x.slot, bytes);
      switch (format_) {
        case cpu_state_format::fp32:
          std::memcpy(to.m + at, a.m + x.slot, bytes);
          std::memcpy(to.v + at, a.v + x.slot, bytes);
          break;
        case cpu_state_format::bf16_moments:
          if (to.raw) {
            std::memcpy(to.m + at, a.words + x.slot, bytes);
            break;
          }
          for (std::size_t i = 0; i < x.n; ++i) {
            const float m = detail::bf16_word_m(a.words[x.slot + i]), v = detail::bf16_word_v(a.words[x.slot + i]);
            std::memcpy(to.m + at + i * sizeof(float), &m, sizeof m);
            std::memcpy(to.v + at + i * sizeof(float), &v, sizeof v);
          }
          break;
        case cpu_state_format::blockwise8_moments:
          detail::for_each_q8_block(ts, x, q8_per_block_,
                                    [&](std::size_t j, std::size_t s, std::size_t i, std::size_t n) {
                                      const std::size_t slot = x.slot + i;
                                      if (to.raw) {
                                        std::memcpy(to.m + x.off + i, a.qm + slot, n);
                                        std::memcpy(to.v + x.off + i, a.qv + slot, n);
                                        std::memcpy(to.dm + j * sizeof(float), a.dm + s, sizeof(float));
                                        std::memcpy(to.dv + j * sizeof(float), a.dv + s, sizeof(float));
                                      } else {  // decoded as export_columns in RAM decodes
                                        float m[q8_block_rows], v[q8_block_rows];
                                        detail::q8_decode_block(a.qm + slot, a.qv + slot, a.dm[s], a.dv[s], n, m, v);
                                        std::memcpy(to.m + at + i * sizeof(float), m, n * sizeof(float));
                                        std::memcpy(to.v + at + i * sizeof(float), v, n * sizeof(float));
                                      }
                                    });
          break;
      }
    }
  });
}

inline void cpu_adam::nvme_write_state(std::size_t t, std::vector<nvme_piece>& pieces,
                                       const nvme_buffers<const std::byte>& from) {
  const tensor_state& ts = tensors_[t];
  nvme_stream(pieces, stream_mode::update, [&](std::span<const nvme_piece> block, const nvme_arrays& a) {
    for (const nvme_piece& x : block) {
      const std::size_t at = x.off * sizeof(float), bytes = x.n * sizeof(float);
      if (a.p != nullptr) std::memcpy(a.p + x.slot, from.p + at, bytes);
      switch (format_) {
        case cpu_state_format::fp32:
          std::memcpy(a.m + x.slot, from.m + at, bytes);
          std::memcpy(a.v + x.slot, from.v + at, bytes);
          break;
        case cpu_state_format::bf16_moments:
          if (from.raw) {
            std::memcpy(a.words + x.slot, from.m + at, bytes);
            break;
          }
          for (std::size_t i = 0; i < x.n; ++i) {
            float m, v;
            std::memcpy(&m, from.m + at + i * sizeof(float), sizeof m);
            std::memcpy(&v, from.v + at + i * sizeof(float), sizeof v);
            a.words[x.slot + i] = detail::bf16_word_nearest(m, v);
          }
          break;
        case cpu_state_format::blockwise8_moments:
          detail::for_each_q8_block(
              ts, x, q8_per_block_, [&](std::size_t j, std::size_t s, std::size_t i, std::size_t n) {
                const std::size_t slot = x.slot + i;
                if (from.raw) {
                  std::memcpy(a.qm + slot, from.m + x.off + i, n);
                  std::memcpy(a.qv + slot, from.v + x.off + i, n);
                  std::memcpy(a.dm + s, from.dm + j * sizeof(float), sizeof(float));
                  std::memcpy(a.dv + s, from.dv + j * sizeof(float), sizeof(float));
                } else {  // re-scaled from the block's own values, to nearest (as import_columns in RAM)
                  float m[q8_block_rows], v[q8_block_rows];
                  std::memcpy(m, from.m + at + i * sizeof(float), n * sizeof(float));
                  std::memcpy(v, from.v + at + i * sizeof(float), n * sizeof(float));
                  detail::q8_encode_block_nearest(m, v, n, a.qm + slot, a.qv + slot, a.dm[s], a.dv[s]);
                }
              });
          break;
      }
    }
  });
}

}  // namespace zenflow
