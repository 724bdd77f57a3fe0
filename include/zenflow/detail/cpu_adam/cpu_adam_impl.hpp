// Definitions of zenflow::cpu_adam (declared in zenflow/cpu_adam.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "zenflow/cpu_adam.hpp"

namespace zenflow {

namespace detail {
/// zenflow::error for field `field` of tasks[i].
template <class... Reason>
[[noreturn]] inline void fail_task(std::size_t i, const char* field, const Reason&... reason) {
  throw error(concat("tasks[", i, "].", field), concat(reason...));
}

inline bool aligned_to(const void* p, std::size_t alignment) noexcept {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

/// The element range of a task's buffer in the given layout: full layout spans first..last listed
/// column, compact spans the listed count.
inline std::size_t layout_first(const cpu_adam_task& t, bool compact, std::size_t rows) noexcept {
  return (t.columns.empty() || compact) ? 0 : static_cast<std::size_t>(t.columns.front()) * rows;
}
/// The bf16-moment kernel over n elements whose first is element e0 of its tensor (p, g, words and
/// out point at that element; gsz and osz are the gradient's and copy-out's element sizes). The
/// random bits hash the low 32 bits of the element index and the high half goes into the key, so
/// the kernel is called in runs that never cross a multiple of 2^32 elements.
inline void bf16_adam_runs(bf16_adam_range_fn fn, float* p, const unsigned char* g, std::size_t gsz,
                           std::uint32_t* words, unsigned char* out, std::size_t osz, std::size_t n,
                           const adam_step_constants& c, std::size_t e0, std::uint64_t task_key) {
  for (std::size_t done = 0; done < n;) {
    const std::size_t e = e0 + done;
    const std::size_t count = std::min(n - done, ((e >> 32) + 1) * (std::size_t{1} << 32) - e);
    fn(p + done, g + done * gsz, words + done, out != nullptr ? out + done * osz : nullptr, count, c,
       static_cast<std::uint32_t>(e), sr_range_key(task_key, e >> 32));
    done += count;
  }
}
inline std::size_t layout_end(const cpu_adam_task& t, bool compact, std::size_t rows, std::size_t cols) noexcept {
  if (t.columns.empty()) return rows * cols;
  if (compact) return t.columns.size() * rows;
  return (static_cast<std::size_t>(t.columns.back()) + 1) * rows;
}
}  // namespace detail

inline void cpu_adam::aligned_free::operator()(float* p) const noexcept {
  std::free(p);
}

inline cpu_adam::cpu_adam(const adam_options& options, const cpu_adam_config& config) {
  options.validate();
  expects(config.chunk_elements >= 1, "config.chunk_elements", "must be >= 1, got ", config.chunk_elements);
  expects(config.threads <= 4096, "config.threads", "must be <= 4096, got ", config.threads);
  expects(config.isa == cpu_isa::automatic || config.isa == cpu_isa::scalar || config.isa == cpu_isa::avx2 ||
              config.isa == cpu_isa::avx512,
          "config.isa", "unknown value");
  expects(cpu_isa_supported(config.isa), "config.isa", "this CPU does not support ", cpu_isa_name(config.isa),
          " (best: ", cpu_isa_name(detect_cpu_isa()), ")");
  expects(is_valid(config.cpu_state), "config.cpu_state", "unknown value ", static_cast<int>(config.cpu_state));
  options_ = options;
  format_ = config.cpu_state;
  seed_ = config.seed;
  isa_ = detail::resolve_isa(config.isa);
  chunk_ = config.chunk_elements;
  if (config.nvme) {
    nvme_ = config.nvme;
    // A one-block file checks the directory, O_DIRECT, the engine and the pool now rather than
    // at the first step, and holds the file's lock (a second optimizer on the same file fails
    // here); the first call that touches the moments replaces it with one sized for the tensors.
    file_ = make_state_file(nvme_->file.block_bytes);
    nvme_status_ = detail::concat(file_->path(), ": ", file_->direct() ? "O_DIRECT" : "buffered I/O (no O_DIRECT)",
                                  ", blocks of ", file_->block_bytes(), " bytes; engine: ", file_->engine().status(),
                                  "; pool: ", file_->pool().size(), " x ", file_->pool().buffer_bytes(), " bytes, ",
                                  file_->pool().status());
    // [master |] m | v (fp32) or [master |] m and v words (bf16): arrays of 4 bytes per element,
    // each a multiple of 16 elements (64-byte aligned). 8-bit: [master |] m codes | v codes |
    // m scales | v scales of whole 8-bit blocks (the arrays stay 64-byte aligned).
    const std::size_t master = master_on_nvme() ? sizeof(float) : 0;
    if (format_ == cpu_state_format::blockwise8_moments) {
      // at least 2 (the state file checked that block_bytes is a multiple of 4096)
      q8_per_block_ = nvme_->file.block_bytes / (q8_block_rows * (master + 2) + 2 * sizeof(float));
      slots_ = q8_per_block_ * q8_block_rows;
    } else {
      const std::size_t arrays = (master != 0 ? 1 : 0) + (format_ == cpu_state_format::fp32 ? 2 : 1);
      slots_ = nvme_->file.block_bytes / (arrays * sizeof(float)) / 16 * 16;
    }
  }
  detail::check_cpus(config.cpus, "config.cpus");
  pool_ = std::make_unique<thread_pool>(config.threads, config.pin_to_cores, config.cpus, "zf-adam");
}

inline std::size_t cpu_adam::add_tensor(std::span<const float> initial_params, index_t rows, index_t cols) {
  expects(rows >= 1, "rows", "must be >= 1, got ", rows);
  expects(cols >= 1, "cols", "must be >= 1, got ", cols);
  expects(rows <= std::numeric_limits<std::int32_t>::max() && cols <= std::numeric_limits<std::int32_t>::max(), "rows",
          "rows and cols must fit in int32, got ", rows, " x ", cols);
  const auto size = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  expects(initial_params.size() == size, "initial_params", "has ", initial_params.size(),
          " elements, rows x cols = ", size);
  expects(master_on_nvme() || !sized_, "add_tensor",
          "the moments' state file is sized (a step, export or import touched it): ", "register every tensor first");
  tensor_state ts;
  ts.rows = rows;
  ts.cols = cols;
  ts.size = size;
  if (format_ == cpu_state_format::blockwise8_moments) ts.blocks = ts.q8_per_col() * static_cast<std::size_t>(cols);
  if (master_on_nvme()) {  // nothing in RAM
    nvme_add_tensor(ts, initial_params);
    tensors_.push_back(std::move(ts));
    return tensors_.size() - 1;
  }
  const auto pad64 = [](std::size_t b) { return (b + 63) / 64 * 64; };
  const std::size_t params_bytes = pad64(size * sizeof(float));
  if (nvme_) {  // params only in RAM: the moments are in the state file
    ts.m_off = ts.v_off = ts.dm_off = ts.dv_off = params_bytes;
  } else {
    // Each array after the first starts a further 256 KiB on in a large tensor. Arrays a large
    // power of two apart stream at half speed or less on some machines: measured on one Zen 4
    // core, the fp32 step over a 64M-element tensor (params, m and v exactly 256 MiB apart) ran at
    // 0.6 G params/s, and at 1.4 G/s with this stagger or with separate allocations; 64 MiB and
    // 192 MiB apart were unaffected. It costs at most 512 KiB per tensor of 4M elements or more.
    const std::size_t stagger = size >= (std::size_t{4} << 20) ? (std::size_t{256} << 10) : 0;
    ts.m_off = ts.v_off = params_bytes + stagger;
    switch (format_) {
      case cpu_state_format::fp32:  // params | m | v
        ts.v_off = ts.m_off + params_bytes + stagger;
        ts.dm_off = ts.dv_off = ts.v_off + params_bytes;
        break;
      case cpu_state_format::bf16_moments:  // params | m, v as one 32-bit word per element (bf16_word)
        ts.dm_off = ts.dv_off = ts.m_off + pad64(size * sizeof(std::uint32_t));
        break;
      case cpu_state_format::blockwise8_moments:  // params | m codes | v codes | m scales | v scales
        ts.v_off = ts.m_off + pad64(size) + stagger;
        ts.dm_off = ts.v_off + pad64(size);
        ts.dv_off = ts.dm_off + pad64(ts.blocks * sizeof(float));
        break;
    }
  }
  const std::size_t bytes = nvme_ ? params_bytes : ts.dv_off + pad64(ts.blocks * sizeof(float));
  ts.alloc_bytes = bytes;
  // Large tensors: 2 MiB alignment and transparent huge pages (fewer TLB misses when streaming).
  const std::size_t alignment = bytes >= (std::size_t{4} << 20) ? (std::size_t{2} << 20) : 64;
  const std::size_t alloc = (bytes + alignment - 1) / alignment * alignment;
  auto* raw = static_cast<float*>(std::aligned_alloc(alignment, alloc));
  if (raw == nullptr) throw error("initial_params", detail::concat("cannot allocate ", alloc, " bytes of state"));
  ts.data.reset(raw);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (alignment > 64) (void)madvise(raw, alloc, MADV_HUGEPAGE);
#endif
  std::memcpy(raw, initial_params.data(), size * sizeof(float));
  std::memset(ts.at(ts.m_off), 0, bytes - ts.m_off);  // moments (and scales) 0
  if (nvme_) {                                        // a fresh file reads as zeros: moments 0
    ts.first_block = blocks_;
    blocks_ += nvme_blocks(ts);
  }
  tensors_.push_back(std::move(ts));
  return tensors_.size() - 1;
}

inline void cpu_adam::validate_tasks(std::span<const cpu_adam_task> tasks) {
  using detail::fail_task;
  std::vector<bool> seen(tensors_.size(), false);
  std::vector<detail::byte_range> outs, grads;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const cpu_adam_task& t = tasks[i];
    if (t.tensor >= tensors_.size())
      fail_task(i, "tensor", "index ", t.tensor, " out of range (", tensors_.size(), " tensors)");
    if (seen[t.tensor]) fail_task(i, "tensor", "tensor ", t.tensor, " appears in more than one task");
    seen[t.tensor] = true;
    const tensor_state& ts = tensors_[t.tensor];
    const auto rows = static_cast<std::size_t>(ts.rows), cols = static_cast<std::size_t>(ts.cols);
    for (std::size_t j = 0; j < t.columns.size(); ++j) {
      const std::int32_t c = t.columns[j];
      if (c < 0 || static_cast<std::size_t>(c) >= cols)
        fail_task(i, "columns", "column ", c, " at position ", j, " out of range [0, ", cols, ")");
      if (j > 0 && c <= t.columns[j - 1])
        fail_task(i, "columns", "must be strictly ascending, got ", t.columns[j - 1], " then ", c);
    }
    if (!is_valid(t.grad_type)) fail_task(i, "grad_type", "unknown dtype ", static_cast<int>(t.grad_type));
    if (t.grad == nullptr) fail_task(i, "grad", "is null");
    if (!detail::aligned_to(t.grad, dtype_size(t.grad_type)))
      fail_task(i, "grad", "is not aligned to its element size ", dtype_size(t.grad_type));
    const std::size_t gsz = dtype_size(t.grad_type);
    const std::size_t g0 = detail::layout_first(t, t.grad_compact, rows);
    const std::size_t g1 = detail::layout_end(t, t.grad_compact, rows, cols);
    grads.push_back(detail::make_range(static_cast<const unsigned char*>(t.grad) + g0 * gsz, (g1 - g0) * gsz, i));
    if (t.copy_out != nullptr) {
      if (!is_valid(t.copy_out_type))
        fail_task(i, "copy_out_type", "unknown dtype ", static_cast<int>(t.copy_out_type));
      const std::size_t osz = dtype_size(t.copy_out_type);
      if (!detail::aligned_to(t.copy_out, osz)) fail_task(i, "copy_out", "is not aligned to its element size ", osz);
      const std::size_t o0 = detail::layout_first(t, t.out_compact, rows);
      const std::size_t o1 = detail::layout_end(t, t.out_compact, rows, cols);
      outs.push_back(detail::make_range(static_cast<unsigned char*>(t.copy_out) + o0 * osz, (o1 - o0) * osz, i));
    }
  }
  // Overlaps: a copy_out may overlap nothing (other copy_outs, gradients, any tensor's state);
  // a gradient may not overlap the state. Gradients may share memory with each other.
  const auto by_lo = [](const detail::byte_range& a, const detail::byte_range& b) { return a.lo < b.lo; };
  if (state_ranges_.size() != tensors_.size()) {  // tensors were added: rebuild the sorted cache
    state_ranges_.clear();
    for (std::size_t k = 0; k < tensors_.size(); ++k)  // each tensor's whole allocation
      state_ranges_.push_back(detail::make_range(tensors_[k].data.get(), tensors_[k].alloc_bytes, k));
    std::sort(state_ranges_.begin(), state_ranges_.end(), by_lo);  // disjoint (separate allocations)
  }
  const std::vector<detail::byte_range>& state = state_ranges_;
  std::sort(outs.begin(), outs.end(), by_lo);
  std::sort(grads.begin(), grads.end(), by_lo);
  const auto hits_state = [&](const detail::byte_range& r) {
    auto it = std::upper_bound(state.begin(), state.end(), r, by_lo);  // first with lo > r.lo
    if (it != state.end() && overlaps(*it, r)) return true;
    return it != state.begin() && overlaps(*std::prev(it), r);
  };
  for (std::size_t k = 0; k < outs.size(); ++k) {
    if (outs[k].lo == outs[k].hi) continue;
    if (k + 1 < outs.size() && overlaps(outs[k], outs[k + 1]))
      fail_task(outs[k + 1].task, "copy_out", "overlaps the copy_out of tasks[", outs[k].task, "]");
    if (hits_state(outs[k])) fail_task(outs[k].task, "copy_out", "overlaps the optimizer state");
  }
  std::vector<std::uintptr_t> grad_max_hi(grads.size());
  for (std::size_t k = 0; k < grads.size(); ++k) {
    grad_max_hi[k] = std::max(grads[k].hi, k ? grad_max_hi[k - 1] : 0);
    if (hits_state(grads[k])) fail_task(grads[k].task, "grad", "overlaps the optimizer state");
  }
  for (const auto& o : outs) {  // any gradient with lo < o.hi and hi > o.lo
    const auto it = std::lower_bound(grads.begin(), grads.end(), o.hi,
                                     [](const detail::byte_range& g, std::uintptr_t x) { return g.lo < x; });
    const auto j = static_cast<std::size_t>(it - grads.begin());
    if (j > 0 && grad_max_hi[j - 1] > o.lo) fail_task(o.task, "copy_out", "overlaps a gradient");
  }
}

inline void cpu_adam::build_segments(std::span<const cpu_adam_task> tasks) {
  segments_.clear();
  std::size_t begin = 0;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const cpu_adam_task& t = tasks[i];
    const tensor_state& ts = tensors_[t.tensor];
    const auto rows = static_cast<std::size_t>(ts.rows);
    const std::size_t gsz = dtype_size(t.grad_type), osz = t.copy_out ? dtype_size(t.copy_out_type) : 0;
    const std::size_t msz = format_ == cpu_state_format::blockwise8_moments ? 1 : 4;  // bytes per element at m_off
    const auto add = [&](std::size_t state_off, std::size_t grad_off, std::size_t out_off, std::size_t n) {
      segment s;
      s.begin = begin;
      s.n = n;
      s.p = master_on_nvme() ? nullptr : ts.span(0).data() + state_off;  // on disk: in a block
      s.m = nvme_ ? nullptr : ts.at(ts.m_off + state_off * msz);         // NVMe: in a block, found per block
      s.v = nvme_ ? nullptr : ts.at(ts.v_off + state_off * msz);
      s.elem = state_off;
      s.g = static_cast<const unsigned char*>(t.grad) + grad_off * gsz;
      s.out = t.copy_out ? static_cast<unsigned char*>(t.copy_out) + out_off * osz : nullptr;
      s.task = static_cast<std::uint32_t>(i);
      segments_.push_back(s);
      begin += n;
    };
    if (t.columns.empty()) {
      add(0, 0, 0, ts.size);
      continue;
    }
    for (std::size_t j = 0; j < t.columns.size();) {  // runs of consecutive columns are contiguous
      std::size_t e = j + 1;
      while (e < t.columns.size() && t.columns[e] == t.columns[e - 1] + 1) ++e;
      const auto c0 = static_cast<std::size_t>(t.columns[j]);
      add(c0 * rows, (t.grad_compact ? j : c0) * rows, (t.out_compact ? j : c0) * rows, (e - j) * rows);
      j = e;
    }
  }
}

