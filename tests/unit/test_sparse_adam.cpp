// host_sparse_adam and the column gather/scatter helpers against brute force: a dense fp32 Adam
// (adam_math.hpp's adam_update over every column of a full copy) of which only the selected
// columns are compared, bit for bit.
#include <zenflow/concepts.hpp>
#include <zenflow/sparse_adam.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

namespace {

using zenflow::dtype;
using zenflow::index_t;
namespace sa = zenflow::detail::sparse_adam;

static_assert(zenflow::device_optimizer<zenflow::host_sparse_adam>);

/// A matrix stored in a byte buffer of any dtype and layout.
struct tensor {
  dtype type = dtype::f32;
  index_t rows = 0, cols = 0;
  bool row_major = true;
  std::vector<std::byte> bytes;

  tensor(dtype t, index_t r, index_t c, bool rm) : type(t), rows(r), cols(c), row_major(rm) {
    bytes.resize(static_cast<std::size_t>(r * c) * zenflow::dtype_size(t));
  }
  [[nodiscard]] zenflow::matrix_view view() {
    return row_major ? zenflow::matrix_view::row_major(bytes.data(), rows, cols, type)
                     : zenflow::matrix_view::column_contiguous(bytes.data(), rows, cols, type);
  }
  [[nodiscard]] zenflow::const_matrix_view cview() { return view(); }
  [[nodiscard]] index_t offset(index_t r, index_t c) const { return row_major ? r * cols + c : c * rows + r; }
  [[nodiscard]] float get(index_t r, index_t c) const { return sa::load_as_float(bytes.data(), type, offset(r, c)); }
  void set(index_t r, index_t c, float x) { sa::store_from_float(bytes.data(), type, offset(r, c), x); }
  /// The raw bits of element (r, c).
  [[nodiscard]] std::uint32_t bits(index_t r, index_t c) const {
    std::uint32_t b = 0;
    std::memcpy(&b, bytes.data() + offset(r, c) * zenflow::dtype_size(type), zenflow::dtype_size(type));
    return b;
  }
};

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

/// The parameter's value as its dtype would store `x`.
std::uint32_t rounded_bits(float x, dtype t) {
  std::byte buf[4] = {};
  sa::store_from_float(buf, t, 0, x);
  std::uint32_t b = 0;
  std::memcpy(&b, buf, zenflow::dtype_size(t));
  return b;
}

/// Dense fp32 state of every column: the brute-force reference.
struct dense_state {
  index_t rows, cols;
  std::vector<float> p, m, v;  // [c * rows + r]
  dense_state(index_t r, index_t c, std::mt19937& rng) : rows(r), cols(c) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (index_t i = 0; i < r * c; ++i) {
      p.push_back(n(rng));
      m.push_back(0.01f * n(rng));
      v.push_back(1e-4f * std::fabs(n(rng)));
    }
  }
  [[nodiscard]] std::vector<float> packed(std::span<const std::int32_t> columns) const {
    std::vector<float> out(3 * columns.size() * static_cast<std::size_t>(rows));
    for (std::size_t l = 0; l < columns.size(); ++l)
      for (index_t r = 0; r < rows; ++r) {
        const auto s = static_cast<std::size_t>(columns[l] * rows + r);
        out[sa::packed_index(rows, l, 0, r)] = p[s];
        out[sa::packed_index(rows, l, 1, r)] = m[s];
        out[sa::packed_index(rows, l, 2, r)] = v[s];
      }
    return out;
  }
  void unpack(std::span<const std::int32_t> columns, std::span<const float> packed) {
    for (std::size_t l = 0; l < columns.size(); ++l)
      for (index_t r = 0; r < rows; ++r) {
        const auto s = static_cast<std::size_t>(columns[l] * rows + r);
        p[s] = packed[sa::packed_index(rows, l, 0, r)];
        m[s] = packed[sa::packed_index(rows, l, 1, r)];
        v[s] = packed[sa::packed_index(rows, l, 2, r)];
      }
  }
};

std::vector<std::int32_t> random_selection(index_t cols, index_t k, std::mt19937& rng) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(cols));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

void fill_random(tensor& t, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> n(0.0f, sigma);
  for (index_t r = 0; r < t.rows; ++r)
    for (index_t c = 0; c < t.cols; ++c) t.set(r, c, n(rng));
}

}  // namespace

