// The host backend's "device" work on its thread pool and SIMD paths (host_sparse_adam's step,
// migration, gather_columns / scatter_columns, host_gradient_stats) against scalar references
// written here, element by element in the plain definition's order, bit for bit: every SIMD path
// this CPU has, several thread counts, row-major, column-contiguous and padded/strided layouts,
// f32/bf16/f16 parameters and gradients, odd shapes, per-parameter options, missing gradients,
// skip flags and the non-finite check.
#include <zenflow/gradient_stats.hpp>
#include <zenflow/sparse_adam.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

namespace {

using zenflow::cpu_isa;
using zenflow::dtype;
using zenflow::host_execution;
using zenflow::index_t;
namespace sa = zenflow::detail::sparse_adam;

std::vector<cpu_isa> available_isas() {
  std::vector<cpu_isa> out;
  for (cpu_isa i : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512})
    if (zenflow::cpu_isa_supported(i)) out.push_back(i);
  return out;
}

/// Every (path, pool) pair the tests run: each path on the calling thread alone and on pools of
/// 2 and 3 threads.
struct executions {
  std::vector<std::unique_ptr<zenflow::thread_pool>> pools;
  std::vector<host_execution> all;
  executions() {
    pools.push_back(std::make_unique<zenflow::thread_pool>(2));
    pools.push_back(std::make_unique<zenflow::thread_pool>(3));
    for (cpu_isa isa : available_isas()) {
      all.push_back({nullptr, isa});
      for (auto& p : pools) all.push_back({p.get(), isa});
    }
  }
};
std::string describe(const host_execution& e) {
  return std::string(zenflow::cpu_isa_name(e.isa)) + " threads " + std::to_string(e.pool ? e.pool->size() : 1);
}

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

/// A matrix with any strides in a byte buffer of any dtype (padding between rows or columns).
struct strided {
  dtype type = dtype::f32;
  index_t rows = 0, cols = 0, rs = 1, cs = 1;
  std::vector<std::byte> bytes;
  strided(dtype t, index_t r, index_t c, index_t row_stride, index_t col_stride)
      : type(t), rows(r), cols(c), rs(row_stride), cs(col_stride) {
    bytes.resize(static_cast<std::size_t>((r - 1) * rs + (c - 1) * cs + 1) * zenflow::dtype_size(t));
  }
  /// Layout kinds: 0 row-major, 1 column-contiguous, 2 padded rows, 3 padded columns, 4 both strided.
  static strided make(dtype t, index_t r, index_t c, int kind) {
    switch (kind) {
      case 0:
        return {t, r, c, c, 1};
      case 1:
        return {t, r, c, 1, r};
      case 2:
        return {t, r, c, c + 3, 1};
      case 3:
        return {t, r, c, 1, r + 5};
      default:
        return {t, r, c, 2, 2 * r + 1};
    }
  }
  [[nodiscard]] index_t offset(index_t r, index_t c) const { return r * rs + c * cs; }
  [[nodiscard]] zenflow::matrix_view view() {
    return zenflow::matrix_view(bytes.data(), rows, cols, rs, cs, type, zenflow::memory_space::host);
  }
  [[nodiscard]] zenflow::const_matrix_view cview() const {
    return zenflow::const_matrix_view(bytes.data(), rows, cols, rs, cs, type, zenflow::memory_space::host);
  }
  [[nodiscard]] float get(index_t r, index_t c) const { return sa::load_as_float(bytes.data(), type, offset(r, c)); }
  void set(index_t r, index_t c, float x) { sa::store_from_float(bytes.data(), type, offset(r, c), x); }
};

void fill(strided& t, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> n(0.0f, sigma);
  for (index_t r = 0; r < t.rows; ++r)
    for (index_t c = 0; c < t.cols; ++c) t.set(r, c, n(rng));
}

std::vector<std::int32_t> pick(index_t cols, index_t k, std::mt19937& rng) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(cols));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

// ------------------------------------------------------------------------------------------------
// The sparse step.
// ------------------------------------------------------------------------------------------------

