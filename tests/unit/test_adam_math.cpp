// The shared per-element Adam math against an independent fp64 implementation of Adam/AdamW.
#include <zenflow/adam_math.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

namespace {
struct reference_adam {
  double p, m = 0, v = 0;
  void step(double g, const zenflow::adam_options& o, std::int64_t t) {
    if (!o.adamw_mode) g += o.weight_decay * p;
    m = o.beta1 * m + (1 - static_cast<double>(o.beta1)) * g;
    v = o.beta2 * v + (1 - static_cast<double>(o.beta2)) * g * g;
    const double bc1 = o.bias_correction ? 1 - std::pow(static_cast<double>(o.beta1), static_cast<double>(t)) : 1;
    const double bc2 = o.bias_correction ? 1 - std::pow(static_cast<double>(o.beta2), static_cast<double>(t)) : 1;
    if (o.adamw_mode) p *= 1 - static_cast<double>(o.lr) * o.weight_decay;
    p -= o.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + o.eps);
  }
};
}  // namespace

TEST_CASE("adam_update tracks fp64 Adam and AdamW over 1000 steps") {
  for (bool adamw : {true, false})
    for (bool bias_correction : {true, false}) {
      zenflow::adam_options o;
      o.lr = 1e-3f;
      o.weight_decay = 0.01f;
      o.adamw_mode = adamw;
      o.bias_correction = bias_correction;
      std::mt19937 rng(42);
      std::normal_distribution<float> noise(0.0f, 1.0f);
      std::vector<float> p(64), m(64, 0.0f), v(64, 0.0f);
      std::vector<reference_adam> ref;
      for (auto& x : p) {
        x = noise(rng);
        ref.push_back({x});
      }
      // Norm-wise relative error: max |p - p_ref| / max |p_ref| (element-wise relative error is
      // meaningless for parameters that cross zero).
      double worst_abs = 0, scale = 0;
      for (std::int64_t t = 1; t <= 1000; ++t) {
        const auto c = zenflow::make_adam_step_constants(o, t, 0.5f);
        for (std::size_t i = 0; i < p.size(); ++i) {
          const float g = 0.1f * p[i] + noise(rng);  // a gradient that depends on the parameter
          zenflow::adam_update(p[i], g, m[i], v[i], c);
          ref[i].step(0.5 * g, o, t);
          worst_abs = std::max(worst_abs, std::fabs(p[i] - ref[i].p));
          scale = std::max(scale, std::fabs(ref[i].p));
        }
      }
      INFO("adamw " << adamw << " bias_correction " << bias_correction);
      CHECK(worst_abs / scale < 2e-6);
    }
}

TEST_CASE("step constants reject bad input and compute bias corrections in double") {
  zenflow::adam_options o;
  CHECK_THROWS_AS(zenflow::make_adam_step_constants(o, 0), zenflow::error);
  CHECK_THROWS_AS(zenflow::make_adam_step_constants(o, 1, -1.0f), zenflow::error);
  o.eps = -1.0f;
  CHECK_THROWS_AS(zenflow::make_adam_step_constants(o, 1), zenflow::error);
  o.eps = 1e-8f;
  // A 64-bit step far beyond any 16-bit counter still decays the corrections to 1.
  const auto late = zenflow::make_adam_step_constants(o, std::int64_t{1} << 40);
  CHECK(late.step_size == doctest::Approx(o.lr));
  CHECK(late.inv_sqrt_bc2 == 1.0f);
  const auto first = zenflow::make_adam_step_constants(o, 1);
  CHECK(first.step_size == doctest::Approx(o.lr / 0.1).epsilon(1e-6));
  CHECK(zenflow::is_finite_bits(1.0f));
  CHECK(!zenflow::is_finite_bits(std::nanf("")));
  CHECK(!zenflow::is_finite_bits(-INFINITY));
}

}  // namespace ZENFLOW_TEST_FILE_ID