// Splits [0, total) of the step's global index space into chunk_ pieces, runs them on the pool
// and calls fn(segment, offset, count) for each part of a piece that lies in one segment.
template <class Fn>
void cpu_adam::for_each_piece(std::size_t total, Fn&& fn) {
  const std::size_t pieces = (total + chunk_ - 1) / chunk_;
  pool_->parallel_for(pieces, [&](std::size_t k) {
    std::size_t lo = k * chunk_;
    const std::size_t hi = std::min(total, lo + chunk_);
    auto it = std::upper_bound(segments_.begin(), segments_.end(), lo,
                               [](std::size_t x, const segment& s) { return x < s.begin; });
    for (--it; lo < hi; ++it) {
      if (it->n == 0) continue;
      const std::size_t off = lo - it->begin;
      const std::size_t count = std::min(hi, it->begin + it->n) - lo;
      fn(*it, off, count);
      lo += count;
    }
  });
}

inline cpu_step_result cpu_adam::step(std::span<const cpu_adam_task> tasks, float grad_scale, bool check_finite) {
  expects(step_count_ < std::numeric_limits<std::int64_t>::max(), "step_count", "would overflow");
  const adam_step_constants c = make_adam_step_constants(options_, step_count_ + 1, grad_scale);  // validates
  std::vector<adam_step_constants> task_constants(tasks.size(), c);
  std::vector<float> task_scale(tasks.size(), grad_scale);
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const auto& t = tasks[i];
    if (t.options == nullptr && t.step == 0 && t.grad_scale == 1.0f) continue;
    expects(t.step >= 0, "tasks", "task ", i, " has step ", t.step, " (must be >= 1, or 0: the optimizer's)");
    expects(is_finite_bits(t.grad_scale) && t.grad_scale >= 0.0f, "tasks", "task ", i, " has grad_scale ", t.grad_scale,
            " (must be finite and >= 0)");
    task_scale[i] = grad_scale * t.grad_scale;
    task_constants[i] = make_adam_step_constants(t.options != nullptr ? *t.options : options_,
                                                 t.step != 0 ? t.step : step_count_ + 1, task_scale[i]);
  }
  validate_tasks(tasks);
  build_segments(tasks);
  const std::size_t total = segments_.empty() ? 0 : segments_.back().begin + segments_.back().n;

  struct kernels {
    detail::adam_range_fn adam;
    detail::nonfinite_range_fn scan;
    std::size_t gsz, osz;
  };
  std::vector<kernels> k(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const auto& t = tasks[i];
    k[i] = {detail::select_adam_range(isa_, t.grad_type, t.copy_out != nullptr, t.copy_out_type),
            detail::select_nonfinite_range(isa_, t.grad_type), dtype_size(t.grad_type),
            t.copy_out ? dtype_size(t.copy_out_type) : 0};
  }
  if (check_finite && total > 0) {
    std::atomic<bool> bad{false};
    for_each_piece(total, [&](const segment& s, std::size_t off, std::size_t n) {
      if (bad.load(std::memory_order_relaxed)) return;
      const kernels& kk = k[s.task];
      if (kk.scan(s.g + off * kk.gsz, n, task_scale[s.task])) bad.store(true, std::memory_order_relaxed);
    });
    if (bad.load()) return {false, step_count_};
  }
  if (nvme_) {
    // Each block the step touches is read, updated on the pool and written back, in block order.
    pieces_.clear();
    for (std::size_t i = 0; i < segments_.size(); ++i)
      split_into_blocks(tasks[segments_[i].task].tensor, segments_[i].elem, segments_[i].n, i, 0, pieces_);
    struct work {
      const nvme_piece* piece;
      std::size_t offset, n;
    };
    std::vector<work> items;
    // Compact moments: the kernels, random-bit keys and quotient bounds of step_compact (the same
    // bits as in RAM).
    std::vector<detail::bf16_adam_range_fn> bf16(tasks.size());
    std::vector<detail::q8_adam_run_fn> q8(tasks.size());
    std::vector<detail::compact_step_constants> compact(tasks.size());
    if (format_ != cpu_state_format::fp32)
      for (std::size_t i = 0; i < tasks.size(); ++i) {
        const cpu_adam_task& t = tasks[i];
        const std::int64_t step = t.step != 0 ? t.step : step_count_ + 1;
        compact[i].key = detail::sr_task_key(seed_, t.tensor, step);
        if (format_ == cpu_state_format::bf16_moments) {
          bf16[i] = detail::select_bf16_adam_range(isa_, t.grad_type, t.copy_out != nullptr, t.copy_out_type);
        } else {
          compact[i].max_ratio = detail::adam_quotient_bound(t.options != nullptr ? *t.options : options_, step);
          q8[i] = detail::select_q8_adam_run(isa_, t.grad_type, t.copy_out != nullptr, t.copy_out_type);
        }
      }
    nvme_stream(pieces_, stream_mode::update, [&](std::span<const nvme_piece> block, const nvme_arrays& a) {
      items.clear();
      for (const nvme_piece& p : block) {
        if (format_ != cpu_state_format::blockwise8_moments) {
          for (std::size_t o = 0; o < p.n; o += chunk_) items.push_back({&p, o, std::min(chunk_, p.n - o)});
          continue;
        }
        // 8-bit: items of whole 8-bit blocks (pieces hold whole blocks: segments are whole columns)
        std::size_t o = 0;
        detail::for_each_q8_block(tensors_[tasks[segments_[p.tag].task].tensor], p, q8_per_block_,
                                  [&](std::size_t, std::size_t, std::size_t i, std::size_t n) {
                                    if (i + n - o >= chunk_ || i + n == p.n)
                                      items.push_back({&p, o, i + n - o}), o = i + n;
                                  });
      }
      pool_->parallel_for(items.size(), [&](std::size_t w) {
        const work& it = items[w];
        const segment& s = segments_[it.piece->tag];
        const kernels& kk = k[s.task];
        const std::size_t off = it.piece->off + it.offset, slot = it.piece->slot + it.offset;
        float* p = a.p != nullptr ? a.p + slot : s.p + off;
        unsigned char* out = s.out ? s.out + off * kk.osz : nullptr;
        switch (format_) {
          case cpu_state_format::fp32:
            kk.adam(p, s.g + off * kk.gsz, a.m + slot, a.v + slot, out, it.n, task_constants[s.task]);
            return;
          case cpu_state_format::bf16_moments:
            detail::bf16_adam_runs(bf16[s.task], p, s.g + off * kk.gsz, kk.gsz, a.words + slot, out, kk.osz, it.n,
                                   task_constants[s.task], s.elem + off, compact[s.task].key);
            return;
          case cpu_state_format::blockwise8_moments: {
            const tensor_state& ts = tensors_[tasks[s.task].tensor];
            const std::size_t e = s.elem + off, j = ts.q8_block_of(e);
            const std::size_t scale = j - (it.piece->block - ts.first_block) * q8_per_block_;
            detail::q8_run r;
            r.p = p;
            r.g = s.g + off * kk.gsz;
            r.qm = a.qm + slot;
            r.qv = a.qv + slot;
            r.dm = a.dm + scale;
            r.dv = a.dv + scale;
            r.out = out;
            r.rows = static_cast<std::size_t>(ts.rows);
            r.first_row = e % r.rows;
            r.blocks = ts.q8_block_of(e + it.n) - j;
            r.first_block = j;
            q8[s.task](r, task_constants[s.task], compact[s.task]);
            return;
          }
        }
      });
    });
  } else if (format_ == cpu_state_format::fp32) {
    for_each_piece(total, [&](const segment& s, std::size_t off, std::size_t n) {
      const kernels& kk = k[s.task];
      kk.adam(s.p + off, s.g + off * kk.gsz, static_cast<float*>(s.m) + off, static_cast<float*>(s.v) + off,
              s.out ? s.out + off * kk.osz : nullptr, n, task_constants[s.task]);
    });
  } else {
    step_compact(tasks, task_constants, total);
  }
  ++step_count_;
  return {true, step_count_};
}

