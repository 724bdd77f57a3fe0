// The compact CPU states (bf16 moments, blockwise 8-bit moments): bit-identity across ISAs /
// threads / chunks, the math against the scalar definitions, the rounding that does not freeze an
// average, the codes and their error bounds, bounded updates, non-finite gradients,
// export/import, save/load, bytes held, and fidelity on small training problems.
#include <zenflow/concepts.hpp>
#include <zenflow/cpu_adam.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::bfloat16;
using zenflow::cpu_adam;
using zenflow::cpu_adam_config;
using zenflow::cpu_adam_task;
using zenflow::cpu_isa;
using zenflow::cpu_state_format;
using zenflow::dtype;
using zenflow::float16;
using zenflow::index_t;
namespace zd = zenflow::detail;

static_assert(zenflow::host_optimizer<cpu_adam>);

namespace {

constexpr cpu_state_format bf16m = cpu_state_format::bf16_moments;
constexpr cpu_state_format q8m = cpu_state_format::blockwise8_moments;

std::vector<cpu_isa> available_isas() {
  std::vector<cpu_isa> out;
  for (cpu_isa i : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512})
    if (zenflow::cpu_isa_supported(i)) out.push_back(i);
  return out;
}

cpu_adam_config config(cpu_state_format f, std::size_t threads = 2, cpu_isa isa = cpu_isa::automatic,
                       std::size_t chunk = std::size_t{1} << 15, std::uint64_t seed = 0x7a656e666c6f77ull) {
  cpu_adam_config c{threads, false, isa, chunk};
  c.cpu_state = f;
  c.seed = seed;
  return c;
}