TEST_CASE("sparse update equals dense Adam on the selected columns; the rest is untouched") {
  std::mt19937 rng(7);
  // Shapes: a sparse selection (row-major: gathered), a dense one (AVX-512: 16-column chunks), and
  // rows longer than a gathered batch (256), whose batches begin and end inside a chunk.
  struct shape {
    index_t rows, cols, k;
  };
  for (const shape sh : {shape{13, 37, 5}, shape{13, 37, 20}, shape{3, 700, 400}})
    for (bool grad_same_layout : {false, true})
      for (bool row_major : {true, false})
        for (dtype pt : {dtype::f32, dtype::bf16, dtype::f16})
          for (dtype gt : {dtype::f32, dtype::bf16, dtype::f16})
            for (bool adamw : {true, false}) {
              CAPTURE(sh.cols);
              CAPTURE(sh.k);
              CAPTURE(grad_same_layout);
              CAPTURE(row_major);
              CAPTURE(static_cast<int>(pt));
              CAPTURE(static_cast<int>(gt));
              CAPTURE(adamw);
              const index_t rows = sh.rows, cols = sh.cols, k = sh.k;
              zenflow::adam_options o;
              o.lr = 1e-2f;
              o.weight_decay = 0.05f;
              o.adamw_mode = adamw;
              dense_state ref(rows, cols, rng);
              tensor param(pt, rows, cols, row_major), grad(gt, rows, cols, grad_same_layout == row_major);
              for (index_t r = 0; r < rows; ++r)
                for (index_t c = 0; c < cols; ++c) param.set(r, c, ref.p[c * rows + r]);
              const auto initial_bytes = param.bytes;
              const auto sel = random_selection(cols, k, rng);
              // A 1-D parameter (a bias) alongside, strided.
              std::vector<float> bias_master(11), bias_m(11, 0.0f), bias_v(11, 0.0f);
              for (auto& x : bias_master) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
              std::vector<std::byte> bias(22 * zenflow::dtype_size(pt));
              zenflow::vector_view bias_view(bias.data(), 11, pt, zenflow::memory_space::host, 2);
              std::vector<float> bias_grad(11);

              zenflow::host_sparse_adam opt(o);
              const auto bias_index = opt.add_vector(bias_view, bias_master);
              const auto index = opt.add_matrix(param.view(), sel, ref.packed(sel));
              CHECK(bias_index == 0);
              CHECK(index == 1);
              CHECK(opt.k(index) == k);
              CHECK(opt.k(bias_index) == 1);
              CHECK(opt.is_vector(bias_index));
              const float device_scale = 0.5f;
              for (std::int64_t t = 1; t <= 20; ++t) {
                fill_random(grad, rng, 0.1f);
                for (auto& g : bias_grad) g = std::normal_distribution<float>(0.0f, 0.1f)(rng);
                const zenflow::const_matrix_view mg[] = {grad.cview()};
                const zenflow::const_vector_view vg[] = {zenflow::const_vector_view(bias_grad.data(), 11, dtype::f32)};
                REQUIRE(opt.step(mg, vg, 2.0f, &device_scale));
                const auto c = zenflow::make_adam_step_constants(o, t, 2.0f * device_scale);
                for (index_t col = 0; col < cols; ++col)  // dense: every column
                  for (index_t r = 0; r < rows; ++r) {
                    const auto s = static_cast<std::size_t>(col * rows + r);
                    zenflow::adam_update(ref.p[s], grad.get(r, col), ref.m[s], ref.v[s], c);
                  }
                for (std::size_t i = 0; i < 11; ++i)
                  zenflow::adam_update(bias_master[i], bias_grad[i], bias_m[i], bias_v[i], c);
              }
              CHECK(opt.step_count() == 20);
              // Selected columns: parameter and state bit-identical to dense Adam.
              std::vector<float> state(3 * k * rows);
              opt.export_state(index, state);
              const auto expect = ref.packed(sel);
              bool state_equal = true, param_equal = true, others_untouched = true;
              for (std::size_t i = 0; i < state.size(); ++i) state_equal &= bits_of(state[i]) == bits_of(expect[i]);
              for (index_t col = 0; col < cols; ++col) {
                const bool selected = std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(col));
                for (index_t r = 0; r < rows; ++r) {
                  const auto es = zenflow::dtype_size(pt);
                  const auto off = static_cast<std::size_t>(param.offset(r, col)) * es;
                  if (selected)
                    param_equal &= param.bits(r, col) == rounded_bits(ref.p[col * rows + r], pt);
                  else
                    others_untouched &= std::memcmp(param.bytes.data() + off, initial_bytes.data() + off, es) == 0;
                }
              }
              CHECK(state_equal);
              CHECK(param_equal);
              CHECK(others_untouched);
              // The vector: all of it, strided (the gaps untouched: they were zero).
              std::vector<float> bias_state(33);
              opt.export_state(bias_index, bias_state);
              bool bias_equal = true;
              for (std::size_t i = 0; i < 11; ++i) {
                bias_equal &= bits_of(bias_state[i]) == bits_of(bias_master[i]);
                bias_equal &= bits_of(bias_state[11 + i]) == bits_of(bias_m[i]);
                bias_equal &= bits_of(bias_state[22 + i]) == bits_of(bias_v[i]);
                std::uint32_t stored = 0;
                std::memcpy(&stored, bias.data() + 2 * i * zenflow::dtype_size(pt), zenflow::dtype_size(pt));
                bias_equal &= stored == rounded_bits(bias_master[i], pt);
                bias_equal &= sa::load_as_float(bias.data(), pt, 2 * i + 1) == 0.0f;
              }
              CHECK(bias_equal);
            }
}