// The adam pass of a compact format, after validation and the non-finite check.
inline void cpu_adam::step_compact(std::span<const cpu_adam_task> tasks,
                                   const std::vector<adam_step_constants>& constants, std::size_t total) {
  struct task_kernel {
    detail::compact_step_constants k;
    detail::bf16_adam_range_fn bf16 = nullptr;
    detail::q8_adam_run_fn q8 = nullptr;
    std::size_t gsz = 0, osz = 0;
  };
  std::vector<task_kernel> kt(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const cpu_adam_task& t = tasks[i];
    const std::int64_t step = t.step != 0 ? t.step : step_count_ + 1;
    kt[i].k.key = detail::sr_task_key(seed_, t.tensor, step);
    kt[i].gsz = dtype_size(t.grad_type);
    kt[i].osz = t.copy_out ? dtype_size(t.copy_out_type) : 0;
    if (format_ == cpu_state_format::bf16_moments) {
      kt[i].bf16 = detail::select_bf16_adam_range(isa_, t.grad_type, t.copy_out != nullptr, t.copy_out_type);
    } else {
      kt[i].k.max_ratio = detail::adam_quotient_bound(t.options != nullptr ? *t.options : options_, step);
      kt[i].q8 = detail::select_q8_adam_run(isa_, t.grad_type, t.copy_out != nullptr, t.copy_out_type);
    }
  }
  if (format_ == cpu_state_format::bf16_moments) {
    for_each_piece(total, [&](const segment& s, std::size_t off, std::size_t n) {
      const task_kernel& kk = kt[s.task];
      detail::bf16_adam_runs(kk.bf16, s.p + off, s.g + off * kk.gsz, kk.gsz, static_cast<std::uint32_t*>(s.m) + off,
                             s.out ? s.out + off * kk.osz : nullptr, kk.osz, n, constants[s.task], s.elem + off,
                             kk.k.key);
    });
    return;
  }
  // 8-bit: a piece runs every block whose first element it holds, whole (blocks never cross a
  // column, segments are whole columns), so no block is split between two threads.
  for_each_piece(total, [&](const segment& s, std::size_t off, std::size_t n) {
    const task_kernel& kk = kt[s.task];
    const tensor_state& ts = tensors_[tasks[s.task].tensor];
    const auto rows = static_cast<std::size_t>(ts.rows);
    const std::size_t per_col = (rows + q8_block_rows - 1) / q8_block_rows;
    const auto first_block_from = [&](std::size_t e) {  // index of the first block starting at or after e
      const std::size_t j = (e % rows + q8_block_rows - 1) / q8_block_rows;
      return (e / rows) * per_col + std::min(j, per_col);
    };
    const std::size_t b0 = first_block_from(s.elem + off), b1 = first_block_from(s.elem + off + n);
    if (b1 <= b0) return;
    const std::size_t first_row = (b0 % per_col) * q8_block_rows;
    const std::size_t rel = (b0 / per_col) * rows + first_row - s.elem;  // first element, in the segment
    detail::q8_run r;
    r.p = s.p + rel;
    r.g = s.g + rel * kk.gsz;
    r.qm = static_cast<std::uint8_t*>(s.m) + rel;
    r.qv = static_cast<std::uint8_t*>(s.v) + rel;
    r.dm = ts.scales(ts.dm_off) + b0;
    r.dv = ts.scales(ts.dv_off) + b0;
    r.out = s.out ? s.out + rel * kk.osz : nullptr;
    r.rows = rows;
    r.first_row = first_row;
    r.blocks = b1 - b0;
    r.first_block = b0;
    kk.q8(r, constants[s.task], kk.k);
  });
}