/// One parameter of the step tests and the plain reference of its update: for every selected
/// element, adam_update on its fp32 master then the parameter rounded to its dtype.
struct param_case {
  strided param, grad;
  std::vector<std::int32_t> selection;
  std::vector<float> master, m, v;  // packed order: slot j, row r at j * rows + r
  zenflow::adam_options options;
  std::int64_t steps = 0;
  bool has_grad = true;

  param_case(strided p, strided g, std::vector<std::int32_t> sel, std::mt19937& rng)
      : param(std::move(p)), grad(std::move(g)), selection(std::move(sel)) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    const std::size_t size = selection.size() * static_cast<std::size_t>(param.rows);
    for (std::size_t i = 0; i < size; ++i) {
      master.push_back(n(rng));
      m.push_back(0.01f * n(rng));
      v.push_back(1e-4f * std::fabs(n(rng)));
    }
    fill(param, rng, 1.0f);
  }
  [[nodiscard]] std::vector<float> packed() const {
    const index_t rows = param.rows;
    std::vector<float> out(3 * master.size());
    for (std::size_t j = 0; j < selection.size(); ++j)
      for (index_t r = 0; r < rows; ++r) {
        const std::size_t s = j * static_cast<std::size_t>(rows) + static_cast<std::size_t>(r);
        out[sa::packed_index(rows, static_cast<index_t>(j), 0, r)] = master[s];
        out[sa::packed_index(rows, static_cast<index_t>(j), 1, r)] = m[s];
        out[sa::packed_index(rows, static_cast<index_t>(j), 2, r)] = v[s];
      }
    return out;
  }
  void reference_step(float scale) {
    if (!has_grad) return;
    const auto c = zenflow::make_adam_step_constants(options, ++steps, scale);
    for (std::size_t j = 0; j < selection.size(); ++j)
      for (index_t r = 0; r < param.rows; ++r) {
        const std::size_t s = j * static_cast<std::size_t>(param.rows) + static_cast<std::size_t>(r);
        zenflow::adam_update(master[s], grad.get(r, selection[j]), m[s], v[s], c);
        param.set(r, selection[j], master[s]);
      }
  }
};

/// A model of several parameters: shapes and layouts chosen to reach every path (direct runs,
/// gathered batches, tails, a single row or column, 1-D parameters).
struct model {
  std::vector<param_case> params;  // matrices first, then vectors (registered as vectors)
  std::size_t matrices = 0;
  model(dtype pt, dtype gt, int layout, std::mt19937& rng) {
    struct shape {
      index_t rows, cols, k;
    };
    const shape shapes[] = {{37, 50, 50}, {19, 300, 33}, {61, 24, 17},  {1, 41, 7},
                            {45, 20, 1},  {3, 3, 3},     {33, 140, 133}};
    for (const shape& s : shapes) {
      const int grad_layout = (layout + 1) % 5;  // a gradient in another layout than the parameter
      params.emplace_back(strided::make(pt, s.rows, s.cols, layout), strided::make(gt, s.rows, s.cols, grad_layout),
                          pick(s.cols, s.k, rng), rng);
    }
    // Contiguous consecutive columns in runs long enough for the direct path.
    std::vector<std::int32_t> runs;
    for (std::int32_t c = 0; c < 100; ++c)
      if (c % 40 < 35) runs.push_back(c);
    params.emplace_back(strided::make(pt, 9, 100, layout), strided::make(gt, 9, 100, layout), runs, rng);
    matrices = params.size();
    for (index_t n : {index_t{1}, index_t{17}, index_t{300}}) {  // vectors: one column of n rows
      params.emplace_back(strided(pt, n, 1, layout == 4 ? 3 : 1, 1), strided(gt, n, 1, layout == 2 ? 2 : 1, 1),
                          std::vector<std::int32_t>{0}, rng);
      auto& vec = params.back();
      std::fill(vec.m.begin(), vec.m.end(), 0.0f);  // add_vector starts the moments at zero
      std::fill(vec.v.begin(), vec.v.end(), 0.0f);
    }
    for (std::size_t i = 0; i < params.size(); ++i) {  // parameter groups: lr and weight decay
      params[i].options.lr = 1e-2f * static_cast<float>(1 + i % 3);
      params[i].options.weight_decay = 0.01f * static_cast<float>(i % 4);
      params[i].options.adamw_mode = layout % 2 == 0;
    }
  }
  void new_gradients(std::mt19937& rng) {
    for (auto& p : params) fill(p.grad, rng, 0.1f);
  }
};