TEST_CASE("reselection migrates state losslessly and keeps kept columns") {
  std::mt19937 rng(11);
  // bf16 keeps its master apart; f32 is its own master (its selected columns).
  for (dtype pt : {dtype::bf16, dtype::f32})
    for (bool row_major : {true, false}) {
      CAPTURE(static_cast<int>(pt));
      CAPTURE(row_major);
      const index_t rows = 9, cols = 40, k = 8;
      dense_state cpu(rows, cols, rng);
      tensor param(pt, rows, cols, row_major);
      if (pt == dtype::f32)  // registered with its own values: the parameter is the master
        for (index_t r = 0; r < rows; ++r)
          for (index_t c = 0; c < cols; ++c) param.set(r, c, cpu.p[c * rows + r]);
      zenflow::host_sparse_adam opt(zenflow::adam_options{});
      const std::vector<std::int32_t> a = {1, 3, 4, 10, 20, 21, 30, 39};
      const std::vector<std::int32_t> b = {0, 3, 4, 11, 20, 22, 30, 38};  // kept: 3 4 20 30
      const auto i = opt.add_matrix(param.view(), a, cpu.packed(a));
      std::vector<float> before(3 * k * rows);
      opt.export_state(i, before);
      CHECK(opt.migration_count(i, b) == 4);

      const std::vector<std::int32_t> enter_ab = {0, 11, 22, 38}, leave_ab = {1, 10, 21, 39};
      const auto entering = cpu.packed(enter_ab);
      std::vector<float> leaving(3 * 4 * rows, -1.0f);
      opt.reselect(i, b, entering, leaving);
      CHECK(std::vector<std::int32_t>(opt.selection(i).begin(), opt.selection(i).end()) == b);
      // Leaving columns carry exactly their state; the state of b is exactly the CPU's.
      CHECK(leaving == cpu.packed(leave_ab));
      std::vector<float> mid(3 * k * rows);
      opt.export_state(i, mid);
      CHECK(mid == cpu.packed(b));

      // And back: the leaving buffer of A->B is the entering buffer of B->A.
      std::vector<float> leaving_back(3 * 4 * rows);
      opt.reselect(i, a, leaving, leaving_back);
      CHECK(leaving_back == entering);
      std::vector<float> after(3 * k * rows);
      opt.export_state(i, after);
      CHECK(std::memcmp(after.data(), before.data(), after.size() * 4) == 0);

      // The same buffer may serve as entering_in and leaving_out.
      std::vector<float> inout = entering;
      opt.reselect(i, b, inout, inout);
      CHECK(inout == cpu.packed(leave_ab));
      opt.export_state(i, mid);
      CHECK(mid == cpu.packed(b));
    }
}

TEST_CASE("updates after a reselection continue from the migrated state") {
  std::mt19937 rng(5);
  const index_t rows = 6, cols = 20, k = 4;
  zenflow::adam_options o;
  o.lr = 0.05f;
  dense_state cpu(rows, cols, rng);
  tensor param(dtype::f32, rows, cols, true), grad(dtype::f32, rows, cols, true);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) param.set(r, c, cpu.p[c * rows + r]);
  auto sel = random_selection(cols, k, rng);
  zenflow::host_sparse_adam opt(o);
  opt.add_matrix(param.view(), sel, cpu.packed(sel));
  std::int64_t t = 0;
  for (int round = 0; round < 4; ++round) {
    for (int s = 0; s < 3; ++s) {
      fill_random(grad, rng);
      const zenflow::const_matrix_view mg[] = {grad.cview()};
      REQUIRE(opt.step(mg, {}));
      const auto c = zenflow::make_adam_step_constants(o, ++t);
      for (auto col : sel)  // the reference updates the selected columns only
        for (index_t r = 0; r < rows; ++r) {
          const auto x = static_cast<std::size_t>(col * rows + r);
          zenflow::adam_update(cpu.p[x], grad.get(r, col), cpu.m[x], cpu.v[x], c);
        }
    }
    const auto next = random_selection(cols, k, rng);
    std::vector<std::int32_t> entering, leaving;
    std::set_difference(next.begin(), next.end(), sel.begin(), sel.end(), std::back_inserter(entering));
    std::set_difference(sel.begin(), sel.end(), next.begin(), next.end(), std::back_inserter(leaving));
    std::vector<float> out(3 * leaving.size() * rows);
    opt.reselect(0, next, cpu.packed(entering), out);
    CHECK(out == cpu.packed(leaving));  // the CPU gets back exactly what the GPU computed
    sel = next;
  }
  std::vector<float> state(3 * k * rows);
  opt.export_state(0, state);
  CHECK(state == cpu.packed(sel));
  for (index_t r = 0; r < rows; ++r)
    for (auto col : sel) CHECK(param.get(r, col) == cpu.p[col * rows + r]);
}

