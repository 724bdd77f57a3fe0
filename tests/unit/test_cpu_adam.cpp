// The CPU Adam: accuracy against fp64, bit-identity across ISAs / threads / chunks / splits,
// masks, copy-out conversions, skipped steps, validation.
#include <zenflow/concepts.hpp>
#include <zenflow/cpu_adam.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::bfloat16;
using zenflow::cpu_adam;
using zenflow::cpu_adam_config;
using zenflow::cpu_adam_task;
using zenflow::cpu_isa;
using zenflow::dtype;
using zenflow::float16;

static_assert(zenflow::host_optimizer<cpu_adam>);

namespace {

std::vector<cpu_isa> available_isas() {
  std::vector<cpu_isa> out;
  for (cpu_isa i : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512})
    if (zenflow::cpu_isa_supported(i)) out.push_back(i);
  return out;
}

template <class T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = zenflow::from_float<T>(x[i]);
  return out;
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}

std::vector<float> snapshot(const cpu_adam& opt) {
  std::vector<float> s;
  for (std::size_t t = 0; t < opt.tensor_count(); ++t)
    for (auto span : {opt.params(t), opt.exp_avg(t), opt.exp_avg_sq(t)}) s.insert(s.end(), span.begin(), span.end());
  return s;
}

struct reference_adam {  // independent fp64 Adam/AdamW
  double p, m = 0, v = 0;
  void step(double g, const zenflow::adam_options& o, std::int64_t t) {
    if (!o.adamw_mode) g += o.weight_decay * p;
    m = o.beta1 * m + (1 - static_cast<double>(o.beta1)) * g;
    v = o.beta2 * v + (1 - static_cast<double>(o.beta2)) * g * g;
    const double bc1 = o.bias_correction ? 1 - std::pow(static_cast<double>(o.beta1), static_cast<double>(t)) : 1;
    const double bc2 = o.bias_correction ? 1 - std::pow(static_cast<double>(o.beta2), static_cast<double>(t)) : 1;
    p -= o.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + o.eps) +
         static_cast<double>(o.lr) * o.weight_decay * p * o.adamw_mode;
  }
};

// Runs 1000 steps of a two-tensor model (one masked) and returns max|p - p_ref| / max|p_ref|.
// Two independent training runs on the same problem and the same noise: cpu_adam (fp32 state,
// gradients computed in fp32 and handed over as `gtype`) and an fp64 Adam whose gradients are
// computed in fp64 from its own parameters. Returns max|p - p_ref| / max|p_ref| over all steps.
// problem::least_squares — g = (p - target) + N(0, 0.05): a noisy quadratic (realistic: the
//   loss feeds parameter errors back, as in training);
// problem::random_walk — g = 0.01 (p - target) + N(0, 1): almost no feedback, so the per-step
//   fp32 rounding of p random-walks (~ sqrt(steps) * ulp / sqrt(12) ~ 1.1e-6 relative after
//   1000 steps: the floor of ANY implementation that stores p in fp32).
enum class problem { least_squares, random_walk };
double error_vs_fp64(cpu_isa isa, dtype gtype, bool adamw, bool bias_correction,
                     problem kind = problem::least_squares) {
  zenflow::adam_options o;
  o.lr = 1e-3f;
  o.weight_decay = 0.01f;
  o.adamw_mode = adamw;
  o.bias_correction = bias_correction;
  cpu_adam opt(o, {2, false, isa, 100});
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  const zenflow::index_t rows = 19, cols = 6;
  const std::size_t n = rows * cols;
  std::vector<double> target(n);
  std::vector<float> init(n);
  for (auto& x : target) x = normal(rng);
  for (std::size_t i = 0; i < n; ++i) init[i] = static_cast<float>(target[i] + 0.3 * normal(rng));
  opt.add_tensor(init, rows, cols);
  std::vector<reference_adam> ref;
  for (float x : init) ref.push_back({x});
  const double curvature = kind == problem::least_squares ? 1.0 : 0.01;
  const double sigma = kind == problem::least_squares ? 0.05 : 1.0;
  std::vector<float> g(n);
  std::vector<bfloat16> gb(n);
  std::vector<float16> gh(n);
  std::vector<double> noise(n);
  double worst = 0, scale = 0;
  for (std::int64_t t = 1; t <= 1000; ++t) {
    auto p = opt.params(0);
    for (std::size_t i = 0; i < n; ++i) {
      noise[i] = sigma * normal(rng);
      g[i] = static_cast<float>(curvature) * (p[i] - static_cast<float>(target[i])) + static_cast<float>(noise[i]);
    }
    const void* gp = g.data();
    if (gtype == dtype::bf16) gp = (gb = convert<bfloat16>(g)).data();
    if (gtype == dtype::f16) gp = (gh = convert<float16>(g)).data();
    const cpu_adam_task task{0, gp, gtype, {}};
    REQUIRE(opt.step({&task, 1}, 0.5f).applied);
    for (std::size_t i = 0; i < n; ++i) {
      ref[i].step(0.5 * (curvature * (ref[i].p - target[i]) + noise[i]), o, t);
      worst = std::max(worst, std::fabs(static_cast<double>(p[i]) - ref[i].p));
      scale = std::max(scale, std::fabs(ref[i].p));
    }
  }
  return worst / scale;
}

}  // namespace

