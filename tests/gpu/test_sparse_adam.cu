// cuda_sparse_adam and the CUDA gather/scatter against the host backend (host_sparse_adam, the
// exact reference). Label gpu: needs a CUDA device to run.
//   - a non-unit effective scale (grad_scale x *scale_ptr) that changes every step, from device
//     and from mapped pinned memory;
//   - a parameter with more tiles than any build of the step kernel can keep blocks resident;
//   - the device-pointer checks: mapped pinned memory where a kernel reads a scalar, device
//     memory elsewhere, pageable memory nowhere;
//   - gather/scatter past 2^21 rows (row-major) and 65535 row tiles (column-contiguous), where
//     blocks walk several row tiles;
//   - many parameters whose tiles one block walks at different step counts (missing gradients),
//     each with its own lr, betas, eps and weight decay.
// Uploads go through zenflow_test::upload (a pageable cudaMemcpy has not landed when it returns).
#include <zenflow/concepts.hpp>
#include <zenflow/sparse_adam.cuh>
#include <zenflow/sparse_adam.hpp>

#include <doctest/doctest.h>

#include "../support/cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

namespace {

using zenflow::dtype;
using zenflow::index_t;
using zenflow::memory_space;
namespace sa = zenflow::detail::sparse_adam;

static_assert(zenflow::device_optimizer<zenflow::cuda_sparse_adam>);

/// A host buffer and its device twin.
struct twin {
  std::vector<std::byte> host;
  zenflow_test::device_buffer dev;
  explicit twin(std::size_t bytes) : host(bytes), dev(bytes) {}
  void to_device() { zenflow_test::upload(dev.data(), host.data(), host.size()); }
  std::vector<std::byte> from_device() const {
    std::vector<std::byte> out(host.size());
    ZENFLOW_CUDA_TRY(cudaMemcpy(out.data(), dev.data(), out.size(), cudaMemcpyDeviceToHost));
    return out;
  }
};

struct matrix_case {
  index_t rows, cols, k;
  bool row_major;
  dtype param_type, grad_type;
};

zenflow::matrix_view make_view(void* data, const matrix_case& c, dtype t, memory_space s, bool row_major) {
  return row_major ? zenflow::matrix_view::row_major(data, c.rows, c.cols, t, s)
                   : zenflow::matrix_view::column_contiguous(data, c.rows, c.cols, t, s);
}

void fill(std::vector<std::byte>& bytes, dtype t, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> n(0.0f, sigma);
  const auto count = static_cast<index_t>(bytes.size() / zenflow::dtype_size(t));
  for (index_t i = 0; i < count; ++i) sa::store_from_float(bytes.data(), t, i, n(rng));
}

std::vector<std::int32_t> random_selection(index_t cols, index_t k, std::mt19937& rng) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(cols));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

/// Distance in units in the last place between two values of dtype t (same sign assumed near).
std::int64_t ulps(float a, float b) {
  std::int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = std::numeric_limits<std::int32_t>::min() - ia;
  if (ib < 0) ib = std::numeric_limits<std::int32_t>::min() - ib;
  return std::llabs(static_cast<std::int64_t>(ia) - ib);
}

/// Parameter value the update must write for a master value: the master rounded (nearest even)
/// to the parameter's dtype.
float rounded(float master, dtype t) {
  std::byte b[4];
  sa::store_from_float(b, t, 0, master);
  return sa::load_as_float(b, t, 0);
}