TEST_CASE("an f32 parameter is its own master: imports write it, an edit is where the next step starts") {
  std::mt19937 rng(17);
  for (bool row_major : {true, false}) {
    CAPTURE(row_major);
    const index_t rows = 7, cols = 24;
    zenflow::adam_options o;
    o.lr = 0.01f;
    dense_state cpu(rows, cols, rng);
    tensor f32(dtype::f32, rows, cols, row_major), bf16(dtype::bf16, rows, cols, row_major);
    tensor grad(dtype::f32, rows, cols, row_major);
    fill_random(grad, rng, 0.1f);
    // Column layout: every selected column is a contiguous line of the parameter and the gradient
    // (the direct path, the kernel in place on the parameter). Row-major: each row's selected
    // columns are short runs (the gathered path: the parameter read into the buffer first).
    const std::vector<std::int32_t> sel = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 23};
    for (index_t r = 0; r < rows; ++r)  // the f32 parameter's values are the master it is registered with
      for (const auto c : sel) f32.set(r, c, cpu.p[c * rows + r]);
    zenflow::host_sparse_adam opt(o);
    const auto i32 = opt.add_matrix(f32.view(), sel, cpu.packed(sel));
    const auto i16 = opt.add_matrix(bf16.view(), sel, cpu.packed(sel));
    // Registration wrote neither parameter.
    for (index_t c = 0; c < cols; ++c) {
      const bool selected = std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(c));
      for (index_t r = 0; r < rows; ++r) {
        CHECK(f32.bits(r, c) == (selected ? bits_of(cpu.p[c * rows + r]) : 0u));
        CHECK(bf16.bits(r, c) == 0u);  // its master is its own copy: the next step writes it
      }
    }
    // The trainer edits both parameters' selected columns between steps.
    for (index_t r = 0; r < rows; ++r)
      for (const auto c : sel) {
        f32.set(r, c, 0.25f);
        bf16.set(r, c, 0.25f);
      }
    const zenflow::const_matrix_view mg[] = {grad.cview(), grad.cview()};
    REQUIRE(opt.step(mg, {}));
    const auto step = zenflow::make_adam_step_constants(o, 1);
    std::vector<float> s32(3 * sel.size() * rows), s16(s32.size());
    opt.export_state(i32, s32);
    opt.export_state(i16, s16);
    for (std::size_t l = 0; l < sel.size(); ++l)
      for (index_t r = 0; r < rows; ++r) {
        const auto x = static_cast<std::size_t>(sel[l] * rows + r);
        float edited = 0.25f, m = cpu.m[x], v = cpu.v[x];
        zenflow::adam_update(edited, grad.get(r, sel[l]), m, v, step);
        float kept = cpu.p[x];
        m = cpu.m[x], v = cpu.v[x];
        zenflow::adam_update(kept, grad.get(r, sel[l]), m, v, step);
        // f32: the step started from the edit, and the exported master is the parameter.
        CHECK(bits_of(s32[sa::packed_index(rows, l, 0, r)]) == bits_of(edited));
        CHECK(f32.bits(r, sel[l]) == bits_of(edited));
        // bf16: from its own master, which the edit did not reach (the coordinator adopts edits).
        CHECK(bits_of(s16[sa::packed_index(rows, l, 0, r)]) == bits_of(kept));
        CHECK(bf16.bits(r, sel[l]) == rounded_bits(kept, dtype::bf16));
      }
    // import_state writes the f32 parameter's selected columns.
    std::vector<float> imported = cpu.packed(sel);
    opt.import_state(i32, imported);
    for (std::size_t l = 0; l < sel.size(); ++l)
      for (index_t r = 0; r < rows; ++r) CHECK(f32.get(r, sel[l]) == cpu.p[sel[l] * rows + r]);
  }
}