TEST_CASE("cpu_adam tracks an independent fp64 Adam/AdamW over 1000 steps") {
  for (cpu_isa isa : available_isas())
    for (bool adamw : {true, false})
      for (bool bc : {true, false}) {
        INFO(zenflow::cpu_isa_name(isa) << " adamw " << adamw << " bias_correction " << bc);
        // fp32 gradients: norm-wise relative error max|p - p_ref| / max|p_ref| <= 1e-6.
        CHECK(error_vs_fp64(isa, dtype::f32, adamw, bc) <= 1e-6);
        // Documented bounds for low-precision gradients (their rounding, 2^-9 for bf16 and
        // 2^-12 for fp16 relative, is the error source; the conversions themselves are exact).
        CHECK(error_vs_fp64(isa, dtype::bf16, adamw, bc) <= 1e-4);
        CHECK(error_vs_fp64(isa, dtype::f16, adamw, bc) <= 1e-5);
        // Gradients that do not damp errors: the fp32 storage floor (see problem::random_walk).
        CHECK(error_vs_fp64(isa, dtype::f32, adamw, bc, problem::random_walk) <= 2e-6);
      }
}

namespace {
// A mixed workload: three tensors, every gradient and copy-out type, masks, both layouts.
struct workload {
  std::vector<std::vector<float>> init;
  std::vector<std::pair<zenflow::index_t, zenflow::index_t>> shape{{37, 5}, {64, 3}, {1000, 1}};
  std::vector<std::int32_t> cols0{0, 2, 3}, cols1{};
  std::vector<float> g0;
  std::vector<bfloat16> g1;
  std::vector<float16> g2;
  workload() {
    std::mt19937 rng(3);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    for (auto [r, c] : shape) {
      init.emplace_back(static_cast<std::size_t>(r * c));
      for (auto& x : init.back()) x = noise(rng);
    }
    std::vector<float> g(init[0].size());
    for (auto& x : g) x = noise(rng);
    g0.resize(cols0.size() * 37);  // compact
    for (std::size_t j = 0; j < cols0.size(); ++j)
      for (int r = 0; r < 37; ++r) g0[j * 37 + r] = g[static_cast<std::size_t>(cols0[j]) * 37 + r];
    std::vector<float> tmp(init[1].size());
    for (auto& x : tmp) x = noise(rng);
    g1 = convert<bfloat16>(tmp);
    tmp.resize(init[2].size());
    for (auto& x : tmp) x = 1e-3f * noise(rng);
    g2 = convert<float16>(tmp);
  }
  // Runs `steps` steps; returns the state plus every copy-out, as bits.
  std::vector<float> run(const cpu_adam_config& cfg, int steps, bool adamw = true) const {
    zenflow::adam_options o;
    o.weight_decay = 0.1f;
    o.adamw_mode = adamw;
    cpu_adam opt(o, cfg);
    for (std::size_t t = 0; t < init.size(); ++t) opt.add_tensor(init[t], shape[t].first, shape[t].second);
    std::vector<bfloat16> out0(init[0].size());
    std::vector<float16> out1(init[1].size());
    std::vector<float> out2(init[2].size());
    std::vector<float> result;
    for (int s = 0; s < steps; ++s) {
      cpu_adam_task tasks[3] = {{0, g0.data(), dtype::f32, cols0, true, out0.data(), dtype::bf16, false},
                                {1, g1.data(), dtype::bf16, cols1, false, out1.data(), dtype::f16, false},
                                {2, g2.data(), dtype::f16, {}, false, out2.data(), dtype::f32, true}};
      REQUIRE(opt.step(tasks, 0.75f).applied);
      for (auto x : out0) result.push_back(zenflow::to_float(x));
      for (auto x : out1) result.push_back(zenflow::to_float(x));
      result.insert(result.end(), out2.begin(), out2.end());
    }
    const auto st = snapshot(opt);
    result.insert(result.end(), st.begin(), st.end());
    return result;
  }
};
}  // namespace