/// host_sparse_adam over a copy of the model's parameters.
struct device {
  std::vector<strided> param;
  zenflow::host_sparse_adam opt;
  std::vector<std::size_t> index;
  device(const model& mdl, const host_execution& exec) : opt(zenflow::adam_options{}) {
    for (const auto& p : mdl.params) param.push_back(p.param);
    opt.set_options(mdl.params[0].options);
    for (std::size_t i = 0; i < mdl.params.size(); ++i) {
      const auto& p = mdl.params[i];
      if (i < mdl.matrices) {
        index.push_back(opt.add_matrix(param[i].view(), p.selection, p.packed(), exec));
      } else {
        const auto view = param[i].view();
        index.push_back(opt.add_vector(
            zenflow::vector_view(view.data, view.rows, view.type, zenflow::memory_space::host, view.row_stride),
            p.master));
      }
      opt.set_options(index.back(), p.options);
    }
  }
  bool step(const model& mdl, float scale, const host_execution& exec, const int* skip = nullptr, bool check = false,
            const float* scale_ptr = nullptr) {
    std::vector<zenflow::const_matrix_view> mg;
    std::vector<zenflow::const_vector_view> vg;
    for (std::size_t i = 0; i < mdl.params.size(); ++i) {
      const auto& p = mdl.params[i];
      const auto g = p.grad.cview();
      if (i < mdl.matrices)
        mg.push_back(p.has_grad ? g : zenflow::const_matrix_view{});
      else
        vg.push_back(p.has_grad
                         ? zenflow::const_vector_view(g.data, g.rows, g.type, zenflow::memory_space::host, g.row_stride)
                         : zenflow::const_vector_view{});
    }
    return opt.step(mg, vg, scale, scale_ptr, skip, check, exec);
  }
};

/// Every parameter byte and every state bit of `d` equal the reference model's.
bool same_as(device& d, const model& mdl, const host_execution& exec) {
  bool ok = true;
  for (std::size_t i = 0; i < mdl.params.size(); ++i) {
    const auto& p = mdl.params[i];
    ok &= d.param[i].bytes == p.param.bytes;
    std::vector<float> state(3 * p.master.size());
    d.opt.export_state(d.index[i], state, exec);
    const auto expect = p.packed();
    for (std::size_t e = 0; e < state.size(); ++e) ok &= bits_of(state[e]) == bits_of(expect[e]);
    ok &= d.opt.step_count(d.index[i]) == p.steps;
  }
  return ok;
}

TEST_CASE("host sparse step: every path, thread count, layout and dtype equals the per-element reference") {
  executions ex;
  std::mt19937 rng(11);
  for (int layout = 0; layout < 5; ++layout)
    for (dtype pt : {dtype::f32, dtype::bf16, dtype::f16})
      for (dtype gt : {dtype::f32, dtype::bf16, dtype::f16}) {
        CAPTURE(layout);
        CAPTURE(zenflow::dtype_name(pt));
        CAPTURE(zenflow::dtype_name(gt));
        model reference(pt, gt, layout, rng);
        std::vector<std::unique_ptr<device>> devices;
        for (const auto& e : ex.all) devices.push_back(std::make_unique<device>(reference, e));
        for (int t = 0; t < 3; ++t) {
          reference.new_gradients(rng);
          // Missing gradients: one matrix and one vector sit out the second step.
          reference.params[2].has_grad = reference.params[reference.matrices].has_grad = t != 1;
          const float scale = t == 2 ? 0.75f : 1.0f;
          for (auto& p : reference.params) p.reference_step(scale);
          for (std::size_t d = 0; d < devices.size(); ++d) {
            CAPTURE(describe(ex.all[d]));
            REQUIRE(devices[d]->step(reference, scale, ex.all[d], nullptr, t == 0));
          }
        }
        for (std::size_t d = 0; d < devices.size(); ++d) {
          CAPTURE(describe(ex.all[d]));
          CHECK(same_as(*devices[d], reference, ex.all[d]));
        }
      }
}