inline bool cpu_adam::accumulate(float* acc, const void* grad, dtype grad_type, index_t n, float scale,
                                 bool check_finite) {
  expects(n >= 0, "n", "must be >= 0, got ", n);
  expects(is_valid(grad_type), "grad_type", "unknown dtype ", static_cast<int>(grad_type));
  expects(std::isfinite(scale), "scale", "must be finite, got ", scale);
  if (n == 0) return true;
  expects(acc != nullptr, "acc", "is null");
  expects(grad != nullptr, "grad", "is null");
  expects(detail::aligned_to(acc, alignof(float)), "acc", "is not 4-byte aligned");
  expects(detail::aligned_to(grad, dtype_size(grad_type)), "grad", "is not aligned to its element size");
  const auto un = static_cast<std::size_t>(n);
  expects(!detail::overlaps(detail::make_range(acc, un * sizeof(float), 0),
                            detail::make_range(grad, un * dtype_size(grad_type), 0)),
          "grad", "overlaps acc");
  const bool bad = detail::parallel_accumulate(*pool_, isa_, chunk_, acc, grad, grad_type, un, scale, false);
  return !check_finite || !bad;
}

inline bool cpu_adam::all_finite(const void* grad, dtype grad_type, index_t n, float scale) {
  expects(n >= 0, "n", "must be >= 0, got ", n);
  expects(is_valid(grad_type), "grad_type", "unknown dtype ", static_cast<int>(grad_type));
  expects(std::isfinite(scale), "scale", "must be finite, got ", scale);
  if (n == 0) return true;
  expects(grad != nullptr, "grad", "is null");
  expects(detail::aligned_to(grad, dtype_size(grad_type)), "grad", "is not aligned to its element size");
  const auto un = static_cast<std::size_t>(n);
  const auto fn = detail::select_nonfinite_range(isa_, grad_type);
  const std::size_t gsz = dtype_size(grad_type);
  std::atomic<bool> bad{false};
  pool_->parallel_for((un + chunk_ - 1) / chunk_, [&](std::size_t k) {
    if (bad.load(std::memory_order_relaxed)) return;
    const std::size_t lo = k * chunk_, cnt = std::min(un, lo + chunk_) - lo;
    if (fn(static_cast<const unsigned char*>(grad) + lo * gsz, cnt, scale)) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

}  // namespace zenflow