std::vector<std::byte> saved(const cpu_adam& opt) {
  std::vector<std::byte> out;
  for (std::size_t t = 0; t < opt.tensor_count(); ++t) {
    std::vector<std::byte> s(opt.saved_state_size(t));
    opt.save_state(t, s);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

struct exported {
  std::vector<float> p, m, v;
};
exported export_all(const cpu_adam& opt, std::size_t t) {
  std::vector<std::int32_t> cols(static_cast<std::size_t>(opt.cols(t)));
  std::iota(cols.begin(), cols.end(), 0);
  const std::size_t n = cols.size() * static_cast<std::size_t>(opt.rows(t));
  exported e{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  opt.export_columns(t, cols, e.p, e.m, e.v);
  return e;
}

template <class T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = zenflow::from_float<T>(x[i]);
  return out;
}

// Four tensors (rows not multiples of 16 or 256: blocks end mid-vector and columns end mid-block),
// gradients in f32 / bf16 / f16, a column list with a compact gradient, copy-outs, a task with its
// own options and step. Returns every state byte and every copy-out byte after `steps` steps.
struct workload {
  struct shape {
    index_t rows, cols;
  };
  std::vector<shape> shapes{{300, 5}, {19, 7}, {777, 1}, {513, 3}};
  std::vector<std::vector<float>> init, grads;
  workload() {
    std::mt19937 rng(3);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    for (auto s : shapes) {
      const auto n = static_cast<std::size_t>(s.rows * s.cols);
      init.emplace_back(n);
      grads.emplace_back(n);
      for (auto& x : init.back()) x = noise(rng);
      for (std::size_t i = 0; i < n; ++i)  // magnitudes over many binades, a few exact zeros
        grads.back()[i] =
            i % 37 == 5 ? 0.0f : noise(rng) * std::exp2(static_cast<float>(static_cast<int>(i % 23) - 11));
    }
  }
  std::vector<std::byte> run(const cpu_adam_config& cfg, int steps) const {
    zenflow::adam_options o;
    o.weight_decay = 0.01f;
    cpu_adam opt(o, cfg);
    for (std::size_t t = 0; t < shapes.size(); ++t) opt.add_tensor(init[t], shapes[t].rows, shapes[t].cols);
    const auto gb = convert<bfloat16>(grads[1]);
    const auto gh = convert<float16>(grads[2]);
    const std::vector<std::int32_t> cols3{0, 2};
    std::vector<float> g3;
    for (int c : cols3) g3.insert(g3.end(), grads[3].begin() + c * 513, grads[3].begin() + (c + 1) * 513);
    std::vector<bfloat16> out0(grads[0].size());
    std::vector<float16> out2(grads[2].size());
    std::vector<float> out3(g3.size());
    zenflow::adam_options group = o;
    group.lr = 3e-3f;
    group.weight_decay = 0.0f;
    std::vector<std::byte> result;
    for (int s = 0; s < steps; ++s) {
      cpu_adam_task t[4] = {{0, grads[0].data(), dtype::f32, {}},
                            {1, gb.data(), dtype::bf16, {}},
                            {2, gh.data(), dtype::f16, {}},
                            {3, g3.data(), dtype::f32, cols3, true}};
      t[0].copy_out = out0.data();
      t[1].options = &group;
      t[1].step = 2 * s + 1;
      t[2].copy_out = out2.data();
      t[2].copy_out_type = dtype::f16;
      t[2].grad_scale = 0.5f;
      t[3].copy_out = out3.data();
      t[3].copy_out_type = dtype::f32;
      t[3].out_compact = true;
      REQUIRE(opt.step(t, 0.75f).applied);
    }
    result = saved(opt);
    const auto append = [&](const void* p, std::size_t bytes) {
      const auto* b = static_cast<const std::byte*>(p);
      result.insert(result.end(), b, b + bytes);
    };
    append(out0.data(), out0.size() * 2);
    append(out2.data(), out2.size() * 2);
    append(out3.data(), out3.size() * 4);
    return result;
  }
};

}  // namespace

TEST_CASE("compact states are bit-identical across ISAs, thread counts and chunk sizes") {
  const workload w;
  for (cpu_state_format f : {bf16m, q8m}) {
    const auto expected = w.run(config(f, 1, cpu_isa::scalar, 1u << 20), 4);
    for (cpu_isa isa : available_isas())
      for (std::size_t threads : {1u, 2u, 3u, 8u})
        for (std::size_t chunk : {1u, 7u, 16u, 100u, 300u, 4096u}) {
          INFO(zenflow::cpu_state_format_name(f)
               << " " << zenflow::cpu_isa_name(isa) << " threads " << threads << " chunk " << chunk);
          CHECK(w.run(config(f, threads, isa, chunk), 4) == expected);
        }
  }
}

TEST_CASE("a step is the fp32 math on the decoded moments, then a rounding of the new ones") {
  // The parameters follow adam_update (bf16) / adam_update_bounded (8-bit) on the decoded moments
  // exactly; the stored moments are the new ones rounded to a neighbouring code.
  std::mt19937 rng(8);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const index_t rows = 300, cols = 3;
  const std::size_t n = rows * cols;
  std::vector<float> init(n), g(n);
  for (auto& x : init) x = noise(rng);
  zenflow::adam_options o;
  o.weight_decay = 0.1f;
  for (cpu_state_format f : {bf16m, q8m})
    for (cpu_isa isa : available_isas()) {
      INFO(zenflow::cpu_state_format_name(f) << " " << zenflow::cpu_isa_name(isa));
      cpu_adam opt(o, config(f, 2, isa, 64));
      opt.add_tensor(init, rows, cols);
      for (int s = 1; s <= 6; ++s) {
        for (auto& x : g) x = noise(rng) * 0.1f;
        const exported before = export_all(opt, 0);
        const cpu_adam_task t{0, g.data(), dtype::f32, {}};
        REQUIRE(opt.step({&t, 1}).applied);
        const exported after = export_all(opt, 0);
        const auto c = zenflow::make_adam_step_constants(o, s);
        const float bound = f == q8m ? zd::adam_quotient_bound(o, s) : std::numeric_limits<float>::infinity();
        std::size_t bad_p = 0, bad_m = 0;
        for (std::size_t i = 0; i < n; ++i) {
          float p = before.p[i], m = before.m[i], v = before.v[i];
          zd::adam_update_bounded(p, g[i], m, v, c, bound);
          bad_p += zd::float_to_bits(p) != zd::float_to_bits(after.p[i]);
          // One code step either way: a bf16 ulp (2^-7 relative); 8-bit: (|x| + 2^-B * scale) / 8.
          const float tol_m = f == bf16m ? std::fabs(m) * 0x1p-7f : std::fabs(m) / 8.0f + 1e-5f;
          const float tol_v = f == bf16m ? v * 0x1p-7f : v / 8.0f + 1e-12f;
          bad_m += std::fabs(after.m[i] - m) > tol_m || std::fabs(after.v[i] - v) > tol_v;
        }
        CHECK(bad_p == 0);
        CHECK(bad_m == 0);
      }
    }
}

TEST_CASE("adam_update_bounded without a bound is adam_update bit for bit") {
  std::mt19937 rng(2);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const auto c = zenflow::make_adam_step_constants({}, 7, 0.3f);
  for (int i = 0; i < 10000; ++i) {
    float p = noise(rng), m = noise(rng), v = std::fabs(noise(rng));
    float p2 = p, m2 = m, v2 = v;
    const float g = noise(rng);
    zenflow::adam_update(p, g, m, v, c);
    zd::adam_update_bounded(p2, g, m2, v2, c, std::numeric_limits<float>::infinity());
    REQUIRE(zd::float_to_bits(p) == zd::float_to_bits(p2));
  }
}

TEST_CASE("an average stored in a compact state decays as in fp32 (round to nearest freezes it)") {
  // beta2 = 0.999: v * beta2 is within half a bf16 ulp (and half an 8-bit code step) of v, so a v
  // rounded to nearest every step never decays. After one gradient of 1 and 3000 zero gradients
  // fp32 has v = 0.001 * 0.999^3000 ~ 5.0e-5; stochastic rounding keeps the mean there.
  const std::size_t n = 2048;
  for (cpu_state_format f : {bf16m, q8m}) {
    INFO(zenflow::cpu_state_format_name(f));
    zenflow::adam_options o;
    cpu_adam opt(o, config(f));
    cpu_adam ref(o, config(cpu_state_format::fp32));
    // Tensor 0: every element decays. Tensor 1 (8-bit): element 0 of every block keeps getting a
    // gradient of 4, so the block's scale stays and only the stochastic rounding of the other
    // elements can make them decay.
    const std::vector<float> init(n, 0.0f);
    for (auto* x : {&opt, &ref}) x->add_tensor(init, 256, 8), x->add_tensor(init, 256, 8);
    std::vector<float> one(n, 1.0f), zero(n, 0.0f), keep(n, 0.0f);
    for (std::size_t i = 0; i < n; i += 256) keep[i] = 4.0f;
    for (int s = 0; s < 3001; ++s) {
      const cpu_adam_task t[2] = {{0, s == 0 ? one.data() : zero.data(), dtype::f32, {}},
                                  {1, s == 0 ? one.data() : keep.data(), dtype::f32, {}}};
      opt.step(t);
      ref.step(t);
    }
    for (std::size_t t = 0; t < 2; ++t) {
      const exported e = export_all(opt, t);
      double sum = 0, sum_ref = 0;
      for (std::size_t i = 0; i < n; ++i)
        if (i % 256 != 0) sum += e.v[i], sum_ref += ref.exp_avg_sq(t)[i];
      INFO("tensor " << t << ": mean v " << sum / (n - 8) << ", fp32 " << sum_ref / (n - 8));
      CHECK(sum == doctest::Approx(sum_ref).epsilon(0.03));
    }
  }
}

TEST_CASE("over 2000 steps the compact moments stay within a bound derived from their rounding of fp32's") {
  // With decoupled weight decay 0 the moments do not depend on the parameters, so the compact
  // optimizer and an fp32 one fed the same gradients compute the same linear recursions, and the
  // difference e = m_compact - m_fp32 obeys e_t = beta e_(t-1) + r_t + d_t: r_t is the rounding
  // of step t (to one of the two codes around the value, |r_t| < one code step s_t), d_t the two
  // fp32 roundings of the update (|d_t| <= 2^-24 (|x_compact| + |x_fp32|)). Unbiased rounding with
  // fresh random bits makes r_t zero-mean given the past with variance <= s_t^2 / 4, so e_t has
  // variance <= V_t = beta^2 V_(t-1) + s_t^2 / 4, around a deterministic part bounded by
  // D_t = beta D_(t-1) + 2^-24 (|m_compact| + |m_fp32|) (2x slack). The code step is bounded from
  // the stored value y: bf16 2^-7 |y|; 8-bit (|y| + 2^-B d) / 8 with the block's scale d <=
  // (largest |y| in the block) / 1.74 (the largest element encodes to one of the two top codes).
  // Checked per element: |e| <= D + 6 sqrt(V); over the 4096 elements: mean((|e| - D)^2 / V) <= 1
  // and |mean(e / sqrt(V))| <= 0.1 (a biased rounding fails these). Gradients: a per-element mean
  // plus noise, magnitudes over 5 binades in every 8-bit block.
  const index_t rows = 512, cols = 8;
  const std::size_t n = rows * cols, block = zenflow::q8_block_rows;
  std::vector<float> mu(n), amp(n), g(n);
  std::mt19937 rng(21);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) amp[i] = std::exp2(-0.5f * static_cast<float>(i % 11)), mu[i] = noise(rng);
  zenflow::adam_options o;
  o.lr = 1e-3f;
  for (cpu_state_format f : {bf16m, q8m}) {
    INFO(zenflow::cpu_state_format_name(f));
    cpu_adam opt(o, config(f)), ref(o, config(cpu_state_format::fp32));
    const std::vector<float> init(n, 0.0f);
    opt.add_tensor(init, rows, cols);
    ref.add_tensor(init, rows, cols);
    std::vector<double> vm(n, 0.0), vv(n, 0.0), dm(n, 0.0), dv(n, 0.0);
    const double b1 = o.beta1, b2 = o.beta2;
    for (int s = 0; s < 2000; ++s) {
      for (std::size_t i = 0; i < n; ++i) g[i] = amp[i] * (mu[i] + noise(rng));
      const cpu_adam_task t{0, g.data(), dtype::f32, {}};
      REQUIRE(opt.step({&t, 1}).applied);
      REQUIRE(ref.step({&t, 1}).applied);
      const exported e = export_all(opt, 0);
      const auto rm = ref.exp_avg(0), rv = ref.exp_avg_sq(0);
      for (std::size_t b0 = 0; b0 < n; b0 += block) {
        double am = 0, av = 0;  // the block's largest stored |m| and v
        for (std::size_t i = b0; i < b0 + block; ++i)
          am = std::max(am, std::fabs(double(e.m[i]))), av = std::max(av, double(e.v[i]));
        for (std::size_t i = b0; i < b0 + block; ++i) {
          const double ym = std::fabs(double(e.m[i])), yv = e.v[i];
          const double sm = f == bf16m ? ym * 0x1p-7 : (ym + 0x1p-15 * am / 1.74) / 8;
          const double sv = f == bf16m ? yv * 0x1p-7 : (yv + 0x1p-31 * av / 1.74) / 8;
          vm[i] = b1 * b1 * vm[i] + sm * sm / 4;
          vv[i] = b2 * b2 * vv[i] + sv * sv / 4;
          dm[i] = b1 * dm[i] + 0x1p-23 * (ym + std::fabs(rm[i]));
          dv[i] = b2 * dv[i] + 0x1p-23 * (yv + rv[i]);
        }
      }
      if (s % 100 != 99) continue;
      double zm2 = 0, zv2 = 0, zm = 0, zv = 0;
      std::size_t beyond = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double em = double(e.m[i]) - rm[i], ev = double(e.v[i]) - rv[i];
        beyond += std::fabs(em) > dm[i] + 6 * std::sqrt(vm[i]) || std::fabs(ev) > dv[i] + 6 * std::sqrt(vv[i]);
        const double xm = std::max(std::fabs(em) - dm[i], 0.0), xv = std::max(std::fabs(ev) - dv[i], 0.0);
        zm2 += xm * xm / vm[i], zv2 += xv * xv / vv[i];
        zm += em / std::sqrt(vm[i]), zv += ev / std::sqrt(vv[i]);
      }
      INFO("step " << s + 1 << ": mean z^2 m " << zm2 / n << " v " << zv2 / n << ", mean z m " << zm / n << " v "
                   << zv / n);
      CHECK(beyond == 0);
      CHECK(zm2 / n <= 1.0);
      CHECK(zv2 / n <= 1.0);
      CHECK(std::fabs(zm / n) <= 0.1);
      CHECK(std::fabs(zv / n) <= 0.1);
      if (s == 1999)
        MESSAGE(zenflow::cpu_state_format_name(f) << " after 2000 steps: mean (e/bound)^2 m " << zm2 / n << ", v "
                                                  << zv2 / n << "; mean e/bound m " << zm / n << ", v " << zv / n);
    }
  }
}

