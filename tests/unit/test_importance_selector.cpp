// The host importance selector and its reference functions against brute force; the host gradient
// statistics (gradient_stats.hpp), on the same test gradients.
#include <zenflow/gradient_stats.hpp>
#include <zenflow/importance_selector.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::const_matrix_view;
using zenflow::dtype;
using zenflow::index_t;
using zenflow::memory_space;
using zenflow::score_norm;

static_assert(zenflow::importance_selector<zenflow::host_importance_selector<>>);

namespace {

// Brute force: sort every column by (score descending, index ascending), keep k, sort ascending.
std::vector<std::int32_t> brute_topk(const std::vector<float>& scores, index_t k) {
  std::vector<std::int32_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) { return scores[a] > scores[b]; });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// A gradient stored in dtype T with a given layout, plus its exact float values.
struct test_grad {
  std::vector<std::uint16_t> half;
  std::vector<float> full;
  std::vector<float> values;  // logical (r, c) -> values[r * cols + c], exactly representable in T
  const_matrix_view view;
};

test_grad make_grad(index_t rows, index_t cols, dtype t, bool row_major, std::mt19937& rng, float spread = 1.0f) {
  test_grad g;
  std::normal_distribution<float> dist(0.0f, spread);
  g.values.resize(static_cast<std::size_t>(rows * cols));
  const index_t rs = row_major ? cols : 1, cs = row_major ? 1 : rows;
  if (t == dtype::f32)
    g.full.resize(g.values.size());
  else
    g.half.resize(g.values.size());
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      float x = dist(rng) * (1.0f + static_cast<float>(c % 7));  // columns of different importance
      const auto at = static_cast<std::size_t>(r * rs + c * cs);
      if (t == dtype::bf16) {
        g.half[at] = zenflow::to_bfloat16(x).bits;
        x = zenflow::to_float(zenflow::bfloat16{g.half[at]});
      } else if (t == dtype::f16) {
        g.half[at] = zenflow::to_float16(x).bits;
        x = zenflow::to_float(zenflow::float16{g.half[at]});
      } else {
        g.full[at] = x;
      }
      g.values[static_cast<std::size_t>(r * cols + c)] = x;
    }
  const void* data =
      t == dtype::f32 ? static_cast<const void*>(g.full.data()) : static_cast<const void*>(g.half.data());
  g.view = const_matrix_view(data, rows, cols, rs, cs, t, memory_space::host);
  return g;
}

std::vector<float> expected_scores(const test_grad& g, index_t rows, index_t cols, score_norm norm) {
  std::vector<float> s(static_cast<std::size_t>(cols), 0.0f);
  for (index_t c = 0; c < cols; ++c) {
    float acc = 0.0f;
    for (index_t r = 0; r < rows; ++r) {
      const float x = g.values[static_cast<std::size_t>(r * cols + c)];
      acc += norm == score_norm::l1 ? std::fabs(x) : x * x;
    }
    s[static_cast<std::size_t>(c)] = acc;
  }
  return s;
}

template <class F>
void check_throws_arg(F&& f, const char* argument) {
  try {
    f();
    FAIL("expected zenflow::error naming ", argument);
  } catch (const zenflow::error& e) {
    CHECK(e.argument() == argument);
  }
}

}  // namespace

TEST_CASE("topk_count follows max(1, floor(ratio * cols)) and validates") {
  CHECK(zenflow::topk_count(0.1, 10) == 1);
  CHECK(zenflow::topk_count(0.1, 4096) == 409);
  CHECK(zenflow::topk_count(0.05, 10) == 1);
  CHECK(zenflow::topk_count(1.0, 7) == 7);
  CHECK(zenflow::topk_count(1e-9, 3) == 1);
  CHECK(zenflow::topk_count(static_cast<double>(0.1f), 100) == 10);
  // A float ratio is the decimal it prints as: 0.7f (0.69999998...) of 10 columns is 7, as
  // DeepSpeed's int(0.7 * 10); and 0.1 of 1048579 columns stays 104857 (no tolerance bumps it).
  CHECK(zenflow::topk_count(static_cast<double>(0.7f), 10) == 7);
  CHECK(zenflow::topk_count(static_cast<double>(0.9f), 10) == 9);
  CHECK(zenflow::topk_count(static_cast<double>(0.35f), 20) == 7);
  CHECK(zenflow::topk_count(static_cast<double>(0.35f), 100) == 35);
  CHECK(zenflow::topk_count(static_cast<double>(0.1f), 1048579) == 104857);
  CHECK(zenflow::topk_count(0.7, 10) == 7);
  check_throws_arg([] { (void)zenflow::topk_count(0.0, 10); }, "topk_ratio");
  check_throws_arg([] { (void)zenflow::topk_count(1.5, 10); }, "topk_ratio");
  check_throws_arg([] { (void)zenflow::topk_count(std::nan(""), 10); }, "topk_ratio");
  check_throws_arg([] { (void)zenflow::topk_count(0.5, 0); }, "cols");
  check_throws_arg([] { (void)zenflow::topk_count(0.5, index_t{1} << 31); }, "cols");
}