TEST_CASE("results are bit-identical across ISAs, thread counts and chunk sizes") {
  const workload w;
  for (bool adamw : {true, false}) {
    const auto expected = w.run({1, false, cpu_isa::scalar, 1u << 20}, 5, adamw);
    for (cpu_isa isa : available_isas())
      for (std::size_t threads : {1u, 2u, 3u, 8u})
        for (std::size_t chunk : {1u, 7u, 16u, 100u, 4096u}) {
          INFO(zenflow::cpu_isa_name(isa) << " threads " << threads << " chunk " << chunk);
          CHECK(same_bits(w.run({threads, false, isa, chunk}, 5, adamw), expected));
        }
  }
}

TEST_CASE("tensor splits and column masks do not change any bit") {
  std::mt19937 rng(11);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const zenflow::index_t rows = 33, cols = 10;
  std::vector<float> init(rows * cols), g(rows * cols);
  for (auto& x : init) x = noise(rng);
  for (auto& x : g) x = noise(rng);
  for (cpu_isa isa : available_isas()) {
    INFO(zenflow::cpu_isa_name(isa));
    // Whole tensor in one task.
    cpu_adam whole({}, {2, false, isa, 64});
    whole.add_tensor(init, rows, cols);
    const cpu_adam_task all{0, g.data(), dtype::f32, {}};
    // The same parameter as two tensors (columns 0-3 and 4-9), each stepped in its own call.
    cpu_adam split({}, {3, false, isa, 50});
    split.add_tensor({init.data(), 4 * rows}, rows, 4);
    split.add_tensor({init.data() + 4 * rows, 6 * rows}, rows, 6);
    // The same parameter with two complementary column lists in two steps of one call each,
    // once with the full-layout gradient and once compact.
    cpu_adam masked({}, {8, false, isa, 13});
    masked.add_tensor(init, rows, cols);
    const std::vector<std::int32_t> even{0, 2, 4, 6, 8}, odd{1, 3, 5, 7, 9};
    std::vector<float> g_odd;
    for (int c : odd) g_odd.insert(g_odd.end(), g.begin() + c * rows, g.begin() + (c + 1) * rows);
    for (int s = 0; s < 4; ++s) {
      whole.step({&all, 1});
      const cpu_adam_task a{0, g.data(), dtype::f32, {}}, b{1, g.data() + 4 * rows, dtype::f32, {}};
      split.step({&a, 1});
      split.set_step_count(split.step_count() - 1);  // both halves are one logical step
      split.step({&b, 1});
      const cpu_adam_task me{0, g.data(), dtype::f32, even}, mo{0, g_odd.data(), dtype::f32, odd, true};
      const auto before_odd = std::vector<float>(masked.params(0).begin(), masked.params(0).end());
      masked.step({&me, 1});
      // Odd columns were neither read nor written by the even step.
      for (int c : odd)
        for (int r = 0; r < rows; ++r) CHECK(masked.params(0)[c * rows + r] == before_odd[c * rows + r]);
      masked.set_step_count(masked.step_count() - 1);
      masked.step({&mo, 1});
    }
    std::vector<float> joined(split.params(0).begin(), split.params(0).end());
    joined.insert(joined.end(), split.params(1).begin(), split.params(1).end());
    CHECK(same_bits(joined, std::vector<float>(whole.params(0).begin(), whole.params(0).end())));
    CHECK(same_bits(std::vector<float>(masked.params(0).begin(), masked.params(0).end()),
                    std::vector<float>(whole.params(0).begin(), whole.params(0).end())));
    CHECK(same_bits(std::vector<float>(masked.exp_avg_sq(0).begin(), masked.exp_avg_sq(0).end()),
                    std::vector<float>(whole.exp_avg_sq(0).begin(), whole.exp_avg_sq(0).end())));
  }
}

