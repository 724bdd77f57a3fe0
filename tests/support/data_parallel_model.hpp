// The model the data-parallel coordinator tests share (host, MPI and NCCL): the options, three
// parameters and the micro-batch gradients of each rank.
//
// The micro-batch gradients are g_r = (r + 1) * m on a dyadic grid (multiples of 1/64, at most 8
// significant bits), so every sum over ranks and the mean are exact in bf16 and f32 whatever
// order the engine adds in, and the ranks' column scores are the mean's times one factor: the
// selection is the mean's. Without clipping 2 ranks equal one process on the mean gradient bit for
// bit (the 1/2 is exact), and so does one rank.
#pragma once

#include <zenflow/coordinator.hpp>
#include <zenflow/types.hpp>
#include <zenflow/view.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace zenflow_test {

inline zenflow::zenflow_options data_parallel_test_options(float max_grad_norm) {
  zenflow::zenflow_options o;
  o.mode = zenflow::offload_mode::zenflow;
  o.topk_ratio = 0.25f;
  o.select_strategy = zenflow::selection_strategy::step;
  o.select_interval = zenflow::interval_option::fixed(3);
  o.update_interval = zenflow::interval_option::fixed(2);
  o.full_warm_up_rounds = 1;
  o.overlap_step = true;
  o.max_grad_norm = max_grad_norm;
  o.optimizer.lr = 1e-2f;
  o.optimizer.weight_decay = 0.01f;
  return o;
}

/// w2 gets no gradient on any rank at these steps (missing_gradients::skip).
inline bool w2_missing(int t) {
  return t % 5 == 4;
}

/// Parameters and gradients of one rank (or of the single-process reference), in host memory:
/// w1 16 x 24 bf16 row-major, w2 12 x 10 f32 column-contiguous, b 16 f32, each dimension times
/// `Scale`.
template <int Scale>
struct basic_data_parallel_model {
  static constexpr zenflow::index_t r1 = 16 * Scale, c1 = 24 * Scale, r2 = 12 * Scale, c2 = 10 * Scale, nb = 16 * Scale;
  std::vector<zenflow::bfloat16> w1 = std::vector<zenflow::bfloat16>(r1 * c1),
                                 g1 = std::vector<zenflow::bfloat16>(r1 * c1);
  std::vector<float> w2 = std::vector<float>(r2 * c2), g2 = std::vector<float>(r2 * c2);
  std::vector<float> b = std::vector<float>(nb), gb = std::vector<float>(nb);

