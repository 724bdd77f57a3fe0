// The CUDA importance selector against the host reference (needs a GPU; label gpu).
//   - device scores within 1e-5 relative of an fp64 sum of the fp32 score terms, for every fill
//     (huge values, f16 subnormals and overflowing squares included), both the device buffer and
//     the host copy from scores();
//   - device top-k == host topk_columns applied to the DEVICE's own scores, exactly;
//   - random and adversarial inputs (ties, all-equal, zeros, extremes, k = 1, k = cols), both
//     layouts, f32/bf16/f16, L1 and L2 squared, many parameters in one select();
//   - device gradient statistics vs host_gradient_stats, with non-finite bf16 and f16 values on
//     the vector and the strided paths.
#include <zenflow/gradient_stats.cuh>
#include <zenflow/importance_selector.cuh>

#include <doctest/doctest.h>

#include "../support/cuda_test_utils.cuh"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using zenflow::const_matrix_view;
using zenflow::dtype;
using zenflow::index_t;
using zenflow::memory_space;
using zenflow::score_norm;

static_assert(zenflow::importance_selector<zenflow::cuda_importance_selector<>>);

namespace plan_checks {
namespace sel = zenflow::detail::selector;
/// Blocks of a vectorized 16-bit row-major gradient over its waves of `resident` blocks.
constexpr double wave_fill(long long rows, long long cols, long long resident) {
  const long long blocks =
      (cols + 255) / 256 * sel::row_sweep_segments(rows, sel::row_sweep_seg_rows(rows, cols, resident));
  return static_cast<double>(blocks) / static_cast<double>((blocks + resident - 1) / resident * resident);
}
// H100 (132 SMs x 4 score blocks) and A100 (108 x 3): the large shapes of the benchmark fill their
// waves, where a fixed ~1024 blocks made 2.1 waves at 8192 x 28672 on an H100.
static_assert(wave_fill(8192, 28672, 528) >= 0.95);
static_assert(wave_fill(28672, 8192, 528) >= 0.95);
static_assert(wave_fill(8192, 28672, 324) >= 0.95);
static_assert(wave_fill(28672, 8192, 324) >= 0.95);
// Segments hold whole warps' rows, at least 128 of them unless the parameter is shorter.
static_assert(sel::row_sweep_seg_rows(8192, 28672, 528) % sel::score_warps == 0);
static_assert(sel::row_sweep_seg_rows(4096, 512, 100000) >= 128);
static_assert(sel::row_sweep_seg_rows(100, 4096, 528) >= 100);
}  // namespace plan_checks

namespace {

struct device_grad {
  index_t rows = 0, cols = 0;
  dtype type = dtype::f32;
  bool row_major = true;
  index_t pad = 0;            // extra elements per leading-dimension stride (breaks 16-byte vectors when odd)
  index_t step = 1;           // inner-dimension stride (2: a strided column or row, no vector path)
  index_t offset = 0;         // elements between the allocation and the view (1: not 16-byte aligned)
  std::vector<float> values;  // logical [r * cols + c], exactly representable in `type`
  std::vector<unsigned char> bytes;
  zenflow_test::device_buffer memory;
  void* device = nullptr;  // memory.data()
  const_matrix_view view, host_view;

