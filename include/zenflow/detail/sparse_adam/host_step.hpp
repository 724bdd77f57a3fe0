// The host sparse Adam step's parallel pass: every parameter's selected elements of one step in one
// index space, cut into equal pieces for the pool (no hand-off per parameter), each piece run with
// the CPU Adam's SIMD kernels. Not a public header.
//
// A parameter's compact state is `lines` lines of `line_len` elements (row-major state: a row of
// its k slots; column layout: a slot's rows). Element (a, b) of it has its gradient at
// g + g_lines.offset(a) + g_pos.offset(b) and its parameter value at the same place of p. Where a
// run of positions is contiguous in both (a whole row of consecutive columns of a row-major
// parameter, a column of a column-contiguous one) the CPU Adam kernel reads the gradient and
// writes the parameter in place, streaming (`direct`); elsewhere the gradient is gathered into a
// small buffer, the kernel updates the state, and the parameter values are scattered from it.
// Both are adam_update then from_float per element: the same bits.
//
// An f32 parameter is its own master (`master == nullptr`): the kernel reads the master from the
// parameter and writes it back there, with no copy-out (the same bits: from_float of an f32 value is
// the value). That is one stream less in and one less out per element.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/detail/host_device/chunk_kernels.hpp"
#include "zenflow/detail/host_device/line_kernels.hpp"
#include "zenflow/detail/host_device/parallel.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::sparse_adam {

namespace hd = zenflow::detail::host_device;

/// One parameter of a host step (see the file comment).
struct host_step_item {
  float* master = nullptr;  // nullptr: the parameter (f32) is the master
  float* m = nullptr;
  float* v = nullptr;
  index_t lines = 0, line_len = 0;
  const std::byte* g = nullptr;
  std::size_t g_size = 4;
  hd::line g_lines, g_pos;
  std::byte* p = nullptr;
  std::size_t p_size = 4;
  hd::line p_lines, p_pos;
  /// Direct: positions [runs[i], runs[i + 1]) are contiguous in g and p (runs ends with line_len).
  bool direct = false;
  std::vector<index_t> runs;
  adam_step_constants c;
  /// (master, g, m, v, p): the gradient's and parameter's dtypes; with the parameter as the master,
  /// (p, g, m, v, nullptr), no copy-out.
  adam_range_fn adam_direct = nullptr;
  nonfinite_range_fn scan_direct = nullptr;
  hd::copy_line_fn gather_g = nullptr;   // gradient -> f32 buffer
  hd::copy_line_fn gather_p = nullptr;   // f32 parameter -> f32 buffer (the parameter as the master)
  hd::copy_line_fn scatter_p = nullptr;  // f32 master -> parameter
  /// Listed positions on a contiguous line of the gradient or the parameter, on the AVX-512 path:
  /// the list's chunks and the chunk copies that replace gather_g, gather_p and scatter_p on the
  /// sides that have one (nullptr: those run).
  std::vector<hd::line_chunk> chunks;
  hd::chunk_copy_fn gather_g_chunks = nullptr, gather_p_chunks = nullptr, scatter_p_chunks = nullptr;
  std::size_t begin = 0;                 // first element in the step's index space
  [[nodiscard]] std::size_t size() const noexcept { return static_cast<std::size_t>(lines * line_len); }
};

/// Positions [b, ...) of a line as their own line: its element offset and the rest.
inline std::pair<index_t, hd::line> from_position(const hd::line& l, index_t b) noexcept {
  if (l.index != nullptr) return {0, {l.index + b, l.stride}};
  return {b * l.stride, {nullptr, l.stride}};
}

/// The step's kernels shared by every item on the gathered path.
struct host_step_kernels {
  adam_range_fn adam_f32 = nullptr;  // on the gathered f32 gradient, no copy-out
  nonfinite_range_fn scan_f32 = nullptr;
};

inline constexpr index_t gather_block = 256;  // positions per gathered batch (a 1 KiB buffer)