TEST_CASE("copy-out and gradient conversions equal to_float / from_float exactly") {
  // lr = 0 and no decay leave every finite parameter unchanged, so the copy-out is the
  // conversion of arbitrary float bit patterns (subnormals, ties, overflow to infinity).
  std::mt19937 rng(5);
  std::vector<float> bits_as_float;
  for (std::uint32_t special : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0xff7fffffu,
                                0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x477fefffu, 0x477ff000u, 0x38800000u,
                                0x387fe000u, 0x33000000u, 0x33000001u, 0x32ffffffu, 0x3c7fe000u, 0x47800000u})
    bits_as_float.push_back(zenflow::detail::bits_to_float(special));
  while (bits_as_float.size() < 100003) {
    const std::uint32_t b = static_cast<std::uint32_t>(rng());
    if ((b & 0x7f800000u) != 0x7f800000u) bits_as_float.push_back(zenflow::detail::bits_to_float(b));
  }
  zenflow::adam_options o;
  o.lr = 0.0f;
  const std::vector<float> zero_grad(bits_as_float.size(), 0.0f);
  for (cpu_isa isa : available_isas()) {
    INFO(zenflow::cpu_isa_name(isa));
    cpu_adam opt(o, {2, false, isa, 1000});
    opt.add_tensor(bits_as_float, static_cast<zenflow::index_t>(bits_as_float.size()), 1);
    std::vector<bfloat16> ob(bits_as_float.size());
    std::vector<float16> oh(bits_as_float.size());
    cpu_adam_task t{0, zero_grad.data(), dtype::f32, {}, false, ob.data(), dtype::bf16};
    opt.step({&t, 1});
    t.copy_out = oh.data();
    t.copy_out_type = dtype::f16;
    opt.step({&t, 1});
    CHECK(same_bits(std::vector<float>(opt.params(0).begin(), opt.params(0).end()), bits_as_float));
    std::size_t bad_b = 0, bad_h = 0;
    for (std::size_t i = 0; i < bits_as_float.size(); ++i) {
      bad_b += ob[i].bits != zenflow::to_bfloat16(bits_as_float[i]).bits;
      bad_h += oh[i].bits != zenflow::to_float16(bits_as_float[i]).bits;
    }
    CHECK(bad_b == 0);
    CHECK(bad_h == 0);

    // Loads: every bf16 and fp16 bit pattern through accumulate (acc = fma(1, g, 0)).
    std::vector<bfloat16> all_b(65536);
    std::vector<float16> all_h(65536);
    for (std::uint32_t i = 0; i < 65536; ++i) all_b[i].bits = all_h[i].bits = static_cast<std::uint16_t>(i);
    for (dtype gt : {dtype::bf16, dtype::f16}) {
      std::vector<float> acc(65536, 0.0f);
      CHECK(!opt.accumulate(acc.data(), gt == dtype::bf16 ? static_cast<const void*>(all_b.data()) : all_h.data(), gt,
                            65536, 1.0f));  // contains NaN and infinity
      std::size_t bad = 0;
      for (std::uint32_t i = 0; i < 65536; ++i) {
        const float x = gt == dtype::bf16 ? zenflow::to_float(all_b[i]) : zenflow::to_float(all_h[i]);
        const float expect = std::fma(1.0f, x, 0.0f);
        bad += std::isnan(x) ? !std::isnan(acc[i]) : std::memcmp(&expect, &acc[i], 4) != 0;
      }
      CHECK(bad == 0);
    }
  }
}

#if ZENFLOW_CPU_ADAM_X86
namespace {
ZENFLOW_TARGET_AVX512 void bf16_512(const float* in, std::uint16_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), zenflow::detail::avx512::to_bf16(_mm512_loadu_ps(in)));
}
ZENFLOW_TARGET_AVX2 void bf16_256(const float* in, std::uint16_t* out) {
  zenflow::detail::avx2::store(reinterpret_cast<bfloat16*>(out), _mm256_loadu_ps(in));
  zenflow::detail::avx2::store(reinterpret_cast<bfloat16*>(out) + 8, _mm256_loadu_ps(in + 8));
}
}  // namespace
#endif

TEST_CASE("SIMD narrowing keeps NaN and infinity exactly as the scalar conversion") {
  const std::uint32_t specials[16] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu,
                                      0xff812345u, 0x7fffffffu, 0x7f7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x00008000u,
                                      0x80018000u, 0x3f7fffffu, 0x477ff000u, 0xc77fefffu};
  float in[16];
  for (int i = 0; i < 16; ++i) in[i] = zenflow::detail::bits_to_float(specials[i]);
  for (cpu_isa isa : available_isas()) {
    INFO(zenflow::cpu_isa_name(isa));
    std::uint16_t ob[16] = {};
#if ZENFLOW_CPU_ADAM_X86
    if (isa == cpu_isa::avx512) bf16_512(in, ob);
    if (isa == cpu_isa::avx2) bf16_256(in, ob);
#endif
    if (isa == cpu_isa::scalar) continue;
    for (int i = 0; i < 16; ++i) CHECK(ob[i] == zenflow::to_bfloat16(in[i]).bits);
  }
}