TEST_CASE("an f32 parameter registered with another master keeps a copy and is not written until a step") {
  // A trainer that keeps its own fp32 masters (or restored its parameters for a checkpoint load
  // after registering the masters it started from): registration leaves the parameter's values
  // alone, as on the CUDA backend; the first step writes the updated master.
  std::mt19937 rng(23);
  for (bool row_major : {true, false}) {
    CAPTURE(row_major);
    const index_t rows = 5, cols = 9;
    zenflow::adam_options o;
    o.lr = 0.01f;
    dense_state cpu(rows, cols, rng);
    tensor param(dtype::f32, rows, cols, row_major), grad(dtype::f32, rows, cols, row_major);
    fill_random(param, rng);  // not the master
    fill_random(grad, rng, 0.1f);
    std::vector<float> bias(3, 0.75f), bias_master = {0.5f, -0.25f, 2.0f}, bias_grad = {0.1f, -0.2f, 0.3f};
    const auto param_before = param.bytes;
    const std::vector<std::int32_t> sel = {1, 4, 8};
    zenflow::host_sparse_adam opt(o);
    const auto i = opt.add_matrix(param.view(), sel, cpu.packed(sel));
    const auto b = opt.add_vector(zenflow::vector_view(bias.data(), 3, dtype::f32), bias_master);
    CHECK(param.bytes == param_before);
    CHECK(bias == std::vector<float>(3, 0.75f));
    std::vector<float> state(3 * sel.size() * rows), bias_state(3 * 3);
    opt.export_state(i, state);
    CHECK(state == cpu.packed(sel));  // the master as registered, not the parameter's values
    opt.export_state(b, bias_state);
    CHECK(std::vector<float>(bias_state.begin(), bias_state.begin() + 3) == bias_master);
    const zenflow::const_matrix_view mg[] = {grad.cview()};
    const zenflow::const_vector_view vg[] = {zenflow::const_vector_view(bias_grad.data(), 3, dtype::f32)};
    REQUIRE(opt.step(mg, vg));
    const auto c = zenflow::make_adam_step_constants(o, 1);
    for (const auto col : sel)
      for (index_t r = 0; r < rows; ++r) {
        const auto x = static_cast<std::size_t>(col * rows + r);
        float p = cpu.p[x], m = cpu.m[x], v = cpu.v[x];
        zenflow::adam_update(p, grad.get(r, col), m, v, c);
        CHECK(param.bits(r, col) == bits_of(p));
      }
    for (std::size_t k = 0; k < 3; ++k) {
      float p = bias_master[k], m = 0.0f, v = 0.0f;
      zenflow::adam_update(p, bias_grad[k], m, v, c);
      CHECK(bits_of(bias[k]) == bits_of(p));
    }
  }
}

TEST_CASE("skip flag, unusable scale and non-finite gradients leave everything unchanged") {
  std::mt19937 rng(3);
  const index_t rows = 5, cols = 12;
  dense_state cpu(rows, cols, rng);
  tensor param(dtype::f16, rows, cols, false), grad(dtype::bf16, rows, cols, false);
  fill_random(param, rng);
  fill_random(grad, rng);
  const std::vector<std::int32_t> sel = {2, 7};
  std::vector<float> bias(4, 0.5f), bias_grad(4, 0.1f);
  zenflow::host_sparse_adam opt(zenflow::adam_options{});
  opt.add_matrix(param.view(), sel, cpu.packed(sel));
  opt.add_vector(zenflow::vector_view(bias.data(), 4, dtype::f32), bias);
  const zenflow::const_matrix_view mg[] = {grad.cview()};
  const zenflow::const_vector_view vg[] = {zenflow::const_vector_view(bias_grad.data(), 4, dtype::f32)};
  REQUIRE(opt.step(mg, vg));
  const auto param_before = param.bytes;
  const auto bias_before = bias;
  std::vector<float> state_before(3 * 2 * rows), state_after(state_before.size());
  opt.export_state(0, state_before);

  const int skip = 1, no_skip = 0;
  CHECK_FALSE(opt.step(mg, vg, 1.0f, nullptr, &skip));
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(opt.step(mg, vg, 1.0f, &inf, &no_skip));
  CHECK_FALSE(opt.step(mg, vg, 1.0f, &nan));
  grad.set(3, 7, nan);  // a selected column
  CHECK_FALSE(opt.step(mg, vg, 1.0f, nullptr, nullptr, true));
  grad.set(3, 7, 0.0f);
  bias_grad[2] = -inf;  // the vector
  CHECK_FALSE(opt.step(mg, vg, 1.0f, nullptr, nullptr, true));
  bias_grad[2] = 0.0f;
  // Finite, but not once scaled (as the CPU Adam checks): skipped too.
  grad.set(3, 7, 3.0e38f);
  const float two = 2.0f;
  CHECK_FALSE(opt.step(mg, vg, 1.0f, &two, nullptr, true));
  CHECK_FALSE(opt.step(mg, vg, 2.0f, nullptr, nullptr, true));
  grad.set(3, 7, 0.0f);
  CHECK(opt.step_count() == 1);
  CHECK(param.bytes == param_before);
  CHECK(bias == bias_before);
  opt.export_state(0, state_after);
  CHECK(std::memcmp(state_after.data(), state_before.data(), state_after.size() * 4) == 0);

  // A non-finite value in an unselected column is not read by the step: it applies.
  grad.set(1, 3, inf);
  CHECK(opt.step(mg, vg, 1.0f, nullptr, nullptr, true));
  CHECK(opt.step_count() == 2);

  // Nothing registered: nothing to step (the device backend enqueues nothing either).
  zenflow::host_sparse_adam empty(zenflow::adam_options{});
  CHECK_FALSE(empty.step({}, {}));
  CHECK(empty.step_count() == 0);
}