TEST_CASE("orderable_key preserves float order and folds -0 into +0") {
  using zenflow::detail::selector::orderable_key;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v{-inf, -3.0e38f, -1.0f, -1e-40f, 0.0f, 1e-45f, 1e-40f, 1.0f, 2.0f, 3.0e38f, inf};
  for (std::size_t i = 1; i < v.size(); ++i) CHECK(orderable_key(v[i - 1]) < orderable_key(v[i]));
  CHECK(orderable_key(-0.0f) == orderable_key(0.0f));
  CHECK(orderable_key(std::nanf("")) == 0u);
  CHECK(orderable_key(std::nanf("")) < orderable_key(-inf));
  for (float x : v) CHECK(zenflow::detail::selector::key_to_float(orderable_key(x)) == x);
}

TEST_CASE("topk_columns equals brute force on random, tied and all-equal scores") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const index_t n = 1 + static_cast<index_t>(rng() % 300);
    std::vector<float> scores(static_cast<std::size_t>(n));
    const int mode = trial % 4;
    for (auto& s : scores) {
      if (mode == 0) s = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
      if (mode == 1) s = static_cast<float>(rng() % 5);                                       // many ties
      if (mode == 2) s = 2.5f;                                                                // all equal
      if (mode == 3) s = (rng() % 2 ? -0.0f : 0.0f) + static_cast<float>(rng() % 3) * 1e30f;  // signed zeros, extremes
    }
    for (index_t k : {index_t{1}, n, 1 + static_cast<index_t>(rng() % static_cast<unsigned>(n))}) {
      std::vector<std::int32_t> out(static_cast<std::size_t>(k));
      zenflow::topk_columns(scores, k, out);
      CHECK(out == brute_topk(scores, k));
    }
  }
  std::vector<float> equal(10, 1.0f);
  std::vector<std::int32_t> out(3);
  zenflow::topk_columns(equal, 3, out);
  CHECK(out == std::vector<std::int32_t>{0, 1, 2});
}

TEST_CASE("topk_columns rejects bad k, a wrong output size and NaN without writing") {
  std::vector<float> scores{1.0f, 2.0f, 3.0f};
  std::vector<std::int32_t> out(2, -7);
  check_throws_arg([&] { zenflow::topk_columns(scores, 0, std::span<std::int32_t>(out).first(0)); }, "k");
  check_throws_arg([&] { zenflow::topk_columns(scores, 4, out); }, "k");
  check_throws_arg([&] { zenflow::topk_columns(scores, 1, out); }, "out");
  scores[1] = std::nanf("");
  check_throws_arg([&] { zenflow::topk_columns(scores, 2, out); }, "scores");
  CHECK(out == std::vector<std::int32_t>{-7, -7});
}

TEST_CASE("column_scores: both layouts, all dtypes, L1 and L2 squared, in the documented order") {
  std::mt19937 rng(11);
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16})
    for (bool row_major : {true, false})
      for (score_norm norm : {score_norm::l1, score_norm::l2_squared}) {
        const index_t rows = 37, cols = 53;
        auto g = make_grad(rows, cols, t, row_major, rng);
        std::vector<float> scores(cols);
        zenflow::column_scores(g.view, norm, scores);
        CHECK(scores == expected_scores(g, rows, cols, norm));  // bitwise: same fp32 order
      }
}

TEST_CASE("column_scores of a strided sub-view (neither layout) scores only the viewed elements") {
  std::vector<float> big(10 * 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 13) - 6.0f;
  // rows 0..4 step 2 of a row-major 10 x 20, columns 0..7 step 2
  const_matrix_view v(big.data(), 5, 8, 40, 2, dtype::f32, memory_space::host);
  std::vector<float> scores(8);
  zenflow::column_scores(v, score_norm::l1, scores);
  for (index_t c = 0; c < 8; ++c) {
    float acc = 0.0f;
    for (index_t r = 0; r < 5; ++r) acc += std::fabs(big[static_cast<std::size_t>(r * 40 + c * 2)]);
    CHECK(scores[static_cast<std::size_t>(c)] == acc);
  }
}