TEST_CASE("a non-finite gradient skips the step and leaves every bit of state unchanged") {
  for (cpu_isa isa : available_isas()) {
    INFO(zenflow::cpu_isa_name(isa));
    cpu_adam opt({}, {3, false, isa, 10});
    std::vector<float> init(40 * 4, 0.5f), g(40 * 4, 0.01f);
    opt.add_tensor(init, 40, 4);
    opt.add_tensor(init, 160, 1);
    const cpu_adam_task ok[2] = {{0, g.data(), dtype::f32, {}}, {1, g.data(), dtype::f32, {}}};
    REQUIRE(opt.step(ok).applied);
    const auto before = snapshot(opt);
    std::vector<bfloat16> out(160, bfloat16{0x1234});
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1e38f}) {
      auto gb = g;
      gb[150] = bad;
      const float scale = bad == -1e38f ? 10.0f : 1.0f;  // finite, but infinite once scaled
      cpu_adam_task t[2] = {{0, g.data(), dtype::f32, {}}, {1, gb.data(), dtype::f32, {}}};
      t[0].copy_out = out.data();
      const auto r = opt.step(t, scale);
      CHECK(!r.applied);
      CHECK(r.step == 1);
      CHECK(opt.step_count() == 1);
      CHECK(same_bits(snapshot(opt), before));
      CHECK(out[0].bits == 0x1234);
    }
    for (dtype gt : {dtype::bf16, dtype::f16}) {
      std::vector<std::uint16_t> g16(160, 0x3c00);
      g16[77] = gt == dtype::bf16 ? 0x7f80 : 0x7c00;  // +infinity
      const cpu_adam_task t{1, g16.data(), gt, {}};
      CHECK(!opt.step({&t, 1}).applied);
      CHECK(same_bits(snapshot(opt), before));
    }
    // A NaN in a column the mask leaves out is never read: the step applies.
    auto gm = g;
    gm[1 * 40 + 3] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<std::int32_t> cols{0, 2, 3};
    const cpu_adam_task t{0, gm.data(), dtype::f32, cols};
    CHECK(opt.step({&t, 1}).applied);
    CHECK(opt.step_count() == 2);
    // check_finite = false applies whatever it is given.
    const cpu_adam_task n{0, gm.data(), dtype::f32, {}};
    CHECK(opt.step({&n, 1}, 1.0f, false).applied);
    CHECK(std::isnan(opt.params(0)[43]));
  }
}