TEST_CASE("host sparse step: a skip flag, an unusable scale or a non-finite value changes nothing on any path") {
  executions ex;
  std::mt19937 rng(5);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const auto& e : ex.all) {
    CAPTURE(describe(e));
    model reference(dtype::bf16, dtype::f32, 0, rng);
    device d(reference, e);
    reference.new_gradients(rng);
    const int skip = 1;
    CHECK_FALSE(d.step(reference, 1.0f, e, &skip, true));
    CHECK_FALSE(d.step(reference, 1.0f, e, nullptr, false, &inf));
    // A NaN in a gathered batch, in a direct run, in a vector; a finite value that overflows when
    // scaled: each alone skips the checked step.
    struct poison {
      std::size_t param;
      index_t r;
      float value, scale;
    };
    const poison cases[] = {
        {1, 18, nan, 1.0f}, {0, 36, -inf, 1.0f}, {reference.matrices + 2, 299, nan, 1.0f}, {6, 32, 3.0e38f, 2.0f}};
    for (const poison& pc : cases) {
      auto& p = reference.params[pc.param];
      const index_t c = p.selection.back();
      const float keep = p.grad.get(pc.r, c);
      p.grad.set(pc.r, c, pc.value);
      CHECK_FALSE(d.step(reference, pc.scale, e, nullptr, true));
      p.grad.set(pc.r, c, keep);
    }
    CHECK(same_as(d, reference, e));  // nothing changed: the reference made no step either
    CHECK(d.opt.step_count() == 0);
    // An unselected column's NaN is not read: the step applies.
    auto& p = reference.params[1];
    std::int32_t unselected = 0;
    while (std::binary_search(p.selection.begin(), p.selection.end(), unselected)) ++unselected;
    p.grad.set(4, unselected, nan);
    for (auto& q : reference.params) q.reference_step(1.0f);
    CHECK(d.step(reference, 1.0f, e, nullptr, true));
    CHECK(same_as(d, reference, e));
  }
}