TEST_CASE("selection_overlap") {
  std::vector<std::int32_t> a{1, 3, 5, 7}, b{3, 4, 5, 6};
  CHECK(zenflow::selection_overlap(a, b) == doctest::Approx(0.5));
  CHECK(zenflow::selection_overlap({}, b) == 0.0);
  CHECK(zenflow::selection_overlap(b, b) == 1.0);
  std::vector<std::int32_t> c{0};
  CHECK(zenflow::selection_overlap(a, c) == 0.0);
}

TEST_CASE("host selector: selection equals brute force over layouts, dtypes, norms, k = 1 and k = cols") {
  std::mt19937 rng(3);
  for (score_norm norm : {score_norm::l1, score_norm::l2_squared})
    for (double ratio : {1e-6, 0.1, 0.37, 1.0}) {
      zenflow::host_importance_selector<> sel(ratio, norm);
      std::vector<test_grad> grads;
      std::vector<const_matrix_view> views;
      int i = 0;
      for (dtype t : {dtype::f32, dtype::bf16, dtype::f16})
        for (bool row_major : {true, false}) {
          const index_t rows = 3 + (i * 5) % 17, cols = 1 + (i * 29) % 61;
          CHECK(sel.add_parameter(rows, cols) == static_cast<std::size_t>(i));
          grads.push_back(make_grad(rows, cols, t, row_major, rng));
          ++i;
        }
      for (auto& g : grads) views.push_back(g.view);
      CHECK_FALSE(sel.has_selection());
      sel.select(views);
      CHECK(sel.has_selection());
      for (std::size_t p = 0; p < sel.parameter_count(); ++p) {
        const auto expect = expected_scores(grads[p], sel.rows(p), sel.cols(p), norm);
        CHECK(std::vector<float>(sel.scores(p).begin(), sel.scores(p).end()) == expect);
        CHECK(sel.k(p) == zenflow::topk_count(ratio, sel.cols(p)));
        const auto got = sel.selected(p);
        CHECK(std::vector<std::int32_t>(got.begin(), got.end()) == brute_topk(expect, sel.k(p)));
        CHECK(sel.previous(p).empty());
        CHECK(sel.overlap(p) == 0.0);
      }
    }
}

TEST_CASE("host selector: previous selection and overlap after a refresh") {
  const index_t rows = 4, cols = 10;
  zenflow::host_importance_selector<> sel(0.3);  // k = 3
  sel.add_parameter(rows, cols);
  std::vector<float> g(rows * cols, 0.0f);
  auto view = const_matrix_view(g.data(), rows, cols, cols, 1, dtype::f32, memory_space::host);
  auto set_col = [&](index_t c, float x) {
    for (index_t r = 0; r < rows; ++r) g[static_cast<std::size_t>(r * cols + c)] = x;
  };
  set_col(1, 5.0f), set_col(4, 4.0f), set_col(8, 3.0f);
  sel.select(std::span(&view, 1));
  CHECK(std::vector<std::int32_t>(sel.selected(0).begin(), sel.selected(0).end()) ==
        std::vector<std::int32_t>{1, 4, 8});
  set_col(8, 0.0f), set_col(2, 9.0f);
  sel.select(std::span(&view, 1));
  CHECK(std::vector<std::int32_t>(sel.selected(0).begin(), sel.selected(0).end()) ==
        std::vector<std::int32_t>{1, 2, 4});
  CHECK(std::vector<std::int32_t>(sel.previous(0).begin(), sel.previous(0).end()) ==
        std::vector<std::int32_t>{1, 4, 8});
  CHECK(sel.overlap(0) == doctest::Approx(2.0 / 3.0));
  // All-equal gradient: the lowest indices win.
  std::fill(g.begin(), g.end(), -1.0f);
  sel.select(std::span(&view, 1));
  CHECK(std::vector<std::int32_t>(sel.selected(0).begin(), sel.selected(0).end()) ==
        std::vector<std::int32_t>{0, 1, 2});
}

namespace {
struct counting_communicator {
  int* calls;
  int world;
  void all_reduce_sum(std::span<float> v) {
    ++*calls;
    for (auto& x : v) x *= static_cast<float>(world);  // as if every rank had the same scores
  }
  int world_size() const { return world; }
};
static_assert(zenflow::score_communicator<counting_communicator>);
static_assert(!zenflow::score_communicator<int>);
}  // namespace