TEST_CASE("8-bit codes: exact zero, monotone, a round trip per code, error bounds") {
  // At scale 1 every code decodes to a value that encodes (to nearest) back to it; -0 (0x80) is 0.
  float prev_m = -1, prev_v = -1;
  for (std::uint32_t c = 0; c < 256; ++c) {
    const float v = zd::q8_decode_v(static_cast<std::uint8_t>(c), 1.0f, -zd::q8_v_offset);
    CHECK(v > prev_v);
    prev_v = v;
    CHECK(zd::q8_encode_v(v, 1.0f, 0, true) == c);
    if (c < 128) {
      const float m = zd::q8_decode_m(static_cast<std::uint8_t>(c), 1.0f, -zd::q8_m_offset);
      CHECK(m > prev_m);
      prev_m = m;
      CHECK(zd::q8_encode_m(m, 1.0f, 0, true) == c);
      CHECK(zd::q8_decode_m(static_cast<std::uint8_t>(c | 0x80), 1.0f, -zd::q8_m_offset) == -m);
      if (c > 0) CHECK(zd::q8_encode_m(-m, 1.0f, 0, true) == (c | 0x80));
    }
  }
  CHECK(zd::q8_decode_v(0, 1.0f, -zd::q8_v_offset) == 0.0f);
  CHECK(zd::q8_decode_m(0, 1.0f, -zd::q8_m_offset) == 0.0f);
  CHECK(zd::q8_decode_v(255, 1.0f, -zd::q8_v_offset) == zd::q8_v_max);
  CHECK(zd::q8_decode_m(127, 1.0f, -zd::q8_m_offset) == zd::q8_m_max);
  // A code step is at most (x + 2^-B) / 8 (B = 15 for m, 31 for v, at scale 1): to nearest is
  // within half of it, stochastic rounding within one.
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> e(-40.0f, 0.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::exp2(e(rng)) * zd::q8_v_max;
    const std::uint32_t r = static_cast<std::uint32_t>(rng()) & 0xfffffu;
    const float vn = zd::q8_decode_v(zd::q8_encode_v(x, 1.0f, 0, true), 1.0f, -zd::q8_v_offset);
    const float vs = zd::q8_decode_v(zd::q8_encode_v(x, 1.0f, r), 1.0f, -zd::q8_v_offset);
    // (below half the smallest step a positive v rounds up to that step instead of to 0)
    REQUIRE(std::fabs(vn - x) <= std::max((x + 0x1p-31f) / 16.0f * 1.0001f, 0x1p-34f - x));
    REQUIRE(std::fabs(vs - x) <= std::max((x + 0x1p-31f) / 8.0f * 1.0001f, 0x1p-34f - x));
    REQUIRE(vn > 0.0f);  // a positive v never encodes to 0
    REQUIRE(vs > 0.0f);
    const float xm = x > zd::q8_m_max ? zd::q8_m_max : x;
    const float mn = zd::q8_decode_m(zd::q8_encode_m(-xm, 1.0f, 0, true), 1.0f, -zd::q8_m_offset);
    REQUIRE(std::fabs(mn + xm) <= (xm + 0x1p-15f) / 16.0f * 1.0001f);
  }
}