TEST_CASE("bad input throws naming the argument and changes nothing") {
  cpu_adam opt({}, {2});
  std::vector<float> init(8 * 3, 1.0f), g(8 * 3, 0.1f);
  opt.add_tensor(init, 8, 3);
  opt.add_tensor(init, 24, 1);
  const cpu_adam_task ok{0, g.data(), dtype::f32, {}};
  opt.step({&ok, 1});
  const auto before = snapshot(opt);
  auto expect_error = [&](auto&& call, const std::string& argument) {
    try {
      call();
      FAIL("no exception for " << argument);
    } catch (const zenflow::error& e) {
      CHECK(e.argument() == argument);
    }
    CHECK(same_bits(snapshot(opt), before));
    CHECK(opt.step_count() == 1);
  };
  auto step1 = [&](cpu_adam_task t, float scale = 1.0f) { return [&opt, t, scale] { opt.step({&t, 1}, scale); }; };
  const std::vector<std::int32_t> out_of_range{0, 3}, descending{2, 1}, negative{-1}, duplicate{1, 1};
  std::vector<std::uint16_t> g16(32);
  std::vector<float> big(64);
  expect_error(step1({5, g.data(), dtype::f32, {}}), "tasks[0].tensor");
  expect_error(step1({0, nullptr, dtype::f32, {}}), "tasks[0].grad");
  expect_error(step1({0, g.data(), static_cast<dtype>(9), {}}), "tasks[0].grad_type");
  expect_error(step1({0, g.data(), dtype::f32, out_of_range}), "tasks[0].columns");
  expect_error(step1({0, g.data(), dtype::f32, descending}), "tasks[0].columns");
  expect_error(step1({0, g.data(), dtype::f32, negative}), "tasks[0].columns");
  expect_error(step1({0, g.data(), dtype::f32, duplicate}), "tasks[0].columns");
  expect_error(step1({0, reinterpret_cast<const char*>(g16.data()) + 1, dtype::bf16, {}}), "tasks[0].grad");
  expect_error(step1({0, g.data(), dtype::f32, {}, false, big.data(), static_cast<dtype>(7)}),
               "tasks[0].copy_out_type");
  expect_error(step1({0, g.data(), dtype::f32, {}, false, reinterpret_cast<char*>(big.data()) + 1, dtype::f32}),
               "tasks[0].copy_out");
  expect_error(step1({0, g.data(), dtype::f32, {}, false, opt.exp_avg(1).data() + 3, dtype::bf16}),
               "tasks[0].copy_out");
  expect_error(step1({0, g.data(), dtype::f32, {}, false, g.data() + 5, dtype::bf16}), "tasks[0].copy_out");
  expect_error(step1({0, opt.params(1).data(), dtype::f32, {}}), "tasks[0].grad");
  expect_error(step1(ok, std::numeric_limits<float>::quiet_NaN()), "grad_scale");
  expect_error(step1(ok, -1.0f), "grad_scale");
  {
    const cpu_adam_task two[2] = {ok, ok};
    expect_error([&] { opt.step(two); }, "tasks[1].tensor");
    cpu_adam_task outs[2] = {{0, g.data(), dtype::f32, {}, false, big.data(), dtype::f32},
                             {1, g.data(), dtype::f32, {}, false, big.data() + 20, dtype::f32}};
    expect_error([&] { opt.step(outs); }, "tasks[1].copy_out");
  }
  std::vector<float> acc(24);
  expect_error([&] { opt.accumulate(nullptr, g.data(), dtype::f32, 24); }, "acc");
  expect_error([&] { opt.accumulate(acc.data(), nullptr, dtype::f32, 24); }, "grad");
  expect_error([&] { opt.accumulate(acc.data(), g.data(), static_cast<dtype>(3), 24); }, "grad_type");
  expect_error([&] { opt.accumulate(acc.data(), g.data(), dtype::f32, -1); }, "n");
  expect_error([&] { opt.accumulate(acc.data(), acc.data() + 4, dtype::f32, 8); }, "grad");
  expect_error([&] { opt.accumulate(acc.data(), g.data(), dtype::f32, 8, INFINITY); }, "scale");
  expect_error([&] { opt.add_tensor(init, 5, 5); }, "initial_params");
  expect_error([&] { opt.add_tensor(init, 0, 24); }, "rows");
  expect_error([&] { opt.set_step_count(-1); }, "step");
  zenflow::adam_options bad;
  bad.lr = -1.0f;
  expect_error([&] { opt.set_options(bad); }, "lr");
  bad = {};
  bad.beta2 = 1.0f;
  expect_error([&] { opt.set_options(bad); }, "beta2");
  bad = {};
  bad.eps = 0.0f;
  expect_error([&] { opt.set_options(bad); }, "eps");
  CHECK(opt.tensor_count() == 2);
  CHECK(opt.options().lr == zenflow::adam_options{}.lr);
  CHECK_THROWS_AS(cpu_adam({}, {1, false, cpu_isa::automatic, 0}), zenflow::error);
  CHECK_THROWS_AS(cpu_adam(bad, {}), zenflow::error);
  CHECK_THROWS_AS((void)opt.params(2), zenflow::error);
}

TEST_CASE("accumulate is fma(scale, g, acc), bit-identical across ISAs and threads, and reports non-finite") {
  std::mt19937 rng(9);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const std::size_t n = 1237;
  std::vector<float> g(n), acc0(n);
  for (auto& x : g) x = noise(rng);
  for (auto& x : acc0) x = noise(rng);
  const auto gb = convert<bfloat16>(g);
  const auto gh = convert<float16>(g);
  for (dtype gt : {dtype::f32, dtype::bf16, dtype::f16}) {
    const void* gp = gt == dtype::f32    ? static_cast<const void*>(g.data())
                     : gt == dtype::bf16 ? static_cast<const void*>(gb.data())
                                         : gh.data();
    std::vector<float> expected = acc0;
    for (std::size_t i = 0; i < n; ++i) {
      const float gi = gt == dtype::f32    ? g[i]
                       : gt == dtype::bf16 ? zenflow::to_float(gb[i])
                                           : zenflow::to_float(gh[i]);
      expected[i] = std::fma(0.125f, gi, expected[i]);
    }
    for (cpu_isa isa : available_isas())
      for (std::size_t threads : {1u, 2u, 3u, 8u})
        for (std::size_t chunk : {1u, 9u, 256u}) {
          cpu_adam opt({}, {threads, false, isa, chunk});
          auto acc = acc0;
          CHECK(opt.accumulate(acc.data(), gp, gt, static_cast<zenflow::index_t>(n), 0.125f));
          CHECK(same_bits(acc, expected));
        }
  }
  cpu_adam opt({}, {2});
  auto acc = acc0;
  auto gn = g;
  gn[1000] = std::numeric_limits<float>::infinity();
  CHECK(!opt.accumulate(acc.data(), gn.data(), dtype::f32, static_cast<zenflow::index_t>(n)));
  CHECK(opt.accumulate(acc.data(), gn.data(), dtype::f32, static_cast<zenflow::index_t>(n), 1.0f, false));
  CHECK(!opt.all_finite(gn.data(), dtype::f32, static_cast<zenflow::index_t>(n)));
  CHECK(opt.all_finite(g.data(), dtype::f32, static_cast<zenflow::index_t>(n)));
  CHECK(!opt.all_finite(g.data(), dtype::f32, static_cast<zenflow::index_t>(n), 1e38f));  // overflows once scaled
}