TEST_CASE("bad input throws before touching state") {
  std::mt19937 rng(1);
  const index_t rows = 4, cols = 10;
  dense_state cpu(rows, cols, rng);
  tensor param(dtype::f32, rows, cols, true), grad(dtype::f32, rows, cols, true);
  fill_random(grad, rng);
  zenflow::host_sparse_adam opt(zenflow::adam_options{});
  auto packed = [&](std::size_t k) { return std::vector<float>(3 * k * rows, 0.25f); };
  auto throws_arg = [](auto&& f, const char* argument) {
    try {
      f();
    } catch (const zenflow::error& e) {
      CHECK(e.argument() == argument);
      return;
    }
    FAIL("expected zenflow::error for ", argument);
  };
  // add_matrix
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>{}, packed(0)); }, "initial_selection");
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>(11, 0), packed(11)); }, "initial_selection");
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>{3, 2}, packed(2)); }, "initial_selection");
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>{2, 2}, packed(2)); }, "initial_selection");
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>{2, 10}, packed(2)); }, "initial_selection");
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>{-1, 2}, packed(2)); }, "initial_selection");
  throws_arg([&] { opt.add_matrix(param.view(), std::vector<std::int32_t>{1, 2}, packed(1)); }, "initial_state_packed");
  auto device_view = param.view();
  device_view.space = zenflow::memory_space::device;
  throws_arg([&] { opt.add_matrix(device_view, std::vector<std::int32_t>{1}, packed(1)); }, "param");
  CHECK(opt.parameter_count() == 0);

  const std::vector<std::int32_t> sel = {1, 5, 6};
  opt.add_matrix(param.view(), sel, cpu.packed(sel));
  const zenflow::const_matrix_view good[] = {grad.cview()};
  REQUIRE(opt.step(good, {}));
  const auto param_before = param.bytes;
  std::vector<float> before(3 * 3 * rows), after(before.size());
  opt.export_state(0, before);

  // step: gradient count, shape, memory space, scale.
  tensor wrong(dtype::f32, rows, cols + 1, true);
  const zenflow::const_matrix_view bad_shape[] = {wrong.cview()};
  throws_arg([&] { opt.step(bad_shape, {}); }, "matrix_grads");
  throws_arg([&] { opt.step({}, {}); }, "matrix_grads");
  auto gdev = grad.cview();
  gdev.space = zenflow::memory_space::device;
  const zenflow::const_matrix_view bad_space[] = {gdev};
  throws_arg([&] { opt.step(bad_space, {}); }, "matrix_grads");
  std::vector<float> extra(3);
  const zenflow::const_vector_view extra_vector[] = {zenflow::const_vector_view(extra.data(), 3, dtype::f32)};
  throws_arg([&] { opt.step(good, extra_vector); }, "vector_grads");
  throws_arg([&] { opt.step(good, {}, -1.0f); }, "grad_scale");
  throws_arg([&] { opt.step(good, {}, std::numeric_limits<float>::infinity()); }, "grad_scale");

  // reselect: k, order, duplicates, range, buffers, vectors.
  std::vector<float> big(3 * 3 * rows), small(3 * rows);
  throws_arg([&] { opt.reselect(0, std::vector<std::int32_t>{1, 5}, big, big); }, "new_selection");
  throws_arg([&] { opt.reselect(0, std::vector<std::int32_t>{5, 1, 6}, big, big); }, "new_selection");
  throws_arg([&] { opt.reselect(0, std::vector<std::int32_t>{1, 1, 6}, big, big); }, "new_selection");
  throws_arg([&] { opt.reselect(0, std::vector<std::int32_t>{1, 5, 10}, big, big); }, "new_selection");
  throws_arg([&] { opt.reselect(0, std::vector<std::int32_t>{0, 2, 3}, small, big); }, "entering_in");
  throws_arg([&] { opt.reselect(0, std::vector<std::int32_t>{0, 2, 3}, big, small); }, "leaving_out");
  throws_arg([&] { opt.reselect(3, std::vector<std::int32_t>{0, 2, 3}, big, big); }, "i");
  throws_arg([&] { opt.export_state(0, small); }, "packed_out");
  throws_arg([&] { opt.import_state(0, small); }, "packed_in");
  std::vector<float> bias(2);
  const auto v = opt.add_vector(zenflow::vector_view(bias.data(), 2, dtype::f32), bias);
  throws_arg([&] { opt.reselect(v, std::vector<std::int32_t>{0}, big, big); }, "i");
  throws_arg(
      [&] {
        opt.add_vector(zenflow::vector_view(bias.data(), 2, dtype::f32), std::span<const float>(small).subspan(0, 1));
      },
      "initial_master");
  zenflow::adam_options bad;
  bad.beta1 = 1.0f;
  throws_arg([&] { opt.set_options(bad); }, "beta1");
  throws_arg([&] { opt.set_step_count(-1); }, "step");

  CHECK(param.bytes == param_before);
  opt.export_state(0, after);
  CHECK(after == before);
  CHECK(std::vector<std::int32_t>(opt.selection(0).begin(), opt.selection(0).end()) == sel);
  CHECK(opt.step_count() == 1);
}