  basic_data_parallel_model() {
    for (std::size_t i = 0; i < w1.size(); ++i)
      w1[i] = zenflow::to_bfloat16(static_cast<float>(static_cast<int>(i % 13) - 6) / 16);
    for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = static_cast<float>(static_cast<int>(i % 7) - 3) / 8;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i) / 32;
  }

  /// Registers w1, w2, b (indices 0, 1, 2) with the host vectors as the parameters.
  template <class C>
  void register_with(C& c, const std::string& first_name = "w1") {
    register_at(c, w1.data(), w2.data(), b.data(), zenflow::memory_space::host, first_name);
  }
  /// Registers w1, w2, b with the parameters at w1_at, w2_at, b_at (in `space`), initialized from
  /// the host vectors.
  template <class C>
  void register_at(C& c, void* w1_at, void* w2_at, void* b_at, zenflow::memory_space space,
                   const std::string& first_name = "w1") const {
    using zenflow::const_matrix_view;
    using zenflow::dtype;
    using zenflow::matrix_view;
    c.register_parameter(first_name, matrix_view::row_major(w1_at, r1, c1, dtype::bf16, space),
                         const_matrix_view::row_major(w1.data(), r1, c1, dtype::bf16), dtype::bf16);
    c.register_parameter("w2", matrix_view::column_contiguous(w2_at, r2, c2, dtype::f32, space),
                         const_matrix_view::column_contiguous(w2.data(), r2, c2, dtype::f32), dtype::f32);
    c.register_parameter("b", zenflow::vector_view(b_at, nb, dtype::f32, space), std::span<const float>(b));
  }

  // m(t): multiples of 1/64 up to 32/64, column weights that move with t (the selection changes).
  static float unit(int t, std::size_t row, std::size_t col) {
    const std::uint32_t h = static_cast<std::uint32_t>(t * 7919 + row * 104729 + col * 1299709) * 2654435761u;
    const int q = static_cast<int>((h >> 16) % 9) - 4;
    const int weight = 1 + static_cast<int>((col * 5 + static_cast<std::size_t>(t) * 3) % 8);
    return static_cast<float>(q * weight) / 64;
  }
  /// This rank's micro-batch gradient, (rank + 1) * m(t); rank < 0: the mean over `ranks` ranks.
  void make_gradients(int t, int rank, int ranks) {
    const float factor = rank >= 0 ? static_cast<float>(rank + 1) : static_cast<float>(ranks + 1) / 2;
    for (std::size_t r = 0; r < r1; ++r)
      for (std::size_t c = 0; c < c1; ++c) g1[r * c1 + c] = zenflow::to_bfloat16(factor * unit(t, r, c));
    for (std::size_t c = 0; c < c2; ++c)
      for (std::size_t r = 0; r < r2; ++r) g2[c * r2 + r] = factor * unit(t + 100, r, c);
    for (std::size_t i = 0; i < nb; ++i) gb[i] = factor * unit(t + 200, i, 0);
  }

  /// Gradients whose column scores differ from rank to rank so much that each rank's own top-k
  /// columns are not the selection of the summed scores: of each 2-D gradient's columns (a window
  /// that moves with t) k get a boost of 10/64 on every rank, and rank r boosts k others of its
  /// own by 16/64; on top, 0 or 1/64 and a sign per element that every rank shares (so the L1 of
  /// the sum is the sum of the ranks' L1 norms). Every rank's top-k is its own k, the summed
  /// scores' top-k the shared ones, and so is the top-k of the mean gradient (one process): a
  /// coordinator that did not all-reduce the scores would select other columns than one process.
  /// Sums over ranks are exact (at most 51/64); rank < 0: the mean over `ranks` ranks (exact for 2).
  void make_rank_specific_gradients(int t, int rank, int ranks) {
    auto value = [&](int r, int who, std::size_t row, std::size_t col, std::size_t cols, std::size_t k) {
      const std::uint32_t h = static_cast<std::uint32_t>(t * 7919 + row * 104729 + col * 1299709 + who) * 2654435761u;
      const float sign = (h >> 20) & 1u ? 1.0f : -1.0f;
      const std::size_t group = ((col + static_cast<std::size_t>(t) * 5) % cols) / k;
      const int boost = group == 0 ? 10 : group == static_cast<std::size_t>(r) + 1 ? 16 : 0;
      return sign * static_cast<float>(static_cast<int>((h >> 9) & 1u) + boost) / 64;
    };
    auto mean_or_own = [&](int who, std::size_t row, std::size_t col, std::size_t cols) {
      const std::size_t k = std::max<std::size_t>(1, cols / 4);
      if (rank >= 0) return value(rank, who, row, col, cols, k);
      float sum = 0.0f;
      for (int r = 0; r < ranks; ++r) sum += value(r, who, row, col, cols, k);
      return sum / static_cast<float>(ranks);
    };
    for (std::size_t r = 0; r < r1; ++r)
      for (std::size_t c = 0; c < c1; ++c) g1[r * c1 + c] = zenflow::to_bfloat16(mean_or_own(1, r, c, c1));
    for (std::size_t c = 0; c < c2; ++c)
      for (std::size_t r = 0; r < r2; ++r) g2[c * r2 + r] = mean_or_own(2, r, c, c2);
    for (std::size_t i = 0; i < nb; ++i) gb[i] = mean_or_own(3, i, 0, 4);
  }

  /// Hands over this step's gradients from the host vectors (w2's only when `with_w2`).
  template <class C, class Stream>
  void submit(C& c, Stream stream, bool with_w2 = true) const {
    submit_from(c, g1.data(), g2.data(), gb.data(), zenflow::memory_space::host, stream, with_w2);
  }
  /// Hands over this step's gradients from g1_at, g2_at, gb_at (in `space`).
  template <class C, class Stream>
  void submit_from(C& c, const void* g1_at, const void* g2_at, const void* gb_at, zenflow::memory_space space,
                   Stream stream, bool with_w2 = true) const {
    using zenflow::const_matrix_view;
    using zenflow::dtype;
    c.submit_gradient(0, const_matrix_view::row_major(g1_at, r1, c1, dtype::bf16, space), stream);
    if (with_w2) c.submit_gradient(1, const_matrix_view::column_contiguous(g2_at, r2, c2, dtype::f32, space), stream);
    c.submit_gradient(2, zenflow::const_vector_view(gb_at, nb, dtype::f32, space), stream);
  }

  /// The parameters' bytes: w1, then w2, then b.
  [[nodiscard]] std::vector<std::byte> bytes() const {
    std::vector<std::byte> out(w1.size() * 2 + (w2.size() + b.size()) * 4);
    std::memcpy(out.data(), w1.data(), w1.size() * 2);
    std::memcpy(out.data() + w1.size() * 2, w2.data(), w2.size() * 4);
    std::memcpy(out.data() + w1.size() * 2 + w2.size() * 4, b.data(), b.size() * 4);
    return out;
  }
};