TEST_CASE("stochastic rounding is unbiased: bf16 and 8-bit codes average to the value") {
  std::mt19937 rng(6);
  for (float x : {1.0f + 0x1p-10f, 0.3f, 7.77e-5f, 1e-30f}) {
    double sum16 = 0, sum8 = 0;
    const int draws = 1 << 16;
    for (int i = 0; i < draws; ++i) {
      const std::uint32_t h = zd::sr_bits(static_cast<std::uint32_t>(i), 0x12345u);
      const float b = zenflow::to_float(zd::to_bfloat16_sr(x, h & 0xffffu));
      const float lo = zenflow::to_float(bfloat16{static_cast<std::uint16_t>(zd::float_to_bits(x) >> 16)});
      REQUIRE((b == lo || b > x));  // rounds to one of the two neighbours
      sum16 += b;
      const float inv = zd::q8_v_max / 1.875f;  // block scale 1.875 / 1.875
      sum8 += zd::q8_decode_v(zd::q8_encode_v(x, inv, zd::q8_random_v(h)), 1.0f, -zd::q8_v_offset);
    }
    CHECK(sum16 / draws == doctest::Approx(x).epsilon(1e-4));
    if (x > 1e-20f) CHECK(sum8 / draws == doctest::Approx(x).epsilon(2e-3));  // below: rounded up, never 0
  }
}

TEST_CASE("a v tiny beside its block's largest never decodes to 0, so its update stays an Adam update") {
  // One block: element 0 has m = 0.01, v = 0.001; element 1 has m 2^-18 and v 2^-36 of those (a
  // state Adam reaches: m^2 <= 52.9 v), so v is below half the smallest nonzero 8-bit step and m
  // is about two steps. Without the positive-v rule v would decode to 0 and the update would be
  // m / eps (clamped to the bound, 25x fp32's); with it the update stays within [0.5, 1.5] of fp32
  // state's.
  for (cpu_isa isa : available_isas()) {
    INFO(zenflow::cpu_isa_name(isa));
    cpu_adam opt({}, config(q8m, 1, isa)), ref({}, config(cpu_state_format::fp32, 1, isa));
    const std::vector<float> init(256, 0.0f), zero(256, 0.0f);
    std::vector<float> m(256, 0.0f), v(256, 0.0f);
    m[0] = 0.01f, v[0] = 0.001f;
    m[1] = 0.01f * 0x1p-18f, v[1] = 0.001f * 0x1p-36f;
    const std::vector<std::int32_t> col{0};
    for (auto* x : {&opt, &ref}) {
      x->add_tensor(init, 256, 1);
      x->import_columns(0, col, init, m, v);
      x->set_step_count(10000);
    }
    const exported e = export_all(opt, 0);
    CHECK(e.v[1] > 0.0f);
    CHECK(e.m[1] > 0.0f);
    const cpu_adam_task t{0, zero.data(), dtype::f32, {}};
    opt.step({&t, 1});
    ref.step({&t, 1});
    const float ratio = opt.params(0)[1] / ref.params(0)[1];
    INFO("update " << opt.params(0)[1] << " fp32 " << ref.params(0)[1]);
    CHECK(ratio >= 0.5f);
    CHECK(ratio <= 1.5f);
  }
}