TEST_CASE("host sparse step: SIMD paths equal the scalar reference where a contracted multiply-add would not") {
  // Inputs on which each product of adam_update, if fused into its neighbouring add instead of
  // rounded first (or fused with the other product), gives other bits for a good share of the
  // elements: the check below fails for such a SIMD path (seen with avx512::adam_block's v line
  // contracted the other way, fma(omb2 * g, g, beta2 * v)).
  const index_t rows = 64, cols = 48;
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  zenflow::adam_options o;
  o.lr = 0.0123f;
  o.weight_decay = 0.037f;
  for (bool adamw : {true, false}) {
    o.adamw_mode = adamw;
    strided grad = strided::make(dtype::f32, rows, cols, 0);
    std::vector<float> master(rows * cols), m(rows * cols), v(rows * cols);
    for (index_t i = 0; i < rows * cols; ++i) {
      master[i] = u(rng) * (i % 2 ? -1.0f : 1.0f);
      m[i] = 0.1f * u(rng);
      v[i] = 1e-4f * u(rng);  // beta2 * v comparable to (1 - beta2) * g * g: the rounding of either shows
    }
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = 0; c < cols; ++c) grad.set(r, c, 0.3f * u(rng) - 0.45f);
    const auto c = zenflow::make_adam_step_constants(o, 3, 0.7f);
    // The inputs discriminate: the other fusions differ from the reference's in many elements.
    int differ_m = 0, differ_v = 0;
    for (index_t i = 0; i < rows * cols; ++i) {
      const float g = zenflow::detail::mul_rn(grad.get(i / cols, i % cols), c.grad_scale);
      const float gl = std::fma(c.l2, master[i], g);
      const float v_ref = std::fma(c.beta2, v[i], (c.one_minus_beta2 * gl) * gl);
      const float v_fused = std::fma(c.one_minus_beta2 * gl, gl, c.beta2 * v[i]);
      const float m_ref = std::fma(c.beta1, m[i], c.one_minus_beta1 * gl);
      const float m_fused = std::fma(c.one_minus_beta1, gl, c.beta1 * m[i]);
      differ_v += bits_of(v_ref) != bits_of(v_fused);
      differ_m += bits_of(m_ref) != bits_of(m_fused);
    }
    CHECK(differ_v > rows * cols / 10);
    CHECK(differ_m > rows * cols / 10);
    const std::vector<std::int32_t> all = [&] {
      std::vector<std::int32_t> a(cols);
      std::iota(a.begin(), a.end(), 0);
      return a;
    }();
    const std::vector<std::int32_t> sparse = {1, 2, 5, 8, 9, 10, 20, 33, 47};
    for (const auto* sel : {&all, &sparse}) {  // the direct and the gathered path
      std::vector<std::vector<std::byte>> results;
      for (cpu_isa isa : available_isas()) {
        CAPTURE(zenflow::cpu_isa_name(isa));
        strided param = strided::make(dtype::f32, rows, cols, 0);
        std::vector<float> packed(3 * sel->size() * rows);
        for (std::size_t j = 0; j < sel->size(); ++j)
          for (index_t r = 0; r < rows; ++r) {
            const auto i = static_cast<std::size_t>(r * cols + (*sel)[j]);
            packed[sa::packed_index(rows, j, 0, r)] = master[i];
            packed[sa::packed_index(rows, j, 1, r)] = m[i];
            packed[sa::packed_index(rows, j, 2, r)] = v[i];
          }
        zenflow::host_sparse_adam opt(o);
        opt.add_matrix(param.view(), *sel, packed);
        opt.set_step_count(2);
        const zenflow::const_matrix_view mg[] = {grad.cview()};
        REQUIRE(opt.step(mg, {}, 0.7f, nullptr, nullptr, false, {nullptr, isa}));
        results.push_back(param.bytes);
        // Against adam_update, the scalar definition.
        bool ok = true;
        for (index_t r = 0; r < rows; ++r)
          for (std::int32_t col : *sel) {
            const auto i = static_cast<std::size_t>(r * cols + col);
            float p = master[i], mm = m[i], vv = v[i];
            zenflow::adam_update(p, grad.get(r, col), mm, vv, c);
            ok &= bits_of(param.get(r, col)) == bits_of(p);
          }
        CHECK(ok);
      }
      for (const auto& r : results) CHECK(r == results.front());
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Migration.
// ------------------------------------------------------------------------------------------------

TEST_CASE("export, import and reselect move state bit for bit on every path, NaN payloads included") {
  executions ex;
  std::mt19937 rng(17);
  for (int layout : {0, 1, 4})
    for (const auto& e : ex.all) {
      CAPTURE(layout);
      CAPTURE(describe(e));
      const index_t rows = 35, cols = 90, k = 30;
      strided param = strided::make(dtype::bf16, rows, cols, layout);
      auto sel = pick(cols, k, rng);
      std::vector<float> packed(3 * k * rows);
      for (std::size_t i = 0; i < packed.size(); ++i) {
        const std::uint32_t b =
            i % 97 == 0 ? 0x7f800001u + static_cast<std::uint32_t>(i) : static_cast<std::uint32_t>(rng());
        std::memcpy(&packed[i], &b, 4);  // any bits: signalling NaNs, infinities, subnormals
      }
      zenflow::host_sparse_adam opt({});
      const auto idx = opt.add_matrix(param.view(), sel, packed, e);
      std::vector<float> out(packed.size());
      opt.export_state(idx, out, e);
      CHECK(std::memcmp(out.data(), packed.data(), out.size() * 4) == 0);
      // Reselect: entering and leaving in the same buffer (they may alias).
      auto next = pick(cols, k, rng);
      const index_t moved = opt.migration_count(idx, next);
      std::vector<float> buffer(3 * moved * rows);
      for (auto& x : buffer) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
      const auto entering = buffer;
      opt.reselect(idx, next, buffer, buffer, e);
      std::vector<float> after(packed.size());
      opt.export_state(idx, after, e);
      // Expected: kept columns keep their state, entering ones take it from `entering` (in
      // ascending order), leaving ones are in `buffer` (ascending).
      bool ok = true;
      index_t in = 0, out_l = 0;
      for (std::size_t j = 0; j < next.size(); ++j) {
        const auto old = std::lower_bound(sel.begin(), sel.end(), next[j]);
        for (int p = 0; p < 3; ++p)
          for (index_t r = 0; r < rows; ++r) {
            const float want = old != sel.end() && *old == next[j]
                                   ? packed[sa::packed_index(rows, old - sel.begin(), p, r)]
                                   : entering[sa::packed_index(rows, in, p, r)];
            ok &= bits_of(after[sa::packed_index(rows, static_cast<index_t>(j), p, r)]) == bits_of(want);
          }
        if (old == sel.end() || *old != next[j]) ++in;
      }
      for (std::size_t j = 0; j < sel.size(); ++j) {
        if (std::binary_search(next.begin(), next.end(), sel[j])) continue;
        for (int p = 0; p < 3; ++p)
          for (index_t r = 0; r < rows; ++r)
            ok &= bits_of(buffer[sa::packed_index(rows, out_l, p, r)]) ==
                  bits_of(packed[sa::packed_index(rows, static_cast<index_t>(j), p, r)]);
        ++out_l;
      }
      CHECK(in == moved);
      CHECK(out_l == moved);
      CHECK(ok);
      // import_state writes back what export_state read.
      opt.import_state(idx, packed, e);
      opt.export_state(idx, out, e);
      CHECK(std::memcmp(out.data(), packed.data(), out.size() * 4) == 0);
    }
}

// ------------------------------------------------------------------------------------------------
// Gather and scatter.
// ------------------------------------------------------------------------------------------------

TEST_CASE("gather_columns and scatter_columns on every path equal the per-element definition") {
  executions ex;
  std::mt19937 rng(23);
  const index_t shapes[][2] = {{70, 23}, {1, 40}, {40, 1}, {129, 300}, {17, 17}};
  for (const auto& shape : shapes)
    for (int layout = 0; layout < 5; ++layout)
      for (dtype st : {dtype::f32, dtype::bf16, dtype::f16})
        for (dtype dt : {dtype::f32, dtype::bf16, dtype::f16}) {
          const index_t rows = shape[0], cols = shape[1];
          CAPTURE(rows);
          CAPTURE(cols);
          CAPTURE(layout);
          CAPTURE(zenflow::dtype_name(st));
          CAPTURE(zenflow::dtype_name(dt));
          strided src = strided::make(st, rows, cols, layout);
          fill(src, rng, 3.0f);
          src.set(0, cols - 1, std::numeric_limits<float>::quiet_NaN());
          src.set(rows - 1, 0, -std::numeric_limits<float>::infinity());
          // Column lists: ascending with gaps (within and beyond a SIMD window), every column in
          // order, and any order with a repeat (a scattered repeat keeps the later value).
          std::vector<std::vector<std::int32_t>> lists = {pick(cols, (cols + 1) / 2, rng), pick(cols, cols, rng),
                                                          pick(cols, (cols + 1) / 2, rng)};
          if (cols > 40) lists.push_back(pick(cols, cols / 20 + 1, rng));
          // Every tenth column left out (ZenFlow's 90% on the CPU): most 8-column windows are one
          // column short of a run (the AVX2 transposition's two-load window).
          std::vector<std::int32_t> most;
          for (std::int32_t c = 0; c < cols; ++c)
            if (c % 10 != 3) most.push_back(c);
          lists.push_back(most);
          std::shuffle(lists[2].begin(), lists[2].end(), rng);
          lists[2].push_back(lists[2].front());
          for (const auto& columns : lists) {
            const float scale = 0.3f;
            const std::size_t dsz = zenflow::dtype_size(dt);
            std::vector<std::byte> expect(columns.size() * rows * dsz);
            for (std::size_t i = 0; i < columns.size(); ++i)
              for (index_t r = 0; r < rows; ++r)
                sa::store_from_float(expect.data(), dt, static_cast<index_t>(i) * rows + r,
                                     src.get(r, columns[i]) * scale);
            // Scatter: a column listed twice takes the later value.
            strided dst0 = strided::make(dt, rows, cols, (layout + 2) % 5);
            fill(dst0, rng, 1.0f);
            std::vector<float> values(columns.size() * rows);
            for (auto& x : values) x = std::normal_distribution<float>(0.0f, 100.0f)(rng);
            strided dst_expect = dst0;
            for (std::size_t i = 0; i < columns.size(); ++i)
              for (index_t r = 0; r < rows; ++r) dst_expect.set(r, columns[i], values[i * rows + r]);
            for (const auto& e : ex.all) {
              CAPTURE(describe(e));
              std::vector<std::byte> got(expect.size());
              zenflow::gather_columns(src.cview(), columns, got.data(), dt, scale, e);
              CHECK(got == expect);
              strided dst = dst0;
              zenflow::scatter_columns(values.data(), dtype::f32, columns, dst.view(), e);
              CHECK(dst.bytes == dst_expect.bytes);
            }
          }
        }
}

TEST_CASE("gather_accumulate equals gather_columns followed by the accumulate kernel, without the buffer") {
  // The host backend's offload at step(): the same bits as the staged path it replaces (an
  // unscaled gather, the scale applied in fp32 as it accumulates), for every layout, dtype, path
  // and thread count, into zeros or over an accumulator, with blocks of whole columns and (70,000
  // rows) blocks of one column's rows.
  namespace hd = zenflow::detail::host_device;
  executions ex;
  std::mt19937 rng(29);
  const index_t shapes[][2] = {{70, 23}, {1, 40}, {129, 300}, {70000, 3}};
  for (const auto& shape : shapes)
    for (int layout = 0; layout < 5; ++layout)
      for (dtype st : {dtype::f32, dtype::bf16, dtype::f16}) {
        const index_t rows = shape[0], cols = shape[1];
        if (rows > 1000 && layout > 1) continue;  // row-major and column-contiguous are enough there
        CAPTURE(rows);
        CAPTURE(cols);
        CAPTURE(layout);
        CAPTURE(zenflow::dtype_name(st));
        strided src = strided::make(st, rows, cols, layout);
        fill(src, rng, 3.0f);
        src.set(0, cols - 1, std::numeric_limits<float>::quiet_NaN());
        // A row of -0: overwriting stores fma(scale, -0, +0) = +0 (a product would store -0).
        for (index_t c = 0; c + 1 < cols; ++c) src.set(std::min<index_t>(17, rows - 1), c, -0.0f);
        for (const auto& columns : {pick(cols, (cols + 1) / 2, rng), pick(cols, cols, rng)}) {
          const auto n = static_cast<index_t>(columns.size());
          std::vector<float> acc0(static_cast<std::size_t>(n * rows));
          for (auto& x : acc0) x = std::normal_distribution<float>(0.0f, 2.0f)(rng);
          for (const bool overwrite : {false, true}) {
            CAPTURE(overwrite);
            const float scale = 0.3f;
            for (const auto& e : ex.all) {
              CAPTURE(describe(e));
              std::vector<std::byte> staged(acc0.size() * zenflow::dtype_size(st));
              zenflow::gather_columns(src.cview(), columns, staged.data(), st, 1.0f, e);
              std::vector<float> expect = acc0;
              (void)zenflow::detail::select_accumulate_range(e.isa, st, overwrite)(expect.data(), staged.data(),
                                                                                   expect.size(), scale);
              std::vector<float> got = acc0;
              const zenflow::const_matrix_view v = src.cview();
              hd::gather_accumulate(
                  {v.data, v.type, v.row_stride, v.col_stride, columns.data(), hd::max_column(columns)}, rows, n, scale,
                  got.data(), overwrite, e, e.isa);
              CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0);
            }
          }
        }
      }
}

// ------------------------------------------------------------------------------------------------
// Gradient statistics.
// ------------------------------------------------------------------------------------------------

/// The documented order, written out: per tensor in memory order, blocks of 16384 elements, 16
/// lanes by element index, lanes folded 8/4/2/1, blocks added in order.
zenflow::gradient_stats reference_stats(const std::vector<strided>& tensors) {
  zenflow::gradient_stats out;
  for (const auto& t : tensors) {
    const bool rows_inner = t.cols == 1 || (t.rows > 1 && t.rs <= t.cs);
    const index_t inner = rows_inner ? t.rows : t.cols, n = t.rows * t.cols;
    for (index_t b = 0; b < n; b += 16384) {
      double lane[16] = {};
      for (index_t e = b; e < std::min(n, b + 16384); ++e) {
        const index_t o = e / inner, i = e % inner;
        const float x = rows_inner ? t.get(i, o) : t.get(o, i);
        if (!std::isfinite(x)) {
          ++out.nonfinite_count;
          continue;
        }
        lane[(e - b) % 16] += static_cast<double>(x) * x;
      }
      for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
      out.sum_of_squares += lane[0];
    }
  }
  return out;
}

TEST_CASE("host_gradient_stats: the documented order on every path and thread count, strided tensors too") {
  executions ex;
  std::mt19937 rng(31);
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16}) {
    CAPTURE(zenflow::dtype_name(t));
    std::vector<strided> tensors;
    for (int layout = 0; layout < 5; ++layout) tensors.push_back(strided::make(t, 130, 257, layout));
    tensors.push_back(strided::make(t, 1, 5, 0));
    tensors.push_back(strided::make(t, 300, 300, 0));  // several blocks, a short last one
    tensors.push_back(strided(t, 1000, 1, 3, 1));      // a strided vector, as a column
    for (auto& x : tensors) fill(x, rng, 2.0f);
    tensors[1].set(5, 7, std::numeric_limits<float>::quiet_NaN());
    tensors[4].set(129, 256, std::numeric_limits<float>::infinity());
    tensors[6].set(299, 299, -std::numeric_limits<float>::infinity());
    const auto expect = reference_stats(tensors);
    std::vector<zenflow::const_matrix_view> views;
    for (std::size_t i = 0; i + 1 < tensors.size(); ++i) views.push_back(tensors[i].cview());
    const zenflow::const_vector_view vec(tensors.back().bytes.data(), 1000, t, zenflow::memory_space::host, 3);
    double fp64 = 0.0;  // the plain sum, for scale
    for (const auto& x : tensors)
      for (index_t r = 0; r < x.rows; ++r)
        for (index_t c = 0; c < x.cols; ++c)
          if (std::isfinite(x.get(r, c))) fp64 += static_cast<double>(x.get(r, c)) * x.get(r, c);
    CHECK(expect.nonfinite_count == 3);
    CHECK(expect.sum_of_squares == doctest::Approx(fp64).epsilon(1e-12));
    for (const auto& e : ex.all) {
      CAPTURE(describe(e));
      const auto got = zenflow::host_gradient_stats(views, std::span(&vec, 1), e);
      CHECK(bits_of(static_cast<float>(got.sum_of_squares)) == bits_of(static_cast<float>(expect.sum_of_squares)));
      CHECK(got.sum_of_squares == expect.sum_of_squares);
      CHECK(got.nonfinite_count == expect.nonfinite_count);
    }
  }
}

TEST_CASE("a SIMD path this CPU lacks, or an unknown one, is rejected before anything changes") {
  strided g = strided::make(dtype::f32, 4, 4, 0);
  const auto v = g.cview();
  const host_execution bad{nullptr, static_cast<cpu_isa>(77)};
  auto arg = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const zenflow::error& e) {
      return std::string(e.argument());
    }
    return "";
  };
  CHECK(arg([&] { (void)zenflow::host_gradient_stats(std::span(&v, 1), {}, bad); }) == "exec.isa");
  std::vector<float> buf(16);
  CHECK(arg([&] { zenflow::gather_columns(v, std::vector<std::int32_t>{1}, buf.data(), dtype::f32, 1.0f, bad); }) ==
        "exec.isa");
  zenflow::host_sparse_adam opt({});
  const std::vector<std::int32_t> sel{1};
  opt.add_matrix(g.view(), sel, std::vector<float>(12, 1.0f));
  CHECK(arg([&] { opt.step(std::span(&v, 1), {}, 1.0f, nullptr, nullptr, false, bad); }) == "exec.isa");
  CHECK(opt.step_count() == 0);
}

}  // namespace

}  // namespace ZENFLOW_TEST_FILE_ID