TEST_CASE("host selector: scores go through the communicator once per select, only with several ranks") {
  std::mt19937 rng(5);
  auto g = make_grad(8, 16, dtype::f32, true, rng);
  int calls = 0;
  zenflow::host_importance_selector<counting_communicator> multi(0.25, score_norm::l1, {&calls, 4});
  multi.add_parameter(8, 16);
  multi.add_parameter(8, 16);
  const_matrix_view views[] = {g.view, g.view};
  multi.select(views);
  CHECK(calls == 1);
  const auto expect = expected_scores(g, 8, 16, score_norm::l1);
  for (index_t c = 0; c < 16; ++c)
    CHECK(multi.scores(1)[static_cast<std::size_t>(c)] == 4.0f * expect[static_cast<std::size_t>(c)]);
  zenflow::host_importance_selector<counting_communicator> single(0.25, score_norm::l1, {&calls, 1});
  single.add_parameter(8, 16);
  single.select(std::span(views, 1));
  CHECK(calls == 1);
}

TEST_CASE("host selector: bad input throws before touching state") {
  std::mt19937 rng(9);
  check_throws_arg([] { zenflow::host_importance_selector<> bad(0.0); }, "topk_ratio");
  check_throws_arg([] { zenflow::host_importance_selector<> bad(1.01); }, "topk_ratio");
  zenflow::host_importance_selector<> sel(0.5);
  check_throws_arg([&] { sel.add_parameter(0, 4); }, "rows");
  check_throws_arg([&] { sel.add_parameter(4, 0); }, "cols");
  sel.add_parameter(6, 8);
  sel.add_parameter(5, 4);
  auto a = make_grad(6, 8, dtype::bf16, true, rng), b = make_grad(5, 4, dtype::f16, false, rng);
  std::vector<const_matrix_view> views{a.view, b.view};
  sel.select(views);
  const std::vector<std::int32_t> sel0(sel.selected(0).begin(), sel.selected(0).end());
  const std::vector<std::int32_t> sel1(sel.selected(1).begin(), sel.selected(1).end());
  const std::vector<float> scores0(sel.scores(0).begin(), sel.scores(0).end());
  auto intact = [&] {
    CHECK(std::vector<std::int32_t>(sel.selected(0).begin(), sel.selected(0).end()) == sel0);
    CHECK(std::vector<std::int32_t>(sel.selected(1).begin(), sel.selected(1).end()) == sel1);
    CHECK(std::vector<float>(sel.scores(0).begin(), sel.scores(0).end()) == scores0);
    CHECK(sel.previous(0).empty());
    CHECK(sel.has_selection());
  };
  // Fresh gradients that would change the selection if accepted.
  auto a2 = make_grad(6, 8, dtype::bf16, true, rng, 3.0f);
  // count mismatch
  check_throws_arg([&] { sel.select(std::span(views).first(1)); }, "grads");
  intact();
  // shape mismatch (second parameter transposed)
  auto bt = make_grad(4, 5, dtype::f16, false, rng);
  std::vector<const_matrix_view> wrong_shape{a2.view, bt.view};
  check_throws_arg([&] { sel.select(wrong_shape); }, "grads");
  intact();
  // wrong memory space
  auto dev = b.view;
  dev.space = memory_space::device;
  std::vector<const_matrix_view> wrong_space{a2.view, dev};
  check_throws_arg([&] { sel.select(wrong_space); }, "grads");
  intact();
  // malformed view
  auto null_view = b.view;
  null_view.data = nullptr;
  std::vector<const_matrix_view> malformed{a2.view, null_view};
  check_throws_arg([&] { sel.select(malformed); }, "grads");
  intact();
  // NaN gradient in the second parameter: the first parameter's fresh selection is not committed either
  auto bn = make_grad(5, 4, dtype::f16, false, rng);
  bn.half[3] = zenflow::to_float16(std::nanf("")).bits;
  std::vector<const_matrix_view> nan_grads{a2.view, bn.view};
  check_throws_arg([&] { sel.select(nan_grads); }, "grads");
  intact();
  // set_selection: wrong size, unsorted, duplicate, out of range, bad index
  const std::vector<std::int32_t> wrong_size{0, 1, 2}, unsorted{3, 1, 2, 0}, dup{0, 1, 1, 2}, oob{0, 1, 2, 8},
      negative{-1, 0, 1, 2};
  check_throws_arg([&] { sel.set_selection(0, wrong_size); }, "columns");
  check_throws_arg([&] { sel.set_selection(0, unsorted); }, "columns");
  check_throws_arg([&] { sel.set_selection(0, dup); }, "columns");
  check_throws_arg([&] { sel.set_selection(0, oob); }, "columns");
  check_throws_arg([&] { sel.set_selection(0, negative); }, "columns");
  check_throws_arg([&] { sel.set_selection(2, sel0); }, "i");
  check_throws_arg([&] { (void)sel.selected(2); }, "i");
  intact();
  // A valid restore
  const std::vector<std::int32_t> restore{1, 3, 5, 7};
  sel.set_selection(0, restore);
  CHECK(std::vector<std::int32_t>(sel.selected(0).begin(), sel.selected(0).end()) == restore);
  CHECK(sel.previous(0).empty());
}