TEST_CASE("the 8-bit update quotient never exceeds the bound exact Adam obeys") {
  // An imported state that no gradient history produces (m = 1, v = 1e-30, as a v quantized to
  // nothing would leave) moves each parameter by at most lr / (1 - beta1^t) * bound(t) under
  // 8-bit state, where fp32 state takes m / eps ~ 1e8 steps of lr.
  zenflow::adam_options o;
  o.lr = 1e-3f;
  for (cpu_isa isa : available_isas()) {
    INFO(zenflow::cpu_isa_name(isa));
    cpu_adam opt(o, config(q8m, 2, isa));
    const index_t rows = 300;
    const std::vector<float> init(rows, 0.0f), m(rows, 1.0f), v(rows, 1e-30f), zero(rows, 0.0f);
    opt.add_tensor(init, rows, 1);
    const std::vector<std::int32_t> col{0};
    opt.import_columns(0, col, init, m, v);
    opt.set_step_count(1000);
    const cpu_adam_task t{0, zero.data(), dtype::f32, {}};
    opt.step({&t, 1});
    // sqrt(C (1 - beta2^t)), C = (1 - beta1)^2 / ((1 - beta2) (1 - beta1^2 / beta2)), t = 1001
    const double b1 = o.beta1, b2 = o.beta2;
    const double bound = std::sqrt((1 - b1) * (1 - b1) / ((1 - b2) * (1 - b1 * b1 / b2)) * (1 - std::pow(b2, 1001.0)));
    CHECK(zd::adam_quotient_bound(o, 1001) == doctest::Approx(bound).epsilon(2e-3));
    const double max_step = o.lr / (1 - std::pow(b1, 1001.0)) * bound * (1 + 2e-3);
    for (index_t i = 0; i < rows; ++i) REQUIRE(std::fabs(opt.params(0)[i]) <= max_step);
    CHECK(std::fabs(opt.params(0)[0]) > 0.5f * max_step);  // the clamp held it, the update is not 0
  }
  zenflow::adam_options loose;
  loose.beta1 = 0.99f;
  loose.beta2 = 0.9f;  // beta1^2 >= beta2: exact Adam has no bound, nothing is clamped
  CHECK(std::isinf(zd::adam_quotient_bound(loose, 10)));
}

TEST_CASE("non-finite gradients: checked steps change no byte, unchecked ones poison only their block") {
  for (cpu_state_format f : {bf16m, q8m})
    for (cpu_isa isa : available_isas()) {
      INFO(zenflow::cpu_state_format_name(f) << " " << zenflow::cpu_isa_name(isa));
      cpu_adam opt({}, config(f, 3, isa, 100));
      const index_t rows = 300, cols = 4;
      std::vector<float> init(rows * cols, 0.5f), g(rows * cols, 0.01f);
      opt.add_tensor(init, rows, cols);
      const cpu_adam_task ok{0, g.data(), dtype::f32, {}};
      REQUIRE(opt.step({&ok, 1}).applied);
      const auto before = saved(opt);
      std::vector<bfloat16> out(rows * cols, bfloat16{0x1234});
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        auto gb = g;
        gb[2 * rows + 7] = bad;
        cpu_adam_task t{0, gb.data(), dtype::f32, {}};
        t.copy_out = out.data();
        CHECK(!opt.step({&t, 1}).applied);
        CHECK(opt.step_count() == 1);
        CHECK(saved(opt) == before);
        CHECK(out[0].bits == 0x1234);
      }
      auto gn = g;
      gn[2 * rows + 7] = std::numeric_limits<float>::quiet_NaN();
      const cpu_adam_task t{0, gn.data(), dtype::f32, {}};
      REQUIRE(opt.step({&t, 1}, 1.0f, false).applied);
      const exported e = export_all(opt, 0);
      for (index_t i = 0; i < rows * cols; ++i) {
        // bf16: the element's own m, v and p are NaN; 8-bit: its block's moments (rows 0-255 of
        // column 2) are NaN, the parameter of the element only.
        const bool in_block = i >= 2 * rows && i < 2 * rows + 256;
        const bool nan_state = f == bf16m ? i == 2 * rows + 7 : in_block;
        REQUIRE(std::isnan(e.m[i]) == nan_state);
        REQUIRE(std::isnan(e.v[i]) == nan_state);
        REQUIRE(std::isnan(opt.params(0)[i]) == (i == 2 * rows + 7));
      }
    }
}