using data_parallel_model = basic_data_parallel_model<1>;

/// Elements of the parameters that differ in any bit (exact), else that are farther apart than the
/// multi-rank tests' tolerance: w1 (bf16) 2e-2, w2 and b (f32) 2e-3.
template <int Scale>
int parameters_apart(const basic_data_parallel_model<Scale>& got, const basic_data_parallel_model<Scale>& want,
                     bool exact) {
  if (exact) {
    const auto a = got.bytes(), b = want.bytes();
    int differ = 0;
    for (std::size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    return differ;
  }
  int far = 0;
  for (std::size_t i = 0; i < got.w1.size(); ++i)
    far += std::fabs(zenflow::to_float(got.w1[i]) - zenflow::to_float(want.w1[i])) > 2e-2f;
  for (std::size_t i = 0; i < got.w2.size(); ++i) far += std::fabs(got.w2[i] - want.w2[i]) > 2e-3f;
  for (std::size_t i = 0; i < got.b.size(); ++i) far += std::fabs(got.b[i] - want.b[i]) > 2e-3f;
  return far;
}

/// Elements of CPU state that differ (exact) or are farther apart than tolerance x (1 + |want|).
inline int state_apart(std::span<const float> got, std::span<const float> want, bool exact, float tolerance) {
  if (got.size() != want.size()) return -1;
  int far = 0;
  for (std::size_t e = 0; e < got.size(); ++e)
    far += exact ? got[e] != want[e] : !(std::fabs(got[e] - want[e]) <= tolerance * (1.0f + std::fabs(want[e])));
  return far;
}

/// How a multi-rank run against one process is set up and how close it must stay (see
/// tests/mpi/test_coordinator_data_parallel.cpp).
struct scenario {
  bool clip = false;           // max_grad_norm between the steps' global norms: some steps clip, some do not
  bool rank_specific = false;  // make_rank_specific_gradients: each rank's own top-k is not the selection
  bool exact = false;          // bit for bit (parameters and CPU state)
  float tolerance = 1e-3f;     // otherwise: f32 values within tolerance x (|b| + rms b)
};

// Elements of `got` farther from `want` than tolerance x (|want| + rms(want)).
inline std::size_t far(std::span<const float> got, std::span<const float> want, float tolerance) {
  double squares = 0.0;
  for (const float x : want) squares += static_cast<double>(x) * x;
  const auto rms = static_cast<float>(std::sqrt(squares / static_cast<double>(std::max<std::size_t>(want.size(), 1))));
  std::size_t n = 0;
  for (std::size_t e = 0; e < got.size(); ++e)
    n += !(std::fabs(got[e] - want[e]) <= tolerance * (std::fabs(want[e]) + rms));
  return n;
}
template <class Model>
std::vector<float> w1_values(const Model& m) {
  std::vector<float> out;
  for (const auto x : m.w1) out.push_back(zenflow::to_float(x));
  return out;
}

// The mean gradient's global L2 norm at each of `steps` steps (what clipping compares).
template <class Model>
std::vector<double> mean_gradient_norms(int steps, int ranks, bool rank_specific) {
  Model m;
  std::vector<double> norms;
  for (int t = 0; t < steps; ++t) {
    if (rank_specific)
      m.make_rank_specific_gradients(t, -1, ranks);
    else
      m.make_gradients(t, -1, ranks);
    double sum = 0.0;
    for (const auto x : m.g1) sum += static_cast<double>(zenflow::to_float(x)) * zenflow::to_float(x);
    for (const float x : m.g2) sum += w2_missing(t) ? 0.0 : static_cast<double>(x) * x;
    for (const float x : m.gb) sum += static_cast<double>(x) * x;
    norms.push_back(std::sqrt(sum));
  }
  return norms;
}

// A clip threshold in the widest gap between the middle half of the sorted norms: about half the
// steps clip, and no step's norm is near the threshold (the ranks compute it from the summed
// gradients, one process from the mean: the last bits may differ).
inline float threshold_between(std::vector<double> norms) {
  std::sort(norms.begin(), norms.end());
  const std::size_t n = norms.size();
  std::size_t best = n / 4;
  for (std::size_t i = n / 4; i + 1 < 3 * n / 4 + 1 && i + 1 < n; ++i)
    if (norms[i + 1] - norms[i] > norms[best + 1] - norms[best]) best = i;
  return static_cast<float>((norms[best] + norms[best + 1]) / 2);
}

}  // namespace zenflow_test