TEST_CASE("selection_policy: step, epoch and auto strategies") {
  zenflow::zenflow_options o;
  o.select_strategy = zenflow::selection_strategy::step;
  o.select_interval = zenflow::interval_option::fixed(5);
  o.update_interval = zenflow::interval_option::fixed(1);
  {
    zenflow::selection_policy p(o);
    CHECK(p.interval_steps() == 5);
    CHECK(p.strategy() == zenflow::selection_strategy::step);
    std::vector<std::int64_t> at;
    for (std::int64_t s = 0; s < 16; ++s)
      if (p.should_select(s)) at.push_back(s);
    CHECK(at == std::vector<std::int64_t>{0, 5, 10, 15});
    check_throws_arg([&] { (void)p.should_select(-1); }, "step");
  }
  o.select_strategy = zenflow::selection_strategy::epoch;
  o.steps_per_epoch = 7;
  o.select_interval = zenflow::interval_option::fixed(2);
  {
    zenflow::selection_policy p(o);
    CHECK(p.interval_steps() == 14);
    CHECK(p.should_select(0));
    CHECK_FALSE(p.should_select(7));
    CHECK(p.should_select(14));
    CHECK(p.should_select(28));
  }
  o.select_strategy = zenflow::selection_strategy::automatic;
  o.select_interval = zenflow::interval_option::automatic();
  {
    zenflow::selection_policy p(o);  // auto with steps_per_epoch -> every epoch
    CHECK(p.strategy() == zenflow::selection_strategy::epoch);
    CHECK(p.interval_steps() == 7);
  }
  o.steps_per_epoch = 0;
  o.auto_select_steps = 100;
  o.update_interval = zenflow::interval_option::automatic();
  {
    zenflow::selection_policy p(o);  // auto without epochs -> every auto_select_steps steps
    CHECK(p.strategy() == zenflow::selection_strategy::step);
    CHECK(p.interval_steps() == 100);
    CHECK(p.should_select(200));
    CHECK_FALSE(p.should_select(150));
  }
  o.select_strategy = zenflow::selection_strategy::epoch;  // epoch without steps_per_epoch
  check_throws_arg([&] { zenflow::selection_policy bad(o); }, "steps_per_epoch");
}

TEST_CASE("host_gradient_stats: sum of squares over finite elements and the non-finite count") {
  std::mt19937 rng(1);
  auto a = make_grad(9, 7, dtype::bf16, true, rng);
  auto b = make_grad(5, 3, dtype::f32, false, rng);
  std::vector<zenflow::float16> bias(6);
  for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = zenflow::to_float16(0.5f * static_cast<float>(i));
  double expect = 0.0;
  for (float x : a.values) expect += static_cast<double>(x) * x;
  for (float x : b.values) expect += static_cast<double>(x) * x;
  for (std::size_t i = 0; i < bias.size(); i += 2) expect += 0.25 * static_cast<double>(i) * static_cast<double>(i);
  const_matrix_view grads[] = {a.view, b.view};
  zenflow::const_vector_view vecs[] = {zenflow::const_vector_view(bias.data(), 3, dtype::f16, memory_space::host, 2)};
  auto s = zenflow::host_gradient_stats(grads, vecs);
  CHECK(s.nonfinite_count == 0);
  CHECK(s.sum_of_squares == doctest::Approx(expect).epsilon(1e-12));
  b.full[4] = std::numeric_limits<float>::infinity();
  b.full[5] = std::nanf("");
  bias[2] = zenflow::to_float16(std::numeric_limits<float>::infinity());
  s = zenflow::host_gradient_stats(grads, vecs);
  CHECK(s.nonfinite_count == 3);
  CHECK(std::isfinite(s.sum_of_squares));
  auto dev = vecs[0];
  dev.space = memory_space::device;
  check_throws_arg([&] { (void)zenflow::host_gradient_stats(grads, std::span(&dev, 1)); }, "vectors");
}

}  // namespace ZENFLOW_TEST_FILE_ID