TEST_CASE("export and import move columns in fp32; the round trips' errors are bounded and stable") {
  std::mt19937 rng(12);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  const index_t rows = 600, cols = 6;
  const std::size_t n = rows * cols;
  // A state as Adam builds it: m ~ g, v ~ g^2 over 12 binades, a few zeros.
  std::vector<float> p(n), m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float scale = std::exp2(static_cast<float>(static_cast<int>(i % 41) - 30) * 0.3f);
    p[i] = noise(rng);
    m[i] = i % 53 == 0 ? 0.0f : noise(rng) * scale;
    v[i] = i % 53 == 0 ? 0.0f : (1.0f + std::fabs(noise(rng))) * scale * scale;
  }
  std::vector<std::int32_t> all(cols);
  std::iota(all.begin(), all.end(), 0);
  for (cpu_state_format f : {cpu_state_format::fp32, bf16m, q8m}) {
    INFO(zenflow::cpu_state_format_name(f));
    cpu_adam opt({}, config(f));
    opt.add_tensor(std::vector<float>(n, 0.0f), rows, cols);
    opt.import_columns(0, all, p, m, v);
    const exported e = export_all(opt, 0);
    CHECK(e.p == p);  // the master is never rounded
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t col0 = i / rows * rows, b0 = col0 + (i % rows) / 256 * 256;
      const std::size_t b1 = std::min<std::size_t>(b0 + 256, col0 + rows);
      float am = 0, av = 0;
      for (std::size_t j = b0; j < b1; ++j) am = std::max(am, std::fabs(m[j])), av = std::max(av, v[j]);
      // fp32: exact; bf16: half a bf16 ulp (2^-8 relative); 8-bit: half a code step,
      // (|x| + 2^-B * scale) / 16 with scale = the block's largest / the largest code.
      const float tm = f == cpu_state_format::fp32 ? 0.0f
                       : f == bf16m                ? std::fabs(m[i]) * 0x1p-8f
                                                   : (std::fabs(m[i]) + 0x1p-15f * am / zd::q8_m_max) / 16.0f;
      const float tv = f == cpu_state_format::fp32 ? 0.0f
                       : f == bf16m                ? v[i] * 0x1p-8f
                                                   : (v[i] + 0x1p-31f * av / zd::q8_v_max) / 16.0f;
      REQUIRE(std::fabs(e.m[i] - m[i]) <= tm * 1.0001f);
      REQUIRE(std::fabs(e.v[i] - v[i]) <= tv * 1.0001f);
      REQUIRE((v[i] > 0.0f) == (e.v[i] > 0.0f));  // zero stays zero, positive stays positive
    }
    // compact -> fp32 -> compact is stable: importing what was exported changes no byte.
    const auto bytes = saved(opt);
    opt.import_columns(0, all, e.p, e.m, e.v);
    CHECK(saved(opt) == bytes);
    // A subset of columns moves alone; the other columns are untouched.
    const std::vector<std::int32_t> some{1, 4};
    std::vector<float> sp(2 * rows), sm(2 * rows), sv(2 * rows);
    opt.export_columns(0, some, sp, sm, sv);
    for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
      REQUIRE(zd::float_to_bits(sm[rows + r]) == zd::float_to_bits(e.m[4 * rows + r]));
      sm[r] *= 2.0f, sv[r] *= 4.0f;
    }
    opt.import_columns(0, some, sp, sm, sv);
    const exported e2 = export_all(opt, 0);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t c = i / rows;
      if (c == 1) {
        REQUIRE(std::fabs(e2.m[i] - 2 * e.m[i]) <= std::fabs(2 * e.m[i]) * 0.07f + 1e-30f);
      } else {
        REQUIRE(zd::float_to_bits(e2.m[i]) == zd::float_to_bits(e.m[i]));
        REQUIRE(zd::float_to_bits(e2.v[i]) == zd::float_to_bits(e.v[i]));
      }
    }
  }
}

TEST_CASE("save_state / load_state restore every bit, and training resumes bit-identically") {
  const workload w;
  for (cpu_state_format f : {cpu_state_format::fp32, bf16m, q8m}) {
    INFO(zenflow::cpu_state_format_name(f));
    std::mt19937 rng(1);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    std::vector<float> init(513 * 3), g(init.size());
    for (auto& x : init) x = noise(rng);
    const auto run = [&](cpu_adam& opt, int from, int to) {
      for (int s = from; s < to; ++s) {
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = std::sin(static_cast<float>(i * 7 + s));
        const cpu_adam_task t{0, g.data(), dtype::f32, {}};
        opt.step({&t, 1});
      }
    };
    cpu_adam straight({}, config(f));
    straight.add_tensor(init, 513, 3);
    run(straight, 0, 10);
    cpu_adam first({}, config(f));
    first.add_tensor(init, 513, 3);
    run(first, 0, 4);
    std::vector<std::byte> bytes(first.saved_state_size(0));
    first.save_state(0, bytes);
    cpu_adam resumed({}, config(f));
    resumed.add_tensor(std::vector<float>(init.size(), 9.0f), 513, 3);
    resumed.load_state(0, bytes);
    CHECK(saved(resumed) == saved(first));
    resumed.set_step_count(first.step_count());
    run(resumed, 4, 10);
    CHECK(saved(resumed) == saved(straight));
    if (f != cpu_state_format::fp32) {  // the seed drives the rounding
      cpu_adam other({}, config(f, 2, cpu_isa::automatic, 1u << 15, 99));
      other.add_tensor(init, 513, 3);
      run(other, 0, 10);
      CHECK(saved(other) != saved(straight));
    }
  }
}

TEST_CASE("a large tensor's staggered arrays hold the state a small tensor's columns hold") {
  // From 4M elements each array after the master starts 256 KiB later than packed (add_tensor):
  // columns 0..3 of a 2048 x 2048 tensor must step, export, save and load exactly as the same
  // columns of a 2048 x 4 tensor, whose arrays are packed (the per-element math and the rounding
  // keys depend on the element's index only).
  constexpr index_t rows = 2048, big_cols = 2048, small_cols = 4;
  const std::size_t big_n = std::size_t{rows} * big_cols, small_n = std::size_t{rows} * small_cols;
  for (cpu_state_format f : {cpu_state_format::fp32, bf16m, q8m}) {
    INFO(zenflow::cpu_state_format_name(f));
    std::mt19937 rng(5);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    std::vector<float> big_init(big_n), big_g(big_n);
    for (auto& x : big_init) x = noise(rng);
    const std::vector<float> small_init(big_init.begin(), big_init.begin() + static_cast<std::ptrdiff_t>(small_n));
    cpu_adam big({}, config(f)), small({}, config(f));
    big.add_tensor(big_init, rows, big_cols);
    small.add_tensor(small_init, rows, small_cols);
    for (int s = 0; s < 3; ++s) {
      for (auto& x : big_g) x = noise(rng);
      const cpu_adam_task tb{0, big_g.data(), dtype::f32, {}}, ts{0, big_g.data(), dtype::f32, {}};
      big.step({&tb, 1});
      small.step({&ts, 1});  // the first small_n elements of the same gradient
    }
    const std::vector<std::int32_t> cols{0, 1, 2, 3};
    const auto columns_of = [&](const cpu_adam& opt) {
      exported e{std::vector<float>(small_n), std::vector<float>(small_n), std::vector<float>(small_n)};
      opt.export_columns(0, cols, e.p, e.m, e.v);
      return e;
    };
    const exported want = columns_of(small), got = columns_of(big);
    CHECK(got.p == want.p);
    CHECK(got.m == want.m);
    CHECK(got.v == want.v);
    if (f == cpu_state_format::fp32) {
      const auto head = [&](std::span<const float> x) {  // the spans of the moments, columns 0..3
        return std::vector<float>(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(small_n));
      };
      CHECK(head(big.exp_avg(0)) == want.m);
      CHECK(head(big.exp_avg_sq(0)) == want.v);
      CHECK(head(big.params(0)) == want.p);
    }
    cpu_adam loaded({}, config(f));
    loaded.add_tensor(std::vector<float>(big_n, 0.0f), rows, big_cols);
    loaded.load_state(0, saved(big));
    loaded.set_step_count(big.step_count());
    CHECK(saved(loaded) == saved(big));
    const exported back = columns_of(loaded);
    CHECK(back.m == want.m);
    CHECK(back.v == want.v);
  }
}