/// Runs host_sparse_adam and cuda_sparse_adam side by side for `steps` steps with options `o`, then
/// checks: compact states within 1 ulp; every updated parameter value equals its own master
/// rounded to the parameter's dtype, and equals the host's wherever the masters agree bitwise;
/// unselected columns and stride gaps bitwise untouched; then the skip paths (skip flag, infinite
/// scale, NaN in a selected column, a finite value that overflows once scaled) change nothing on
/// any parameter, and a NaN in an unselected column does not skip.
void check_against_host(const zenflow::adam_options& o, int steps, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<matrix_case> cases = {
      {64, 300, 30, true, dtype::bf16, dtype::bf16}, {128, 50, 5, false, dtype::f32, dtype::f32},
      {33, 257, 25, true, dtype::f16, dtype::f32},   {1000, 40, 4, false, dtype::bf16, dtype::bf16},
      {7, 4096, 409, true, dtype::f32, dtype::bf16}, {3, 5, 5, true, dtype::bf16, dtype::f16},
  };
  // More than twice as many tiles as the device's threads-per-SM limit lets blocks of kThreads be
  // resident, whatever the step kernel's register count: every block walks at least two tiles
  // and reuses its decision.
  const long long resident_bound = zenflow_test::max_resident_blocks(sa::kThreads);
  const index_t walk_rows = 1024, walk_k = (2 * resident_bound * sa::kTile) / walk_rows + 1;
  cases.push_back({walk_rows, walk_k + 64, walk_k, false, dtype::bf16, dtype::bf16});
  {
    int device_id = 0, sms = 0, per_sm = 0;
    ZENFLOW_CUDA_TRY(cudaGetDevice(&device_id));
    ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_id));
    ZENFLOW_CUDA_TRY(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sa::sparse_adam_step_kernel, sa::kThreads, 0));
    const index_t walk_tiles = (walk_rows * walk_k + sa::kTile - 1) / sa::kTile;
    REQUIRE(walk_tiles > 2 * static_cast<index_t>(sms) * per_sm);  // the grid cuda_sparse_adam launches
  }
  zenflow::host_sparse_adam host(o);
  zenflow::cuda_sparse_adam device(o);
  // A blocking stream: the twins' cudaMemcpy uploads (legacy stream; a pageable upload may return
  // before its DMA landed) are ordered before the steps enqueued here.
  const zenflow_test::cuda_stream blocking_stream(cudaStreamDefault);
  const cudaStream_t stream = blocking_stream.get();

  std::vector<twin> params, grads, packed;
  std::vector<std::vector<std::byte>> host_params, initial;
  std::vector<std::vector<std::int32_t>> selections;
  for (const auto& c : cases) {
    const std::size_t bytes = static_cast<std::size_t>(c.rows * c.cols);
    params.emplace_back(bytes * zenflow::dtype_size(c.param_type));
    grads.emplace_back(bytes * zenflow::dtype_size(c.grad_type));
    fill(params.back().host, c.param_type, rng, 1.0f);
    params.back().to_device();
    host_params.push_back(params.back().host);
    initial.push_back(params.back().host);
    selections.push_back(random_selection(c.cols, c.k, rng));
    packed.emplace_back(3 * c.rows * c.k * sizeof(float));
    fill(packed.back().host, dtype::f32, rng, 0.01f);
    auto* f = reinterpret_cast<float*>(packed.back().host.data());
    for (index_t i = 0; i < 3 * c.rows * c.k; ++i)
      if ((i / c.rows) % 3 == 2) f[i] = std::fabs(f[i]);  // exp_avg_sq >= 0
    packed.back().to_device();
    const auto span = std::span<const float>(f, static_cast<std::size_t>(3 * c.rows * c.k));
    const auto h =
        host.add_matrix(make_view(host_params.back().data(), c, c.param_type, memory_space::host, c.row_major),
                        selections.back(), span);
    const auto d =
        device.add_matrix(make_view(params.back().dev.data(), c, c.param_type, memory_space::device, c.row_major),
                          selections.back(), packed.back().dev.data<const float>(), stream);
    CHECK(h == d);
  }
  // A strided bf16 bias.
  std::vector<float> bias_master(100);
  for (auto& x : bias_master) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  twin bias(200 * 2), bias_grad(100 * 4);
  std::vector<std::byte> host_bias(bias.host.size());
  bias.to_device();
  host.add_vector(zenflow::vector_view(host_bias.data(), 100, dtype::bf16, memory_space::host, 2), bias_master);
  device.add_vector(zenflow::vector_view(bias.dev.data(), 100, dtype::bf16, memory_space::device, 2), bias_master,
                    stream);
  const std::size_t n_params = cases.size() + 1;

  // The step's scale and skip flag: device memory on even steps, mapped pinned memory on odd ones.
  twin scale(4), skip(4);
  const int no_skip = 0;
  std::memcpy(skip.host.data(), &no_skip, 4);
  skip.to_device();
  zenflow_test::mapped_pinned<float> mapped_scale;
  zenflow_test::mapped_pinned<int> mapped_skip;

  // Gradient views: the parameter's layout for even cases, the other layout for odd ones.
  std::vector<zenflow::const_matrix_view> hg, dg;
  for (std::size_t p = 0; p < cases.size(); ++p) {
    const bool rm = (p % 2 == 0) ? cases[p].row_major : !cases[p].row_major;
    hg.push_back(make_view(grads[p].host.data(), cases[p], cases[p].grad_type, memory_space::host, rm));
    dg.push_back(make_view(grads[p].dev.data(), cases[p], cases[p].grad_type, memory_space::device, rm));
  }
  const zenflow::const_vector_view hv[] = {zenflow::const_vector_view(bias_grad.host.data(), 100, dtype::f32)};
  const zenflow::const_vector_view dv[] = {
      zenflow::const_vector_view(bias_grad.dev.data(), 100, dtype::f32, memory_space::device)};
  for (int t = 0; t < steps; ++t) {
    for (std::size_t p = 0; p < cases.size(); ++p) {
      fill(grads[p].host, cases[p].grad_type, rng, 0.1f);
      grads[p].to_device();
    }
    fill(bias_grad.host, dtype::f32, rng, 0.1f);
    bias_grad.to_device();
    // Effective scale 2 x (0.3 .. 0.51), different from step to step: a step or check that drops
    // either factor, or reads a stale *scale_ptr, moves exp_avg by 2x or more.
    const float scale_value = 0.3f + 0.07f * static_cast<float>(t % 4);
    const bool mapped = t % 2 == 1;
    if (mapped) {
      *mapped_scale.host() = scale_value;  // the previous step has completed (synchronized below)
    } else {
      std::memcpy(scale.host.data(), &scale_value, 4);
      scale.to_device();
    }
    const bool check = t % 3 == 0;
    REQUIRE(host.step(hg, hv, 2.0f, &scale_value, &no_skip, check));
    device.step(dg, dv, 2.0f, mapped ? mapped_scale.device() : scale.dev.data<const float>(),
                mapped ? mapped_skip.device() : skip.dev.data<const int>(), check, stream);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // the host buffers of the gradients are refilled next
  }
  CHECK(device.step_count() == steps);
  CHECK(host.step_count() == steps);

  // Every parameter's compact state and parameter bytes, from the device and the host.
  struct snapshot {
    std::vector<std::vector<float>> state;
    std::vector<std::vector<std::byte>> param;
  };
  auto device_snapshot = [&] {
    snapshot s;
    for (std::size_t p = 0; p < n_params; ++p) {
      s.state.emplace_back(3 * device.rows(p) * device.k(p));
      device.export_state(p, s.state.back());
      s.param.push_back(p < cases.size() ? params[p].from_device() : bias.from_device());
    }
    return s;
  };
  auto compare = [&](const snapshot& dev) {
    for (std::size_t p = 0; p < n_params; ++p) {
      CAPTURE(p);
      const bool is_bias = p == cases.size();
      const matrix_case c = is_bias ? matrix_case{100, 1, 1, false, dtype::bf16, dtype::f32} : cases[p];
      const std::vector<std::int32_t> sel = is_bias ? std::vector<std::int32_t>{0} : selections[p];
      std::vector<float> hs(dev.state[p].size());
      host.export_state(p, hs);
      std::int64_t worst = 0;
      for (std::size_t i = 0; i < hs.size(); ++i) worst = std::max(worst, ulps(hs[i], dev.state[p][i]));
      CHECK(worst <= 1);  // the same fp32 operations; only the device's double pow may differ, far below
      const auto& dp = dev.param[p];
      const auto& hp = is_bias ? host_bias : host_params[p];
      const auto& init = is_bias ? std::vector<std::byte>(hp.size()) : initial[p];
      const auto es = zenflow::dtype_size(c.param_type);
      bool untouched = true, own_master = true, equal_where_masters_equal = true;
      for (index_t r = 0; r < c.rows; ++r)
        for (index_t col = 0; col < c.cols; ++col) {
          // The bias is strided (stride 2): element r at 2r; the gaps 2r + 1 must stay zero.
          const index_t off = is_bias ? 2 * r : c.row_major ? r * c.cols + col : col * c.rows + r;
          if (is_bias) untouched &= sa::load_as_float(dp.data(), dtype::bf16, off + 1) == 0.0f;
          const auto slot = std::lower_bound(sel.begin(), sel.end(), col) - sel.begin();
          if (slot == static_cast<std::ptrdiff_t>(sel.size()) || sel[slot] != col) {
            untouched &= std::memcmp(dp.data() + off * es, init.data() + off * es, es) == 0;
            continue;
          }
          const float dev_master = dev.state[p][sa::packed_index(c.rows, slot, 0, r)];
          const float host_master = hs[sa::packed_index(c.rows, slot, 0, r)];
          const float a = sa::load_as_float(dp.data(), c.param_type, off);
          own_master &= a == rounded(dev_master, c.param_type);
          if (dev_master == host_master)
            equal_where_masters_equal &= a == sa::load_as_float(hp.data(), c.param_type, off);
        }
      CHECK(untouched);
      CHECK(own_master);
      CHECK(equal_where_masters_equal);
    }
  };
  const snapshot after = device_snapshot();
  compare(after);

  // Skips decided on device leave every parameter bitwise unchanged, the counter included.
  const int yes = 1;
  zenflow_test::upload(skip.dev.data(), &yes, 4);
  device.step(dg, dv, 1.0f, nullptr, skip.dev.data<const int>(), false, stream);
  const float inf = std::numeric_limits<float>::infinity();
  zenflow_test::upload(scale.dev.data(), &inf, 4);
  device.step(dg, dv, 1.0f, scale.dev.data<const float>(), nullptr, false, stream);
  // A NaN in a selected column of parameter 0 with check_finite, then (restored) a finite value
  // that overflows once scaled by 2, as the CPU Adam's check sees it.
  const std::size_t g0 = 2 * static_cast<std::size_t>(selections[0][0]);  // bf16, row 0
  const zenflow::bfloat16 nan16 = zenflow::to_bfloat16(std::numeric_limits<float>::quiet_NaN());
  const zenflow::bfloat16 huge16 = zenflow::to_bfloat16(3.0e38f);
  zenflow_test::upload(grads[0].dev.data<std::byte>() + g0, &nan16, 2);
  device.step(dg, dv, 1.0f, nullptr, nullptr, true, stream);
  zenflow_test::upload(grads[0].dev.data<std::byte>() + g0, &huge16, 2);
  device.step(dg, dv, 2.0f, nullptr, nullptr, true, stream);
  const float two = 2.0f;  // the same factor through the device scale: the check must apply it too
  zenflow_test::upload(scale.dev.data(), &two, 4);
  device.step(dg, dv, 1.0f, scale.dev.data<const float>(), nullptr, true, stream);
  // The same factor from mapped pinned memory, read by the non-finite check; then a skip flag
  // there.
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  *mapped_scale.host() = 2.0f;
  device.step(dg, dv, 1.0f, mapped_scale.device(), nullptr, true, stream);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  *mapped_skip.host() = 1;
  device.step(dg, dv, 1.0f, nullptr, mapped_skip.device(), false, stream);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  CHECK(device.step_count() == steps);
  const snapshot skipped = device_snapshot();
  for (std::size_t p = 0; p < n_params; ++p) {
    CAPTURE(p);
    CHECK(skipped.param[p] == after.param[p]);
    CHECK(std::memcmp(skipped.state[p].data(), after.state[p].data(), after.state[p].size() * 4) == 0);
  }

  // A NaN in an unselected column is not read: the step applies, on both, and they still agree.
  grads[0].to_device();  // the last gradients again, on both sides
  const auto unselected = zenflow::complement_columns(selections[0], cases[0].cols);
  REQUIRE(!unselected.empty());
  const std::size_t at = 2 * static_cast<std::size_t>(unselected[0]);
  std::memcpy(grads[0].host.data() + at, &nan16, 2);
  zenflow_test::upload(grads[0].dev.data<std::byte>() + at, &nan16, 2);
  CHECK(host.step(hg, hv, 1.0f, nullptr, nullptr, true));
  device.step(dg, dv, 1.0f, nullptr, nullptr, true, stream);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  CHECK(device.step_count() == steps + 1);
  compare(device_snapshot());
}

}  // namespace