  device_grad() = default;
  device_grad(const device_grad&) = delete;
  device_grad& operator=(const device_grad&) = delete;
};

enum class fill { normal, ties, all_equal, zeros, extremes, sparse };

void make(device_grad& g, index_t rows, index_t cols, dtype t, bool row_major, fill f, std::mt19937& rng,
          index_t pad = 0, index_t step = 1, index_t offset = 0) {
  g.rows = rows, g.cols = cols, g.type = t, g.row_major = row_major, g.pad = pad, g.step = step, g.offset = offset;
  const index_t rs = row_major ? step * cols + pad : step, cs = row_major ? step : step * rows + pad;
  const index_t extent = (rows - 1) * rs + (cols - 1) * cs + 1;
  const std::size_t es = zenflow::dtype_size(t);
  g.bytes.assign(static_cast<std::size_t>(extent) * es, 0);
  g.values.assign(static_cast<std::size_t>(rows * cols), 0.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float big = t == dtype::f16 ? 6.0e4f : t == dtype::bf16 ? 1.0e30f : 1.0e30f;
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      float x = 0.0f;
      switch (f) {
        case fill::normal:
          x = normal(rng) * (1.0f + static_cast<float>(c % 11));
          break;
        case fill::ties:
          x = static_cast<float>(static_cast<int>(rng() % 3)) - 1.0f;
          break;
        case fill::all_equal:
          x = 0.75f;
          break;
        case fill::zeros:
          x = (rng() % 2) ? -0.0f : 0.0f;
          break;
        case fill::extremes: {
          const unsigned pick = rng() % 4;
          x = pick == 0 ? big : pick == 1 ? -big : pick == 2 ? 1e-30f : 0.0f;
          if (t == dtype::f16 && pick == 2) x = 6e-8f;  // a subnormal half
          break;
        }
        case fill::sparse:
          x = (rng() % 64 == 0) ? normal(rng) : 0.0f;
          break;
      }
      const std::size_t at = static_cast<std::size_t>(r * rs + c * cs);
      if (t == dtype::f32) {
        std::memcpy(&g.bytes[at * 4], &x, 4);
      } else {
        const std::uint16_t bits = t == dtype::bf16 ? zenflow::to_bfloat16(x).bits : zenflow::to_float16(x).bits;
        x = t == dtype::bf16 ? zenflow::to_float(zenflow::bfloat16{bits}) : zenflow::to_float(zenflow::float16{bits});
        std::memcpy(&g.bytes[at * 2], &bits, 2);
      }
      g.values[static_cast<std::size_t>(r * cols + c)] = x;
    }
  g.memory = zenflow_test::device_buffer(g.bytes.size() + 16);
  g.device = g.memory.data();
  void* first = static_cast<char*>(g.device) + offset * es;  // offset * es < 16: inside the slack
  ZENFLOW_CUDA_TRY(cudaMemcpy(first, g.bytes.data(), g.bytes.size(), cudaMemcpyHostToDevice));
  // A pageable upload may return before its DMA landed, on the legacy stream, which the
  // non-blocking streams below do not wait for.
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  g.view = const_matrix_view(first, rows, cols, rs, cs, t, memory_space::device);
  g.host_view = const_matrix_view(g.bytes.data(), rows, cols, rs, cs, t, memory_space::host);
}

/// Column scores as the kernel defines them: fp32 terms (score_term: |g| or g*g, which
/// overflows to +inf for |g| > ~1.8e19 and underflows for tiny g), summed in fp64. The kernel's
/// fp32 sums of the same terms stay within 1e-5 relative: the test's column sums never exceed the
/// fp32 range unless a term is already infinite.
/// Overwrites `size` bytes of element `index` (in memory order, gaps included) of g, on device and
/// in the host bytes the host views read.
void plant(device_grad& g, std::size_t index, const void* value, std::size_t size) {
  const std::size_t at = (static_cast<std::size_t>(g.offset) + index) * size;
  ZENFLOW_CUDA_TRY(cudaMemcpy(static_cast<char*>(g.device) + at, value, size, cudaMemcpyHostToDevice));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  std::memcpy(g.bytes.data() + index * size, value, size);
}

std::vector<double> fp64_scores(const device_grad& g, score_norm norm) {
  std::vector<double> s(static_cast<std::size_t>(g.cols), 0.0);
  for (index_t r = 0; r < g.rows; ++r)
    for (index_t c = 0; c < g.cols; ++c)
      s[static_cast<std::size_t>(c)] +=
          zenflow::detail::selector::score_term(g.values[static_cast<std::size_t>(r * g.cols + c)], norm);
  return s;
}

/// How many of `got` differ from the fp64 reference by more than 1e-5 relative (infinite
/// references must be matched exactly).
int score_mismatches(std::span<const float> got, const std::vector<double>& ref) {
  int bad = 0;
  for (std::size_t c = 0; c < ref.size(); ++c) {
    const double tol = 1e-5 * std::fabs(ref[c]) + 1e-37;
    if (std::isinf(ref[c]) ? got[c] != ref[c] : !(std::fabs(got[c] - ref[c]) <= tol)) ++bad;
  }
  return bad;
}

// Checks one select() of `sel` over `grads` against the host.
template <class Selector>
void check_selection(Selector& sel, const std::vector<device_grad*>& grads, score_norm norm, cudaStream_t stream) {
  std::vector<const_matrix_view> views;
  for (auto* g : grads) views.push_back(g->view);
  sel.select(views, stream);
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const auto& g = *grads[i];
    CAPTURE(i);
    CAPTURE(g.rows);
    CAPTURE(g.cols);
    CAPTURE(static_cast<int>(g.type));
    CAPTURE(g.row_major);
    // The device buffer (copied straight from device memory) and the host copy scores() keeps,
    // each against the reference: comparing one with the other would only test the copy.
    std::vector<float> dev(static_cast<std::size_t>(g.cols));
    ZENFLOW_CUDA_TRY(cudaMemcpy(dev.data(), sel.scores_device(i), dev.size() * 4, cudaMemcpyDeviceToHost));
    const auto ref = fp64_scores(g, norm);
    CHECK(score_mismatches(dev, ref) == 0);
    const auto host_copy = sel.scores(i);
    REQUIRE(host_copy.size() == ref.size());
    CHECK(score_mismatches(host_copy, ref) == 0);
    // Device top-k == host top-k of the device's own scores, exactly.
    std::vector<std::int32_t> expect(static_cast<std::size_t>(sel.k(i)));
    zenflow::topk_columns(dev, sel.k(i), expect);
    const auto got = sel.selected(i);
    CHECK(std::vector<std::int32_t>(got.begin(), got.end()) == expect);
    std::vector<std::int32_t> got_dev(expect.size());
    ZENFLOW_CUDA_TRY(cudaMemcpy(got_dev.data(), sel.selected_device(i), got_dev.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(got_dev == expect);
  }
}

}  // namespace

TEST_CASE("device selection matches the host over layouts, dtypes, norms and adversarial fills") {
  const zenflow_test::cuda_stream owned_stream;  // non-blocking
  const cudaStream_t stream = owned_stream.get();
  std::mt19937 rng(2024);
  const fill fills[] = {fill::normal, fill::ties, fill::all_equal, fill::zeros, fill::extremes, fill::sparse};
  // Shapes that exercise full tiles, partial vectors and tiles, one row / one column, several row
  // segments, and ties carried across the top-k's 2048-column output tiles.
  const index_t shapes[][2] = {{1, 1}, {1, 300}, {300, 1}, {7, 33}, {64, 257}, {513, 1000}, {1500, 96}, {3, 5000}};
  // Memory variants: {pad, inner step, offset}: dense and 16-byte aligned (vector loads), a padded
  // leading dimension, a base one element off 16-byte alignment, a strided inner dimension.
  const index_t variants[][3] = {{0, 1, 0}, {1, 1, 0}, {0, 1, 1}, {0, 2, 0}};
  for (score_norm norm : {score_norm::l1, score_norm::l2_squared})
    for (double ratio : {1e-9, 0.05, 0.1, 0.5, 1.0})
      for (int fi = 0; fi < 6; ++fi) {
        const fill f = fills[fi];
        zenflow::cuda_importance_selector<> sel(ratio, norm);
        std::vector<std::unique_ptr<device_grad>> owned;
        std::vector<device_grad*> grads;
        int combo = 0;
        for (dtype t : {dtype::f32, dtype::bf16, dtype::f16})
          for (bool row_major : {true, false})
            for (const auto& v : variants) {
              // Half of the shapes per combination, the other half with the next fill, so that every
              // (dtype, layout, variant, shape) meets three fills per norm and ratio.
              for (int j = 0; j < 8; ++j) {
                if ((j + combo + fi) % 2 != 0) continue;
                owned.push_back(std::make_unique<device_grad>());
                make(*owned.back(), shapes[j][0], shapes[j][1], t, row_major, f, rng, v[0], v[1], v[2]);
                grads.push_back(owned.back().get());
                sel.add_parameter(shapes[j][0], shapes[j][1]);
              }
              ++combo;
            }
        CAPTURE(static_cast<int>(f));
        CAPTURE(ratio);
        check_selection(sel, grads, norm, stream);
      }
}

TEST_CASE("device selection: large shapes, many parameters in one launch, repeated selects and overlap") {
  const zenflow_test::cuda_stream owned_stream;  // non-blocking
  const cudaStream_t stream = owned_stream.get();
  std::mt19937 rng(99);
  zenflow::cuda_importance_selector<> sel(0.1, score_norm::l1);
  std::vector<std::unique_ptr<device_grad>> owned;
  std::vector<device_grad*> grads;
  const index_t shapes[][2] = {{4096, 512}, {512, 4096}, {2048, 3000}, {33, 65536}, {8192, 64}};
  for (int i = 0; i < 20; ++i) {
    const auto& s = shapes[i % 5];
    owned.push_back(std::make_unique<device_grad>());
    make(*owned.back(), s[0], s[1],
         i % 3 == 0   ? dtype::f32
         : i % 3 == 1 ? dtype::bf16
                      : dtype::f16,
         i % 2 == 0, fill::normal, rng);
    grads.push_back(owned.back().get());
    sel.add_parameter(s[0], s[1]);
  }
  check_selection(sel, grads, score_norm::l1, stream);
  const std::vector<std::int32_t> first(sel.selected(0).begin(), sel.selected(0).end());
  check_selection(sel, grads, score_norm::l1, stream);  // same gradients: same selection, overlap 1
  for (std::size_t i = 0; i < grads.size(); ++i) CHECK(sel.overlap(i) == 1.0);
  CHECK(std::vector<std::int32_t>(sel.previous(0).begin(), sel.previous(0).end()) == first);
  std::vector<std::int32_t> prev_dev(first.size());
  ZENFLOW_CUDA_TRY(cudaMemcpy(prev_dev.data(), sel.previous_device(0), prev_dev.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(prev_dev == first);
}

TEST_CASE("device selector: bad input throws before touching state") {
  std::mt19937 rng(1);
  device_grad a, nan_grad;
  make(a, 16, 40, dtype::bf16, true, fill::normal, rng);
  make(nan_grad, 16, 40, dtype::bf16, true, fill::normal, rng);
  const std::uint16_t nan_bits = zenflow::to_bfloat16(std::nanf("")).bits;
  ZENFLOW_CUDA_TRY(cudaMemcpy(static_cast<char*>(nan_grad.device) + 2 * 5, &nan_bits, 2, cudaMemcpyHostToDevice));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  zenflow::cuda_importance_selector<> sel(0.25);
  sel.add_parameter(16, 40);
  sel.select(std::span(&a.view, 1), nullptr);
  sel.select(std::span(&a.view, 1), nullptr);  // a previous selection exists too
  const std::vector<std::int32_t> before(sel.selected(0).begin(), sel.selected(0).end());
  const std::vector<std::int32_t> previous_before(sel.previous(0).begin(), sel.previous(0).end());
  REQUIRE(previous_before.size() == before.size());
  const std::vector<float> scores_before(sel.scores(0).begin(), sel.scores(0).end());
  CHECK_THROWS_AS(sel.select(std::span(&a.host_view, 1), nullptr), zenflow::error);    // host memory
  CHECK_THROWS_AS(sel.select(std::span(&nan_grad.view, 1), nullptr), zenflow::error);  // NaN score
  CHECK(std::vector<std::int32_t>(sel.selected(0).begin(), sel.selected(0).end()) == before);
  CHECK(std::vector<std::int32_t>(sel.previous(0).begin(), sel.previous(0).end()) == previous_before);
  CHECK(std::vector<float>(sel.scores(0).begin(), sel.scores(0).end()) == scores_before);
  // The device copies too (the host ones above are cached): the failed select ran its kernels.
  std::vector<std::int32_t> dev(before.size());
  ZENFLOW_CUDA_TRY(cudaMemcpy(dev.data(), sel.selected_device(0), dev.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(dev == before);
  ZENFLOW_CUDA_TRY(cudaMemcpy(dev.data(), sel.previous_device(0), dev.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(dev == previous_before);
  std::vector<float> dev_scores(scores_before.size());
  ZENFLOW_CUDA_TRY(cudaMemcpy(dev_scores.data(), sel.scores_device(0), dev_scores.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(dev_scores == scores_before);
  // A parameter registered after the buffers were sized has no device copies yet, and scores()
  // reads only what exists.
  zenflow::cuda_importance_selector<> grown(0.25);
  grown.add_parameter(16, 40);
  grown.select(std::span(&a.view, 1), nullptr);
  grown.add_parameter(8, 3000);
  CHECK(grown.scores(0).size() == 40);
  CHECK(grown.scores(1).size() == 3000);
  CHECK(grown.selected_device(1) == nullptr);
  CHECK(grown.scores_device(1) == nullptr);
  CHECK(grown.selected_device(0) != nullptr);
  const std::vector<std::int32_t> unsorted{5, 1, 2, 3, 4, 6, 7, 8, 9, 10};
  CHECK_THROWS_AS(sel.set_selection(0, unsorted), zenflow::error);
  std::vector<std::int32_t> restore(10);
  for (int j = 0; j < 10; ++j) restore[static_cast<std::size_t>(j)] = 3 * j;
  sel.set_selection(0, restore);
  ZENFLOW_CUDA_TRY(cudaMemcpy(dev.data(), sel.selected_device(0), dev.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(dev == restore);
}

TEST_CASE("device gradient statistics match the host reference") {
  const zenflow_test::cuda_stream owned_stream;  // non-blocking
  const cudaStream_t stream = owned_stream.get();
  std::mt19937 rng(5);
  std::vector<std::unique_ptr<device_grad>> owned;
  std::vector<const_matrix_view> dev_views, host_views;
  for (int i = 0; i < 60; ++i) {  // more than one 48-tensor batch
    owned.push_back(std::make_unique<device_grad>());
    const index_t rows = 1 + (i * 37) % 300, cols = 1 + (i * 53) % 700;
    make(*owned.back(), rows, cols,
         i % 3 == 0   ? dtype::f32
         : i % 3 == 1 ? dtype::bf16
                      : dtype::f16,
         i % 2 == 0, fill::normal, rng, i % 4 == 3 || i % 8 == 4 ? 1 : 0);
    dev_views.push_back(owned.back()->view);
    host_views.push_back(owned.back()->host_view);
  }
  std::int64_t elements = 2500;  // in the views: the tensors' and the strided vector's
  for (const auto& g : owned) elements += static_cast<std::int64_t>(g->rows) * g->cols;
  device_grad vec;
  make(vec, 1, 5000, dtype::bf16, true, fill::normal, rng);
  // a strided vector: every other element
  std::vector<zenflow::const_vector_view> dev_vecs{
      zenflow::const_vector_view(vec.device, 2500, dtype::bf16, memory_space::device, 2)};
  std::vector<zenflow::const_vector_view> host_vecs{
      zenflow::const_vector_view(vec.bytes.data(), 2500, dtype::bf16, memory_space::host, 2)};
  const zenflow_test::device_buffer out_memory(sizeof(zenflow::gradient_stats_device));
  auto* out = out_memory.data<zenflow::gradient_stats_device>();
  // Tensor i is f32 / bf16 / f16 for i % 3 = 0 / 1 / 2, row-major for even i, with a padded
  // leading dimension (a gap element per row or column: the strided path) for i % 4 = 3 (odd,
  // column-contiguous) and i % 8 = 4 (even, row-major: 4, 12, 20 are bf16, f32, f16).
  REQUIRE(owned[1]->type == dtype::bf16);
  REQUIRE(owned[2]->type == dtype::f16);
  REQUIRE((owned[1]->pad == 0 && owned[2]->pad == 0));
  REQUIRE((owned[4]->type == dtype::bf16 && owned[4]->pad == 1 && owned[4]->row_major));
  REQUIRE((owned[11]->type == dtype::f16 && owned[11]->pad == 1 && !owned[11]->row_major));
  unsigned long long planted = 0;  // non-finite elements of the views
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      const float inf = std::numeric_limits<float>::infinity();
      plant(*owned[0], 0, &inf, 4);  // f32
      ++planted;
      // 16-bit values: contiguous tensors (16-byte vector loads, and the scalar tail: the last
      // element), padded ones (element loads), the strided vector. Gap elements are not part of
      // any view: a NaN there must not count. 65504 is the largest finite f16.
      const std::uint16_t bf16_inf = 0x7f80, bf16_nan = 0x7fc1, bf16_ninf = 0xff80;
      const std::uint16_t f16_inf = 0x7c00, f16_nan = 0x7e01, f16_ninf = 0xfc00, f16_max = 0x7bff;
      const auto last = [](const device_grad& g) { return static_cast<std::size_t>(g.rows * g.cols - 1); };
      plant(*owned[1], 100, &bf16_inf, 2);
      plant(*owned[1], last(*owned[1]), &bf16_nan, 2);
      plant(*owned[2], 3, &f16_ninf, 2);
      plant(*owned[2], last(*owned[2]), &f16_nan, 2);
      plant(*owned[2], 50, &f16_max, 2);
      planted += 4;
      const device_grad& p4 = *owned[4];  // row-major, row stride cols + 1
      plant(*owned[4], static_cast<std::size_t>(5 * (p4.cols + 1) + 10), &bf16_ninf, 2);
      plant(*owned[4], static_cast<std::size_t>(3 * (p4.cols + 1) + p4.cols), &bf16_nan, 2);  // gap
      const device_grad& p11 = *owned[11];  // column-contiguous, column stride rows + 1
      plant(*owned[11], static_cast<std::size_t>(7 * (p11.rows + 1) + 2), &f16_inf, 2);
      plant(*owned[11], static_cast<std::size_t>(2 * (p11.rows + 1) + p11.rows), &f16_nan, 2);  // gap
      plant(*owned[11], static_cast<std::size_t>(9 * (p11.rows + 1) + 4), &f16_max, 2);
      planted += 2;
      plant(vec, 2 * 7, &bf16_nan, 2);      // element 7 of the stride-2 view
      plant(vec, 2 * 9 + 1, &bf16_inf, 2);  // a gap between elements 9 and 10
      ++planted;
    }
    zenflow::cuda_gradient_stats(dev_views, dev_vecs, out, stream);
    zenflow::gradient_stats_device got{};
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(&got, out, sizeof(got), cudaMemcpyDeviceToHost, stream));
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    const auto expect = zenflow::host_gradient_stats(host_views, host_vecs);
    CHECK(got.nonfinite_count == static_cast<unsigned long long>(expect.nonfinite_count));
    CHECK(got.nonfinite_count == planted);
    // The device sums in a tree of fixed shape, the host in its own order: both in double, each
    // within (n - 1) u of the exact sum of the (exact, non-negative) squares, so they differ by at
    // most 2 n u times the sum. A relative 1e-12 is too tight once two 65504^2 terms sit early in
    // the host's running sum (every later addition then rounds at 2^-19); a dropped, doubled or
    // mis-converted element is far outside this bound in round 0 (sum ~ the element count).
    const double n = static_cast<double>(elements);
    const double bound = 2.0 * n * std::ldexp(1.0, -53) * expect.sum_of_squares;
    INFO("device ", got.sum_of_squares, " host ", expect.sum_of_squares, " bound ", bound);
    CHECK(std::abs(got.sum_of_squares - expect.sum_of_squares) <= bound);
    // Deterministic: a second run gives the same bits.
    zenflow::cuda_gradient_stats(dev_views, dev_vecs, out, stream);
    zenflow::gradient_stats_device again{};
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(&again, out, sizeof(again), cudaMemcpyDeviceToHost, stream));
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    CHECK(std::memcmp(&again, &got, sizeof(got)) == 0);
  }
}