TEST_CASE("gather and scatter columns: layouts, scale, dtype conversion") {
  std::mt19937 rng(9);
  for (bool row_major : {true, false})
    for (dtype st : {dtype::f32, dtype::bf16, dtype::f16})
      for (dtype dt : {dtype::f32, dtype::bf16, dtype::f16}) {
        CAPTURE(row_major);
        const index_t rows = 70, cols = 23;  // more rows than one gather block
        tensor src(st, rows, cols, row_major);
        fill_random(src, rng);
        const std::vector<std::int32_t> columns = {0, 4, 5, 17, 22};
        std::vector<std::byte> compact(columns.size() * rows * zenflow::dtype_size(dt));
        zenflow::gather_columns(src.cview(), columns, compact.data(), dt, 0.375f);
        bool ok = true;
        for (std::size_t i = 0; i < columns.size(); ++i)
          for (index_t r = 0; r < rows; ++r) {
            const float expect = src.get(r, columns[i]) * 0.375f;
            std::byte e[4] = {};
            sa::store_from_float(e, dt, 0, expect);
            ok &=
                std::memcmp(e, compact.data() + (i * rows + r) * zenflow::dtype_size(dt), zenflow::dtype_size(dt)) == 0;
          }
        CHECK(ok);

        tensor dst(dt, rows, cols, !row_major);
        fill_random(dst, rng);
        const auto before = dst;
        std::vector<float> values(columns.size() * rows);
        for (auto& x : values) x = std::normal_distribution<float>(0.0f, 3.0f)(rng);
        zenflow::scatter_columns(values.data(), dtype::f32, columns, dst.view());
        for (index_t c = 0; c < cols; ++c) {
          const auto it = std::find(columns.begin(), columns.end(), c);
          for (index_t r = 0; r < rows; ++r) {
            if (it == columns.end())
              ok &= dst.bits(r, c) == before.bits(r, c);
            else
              ok &= dst.bits(r, c) == rounded_bits(values[(it - columns.begin()) * rows + r], dt);
          }
        }
        CHECK(ok);
      }
  // Bad input.
  tensor src(dtype::f32, 3, 4, true);
  std::vector<float> buf(12);
  CHECK_THROWS_AS(zenflow::gather_columns(src.cview(), std::vector<std::int32_t>{4}, buf.data(), dtype::f32),
                  zenflow::error);
  CHECK_THROWS_AS(zenflow::scatter_columns(buf.data(), dtype::f32, std::vector<std::int32_t>{-1}, src.view()),
                  zenflow::error);
  auto dev = src.view();
  dev.space = zenflow::memory_space::device;
  CHECK_THROWS_AS(zenflow::scatter_columns(buf.data(), dtype::f32, std::vector<std::int32_t>{1}, dev), zenflow::error);
}

TEST_CASE("complement_columns") {
  CHECK(zenflow::complement_columns(std::vector<std::int32_t>{1, 3}, 5) == std::vector<std::int32_t>{0, 2, 4});
  CHECK(zenflow::complement_columns(std::vector<std::int32_t>{}, 3) == std::vector<std::int32_t>{0, 1, 2});
  CHECK(zenflow::complement_columns(std::vector<std::int32_t>{0, 1, 2}, 3).empty());
  CHECK_THROWS_AS(zenflow::complement_columns(std::vector<std::int32_t>{2, 1}, 3), zenflow::error);
  CHECK_THROWS_AS(zenflow::complement_columns(std::vector<std::int32_t>{3}, 3), zenflow::error);
}