TEST_CASE("bytes held per parameter: 12 (fp32), 8 (bf16 moments), 6 + 8 per 256-row block (8-bit)") {
  for (cpu_state_format f : {cpu_state_format::fp32, bf16m, q8m}) {
    cpu_adam opt({}, config(f));
    opt.add_tensor(std::vector<float>(1024 * 64, 0.0f), 1024, 64);
    opt.add_tensor(std::vector<float>(300 * 2, 0.0f), 300, 2);  // 2 blocks per column
    const std::size_t n = 1024 * 64 + 600;
    const std::size_t expect = f == cpu_state_format::fp32 ? 12 * n : f == bf16m ? 8 * n : 6 * n + 8 * (64 * 4 + 2 * 2);
    CHECK(opt.state_bytes() == expect);
    CHECK(opt.state_bytes(1) + opt.state_bytes(0) == expect);
    CHECK(opt.saved_state_size(1) == opt.state_bytes(1) + 40);
  }
}

TEST_CASE("compact state rejects what it cannot do, naming the argument, before changing anything") {
  cpu_adam opt({}, config(q8m));
  std::vector<float> init(300 * 2, 1.0f);
  opt.add_tensor(init, 300, 2);
  const auto before = saved(opt);
  const auto expect_error = [&](auto&& call, const std::string& argument) {
    try {
      call();
      FAIL("no exception for " << argument);
    } catch (const zenflow::error& e) {
      CHECK(e.argument() == argument);
    }
    CHECK(saved(opt) == before);
  };
  expect_error([&] { (void)opt.exp_avg(0); }, "cpu_state");
  expect_error([&] { (void)std::as_const(opt).exp_avg_sq(0); }, "cpu_state");
  const std::vector<std::int32_t> one{1}, bad{2}, twice{1, 1};
  std::vector<float> col(300, 0.5f), short_col(299, 0.5f);
  expect_error([&] { opt.export_columns(0, bad, col, col, col); }, "columns");
  expect_error([&] { opt.export_columns(0, twice, col, col, col); }, "columns");
  expect_error([&] { opt.export_columns(1, one, col, col, col); }, "t");
  expect_error([&] { opt.export_columns(0, one, col, short_col, col); }, "exp_avg");
  auto nan = col;
  nan[17] = std::numeric_limits<float>::quiet_NaN();
  auto neg = col;
  neg[3] = -1e-20f;
  expect_error([&] { opt.import_columns(0, one, col, nan, col); }, "exp_avg");
  expect_error([&] { opt.import_columns(0, one, col, col, neg); }, "exp_avg_sq");
  expect_error([&] { opt.import_columns(0, one, col, col, short_col); }, "exp_avg_sq");
  std::vector<std::byte> bytes(opt.saved_state_size(0));
  opt.save_state(0, bytes);
  expect_error([&] { opt.save_state(0, std::span<std::byte>(bytes).first(10)); }, "out");
  expect_error([&] { opt.load_state(0, std::span<const std::byte>(bytes).first(bytes.size() - 1)); }, "in");
  auto wrong = bytes;
  wrong[0] = std::byte{0};
  expect_error([&] { opt.load_state(0, wrong); }, "in");
  cpu_adam other_format({}, config(bf16m));
  other_format.add_tensor(init, 300, 2);
  std::vector<std::byte> bf(other_format.saved_state_size(0));
  other_format.save_state(0, bf);
  expect_error([&] { opt.load_state(0, bf); }, "in");
  cpu_adam other_shape({}, config(q8m));
  other_shape.add_tensor(init, 200, 3);
  std::vector<std::byte> os(other_shape.saved_state_size(0));
  other_shape.save_state(0, os);
  expect_error([&] { opt.load_state(0, os); }, "in");
  cpu_adam_config cfg;
  cfg.cpu_state = static_cast<cpu_state_format>(7);
  try {
    cpu_adam x({}, cfg);
    FAIL("no exception");
  } catch (const zenflow::error& e) {
    CHECK(e.argument() == "config.cpu_state");
  }
  CHECK(zenflow::parse_cpu_state_format("blockwise8_moments") == q8m);
  CHECK(zenflow::parse_cpu_state_format("bf16_moments") == bf16m);
  CHECK(!zenflow::parse_cpu_state_format("int8").has_value());
}