/// Positions [b0, b1) of line `a` of `it`: the Adam step (`scan` false), or the non-finite scan of
/// the scaled gradient (`scan` true: returns true when a value is NaN or infinite).
inline bool run_line(const host_step_item& it, const host_step_kernels& k, index_t a, index_t b0, index_t b1, bool scan,
                     float scale) {
  const index_t s = a * it.line_len;
  const std::byte* g_line = it.g + static_cast<std::size_t>(it.g_lines.offset(a)) * it.g_size;
  std::byte* p_line = it.p + static_cast<std::size_t>(it.p_lines.offset(a)) * it.p_size;
  if (it.direct) {
    auto run = std::upper_bound(it.runs.begin(), it.runs.end(), b0) - 1;
    for (index_t x0 = b0; x0 < b1; ++run) {
      const index_t x1 = std::min(b1, *(run + 1));
      const auto n = static_cast<std::size_t>(x1 - x0);
      const std::byte* g = g_line + static_cast<std::size_t>(it.g_pos.offset(x0)) * it.g_size;
      if (scan) {
        if (it.scan_direct(g, n, scale)) return true;
      } else {
        std::byte* p = p_line + static_cast<std::size_t>(it.p_pos.offset(x0)) * it.p_size;
        if (it.master == nullptr)
          it.adam_direct(reinterpret_cast<float*>(p), g, it.m + s + x0, it.v + s + x0, nullptr, n, it.c);
        else
          it.adam_direct(it.master + s + x0, g, it.m + s + x0, it.v + s + x0, p, n, it.c);
      }
      x0 = x1;
    }
    return false;
  }
  // 16 floats of slack each: the chunk gathers store whole vectors.
  alignas(64) float buffer[gather_block + 16];
  alignas(64) float own_master[gather_block + 16];  // the parameter's values, when it is the master
  for (index_t x0 = b0; x0 < b1; x0 += gather_block) {
    const index_t n = std::min(gather_block, b1 - x0);
    const hd::line_chunk* chunk = it.chunks.empty() ? nullptr : hd::chunk_at(it.chunks, x0);
    const auto [g_off, g_rest] = from_position(it.g_pos, x0);
    if (it.gather_g_chunks != nullptr)
      it.gather_g_chunks(g_line, buffer, chunk, x0, n);
    else
      it.gather_g(g_line + static_cast<std::size_t>(g_off) * it.g_size, g_rest, buffer, {}, n, 1.0f);
    if (scan) {
      if (k.scan_f32(buffer, static_cast<std::size_t>(n), scale)) return true;
      continue;
    }
    const auto [p_off, p_rest] = from_position(it.p_pos, x0);
    std::byte* p = p_line + static_cast<std::size_t>(p_off) * it.p_size;
    float* master = it.master != nullptr ? it.master + s + x0 : own_master;
    if (it.master == nullptr) {
      if (it.gather_p_chunks != nullptr)
        it.gather_p_chunks(p_line, master, chunk, x0, n);
      else
        it.gather_p(p, p_rest, master, {}, n, 1.0f);
    }
    k.adam_f32(master, buffer, it.m + s + x0, it.v + s + x0, nullptr, static_cast<std::size_t>(n), it.c);
    if (it.scatter_p_chunks != nullptr)
      it.scatter_p_chunks(master, p_line, chunk, x0, n);
    else
      it.scatter_p(master, {}, p, p_rest, n, 1.0f);
  }
  return false;
}

/// Runs the step (scan false) or the scan (scan true; returns whether a value is not finite) over
/// every item, in pieces of adam_task_elements on exec's pool.
inline bool run_host_step(std::span<const host_step_item> items, const host_step_kernels& k, bool scan, float scale,
                          const host_execution& exec) {
  const std::size_t total = items.empty() ? 0 : items.back().begin + items.back().size();
  const auto chunk = static_cast<std::size_t>(hd::adam_task_elements);
  std::atomic<bool> bad{false};
  hd::parallel_for(exec, (total + chunk - 1) / chunk, [&](std::size_t task) {
    std::size_t lo = task * chunk;
    const std::size_t hi = std::min(total, lo + chunk);
    auto it = std::upper_bound(items.begin(), items.end(), lo,
                               [](std::size_t x, const host_step_item& i) { return x < i.begin; }) -
              1;
    for (; lo < hi; ++it) {
      const std::size_t end = std::min(hi, it->begin + it->size());
      if (it->size() == 0) continue;
      const auto e0 = static_cast<index_t>(lo - it->begin), e1 = static_cast<index_t>(end - it->begin);
      for (index_t a = e0 / it->line_len; a * it->line_len < e1; ++a) {
        if (scan && bad.load(std::memory_order_relaxed)) return;
        const index_t b0 = std::max(e0 - a * it->line_len, index_t{0});
        const index_t b1 = std::min(e1 - a * it->line_len, it->line_len);
        if (run_line(*it, k, a, b0, b1, scan, scale)) bad.store(true, std::memory_order_relaxed);
      }
      lo = end;
    }
  });
  return bad.load();
}

}  // namespace zenflow::detail::sparse_adam
