// Definitions of cpu_adam's state accounting and movement (declared in zenflow/cpu_adam.hpp):
// fp32 moment spans, bytes held, export/import of columns in fp32, save/load of raw bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zenflow/cpu_adam.hpp"

namespace zenflow {

namespace detail {
/// The header of cpu_adam::save_state's bytes (host byte order).
struct saved_state_header {
  std::uint32_t magic = 0x5343465au;  // "ZFCS" in little-endian bytes
  std::uint16_t version = 1;
  std::uint8_t format = 0;
  std::uint8_t reserved0 = 0;
  std::uint32_t block_rows = 0;  // q8_block_rows for the 8-bit format, else 0
  std::uint32_t reserved1 = 0;
  std::uint64_t rows = 0, cols = 0;
  std::uint64_t payload_bytes = 0;  // the bytes after the header
};
static_assert(sizeof(saved_state_header) == 40);
inline constexpr std::uint32_t saved_state_magic = 0x5343465au;
}  // namespace detail

inline std::span<float> cpu_adam::fp32_moment(std::size_t t, int which) const {
  const tensor_state& ts = tensor(t, "t");
  expects(!nvme_, "nvme", "the moments live in a state file on the SSD (use export_columns / import_columns)");
  expects(format_ == cpu_state_format::fp32, "cpu_state", "is ", cpu_state_format_name(format_),
          ": fp32 moment spans exist for fp32 state only (use export_columns / import_columns)");
  return ts.span(which);
}

inline std::span<float> cpu_adam::master(std::size_t t) const {
  const tensor_state& ts = tensor(t, "t");
  expects(!master_on_nvme(), "nvme",
          "the fp32 master lives in a state file on the SSD (use export_columns / import_columns)");
  return ts.span(0);
}

inline std::size_t cpu_adam::state_bytes(std::size_t t) const {
  const tensor_state& ts = tensor(t, "t");
  return ts.size * (sizeof(float) + moment_bytes_per_parameter(format_)) + 2 * ts.blocks * sizeof(float);
}

inline std::size_t cpu_adam::state_bytes() const {
  std::size_t total = 0;
  for (std::size_t t = 0; t < tensors_.size(); ++t) total += state_bytes(t);
  return total;
}

inline std::size_t cpu_adam::host_state_bytes() const {
  std::size_t total = 0;
  if (master_on_nvme()) return 0;
  for (std::size_t t = 0; t < tensors_.size(); ++t) total += nvme_ ? tensors_[t].size * sizeof(float) : state_bytes(t);
  return total;
}

inline void cpu_adam::validate_columns(std::size_t t, std::span<const std::int32_t> columns,
                                       std::initializer_list<std::pair<const char*, std::size_t>> sizes) const {
  const tensor_state& ts = tensor(t, "t");
  for (std::size_t j = 0; j < columns.size(); ++j) {
    expects(columns[j] >= 0 && columns[j] < ts.cols, "columns", "column ", columns[j], " at position ", j,
            " out of range [0, ", ts.cols, ")");
    if (j > 0)  // the message reads columns[j - 1]: only for j > 0
      expects(columns[j] > columns[j - 1], "columns", "must be strictly ascending, got ", columns[j - 1], " then ",
              columns[j]);
  }
  const std::size_t want = columns.size() * static_cast<std::size_t>(ts.rows);
  for (const auto& [name, size] : sizes)
    expects(size == want, name, "has ", size, " elements, columns x rows = ", want);
}

inline void cpu_adam::export_columns(std::size_t t, std::span<const std::int32_t> columns, std::span<float> params,
                                     std::span<float> exp_avg, std::span<float> exp_avg_sq) const {
  validate_columns(t, columns,
                   {{"params", params.size()}, {"exp_avg", exp_avg.size()}, {"exp_avg_sq", exp_avg_sq.size()}});
  const tensor_state& ts = tensors_[t];
  const auto rows = static_cast<std::size_t>(ts.rows);
  const std::size_t per_col = (rows + q8_block_rows - 1) / q8_block_rows;
  if (nvme_) {
    auto pieces = column_pieces(t, columns);
    nvme_read_state(t, pieces,
                    {.p = std::as_writable_bytes(params).data(),
                     .m = std::as_writable_bytes(exp_avg).data(),
                     .v = std::as_writable_bytes(exp_avg_sq).data()});
    if (master_on_nvme()) return;
  }
  for (std::size_t j = 0; j < columns.size(); ++j) {
    const std::size_t src = static_cast<std::size_t>(columns[j]) * rows, dst = j * rows;
    std::memcpy(params.data() + dst, ts.span(0).data() + src, rows * sizeof(float));
    if (nvme_) continue;
    switch (format_) {
      case cpu_state_format::fp32:
        std::memcpy(exp_avg.data() + dst, ts.span(1).data() + src, rows * sizeof(float));
        std::memcpy(exp_avg_sq.data() + dst, ts.span(2).data() + src, rows * sizeof(float));
        break;
      case cpu_state_format::bf16_moments: {
        const auto* w = reinterpret_cast<const std::uint32_t*>(ts.at(ts.m_off)) + src;
        for (std::size_t r = 0; r < rows; ++r)
          exp_avg[dst + r] = detail::bf16_word_m(w[r]), exp_avg_sq[dst + r] = detail::bf16_word_v(w[r]);
        break;
      }
      case cpu_state_format::blockwise8_moments: {
        const std::size_t blk = static_cast<std::size_t>(columns[j]) * per_col;
        for (std::size_t r0 = 0, b = 0; r0 < rows; r0 += q8_block_rows, ++b)
          detail::q8_decode_block(ts.at(ts.m_off) + src + r0, ts.at(ts.v_off) + src + r0, ts.scales(ts.dm_off)[blk + b],
                                  ts.scales(ts.dv_off)[blk + b], std::min(q8_block_rows, rows - r0),
                                  exp_avg.data() + dst + r0, exp_avg_sq.data() + dst + r0);
        break;
      }
    }
  }
}

inline void cpu_adam::export_state(std::size_t t, std::span<const std::int32_t> columns, std::span<float> out) const {
  const std::size_t n = columns.size() * static_cast<std::size_t>(tensor(t, "t").rows);
  expects(out.size() == slots_type::count * n, "out", "has ", out.size(), " elements, ", slots_type::count,
          " slots x columns x rows = ", slots_type::count * n);
  export_columns(t, columns, out.first(n), out.subspan(n, n), out.subspan(2 * n, n));
}

inline void cpu_adam::import_state(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> in) {
  const std::size_t n = columns.size() * static_cast<std::size_t>(tensor(t, "t").rows);
  expects(in.size() == slots_type::count * n, "in", "has ", in.size(), " elements, ", slots_type::count,
          " slots x columns x rows = ", slots_type::count * n);
  import_columns(t, columns, in.first(n), in.subspan(n, n), in.subspan(2 * n, n));
}

inline void cpu_adam::import_columns(std::size_t t, std::span<const std::int32_t> columns,
                                     std::span<const float> params, std::span<const float> exp_avg,
                                     std::span<const float> exp_avg_sq) {
  validate_columns(t, columns,
                   {{"params", params.size()}, {"exp_avg", exp_avg.size()}, {"exp_avg_sq", exp_avg_sq.size()}});
  for (std::size_t i = 0; i < exp_avg.size(); ++i) {
    expects(is_finite_bits(exp_avg[i]), "exp_avg", "element ", i, " is ", exp_avg[i], " (must be finite)");
    expects(is_finite_bits(exp_avg_sq[i]) && exp_avg_sq[i] >= 0.0f, "exp_avg_sq", "element ", i, " is ", exp_avg_sq[i],
            " (must be finite and >= 0)");
  }
  const tensor_state& ts = tensors_[t];
  const auto rows = static_cast<std::size_t>(ts.rows);
  const std::size_t per_col = (rows + q8_block_rows - 1) / q8_block_rows;
  if (nvme_) {  // the file first: of the two, only the file can fail
    auto pieces = column_pieces(t, columns);
    nvme_write_state(
        t, pieces,
        {.p = std::as_bytes(params).data(), .m = std::as_bytes(exp_avg).data(), .v = std::as_bytes(exp_avg_sq).data()});
    if (master_on_nvme()) return;
  }
  for (std::size_t j = 0; j < columns.size(); ++j) {
    const std::size_t dst = static_cast<std::size_t>(columns[j]) * rows, src = j * rows;
    std::memcpy(ts.span(0).data() + dst, params.data() + src, rows * sizeof(float));
    if (nvme_) continue;
    switch (format_) {
      case cpu_state_format::fp32:
        std::memcpy(ts.span(1).data() + dst, exp_avg.data() + src, rows * sizeof(float));
        std::memcpy(ts.span(2).data() + dst, exp_avg_sq.data() + src, rows * sizeof(float));
        break;
      case cpu_state_format::bf16_moments: {
        auto* w = reinterpret_cast<std::uint32_t*>(ts.at(ts.m_off)) + dst;
        for (std::size_t r = 0; r < rows; ++r) w[r] = detail::bf16_word_nearest(exp_avg[src + r], exp_avg_sq[src + r]);
        break;
      }
      case cpu_state_format::blockwise8_moments: {
        const std::size_t blk = static_cast<std::size_t>(columns[j]) * per_col;
        for (std::size_t r0 = 0, b = 0; r0 < rows; r0 += q8_block_rows, ++b)
          detail::q8_encode_block_nearest(exp_avg.data() + src + r0, exp_avg_sq.data() + src + r0,
                                          std::min(q8_block_rows, rows - r0), ts.at(ts.m_off) + dst + r0,
                                          ts.at(ts.v_off) + dst + r0, ts.scales(ts.dm_off)[blk + b],
                                          ts.scales(ts.dv_off)[blk + b]);
        break;
      }
    }
  }
}

inline std::vector<std::pair<std::size_t, std::size_t>> cpu_adam::state_regions(const tensor_state& ts) const {
  const std::size_t n = ts.size;
  switch (format_) {
    case cpu_state_format::fp32:
      return {{0, n * 4}, {ts.m_off, n * 4}, {ts.v_off, n * 4}};
    case cpu_state_format::bf16_moments:
      return {{0, n * 4}, {ts.m_off, n * 4}};
    case cpu_state_format::blockwise8_moments:
      break;
  }
  return {{0, n * 4}, {ts.m_off, n}, {ts.v_off, n}, {ts.dm_off, ts.blocks * 4}, {ts.dv_off, ts.blocks * 4}};
}

template <class Byte>
auto cpu_adam::saved_arrays(const tensor_state& ts, Byte* at) const -> nvme_buffers<Byte> {
  nvme_buffers<Byte> b{.raw = true};
  const std::size_t n = ts.size;
  if (master_on_nvme()) b.p = at, at += n * sizeof(float);
  b.m = at;
  switch (format_) {
    case cpu_state_format::fp32:
      b.v = at + n * sizeof(float);
      break;
    case cpu_state_format::bf16_moments:
      break;
    case cpu_state_format::blockwise8_moments:
      b.v = at + n, b.dm = at + 2 * n, b.dv = at + 2 * n + ts.blocks * sizeof(float);
      break;
  }
  return b;
}

inline std::size_t cpu_adam::saved_state_size(std::size_t t) const {
  return sizeof(detail::saved_state_header) + state_bytes(t);
}

inline void cpu_adam::save_state(std::size_t t, std::span<std::byte> out) const {
  const tensor_state& ts = tensor(t, "t");
  expects(out.size() == saved_state_size(t), "out", "has ", out.size(),
          " bytes, saved_state_size(t) = ", saved_state_size(t));
  detail::saved_state_header h;
  h.format = static_cast<std::uint8_t>(format_);
  h.block_rows = format_ == cpu_state_format::blockwise8_moments ? static_cast<std::uint32_t>(q8_block_rows) : 0;
  h.rows = static_cast<std::uint64_t>(ts.rows);
  h.cols = static_cast<std::uint64_t>(ts.cols);
  h.payload_bytes = state_bytes(t);
  std::byte* o = out.data();
  const auto put = [&o](const void* src, std::size_t bytes) {
    std::memcpy(o, src, bytes);
    o += bytes;
  };
  put(&h, sizeof h);
  if (nvme_) {  // as the same format in RAM saves it (state_regions' order)
    const std::size_t bytes = ts.size * sizeof(float);
    if (!master_on_nvme()) put(ts.at(0), bytes);
    std::vector<nvme_piece> pieces;
    split_into_blocks(t, 0, ts.size, 0, 0, pieces);
    nvme_read_state(t, pieces, saved_arrays(ts, o));
    return;
  }
  for (const auto& [off, bytes] : state_regions(ts)) put(ts.at(off), bytes);
}

inline void cpu_adam::load_state(std::size_t t, std::span<const std::byte> in) {
  const tensor_state& ts = tensor(t, "t");
  detail::saved_state_header h;
  expects(in.size() >= sizeof h, "in", "has ", in.size(), " bytes, less than the ", sizeof h, "-byte header");
  std::memcpy(&h, in.data(), sizeof h);
  expects(h.magic == detail::saved_state_magic, "in",
          "is not a cpu_adam tensor state (or was saved with the other byte order)");
  expects(h.version == 1, "in", "has version ", h.version, ", this build reads version 1");
  const auto saved = static_cast<cpu_state_format>(h.format);
  expects(saved == format_, "in", "holds ", cpu_state_format_name(saved), " state, this optimizer holds ",
          cpu_state_format_name(format_), " (convert with export_columns / import_columns)");
  expects(h.rows == static_cast<std::uint64_t>(ts.rows) && h.cols == static_cast<std::uint64_t>(ts.cols), "in",
          "holds a ", h.rows, " x ", h.cols, " tensor, tensor ", t, " is ", ts.rows, " x ", ts.cols);
  const std::uint32_t block_rows =
      format_ == cpu_state_format::blockwise8_moments ? static_cast<std::uint32_t>(q8_block_rows) : 0;
  expects(h.block_rows == block_rows, "in", "has blocks of ", h.block_rows, " rows, this build uses ", block_rows);
  expects(h.payload_bytes == state_bytes(t) && in.size() == saved_state_size(t), "in", "has ", in.size(), " bytes, a ",
          ts.rows, " x ", ts.cols, " ", cpu_state_format_name(format_), " state has ", saved_state_size(t));
  const std::byte* i = in.data() + sizeof h;
  const auto get = [&i](void* dst, std::size_t bytes) {
    std::memcpy(dst, i, bytes);
    i += bytes;
  };
  if (nvme_) {  // the file first: of the two, only the file can fail
    const std::size_t bytes = ts.size * sizeof(float);
    std::vector<nvme_piece> pieces;
    split_into_blocks(t, 0, ts.size, 0, 0, pieces);
    nvme_write_state(t, pieces, saved_arrays(ts, i + (master_on_nvme() ? 0 : bytes)));
    if (!master_on_nvme()) get(ts.at(0), bytes);
    return;
  }
  for (const auto& [off, bytes] : state_regions(ts)) get(ts.at(off), bytes);
}

}  // namespace zenflow