// ---------------------------------------------------------------------------------------------
// Fidelity: small training problems with Adam, every format against fp32 state.
// ---------------------------------------------------------------------------------------------
namespace {

// Softmax regression on 10 Gaussian clusters in 64 dimensions (noisy minibatches of 32), and a
// noisy least-squares fit with ill-conditioned features (scales 1 to 1e-2). Returns the final
// full-data loss and the parameters after `steps` AdamW steps (lr, weight decay 0.01).
struct problem_result {
  double loss;
  std::vector<float> params;
};

problem_result softmax_regression(cpu_state_format f, int steps, float lr) {
  constexpr int d = 65, k = 10, n = 2000, batch = 32;
  std::mt19937 data_rng(1);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> centers(k * 64), x(n * d);
  std::vector<int> y(n);
  for (auto& c : centers) c = noise(data_rng) * 0.3f;
  for (int i = 0; i < n; ++i) {
    y[i] = i % k;
    for (int j = 0; j < 64; ++j) x[i * d + j] = centers[y[i] * 64 + j] + noise(data_rng);
    x[i * d + 64] = 1.0f;
  }
  zenflow::adam_options o;
  o.lr = lr;
  o.weight_decay = 0.01f;
  cpu_adam opt(o, config(f, 1));
  opt.add_tensor(std::vector<float>(d * k, 0.0f), d, k);  // W[:, c] is column c
  std::mt19937 batch_rng(2);
  std::vector<float> g(d * k);
  const auto loss_grad = [&](const float* w, const int* idx, int count, float* grad) {
    double loss = 0;
    if (grad) std::fill(grad, grad + d * k, 0.0f);
    for (int b = 0; b < count; ++b) {
      const float* xi = &x[idx[b] * d];
      double z[k], zmax = -1e30, sum = 0;
      for (int c = 0; c < k; ++c) {
        z[c] = 0;
        for (int j = 0; j < d; ++j) z[c] += static_cast<double>(xi[j]) * w[c * d + j];
        zmax = std::max(zmax, z[c]);
      }
      for (int c = 0; c < k; ++c) sum += std::exp(z[c] - zmax);
      loss += std::log(sum) + zmax - z[y[idx[b]]];
      if (grad)
        for (int c = 0; c < k; ++c) {
          const double pc = std::exp(z[c] - zmax) / sum - (c == y[idx[b]] ? 1.0 : 0.0);
          for (int j = 0; j < d; ++j) grad[c * d + j] += static_cast<float>(pc * xi[j] / count);
        }
    }
    return loss / count;
  };
  int idx[batch];
  for (int s = 0; s < steps; ++s) {
    for (int& i : idx) i = static_cast<int>(batch_rng() % n);
    loss_grad(opt.params(0).data(), idx, batch, g.data());
    const cpu_adam_task t{0, g.data(), dtype::f32, {}};
    opt.step({&t, 1});
  }
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  return {loss_grad(opt.params(0).data(), all.data(), n, nullptr),
          std::vector<float>(opt.params(0).begin(), opt.params(0).end())};
}

problem_result least_squares(cpu_state_format f, int steps, float lr) {
  constexpr int d = 256, k = 8, n = 2048, batch = 64;
  std::mt19937 data_rng(5);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> x(n * d), w_true(d * k), t(n * k);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) x[i * d + j] = noise(data_rng) * std::pow(10.0f, -2.0f * j / (d - 1));
  for (auto& w : w_true) w = noise(data_rng);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < k; ++c) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += static_cast<double>(x[i * d + j]) * w_true[c * d + j];
      t[i * k + c] = static_cast<float>(s) + 0.01f * noise(data_rng);
    }
  zenflow::adam_options o;
  o.lr = lr;
  o.weight_decay = 0.01f;
  cpu_adam opt(o, config(f, 1));
  opt.add_tensor(std::vector<float>(d * k, 0.0f), d, k);
  std::mt19937 batch_rng(6);
  std::vector<float> g(d * k);
  const auto loss_grad = [&](const float* w, const int* idx, int count, float* grad) {
    double loss = 0;
    if (grad) std::fill(grad, grad + d * k, 0.0f);
    for (int b = 0; b < count; ++b)
      for (int c = 0; c < k; ++c) {
        const float* xi = &x[idx[b] * d];
        double r = -t[idx[b] * k + c];
        for (int j = 0; j < d; ++j) r += static_cast<double>(xi[j]) * w[c * d + j];
        loss += 0.5 * r * r;
        if (grad)
          for (int j = 0; j < d; ++j) grad[c * d + j] += static_cast<float>(r * xi[j] / count);
      }
    return loss / (count * k);
  };
  int idx[batch];
  for (int s = 0; s < steps; ++s) {
    for (int& i : idx) i = static_cast<int>(batch_rng() % n);
    loss_grad(opt.params(0).data(), idx, batch, g.data());
    const cpu_adam_task task{0, g.data(), dtype::f32, {}};
    opt.step({&task, 1});
  }
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  return {loss_grad(opt.params(0).data(), all.data(), n, nullptr),
          std::vector<float>(opt.params(0).begin(), opt.params(0).end())};
}

double relative_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("fidelity: compact states train small problems as fp32 state does") {
  struct bar {
    cpu_state_format f;
    double loss, distance;  // max relative loss difference, max relative parameter distance
  };
  // A quantizer that rounds to nearest (bf16: +30% loss on the least-squares problem), loses the
  // sign or the scale fails these bars by far.
  for (const bar& b : {bar{bf16m, 0.02, 0.02}, bar{q8m, 0.03, 0.08}}) {
    const auto sm_ref = softmax_regression(cpu_state_format::fp32, 3000, 1e-2f);
    const auto sm = softmax_regression(b.f, 3000, 1e-2f);
    const auto ls_ref = least_squares(cpu_state_format::fp32, 3000, 1e-3f);
    const auto ls = least_squares(b.f, 3000, 1e-3f);
    const double sm_dl = (sm.loss - sm_ref.loss) / sm_ref.loss, ls_dl = (ls.loss - ls_ref.loss) / ls_ref.loss;
    const double sm_d = relative_distance(sm.params, sm_ref.params), ls_d = relative_distance(ls.params, ls_ref.params);
    MESSAGE(zenflow::cpu_state_format_name(b.f)
            << ": softmax loss " << sm.loss << " (fp32 " << sm_ref.loss << ", rel " << sm_dl << ", param distance "
            << sm_d << "); least squares loss " << ls.loss << " (fp32 " << ls_ref.loss << ", rel " << ls_dl
            << ", param distance " << ls_d << ")");
    CHECK(std::fabs(sm_dl) <= b.loss);
    CHECK(std::fabs(ls_dl) <= b.loss);
    CHECK(sm_d <= b.distance);
    CHECK(ls_d <= b.distance);
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