TEST_CASE("an overwriting accumulate equals accumulating into zeros and never reads the accumulator") {
  // The coordinator's first accumulated step of an interval overwrites instead of zeroing first:
  // the same bits, -0 products included (fma(s, g, +0) is +0 there), whatever the accumulator held.
  std::mt19937 rng(11);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const std::size_t n = 1237;
  std::vector<float> g(n);
  for (auto& x : g) x = noise(rng);
  g[3] = -0.0f;
  g[4] = -std::numeric_limits<float>::denorm_min();  // scaled by 0.125: -0
  g[5] = std::numeric_limits<float>::infinity();
  const auto gb = convert<bfloat16>(g);
  for (dtype gt : {dtype::f32, dtype::bf16}) {
    const void* gp = gt == dtype::f32 ? static_cast<const void*>(g.data()) : gb.data();
    std::vector<float> expected(n, 0.0f);
    zenflow::detail::cpu_accumulate_kernel(cpu_isa::scalar, expected.data(), gp, gt, n, 0.125f);
    const std::vector<float> garbage(n, std::numeric_limits<float>::quiet_NaN());
    for (cpu_isa isa : available_isas()) {
      auto acc = garbage;
      CHECK(zenflow::detail::cpu_accumulate_kernel(isa, acc.data(), gp, gt, n, 0.125f, /*overwrite=*/true));
      CHECK(same_bits(acc, expected));
    }
    for (std::size_t threads : {1u, 3u})
      for (std::size_t chunk : {7u, 64u, 4096u}) {
        zenflow::thread_pool pool(threads);
        auto acc = garbage;
        CHECK(zenflow::detail::parallel_accumulate(pool, cpu_isa::automatic, chunk, acc.data(), gp, gt, n, 0.125f,
                                                   /*overwrite=*/true));  // g[5] is infinite
        CHECK(same_bits(acc, expected));
        auto twice = expected;  // then adding: fma(s, g, acc) per element, as cpu_adam::accumulate
        (void)zenflow::detail::parallel_accumulate(pool, cpu_isa::automatic, chunk, acc.data(), gp, gt, n, 0.125f,
                                                   /*overwrite=*/false);
        zenflow::detail::cpu_accumulate_kernel(cpu_isa::scalar, twice.data(), gp, gt, n, 0.125f);
        CHECK(same_bits(acc, twice));
      }
  }
}

TEST_CASE("the step counter is 64-bit and drives the bias correction") {
  cpu_adam a({}, {1}), b({}, {1});
  std::vector<float> init(16, 1.0f), g(16, 0.5f);
  a.add_tensor(init, 16, 1);
  b.add_tensor(init, 16, 1);
  a.set_step_count(std::int64_t{1} << 40);
  const cpu_adam_task t{0, g.data(), dtype::f32, {}};
  CHECK(a.step({&t, 1}).step == (std::int64_t{1} << 40) + 1);
  b.step({&t, 1});
  // Late in training the bias corrections are 1: the first update of b (t = 1, bias-corrected)
  // moves by lr; a's (corrected ~1) moves by (1 - beta1) * lr * g / (sqrt(1 - beta2) * |g|).
  CHECK(b.params(0)[0] == doctest::Approx(1.0f - 1e-3f).epsilon(1e-5));
  CHECK(a.params(0)[0] == doctest::Approx(1.0f - 1e-3f * 0.1f / std::sqrt(0.001f)).epsilon(1e-4));
  CHECK(a.isa() != cpu_isa::automatic);
  CHECK(zenflow::cpu_isa_name(zenflow::detect_cpu_isa()) != "unknown");
}