TEST_CASE(
    "per-parameter lr, betas, eps and weight decay equal an optimizer with those options; nothing else may "
    "differ") {
  zenflow::adam_options base;
  base.lr = 0.01f;
  base.weight_decay = 0.1f;
  zenflow::adam_options group = base;
  group.lr = 0.004f;
  group.beta1 = 0.8f;
  group.beta2 = 0.95f;
  group.eps = 1e-6f;
  group.weight_decay = 0.0f;
  const zenflow::index_t n = 9;
  std::vector<float> master(n), grad(n);
  for (zenflow::index_t i = 0; i < n; ++i) {
    master[i] = 0.1f * static_cast<float>(i) - 0.4f;
    grad[i] = 0.2f * static_cast<float>(i % 4) - 0.3f;
  }
  std::vector<float> p_mixed0(n), p_mixed1(n), p_alone(n);
  zenflow::host_sparse_adam mixed(base), alone(group);
  mixed.add_vector(zenflow::vector_view{p_mixed0.data(), n, zenflow::dtype::f32}, master);
  mixed.add_vector(zenflow::vector_view{p_mixed1.data(), n, zenflow::dtype::f32}, master);
  alone.add_vector(zenflow::vector_view{p_alone.data(), n, zenflow::dtype::f32}, master);
  mixed.set_options(1, group);
  CHECK(mixed.options(1) == group);
  CHECK(mixed.options(0) == base);
  const zenflow::const_vector_view g{grad.data(), n, zenflow::dtype::f32};
  const zenflow::const_vector_view both[] = {g, g};
  for (int s = 0; s < 5; ++s) {
    REQUIRE(mixed.step({}, both));
    REQUIRE(alone.step({}, std::span(&g, 1)));
  }
  CHECK(p_mixed1 == p_alone);
  CHECK(p_mixed0 != p_alone);
  zenflow::adam_options other = base;
  other.adamw_mode = false;  // shared by every parameter
  CHECK_THROWS_WITH_AS(mixed.set_options(0, other), doctest::Contains("adamw_mode"), zenflow::error);
  CHECK(mixed.options(0) == base);
}

TEST_CASE("a parameter without a gradient (null view) is untouched and keeps its own step count") {
  // Two vectors stepped together, one of them skipped in some steps, against two optimizers that
  // each step one vector only in the steps it has a gradient: equal bit for bit (torch's
  // per-parameter `step`).
  zenflow::adam_options o;
  o.lr = 0.05f;
  o.weight_decay = 0.1f;
  const index_t n = 6;
  std::vector<float> a(n, 0.5f), b(n, -0.25f), ra = a, rb = b, g(n);
  zenflow::host_sparse_adam together(o), alone_a(o), alone_b(o);
  together.add_vector(zenflow::vector_view{a.data(), n, dtype::f32}, a);
  together.add_vector(zenflow::vector_view{b.data(), n, dtype::f32}, b);
  alone_a.add_vector(zenflow::vector_view{ra.data(), n, dtype::f32}, ra);
  alone_b.add_vector(zenflow::vector_view{rb.data(), n, dtype::f32}, rb);
  const zenflow::const_matrix_view no_matrices[1] = {};
  for (int s = 0; s < 10; ++s) {
    for (index_t i = 0; i < n; ++i) g[i] = 0.1f * static_cast<float>(s + i) - 0.3f;
    const bool b_has = s % 3 != 1;
    const zenflow::const_vector_view grad{g.data(), n, dtype::f32};
    const std::vector<float> b_before = b;
    const zenflow::const_vector_view both[2] = {grad, b_has ? grad : zenflow::const_vector_view{}};
    CHECK(together.step({no_matrices, 0}, both));
    CHECK(alone_a.step({no_matrices, 0}, {&grad, 1}));
    if (b_has) CHECK(alone_b.step({no_matrices, 0}, {&grad, 1}));
    if (!b_has) CHECK(std::memcmp(b.data(), b_before.data(), n * sizeof(float)) == 0);
  }
  CHECK(std::memcmp(a.data(), ra.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(b.data(), rb.data(), n * sizeof(float)) == 0);
  CHECK(together.step_count() == 10);
  CHECK(together.step_count(0) == 10);
  CHECK(together.step_count(1) == 7);
  CHECK(together.step_count(1) == alone_b.step_count());
  together.set_step_count(1, 3);  // checkpoint restore of one parameter's count
  CHECK(together.step_count(1) == 3);
  CHECK(together.step_count(0) == 10);
  together.set_step_count(4);  // the optimizer's and every parameter's
  CHECK(together.step_count(0) == 4);
  CHECK(together.step_count(1) == 4);
}

}  // namespace ZENFLOW_TEST_FILE_ID