TEST_CASE("cuda_sparse_adam equals host_sparse_adam after 100 steps (AdamW, bias correction)") {
  zenflow::adam_options o;
  o.lr = 1e-3f;
  o.weight_decay = 0.01f;
  check_against_host(o, 100, 2024);
}

TEST_CASE("cuda_sparse_adam equals host_sparse_adam: Adam with L2 decay, no bias correction") {
  zenflow::adam_options o;
  o.lr = 2e-3f;
  o.weight_decay = 0.05f;
  o.adamw_mode = false;
  o.bias_correction = false;
  check_against_host(o, 30, 7);
}

TEST_CASE("device migration round trip is lossless and matches the host") {
  std::mt19937 rng(77);
  for (bool row_major : {true, false}) {
    const matrix_case c{48, 200, 20, row_major, dtype::bf16, dtype::bf16};
    twin param(c.rows * c.cols * 2);
    fill(param.host, dtype::bf16, rng, 1.0f);
    param.to_device();
    const auto a = random_selection(c.cols, c.k, rng);
    const auto b = random_selection(c.cols, c.k, rng);
    twin packed(3 * c.rows * c.k * 4);
    fill(packed.host, dtype::f32, rng, 1.0f);
    packed.to_device();
    const auto* f = reinterpret_cast<const float*>(packed.host.data());
    zenflow::host_sparse_adam host(zenflow::adam_options{});
    zenflow::cuda_sparse_adam device(zenflow::adam_options{});
    host.add_matrix(make_view(param.host.data(), c, dtype::bf16, memory_space::host, row_major), a,
                    std::span<const float>(f, 3 * c.rows * c.k));
    device.add_matrix(make_view(param.dev.data(), c, dtype::bf16, memory_space::device, row_major), a,
                      packed.dev.data<const float>(), nullptr);
    const index_t moved = device.migration_count(0, b);
    CHECK(moved == host.migration_count(0, b));
    const std::size_t n = 3 * c.rows * moved;
    twin entering(n * 4), leaving(n * 4), back(n * 4);
    fill(entering.host, dtype::f32, rng, 1.0f);
    entering.to_device();
    const auto* ef = reinterpret_cast<const float*>(entering.host.data());
    std::vector<float> host_leaving(n);
    host.reselect(0, b, std::span<const float>(ef, n), host_leaving);
    device.reselect(0, b, entering.dev.data<const float>(), leaving.dev.data<float>(), nullptr);
    const auto dl = leaving.from_device();
    CHECK(std::memcmp(dl.data(), host_leaving.data(), n * 4) == 0);
    std::vector<float> hs(3 * c.rows * c.k), ds(hs.size());
    host.export_state(0, hs);
    device.export_state(0, ds);
    CHECK(hs == ds);
    CHECK(std::equal(device.selection(0).begin(), device.selection(0).end(), b.begin()));
    std::vector<std::int32_t> sel_dev(c.k), rest_dev(c.cols - c.k);
    ZENFLOW_CUDA_TRY(cudaMemcpy(sel_dev.data(), device.selection_device(0).data(), c.k * 4, cudaMemcpyDeviceToHost));
    ZENFLOW_CUDA_TRY(
        cudaMemcpy(rest_dev.data(), device.unselected_device(0).data(), rest_dev.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(sel_dev == b);
    CHECK(rest_dev == zenflow::complement_columns(b, c.cols));
    // Back to a: what left enters again, and the state is the original, bit for bit.
    device.reselect(0, a, leaving.dev.data<const float>(), back.dev.data<float>(), nullptr);
    const auto db = back.from_device();
    CHECK(std::memcmp(db.data(), entering.host.data(), n * 4) == 0);
    device.export_state(0, ds);
    CHECK(std::memcmp(ds.data(), f, ds.size() * 4) == 0);
    // Bad input throws before anything is enqueued.
    CHECK_THROWS_AS(device.reselect(0, std::vector<std::int32_t>(c.k, 0), leaving.dev.data<const float>(),
                                    back.dev.data<float>(), nullptr),
                    zenflow::error);
    std::vector<float> host_buffer(n);
    CHECK_THROWS_AS(device.reselect(0, b, host_buffer.data(), back.dev.data<float>(), nullptr), zenflow::error);
    CHECK_THROWS_AS(device.add_matrix(make_view(param.host.data(), c, dtype::bf16, memory_space::host, row_major), a,
                                      packed.dev.data<const float>(), nullptr),
                    zenflow::error);
    CHECK(device.parameter_count() == 1);
    // entering_in and leaving_out may be one buffer: the entering values are read before the
    // leaving ones are written.
    twin both(n * 4);
    both.host = entering.host;
    both.to_device();
    device.reselect(0, b, both.dev.data<const float>(), both.dev.data<float>(), nullptr);
    CHECK(std::memcmp(both.from_device().data(), host_leaving.data(), n * 4) == 0);
    device.export_state(0, ds);
    CHECK(hs == ds);
  }
}

TEST_CASE("device gather/scatter equal the host versions") {
  std::mt19937 rng(5);
  for (bool row_major : {true, false})
    for (dtype st : {dtype::f32, dtype::bf16, dtype::f16})
      for (dtype dt : {dtype::f32, dtype::bf16, dtype::f16}) {
        const matrix_case c{1100, 77, 0, row_major, st, dt};
        twin src(c.rows * c.cols * zenflow::dtype_size(st));
        fill(src.host, st, rng, 1.0f);
        src.to_device();
        const auto columns = random_selection(c.cols, 45, rng);
        zenflow_test::device_buffer columns_dev(columns.size() * 4), scale_dev(4);
        zenflow_test::upload(columns_dev.data(), columns.data(), columns.size() * 4);
        const float scale_value = 0.75f;
        zenflow_test::upload(scale_dev.data(), &scale_value, 4);
        // Every other combination reads the scale from mapped pinned memory.
        zenflow_test::mapped_pinned<float> mapped_scale;
        *mapped_scale.host() = scale_value;
        const bool mapped = (static_cast<int>(st) + static_cast<int>(dt) + (row_major ? 1 : 0)) % 2 == 1;
        const std::size_t compact_bytes = columns.size() * c.rows * zenflow::dtype_size(dt);
        std::vector<std::byte> host_compact(compact_bytes);
        twin dev_compact(compact_bytes);
        zenflow::gather_columns(make_view(src.host.data(), c, st, memory_space::host, row_major), columns,
                                host_compact.data(), dt, 0.5f * scale_value);
        const std::span<const std::int32_t> cols_span(columns_dev.data<const std::int32_t>(), columns.size());
        zenflow::cuda_gather_columns(make_view(src.dev.data(), c, st, memory_space::device, row_major), cols_span,
                                     dev_compact.dev.data(), dt, 0.5f,
                                     mapped ? mapped_scale.device() : scale_dev.data<const float>(), nullptr);
        CHECK(dev_compact.from_device() == host_compact);

        twin dst(c.rows * c.cols * zenflow::dtype_size(dt));
        fill(dst.host, dt, rng, 1.0f);
        dst.to_device();
        auto host_dst = dst.host;
        zenflow::scatter_columns(host_compact.data(), dt, columns,
                                 make_view(host_dst.data(), c, dt, memory_space::host, !row_major));
        zenflow::cuda_scatter_columns(dev_compact.dev.data(), dt, cols_span,
                                      make_view(dst.dev.data(), c, dt, memory_space::device, !row_major), nullptr);
        CHECK(dst.from_device() == host_dst);
      }
}

TEST_CASE("device-pointer checks: mapped pinned memory for the scalars kernels read, device memory elsewhere") {
  const matrix_case c{16, 40, 4, true, dtype::bf16, dtype::bf16};
  std::mt19937 rng(3);
  twin param(c.rows * c.cols * 2), grad(c.rows * c.cols * 2), packed(3 * c.rows * c.k * 4);
  fill(param.host, dtype::bf16, rng, 1.0f);
  fill(grad.host, dtype::bf16, rng, 0.1f);
  param.to_device();
  grad.to_device();
  packed.to_device();
  zenflow::cuda_sparse_adam device(zenflow::adam_options{});
  const auto selection = random_selection(c.cols, c.k, rng);
  device.add_matrix(make_view(param.dev.data(), c, dtype::bf16, memory_space::device, true), selection,
                    packed.dev.data<const float>(), nullptr);
  const zenflow::const_matrix_view grads[] = {make_view(grad.dev.data(), c, dtype::bf16, memory_space::device, true)};
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  zenflow_test::mapped_pinned<float> mapped_scale;
  zenflow_test::mapped_pinned<int> mapped_skip;
  zenflow_test::mapped_pinned<std::int32_t> mapped_columns(c.k);
  zenflow_test::mapped_pinned<float> mapped_floats(3 * c.rows * c.k);
  const float pageable_scale = 1.0f;
  const int pageable_skip = 0;

  // Pageable host memory is readable by no kernel: rejected before anything is enqueued.
  CHECK_THROWS_AS(device.step(grads, {}, 1.0f, &pageable_scale, nullptr, false, nullptr), zenflow::error);
  CHECK_THROWS_AS(device.step(grads, {}, 1.0f, nullptr, &pageable_skip, false, nullptr), zenflow::error);
  CHECK(device.step_count() == 0);
  // Mapped pinned scalars are read in place: a mapped skip flag skips, a mapped scale applies.
  *mapped_skip.host() = 1;
  *mapped_scale.host() = 0.5f;
  device.step(grads, {}, 1.0f, mapped_scale.device(), mapped_skip.device(), true, nullptr);
  CHECK(device.step_count() == 0);
  *mapped_skip.host() = 0;
  device.step(grads, {}, 1.0f, mapped_scale.device(), mapped_skip.device(), true, nullptr);
  CHECK(device.step_count() == 1);

  // Arrays the kernels index must be device memory, mapped or not.
  for (std::int32_t j = 0; j < c.k; ++j) mapped_columns.host()[j] = selection[static_cast<std::size_t>(j)];
  zenflow_test::device_buffer compact(c.rows * c.k * 4);
  const auto src = make_view(grad.dev.data(), c, dtype::bf16, memory_space::device, true);
  const std::span<const std::int32_t> mapped_list(mapped_columns.device(), static_cast<std::size_t>(c.k));
  CHECK_THROWS_AS(
      zenflow::cuda_gather_columns(src, mapped_list, compact.data(), dtype::f32, mapped_scale.device(), nullptr),
      zenflow::error);
  CHECK_THROWS_AS(zenflow::cuda_gather_columns(src, device.selection_device(0), mapped_floats.device(), dtype::f32,
                                               mapped_scale.device(), nullptr),
                  zenflow::error);
  CHECK_THROWS_AS(zenflow::cuda_gather_columns(src, device.selection_device(0), compact.data(), dtype::f32,
                                               &pageable_scale, nullptr),
                  zenflow::error);
  CHECK_THROWS_AS(device.import_state(0, mapped_floats.device(), nullptr), zenflow::error);
  CHECK_THROWS_AS(device.export_state(0, mapped_floats.device(), nullptr), zenflow::error);
  // ... while the gather's scale may be mapped (the same check, with the mapped-host branch).
  CHECK_NOTHROW(zenflow::cuda_gather_columns(src, device.selection_device(0), compact.data(), dtype::f32,
                                             mapped_scale.device(), nullptr));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
}

namespace {

/// Gathers `columns` of a rows x cols bf16 matrix (layout `row_major`) into f32 with a mapped
/// scale and scatters them into another bf16 matrix of that layout, on device and on host;
/// both must agree byte for byte. The values are a cheap function of the index (the matrices
/// are large).
void check_large_gather_scatter(index_t rows, index_t cols, const std::vector<std::int32_t>& columns, bool row_major) {
  const matrix_case c{rows, cols, 0, row_major, dtype::bf16, dtype::bf16};
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  twin src(n * 2), dst(n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(static_cast<int>((i * 2654435761u) >> 20 & 0xfff) - 2048) / 64.0f;
    sa::store_from_float(src.host.data(), dtype::bf16, static_cast<index_t>(i), x);
    sa::store_from_float(dst.host.data(), dtype::bf16, static_cast<index_t>(i), -x);
  }
  src.to_device();
  dst.to_device();
  zenflow_test::device_buffer columns_dev(columns.size() * 4);
  zenflow_test::upload(columns_dev.data(), columns.data(), columns.size() * 4);
  zenflow_test::mapped_pinned<float> scale;
  *scale.host() = 0.375f;
  const std::size_t compact_bytes = columns.size() * static_cast<std::size_t>(rows) * 4;
  std::vector<std::byte> host_compact(compact_bytes);
  twin dev_compact(compact_bytes);
  zenflow::gather_columns(make_view(src.host.data(), c, dtype::bf16, memory_space::host, row_major), columns,
                          host_compact.data(), dtype::f32, 0.375f);
  const std::span<const std::int32_t> list(columns_dev.data<const std::int32_t>(), columns.size());
  zenflow::cuda_gather_columns(make_view(src.dev.data(), c, dtype::bf16, memory_space::device, row_major), list,
                               dev_compact.dev.data(), dtype::f32, scale.device(), nullptr);
  CHECK(dev_compact.from_device() == host_compact);
  zenflow::scatter_columns(host_compact.data(), dtype::f32, columns,
                           make_view(dst.host.data(), c, dtype::bf16, memory_space::host, row_major));
  zenflow::cuda_scatter_columns(dev_compact.dev.data(), dtype::f32, list,
                                make_view(dst.dev.data(), c, dtype::bf16, memory_space::device, row_major), nullptr);
  CHECK(dst.from_device() == dst.host);
}

}  // namespace

TEST_CASE("device gather/scatter where blocks walk several row tiles") {
  // Row-major: 32-row tiles, gridDim.y capped at 65535, so past 65535 x 32 < 2^21 rows a block
  // takes a second row tile.
  check_large_gather_scatter((index_t{1} << 21) + 40, 8, {1, 4, 6}, true);
  // Column-contiguous: kTile-row tiles, so past 65535 x kTile rows (a single column, 128 MiB of bf16).
  check_large_gather_scatter(index_t{65535} * sa::kTile + 1000, 1, {0}, false);
}

TEST_CASE("a parameter without a gradient is skipped with its own step count, as on the host") {
  // Two f32 matrices (column-contiguous, all columns selected) and a vector; each misses some
  // steps. Device and host must agree on every state value (within the device's last-bit pow
  // difference) and on every per-parameter count; a skipped parameter is bitwise untouched.
  zenflow::adam_options o;
  o.lr = 1e-2f;
  o.weight_decay = 0.01f;
  const index_t rows = 7, cols = 5, n = 9;
  const auto has = [](std::size_t i, int s) { return i == 0 ? s % 3 != 1 : i == 1 ? s % 2 == 0 : s % 4 != 3; };
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> p0(rows * cols), p1(rows * cols), v(n);
  for (auto* x : {&p0, &p1, &v})
    for (auto& e : *x) e = noise(rng);
  std::vector<std::int32_t> all(cols);
  std::iota(all.begin(), all.end(), 0);
  std::vector<float> packed0(3 * rows * cols, 0.0f), packed1(packed0.size(), 0.0f);
  for (index_t c = 0; c < cols; ++c)
    for (index_t r = 0; r < rows; ++r) {
      packed0[sa::packed_index(rows, c, 0, r)] = p0[c * rows + r];
      packed1[sa::packed_index(rows, c, 0, r)] = p1[c * rows + r];
    }
  zenflow_test::cuda_stream owned;
  const cudaStream_t stream = owned.get();
  std::vector<float> hp0 = p0, hp1 = p1, hv = v;
  zenflow::host_sparse_adam host(o);
  host.add_matrix(zenflow::matrix_view::column_contiguous(hp0.data(), rows, cols, dtype::f32), all, packed0);
  host.add_matrix(zenflow::matrix_view::column_contiguous(hp1.data(), rows, cols, dtype::f32), all, packed1);
  host.add_vector(zenflow::vector_view{hv.data(), n, dtype::f32}, v);
  zenflow_test::device_buffer dp0(p0.size() * 4), dp1(p1.size() * 4), dv(v.size() * 4), packed_dev(packed0.size() * 4);
  zenflow_test::device_buffer dg0(p0.size() * 4), dg1(p1.size() * 4), dgv(v.size() * 4);
  zenflow_test::upload(dp0.data(), p0.data(), p0.size() * 4);
  zenflow_test::upload(dp1.data(), p1.data(), p1.size() * 4);
  zenflow_test::upload(dv.data(), v.data(), v.size() * 4);
  zenflow::cuda_sparse_adam device(o);
  zenflow_test::upload(packed_dev.data(), packed0.data(), packed0.size() * 4);
  device.add_matrix(zenflow::matrix_view::column_contiguous(dp0.data(), rows, cols, dtype::f32, memory_space::device),
                    all, packed_dev.data<const float>(), stream);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  zenflow_test::upload(packed_dev.data(), packed1.data(), packed1.size() * 4);
  device.add_matrix(zenflow::matrix_view::column_contiguous(dp1.data(), rows, cols, dtype::f32, memory_space::device),
                    all, packed_dev.data<const float>(), stream);
  device.add_vector(zenflow::vector_view{dv.data(), n, dtype::f32, memory_space::device}, v, stream);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<float> g0(p0.size()), g1(p1.size()), gv(v.size());
  const auto read_p1 = [&] {
    std::vector<float> out(p1.size());
    ZENFLOW_CUDA_TRY(cudaMemcpy(out.data(), dp1.data(), out.size() * 4, cudaMemcpyDeviceToHost));
    return out;
  };
  for (int s = 0; s < 12; ++s) {
    for (auto* x : {&g0, &g1, &gv})
      for (auto& e : *x) e = noise(rng);
    zenflow_test::upload(dg0.data(), g0.data(), g0.size() * 4);
    zenflow_test::upload(dg1.data(), g1.data(), g1.size() * 4);
    zenflow_test::upload(dgv.data(), gv.data(), gv.size() * 4);
    auto view = [&](bool given, const void* data) {
      return given ? zenflow::const_matrix_view::column_contiguous(data, rows, cols, dtype::f32)
                   : zenflow::const_matrix_view{};
    };
    const zenflow::const_matrix_view hm[] = {view(has(0, s), g0.data()), view(has(1, s), g1.data())};
    const zenflow::const_vector_view hvg[] = {has(2, s) ? zenflow::const_vector_view{gv.data(), n, dtype::f32}
                                                        : zenflow::const_vector_view{}};
    zenflow::const_matrix_view dm[] = {view(has(0, s), dg0.data()), view(has(1, s), dg1.data())};
    for (auto& m : dm) m.space = memory_space::device;
    const zenflow::const_vector_view dvg[] = {
        has(2, s) ? zenflow::const_vector_view{dgv.data(), n, dtype::f32, memory_space::device}
                  : zenflow::const_vector_view{}};
    const auto before = read_p1();
    CHECK(host.step(hm, hvg));
    device.step(dm, dvg, 1.0f, nullptr, nullptr, false, stream);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    if (!has(1, s)) CHECK(read_p1() == before);  // untouched
  }
  CHECK(device.step_count() == 12);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(device.step_count(i) == host.step_count(i));
    const index_t size = i < 2 ? 3 * rows * cols : 3 * n;
    std::vector<float> hs(static_cast<std::size_t>(size)), ds(hs.size());
    host.export_state(i, hs);
    device.export_state(i, ds);
    std::int64_t worst = 0;
    for (std::size_t e = 0; e < hs.size(); ++e) worst = std::max(worst, ulps(hs[e], ds[e]));
    CHECK(worst <= 1);
  }
  CHECK(host.step_count(0) == 8);
  CHECK(host.step_count(1) == 6);
  CHECK(host.step_count(2) == 9);
}

TEST_CASE(
    "many parameters over many blocks: per-parameter step counts, lr, betas, eps and weight decay, as on the "
    "host") {
  // 40 parameters whose tiles add up to more than 4x the blocks of 256 threads the device can keep
  // resident, so every block of the persistent grid walks tiles of several parameters. They miss
  // their gradient in different steps (their step counts, hence their bias corrections, differ
  // from one parameter to the next, including between the parameters one block walks), and each
  // has its own lr, betas, eps and weight decay (parameter groups; neighbours at the same step
  // differ in their betas or eps). Device and host must agree on every state
  // value (within the device's last-bit pow difference) and on every count.
  // Mutations this test is to be seen failing on a GPU (compiled here, not run):
  //   1. kernels.cuh, sparse_adam_step_kernel: delete the __syncthreads() before thread 0 counts
  //      the block done (a block's lagging warps then read step counts the grid's last block
  //      already advanced, and a barrier inside the tile loop is reached by some warps only);
  //      also run under `compute-sanitizer --tool synccheck`;
  //   2. kernels.cuh: hand set_lr_and_weight_decay ctl.options.lr and ctl.options.weight_decay
  //      instead of the parameter's d.lr and d.weight_decay;
  //   3. cuda_sparse_adam_impl.cuh: leave ctl.betas_differ false (the kernel then recomputes a
  //      block's constants at a new step only, and neighbours at one step share the first's betas).
  const long long resident = zenflow_test::max_resident_blocks(sa::kThreads);
  const int count = 40, vectors = 4, steps = 12;
  const index_t rows = 1024;
  const index_t k = std::max<index_t>(2, (4 * resident / count + 1) * sa::kTile / rows);
  // Parameter i misses its gradient every (2 + i % 5)-th step, phase-shifted by i: 6 distinct step
  // counts over the 44 parameters (6 to 11 of 12), neighbours differ; the last step has them all.
  const auto has = [](int i, int s) { return (s + i) % (2 + i % 5) != 0 || s == 11; };
  std::mt19937 rng(41);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  zenflow::adam_options base;
  base.lr = 1e-3f;
  base.weight_decay = 0.01f;
  zenflow::host_sparse_adam host(base);
  zenflow::cuda_sparse_adam device(base);
  zenflow_test::cuda_stream owned;
  const cudaStream_t stream = owned.get();
  struct parameter {
    index_t cols;
    bool row_major;
    std::vector<float> host_values, grad;
    zenflow_test::device_buffer values, grad_dev;
  };
  std::vector<parameter> ps(static_cast<std::size_t>(count + vectors));
  std::int64_t tiles = 0;
  for (int i = 0; i < count + vectors; ++i) {
    auto& p = ps[static_cast<std::size_t>(i)];
    const bool vector = i >= count;
    p.cols = vector ? 1 : k + 1 + i % 5;
    p.row_major = !vector && i % 3 == 0;
    const std::size_t n = static_cast<std::size_t>(rows * p.cols);
    p.host_values.resize(n);
    for (auto& x : p.host_values) x = noise(rng);
    p.grad.resize(n);
    p.values = zenflow_test::device_buffer(n * 4);
    p.grad_dev = zenflow_test::device_buffer(n * 4);
    zenflow_test::upload(p.values.data(), p.host_values.data(), n * 4);
    const matrix_case c{rows, p.cols, k, p.row_major, dtype::f32, dtype::f32};
    if (vector) {
      const std::vector<float> master = p.host_values;
      host.add_vector(zenflow::vector_view{p.host_values.data(), rows, dtype::f32}, master);
      device.add_vector(zenflow::vector_view{p.values.data(), rows, dtype::f32, memory_space::device}, master, stream);
      tiles += (rows + sa::kTile - 1) / sa::kTile;
    } else {
      const auto selection = random_selection(p.cols, k, rng);
      std::vector<float> packed(static_cast<std::size_t>(3 * rows * k));
      for (index_t j = 0; j < k; ++j)
        for (index_t r = 0; r < rows; ++r) {
          const index_t col = selection[static_cast<std::size_t>(j)];
          packed[sa::packed_index(rows, j, 0, r)] =
              p.host_values[static_cast<std::size_t>(p.row_major ? r * p.cols + col : col * rows + r)];
          packed[sa::packed_index(rows, j, 1, r)] = 0.01f * noise(rng);
          packed[sa::packed_index(rows, j, 2, r)] = 1e-4f * std::fabs(noise(rng));
        }
      zenflow_test::device_buffer packed_dev(packed.size() * 4);
      zenflow_test::upload(packed_dev.data(), packed.data(), packed.size() * 4);
      host.add_matrix(make_view(p.host_values.data(), c, dtype::f32, memory_space::host, p.row_major), selection,
                      packed);
      device.add_matrix(make_view(p.values.data(), c, dtype::f32, memory_space::device, p.row_major), selection,
                        packed_dev.data<const float>(), stream);
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // packed_dev goes out of scope
      tiles += (rows * k + sa::kTile - 1) / sa::kTile;
    }
    zenflow::adam_options own = base;
    own.lr = 1e-3f * static_cast<float>(1 + i % 7);
    own.weight_decay = 0.02f * static_cast<float>(i % 4);
    own.beta1 = i % 3 == 0 ? 0.8f : 0.9f;
    own.beta2 = i % 4 == 1 ? 0.99f : 0.999f;
    own.eps = i % 5 == 2 ? 1e-6f : 1e-8f;
    host.set_options(static_cast<std::size_t>(i), own);
    device.set_options(static_cast<std::size_t>(i), own);
  }
  REQUIRE(tiles > 4 * resident);
  for (int s = 0; s < steps; ++s) {
    std::vector<zenflow::const_matrix_view> hm, dm;
    std::vector<zenflow::const_vector_view> hv, dv;
    for (int i = 0; i < count + vectors; ++i) {
      auto& p = ps[static_cast<std::size_t>(i)];
      const bool given = has(i, s);
      if (given) {
        for (auto& g : p.grad) g = 0.1f * noise(rng);
        zenflow_test::upload(p.grad_dev.data(), p.grad.data(), p.grad.size() * 4);
      }
      const matrix_case c{rows, p.cols, k, p.row_major, dtype::f32, dtype::f32};
      if (i >= count) {
        hv.push_back(given ? zenflow::const_vector_view{p.grad.data(), rows, dtype::f32}
                           : zenflow::const_vector_view{});
        dv.push_back(given ? zenflow::const_vector_view{p.grad_dev.data(), rows, dtype::f32, memory_space::device}
                           : zenflow::const_vector_view{});
      } else {
        // The gradient in the other layout for every other parameter.
        const bool layout = i % 2 == 0 ? p.row_major : !p.row_major;
        hm.push_back(given ? make_view(p.grad.data(), c, dtype::f32, memory_space::host, layout)
                           : zenflow::const_matrix_view{});
        dm.push_back(given ? make_view(p.grad_dev.data(), c, dtype::f32, memory_space::device, layout)
                           : zenflow::const_matrix_view{});
      }
    }
    CHECK(host.step(hm, hv));
    device.step(dm, dv, 1.0f, nullptr, nullptr, false, stream);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));  // the gradients are refilled next step
  }
  CHECK(device.step_count() == steps);
  std::set<std::int64_t> distinct;
  for (int i = 0; i < count + vectors; ++i) {
    CAPTURE(i);
    const auto u = static_cast<std::size_t>(i);
    CHECK(device.step_count(u) == host.step_count(u));
    distinct.insert(host.step_count(u));
    std::vector<float> hs(static_cast<std::size_t>(3 * rows * host.k(u))), ds(hs.size());
    host.export_state(u, hs);
    device.export_state(u, ds);
    std::int64_t worst = 0;
    for (std::size_t e = 0; e < hs.size(); ++e) worst = std::max(worst, ulps(hs[e], ds[e]));
    CHECK(worst <= 1);
  }
  CHECK(distinct.size() == 6);  // the parameters did step at different counts (6 to 11)
}