TEST_CASE("a task's own hyper-parameters (parameter groups) equal an optimizer with those options") {
  zenflow::adam_options base;
  base.lr = 0.01f;
  base.weight_decay = 0.1f;
  zenflow::adam_options group = base;
  group.lr = 0.03f;
  group.weight_decay = 0.0f;
  const zenflow::index_t rows = 5, cols = 7;
  std::vector<float> init(rows * cols), grad(rows * cols);
  for (std::size_t i = 0; i < init.size(); ++i) {
    init[i] = 0.05f * static_cast<float>(i % 11) - 0.2f;
    grad[i] = 0.3f * static_cast<float>(i % 5) - 0.6f;
  }
  zenflow::cpu_adam mixed(base), alone(group), plain(base);
  mixed.add_tensor(init, rows, cols);
  mixed.add_tensor(init, rows, cols);
  alone.add_tensor(init, rows, cols);
  plain.add_tensor(init, rows, cols);
  for (int s = 0; s < 4; ++s) {
    zenflow::cpu_adam_task t{};
    t.grad = grad.data();
    t.grad_type = zenflow::dtype::f32;
    zenflow::cpu_adam_task own = t;
    own.tensor = 1;
    own.options = &group;
    const zenflow::cpu_adam_task both[] = {t, own};
    REQUIRE(mixed.step(both).applied);
    REQUIRE(alone.step(std::span(&t, 1)).applied);
    REQUIRE(plain.step(std::span(&t, 1)).applied);
  }
  auto same = [](std::span<const float> a, std::span<const float> b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  };
  CHECK(same(mixed.params(1), alone.params(0)));  // the task's options, bit for bit
  CHECK(same(mixed.params(0), plain.params(0)));  // the optimizer's for the others
  CHECK_FALSE(same(mixed.params(0), mixed.params(1)));
  zenflow::adam_options bad = base;
  bad.lr = -1.0f;
  zenflow::cpu_adam_task t{};
  t.grad = grad.data();
  t.options = &bad;
  const auto before = std::vector<float>(mixed.params(0).begin(), mixed.params(0).end());
  CHECK_THROWS_WITH_AS(mixed.step(std::span(&t, 1)), doctest::Contains("lr"), zenflow::error);
  CHECK(same(mixed.params(0), before));
}

TEST_CASE("a task's own step and gradient scale equal an optimizer at that step with that scale") {
  // The coordinator counts CPU steps per parameter and averages each over its own count: a task
  // with step t and grad_scale s must equal a separate optimizer at step t - 1 stepped with s.
  const zenflow::index_t rows = 16, cols = 3;
  std::vector<float> init(rows * cols), g(rows * cols);
  for (std::size_t i = 0; i < init.size(); ++i) {
    init[i] = 0.01f * static_cast<float>(i % 11) - 0.05f;
    g[i] = 0.3f * static_cast<float>(i % 7) - 0.9f;
  }
  zenflow::adam_options o;
  o.lr = 0.01f;
  o.weight_decay = 0.02f;
  cpu_adam per_task(o, {1});
  per_task.add_tensor(init, rows, cols);
  per_task.add_tensor(init, rows, cols);
  cpu_adam reference(o, {1});
  reference.add_tensor(init, rows, cols);
  reference.set_step_count(4);
  cpu_adam_task a{0, g.data(), dtype::f32, {}};
  a.step = 5;
  a.grad_scale = 0.25f;
  cpu_adam_task b{1, g.data(), dtype::f32, {}};  // the optimizer's own step (1) and scale
  const cpu_adam_task both[2] = {a, b};
  CHECK(per_task.step(both, 2.0f).applied);
  CHECK(per_task.step_count() == 1);  // its own count advances by one either way
  const cpu_adam_task r{0, g.data(), dtype::f32, {}};
  reference.step({&r, 1}, 0.5f);
  CHECK(same_bits(std::vector<float>(per_task.params(0).begin(), per_task.params(0).end()),
                  std::vector<float>(reference.params(0).begin(), reference.params(0).end())));
  cpu_adam first(o, {1});
  first.add_tensor(init, rows, cols);
  first.step({&r, 1}, 2.0f);
  CHECK(same_bits(std::vector<float>(per_task.params(1).begin(), per_task.params(1).end()),
                  std::vector<float>(first.params(0).begin(), first.params(0).end())));
  cpu_adam_task bad = a;
  bad.step = -1;
  CHECK_THROWS_AS(per_task.step({&bad, 1}), zenflow::error);
  bad = a;
  bad.grad_scale = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(per_task.step({&bad, 1}), zenflow::error);
  CHECK(per_task.step_count() == 1);
}

}  // namespace ZENFLOW_TEST_FILE_ID
