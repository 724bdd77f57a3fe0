// One test per defect known from other ZenFlow / ZeRO-Offload implementations, each written so
// that it fails when the defect is put back into zenflow:
//   - the step counter that bias correction uses stops at 256 (a bf16 counter);
//   - bf16 moments that never decay;
//   - optimizer state lost or truncated when columns move between the GPU and the CPU;
//   - staleness that silently becomes two intervals;
//   - a gradient staging buffer reused while the CPU still reads it;
//   - selected (GPU) gradients never clipped;
//   - PCIe traffic other than the unselected columns' gradients and the CPU columns' parameters;
//   - "auto" update interval dividing by zero;
//   - synchronizations of the trainer's stream on every step;
//   - two writers of the fp32 master at once (a CPU update and a reselection's migration);
//   - pinning lost (a per-step copy between device memory and pageable host memory);
//   - a hang when a selection is empty (DeepSpeed's PR 8012): a data-parallel rank owning none
//     of a parameter's CPU columns, or a parameter without a selection, must still make every
//     collective its peers make (multi-rank: tests/mpi/test_coordinator_data_parallel.cpp).
#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>
#include <zenflow/sparse_adam.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "coordinator_harness.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

// fp64 Adam/AdamW of one element (the reference every implementation is held to).
struct adam64 {
  double p = 0.0, m = 0.0, v = 0.0;
  void step(double g, const adam_options& o, std::int64_t t) {
    m = o.beta1 * m + (1.0 - o.beta1) * g;
    v = o.beta2 * v + (1.0 - o.beta2) * g * g;
    const double bc1 = 1.0 - std::pow(static_cast<double>(o.beta1), static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(t));
    p -= o.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + o.eps) + o.lr * o.weight_decay * p;
  }
};

// A host backend that counts what the coordinator does to the trainer's stream.
struct counting_backend : host_backend {
  static inline host_stream* trainer = nullptr;
  static inline std::atomic<int> stream_syncs{0};
  static inline std::atomic<int> copies{0};
  static void synchronize(stream_type stream) {
    if (stream == trainer) ++stream_syncs;
    host_backend::synchronize(stream);
  }
  static void synchronize(const event_type& event) { host_backend::synchronize(event); }
  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_type stream) {
    if (stream == trainer) ++copies;
    host_backend::copy_async(dst, src, bytes, stream);
  }
};

// A host backend whose offload worker is slow to start each gradient's copies: the trainer runs
// ahead of it as far as the schedule lets it.
struct slow_offload_backend : host_backend {
  static void wait(stream_type stream, const event_type& event) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    host_backend::wait(stream, event);
  }
};

// A CPU optimizer whose updates take a while and that counts every access to its state for
// writing (migration, checkpoint load) made while an update runs on another thread: two writers
// of the fp32 master at once.
struct watched_cpu_adam : cpu_adam {
  using cpu_adam::cpu_adam;
  static inline std::atomic<int> updating{0};
  static inline std::atomic<int> overlaps{0};
  static inline std::atomic<int> state_moves{0};  // export_state / import_state calls
  cpu_step_result step(std::span<const cpu_adam_task> tasks, float grad_scale, bool check_finite) {
    ++updating;
    std::this_thread::sleep_for(std::chrono::milliseconds(15));
    const auto result = cpu_adam::step(tasks, grad_scale, check_finite);
    --updating;
    return result;
  }
  std::span<float> params(std::size_t t) { return note(cpu_adam::params(t)); }
  std::span<const float> params(std::size_t t) const { return cpu_adam::params(t); }
  void export_state(std::size_t t, std::span<const std::int32_t> columns, std::span<float> out) const {
    note();
    ++state_moves;
    cpu_adam::export_state(t, columns, out);
  }
  void import_state(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> in) {
    note();
    ++state_moves;
    cpu_adam::import_state(t, columns, in);
  }

 private:
  static std::span<float> note(std::span<float> state) {
    note();
    return state;
  }
  static void note() {
    if (updating.load() > 0) ++overlaps;
  }
};

// The host backend, telling "device" memory (device_buffer), pinned host memory (host_buffer)
// and everything else (pageable) apart, and counting copies between device and pageable memory:
// on a GPU such a copy is staged synchronously through a driver buffer (pinning lost).
struct pinning_backend : host_backend {
  static inline std::mutex mutex;
  static inline std::map<const std::byte*, std::pair<std::size_t, bool>> ranges;  // start: bytes, pinned
  static inline std::atomic<int> pageable_copies{0};

  static void add(const std::byte* p, std::size_t bytes, bool pinned) {
    if (p == nullptr) return;
    std::lock_guard lock(mutex);
    ranges[p] = {bytes, pinned};
  }
  static void drop(const std::byte* p) {
    if (p == nullptr) return;
    std::lock_guard lock(mutex);
    ranges.erase(p);
  }
  // 0: pageable host memory, 1: device memory, 2: pinned host memory.
  static int kind(const void* address) {
    const auto* p = static_cast<const std::byte*>(address);
    std::lock_guard lock(mutex);
    auto it = ranges.upper_bound(p);
    if (it == ranges.begin()) return 0;
    --it;
    if (p >= it->first + it->second.first) return 0;
    return it->second.second ? 2 : 1;
  }
  template <class Base, bool Pinned>
  class tracked : public Base {
   public:
    tracked() = default;
    explicit tracked(std::size_t bytes) : Base(bytes) { add(this->data(), bytes, Pinned); }
    tracked(tracked&&) noexcept = default;
    tracked& operator=(tracked&& other) noexcept {
      if (this != &other) {
        drop(this->data());
        Base::operator=(std::move(other));
      }
      return *this;
    }
    ~tracked() { drop(this->data()); }
  };
  using device_buffer = tracked<host_backend::device_buffer, false>;
  using host_buffer = tracked<host_backend::host_buffer, true>;

  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_type stream) {
    const int to = kind(dst), from = kind(src);
    if ((to == 1 && from == 0) || (from == 1 && to == 0)) ++pageable_copies;
    host_backend::copy_async(dst, src, bytes, stream);
  }
};

}  // namespace

TEST_CASE("defect: a step counter that stops at 256 (bias correction past step 256)") {
  adam_options o;
  o.lr = 1e-3f;
  o.weight_decay = 0.01f;
  host_sparse_adam opt(o);
  const index_t rows = 4, cols = 3;
  std::vector<std::uint16_t> param(rows * cols);  // bf16, row-major
  std::vector<float> grad(rows * cols);
  std::vector<adam64> ref(rows * cols);
  auto view = matrix_view::row_major(param.data(), rows, cols, dtype::bf16);
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) {
      const float x = 0.1f * static_cast<float>((r * cols + c) % 7) - 0.3f;
      toy_model::store(view, r, c, x);
      ref[r * cols + c].p = x;
    }
  const std::vector<std::int32_t> selection = {0, 2};
  std::vector<float> packed;
  for (std::int32_t c : selection) {
    for (index_t r = 0; r < rows; ++r) packed.push_back(static_cast<float>(ref[r * cols + c].p));  // master
    for (int s = 0; s < 2 * rows; ++s) packed.push_back(0.0f);                                     // m, v
  }
  opt.add_matrix(view, selection, packed);
  std::mt19937 rng(3);
  std::normal_distribution<float> n01;
  const int steps = 300;
  for (int t = 1; t <= steps; ++t) {
    for (auto& g : grad) g = n01(rng);
    const const_matrix_view gv = const_matrix_view::row_major(grad.data(), rows, cols, dtype::f32);
    REQUIRE(opt.step(std::span(&gv, 1), {}));
    for (std::int32_t c : selection)
      for (index_t r = 0; r < rows; ++r) ref[r * cols + c].step(grad[r * cols + c], o, t);
  }
  CHECK(opt.step_count() == steps);
  std::vector<float> state(3 * rows * selection.size());
  opt.export_state(0, state);
  for (std::size_t j = 0; j < selection.size(); ++j)
    for (index_t r = 0; r < rows; ++r) {
      const auto& e = ref[r * cols + selection[j]];
      CHECK(state[j * 3 * rows + r] == doctest::Approx(e.p).epsilon(1e-5));  // master
    }
}

TEST_CASE("defect: bf16 moments that never decay") {
  // v decays by beta2 = 0.999 per step: 0.1 % is below half a bf16 ulp, so a bf16 moment would
  // stay where it is. The moments are fp32 whatever the parameter's dtype.
  adam_options o;
  host_sparse_adam opt(o);
  const index_t rows = 8;
  std::vector<std::uint16_t> param(rows, 0);
  std::vector<float> grad(rows, 0.0f);
  std::vector<float> master(rows, 0.5f);
  auto view = vector_view{param.data(), rows, dtype::bf16};
  opt.add_vector(view, master);
  const const_vector_view gv{grad.data(), rows, dtype::f32};
  std::fill(grad.begin(), grad.end(), 1.0f);
  for (int t = 0; t < 5; ++t) opt.step({}, std::span(&gv, 1));
  std::vector<float> s0(3 * rows);
  opt.export_state(0, s0);
  std::fill(grad.begin(), grad.end(), 0.0f);
  const int quiet = 50;
  for (int t = 0; t < quiet; ++t) opt.step({}, std::span(&gv, 1));
  std::vector<float> s1(3 * rows);
  opt.export_state(0, s1);
  for (index_t r = 0; r < rows; ++r) {
    CHECK(s1[rows + r] == doctest::Approx(s0[rows + r] * std::pow(0.9, quiet)).epsilon(1e-4));            // m
    CHECK(s1[2 * rows + r] == doctest::Approx(s0[2 * rows + r] * std::pow(0.999, quiet)).epsilon(1e-5));  // v
  }
}

TEST_CASE("defect: optimizer state lost or truncated when columns move (fp64 reference, same selections)") {
  // ZenFlow sync with frequent reselections and a hot set of columns that rotates, so columns
  // enter and leave the GPU. The fp64 reference follows the coordinator's selections and intervals
  // and keeps one state per column wherever it lives: a column whose GPU state was not copied back
  // into the CPU master (or was truncated to bf16 on the way) ends far from it.
  auto o = base_options();
  o.overlap_step = false;
  o.update_interval = interval_option::fixed(2);
  o.select_interval = interval_option::fixed(3);
  o.full_warm_up_rounds = 1;
  harness h(o);
  struct tracked {
    std::vector<adam64> state;        // column-major: c * rows + r
    std::vector<double> accumulator;  // the CPU columns' gradient sum of the current interval
  };
  std::vector<tracked> ref(h.model.weights.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const auto& w = h.model.weights[i];
    ref[i].state.resize(w.rows * w.cols);
    ref[i].accumulator.assign(w.rows * w.cols, 0.0);
    for (index_t r = 0; r < w.rows; ++r)
      for (index_t c = 0; c < w.cols; ++c) ref[i].state[c * w.rows + r].p = w.master0[r * w.cols + c];
  }
  std::int64_t gpu_t = 0, cpu_t = 0, accumulated = 0;
  std::mt19937 rng(11);
  std::normal_distribution<float> n01;
  std::set<std::pair<std::size_t, std::int32_t>> left_gpu;
  std::vector<std::vector<std::int32_t>> previous(ref.size());
  const std::int64_t steps = 19;
  auto cpu_update = [&] {  // the CPU Adam on the mean gradient of the interval, on the CPU columns
    ++cpu_t;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const auto& w = h.model.weights[i];
      const auto sel = h.coordinator.gpu_columns(i);
      for (index_t c = 0; c < w.cols; ++c) {
        if (std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(c))) continue;
        for (index_t r = 0; r < w.rows; ++r) {
          auto& a = ref[i].accumulator[c * w.rows + r];
          ref[i].state[c * w.rows + r].step(a / static_cast<double>(accumulated), o.optimizer, cpu_t);
          a = 0.0;
        }
      }
    }
    accumulated = 0;
  };
  for (std::int64_t s = 0; s < steps; ++s) {
    h.stream.synchronize();
    for (auto& w : h.model.weights) {  // rotating hot columns, as the trainer's gradients
      matrix_view g{w.grad.data(),     w.rows, w.cols, w.view().row_stride, w.view().col_stride, w.type,
                    memory_space::host};
      for (index_t r = 0; r < w.rows; ++r)
        for (index_t c = 0; c < w.cols; ++c) toy_model::store(g, r, c, n01(rng) + ((c + s / 3) % 4 == 0 ? 6.0f : 0.0f));
    }
    for (auto& b : h.model.bias_grad) b = n01(rng);
    for (std::size_t i = 0; i <= h.model.weights.size(); ++i) h.submit(i);
    h.coordinator.step(&h.stream);
    ++gpu_t;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const auto& w = h.model.weights[i];
      const auto sel = h.coordinator.gpu_columns(i);
      for (std::int32_t c : previous[i])
        if (!std::binary_search(sel.begin(), sel.end(), c)) left_gpu.insert({i, c});
      previous[i].assign(sel.begin(), sel.end());
      for (index_t c = 0; c < w.cols; ++c) {
        const bool on_gpu = std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(c));
        for (index_t r = 0; r < w.rows; ++r) {
          const double g = toy_model::load(w.grad_view(), r, c);
          if (on_gpu)
            ref[i].state[c * w.rows + r].step(g, o.optimizer, gpu_t);
          else
            ref[i].accumulator[c * w.rows + r] += g;
        }
      }
    }
    ++accumulated;
    const auto trace = h.coordinator.trace();
    const bool interval_ended = !trace.empty() && trace.back().last_step == s;
    // A reselection at s + 1 ends the interval at s too: the trace shows it one step later.
    const bool cut = !interval_ended && s + 1 < steps && (s + 1 - o.full_warm_up_rounds) % 3 == 0;
    if (interval_ended || cut) cpu_update();
  }
  h.coordinator.finish(&h.stream);  // ends the last interval too
  if (accumulated > 0) cpu_update();
  REQUIRE(left_gpu.size() >= 4);  // columns did move back to the CPU
  const auto& cpu = h.coordinator.host_optimizer();
  CHECK(cpu.step_count() == cpu_t);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const auto& w = h.model.weights[i];
    const auto master = cpu.params(i);
    const auto sel = h.coordinator.gpu_columns(i);
    for (index_t c = 0; c < w.cols; ++c) {
      if (std::binary_search(sel.begin(), sel.end(), static_cast<std::int32_t>(c))) continue;
      for (index_t r = 0; r < w.rows; ++r) {
        const bool left = left_gpu.count({i, c}) > 0;
        INFO("weight " << i << " column " << c << " row " << r << " left the GPU: " << left);
        CHECK(master[c * w.rows + r] == doctest::Approx(ref[i].state[c * w.rows + r].p).epsilon(1e-5));
      }
    }
  }
}

TEST_CASE("defect: staleness that silently becomes two intervals") {
  // Many asynchronous intervals between two reselections, so that a result written back one
  // interval late is not hidden by a reselection's flush.
  SUBCASE("fixed") {
    auto o = base_options();
    o.update_interval = interval_option::fixed(2);
    o.select_interval = interval_option::fixed(12);
    harness h(o);
    h.train(30);
    h.finish();
    check_staleness(h.coordinator.trace(), 30, true);
  }
  SUBCASE("auto") {
    auto o = base_options();
    o.update_interval = interval_option::automatic();
    o.max_update_interval = 2;
    o.select_interval = interval_option::fixed(12);
    harness h(o);
    h.train(30);
    h.finish();
    const auto trace = h.coordinator.trace();
    CHECK(trace.size() >= 12);
    check_staleness(trace, 30, true);
  }
}

TEST_CASE("defect: a gradient staging buffer reused while the CPU still reads it") {
  // The offload worker is slow; the trainer must not gather into a staging buffer (or overwrite
  // a step's flags) that the worker has not copied yet. The result stays bit-identical.
  const auto o = base_options();
  harness fast(o);
  fast.train(14);
  basic_harness<basic_coordinator<slow_offload_backend>> slow(o);
  slow.train(14);
  CHECK(slow.finish() == fast.finish());
}

TEST_CASE("defect: selected gradients never clipped") {
  // Dense runs every column through the GPU path, ZeRO-Offload every matrix column through the
  // CPU path: with clipping both must scale by the same global factor. On the f32 weight and the
  // bias (no low-precision rounding between the two paths) they agree bit for bit.
  for (float max_norm : {0.5f, 2.0f}) {
    CAPTURE(max_norm);
    auto dense = zenflow_options::dense();
    dense.max_grad_norm = max_norm;
    auto zero = zenflow_options::zero_offload();
    zero.max_grad_norm = max_norm;
    harness a(dense), b(zero);
    a.train(9);
    b.train(9);
    a.finish();
    b.finish();
    CHECK(a.model.weights[1].storage == b.model.weights[1].storage);
    CHECK(a.model.bias == b.model.bias);
    harness unclipped(zenflow_options::dense());
    unclipped.train(9);
    unclipped.finish();
    CHECK(unclipped.model.weights[1].storage != a.model.weights[1].storage);  // the clip was active
  }
}

TEST_CASE("defect: PCIe traffic other than the unselected columns (independent byte count)") {
  struct setting {
    const char* name;
    zenflow_options options;
  };
  auto sync = base_options();
  sync.overlap_step = false;
  sync.select_interval = interval_option::fixed(4);
  auto async = base_options();
  auto all_gpu = base_options();
  all_gpu.topk_ratio = 1.0f;
  auto warm = base_options();
  warm.full_warm_up_rounds = 3;
  // Members, not structured bindings: doctest's CAPTURE captures them in a lambda, which clang
  // before 16 refuses for a binding.
  for (const setting& each : {setting{"sync", sync}, setting{"async", async}, setting{"all on the GPU", all_gpu},
                              setting{"dense", zenflow_options::dense()}, setting{"warm-up", warm}}) {
    const char* const name = each.name;
    const zenflow_options& o = each.options;
    CAPTURE(name);
    harness h(o);
    std::vector<std::vector<std::int32_t>> before(h.model.weights.size());
    std::vector<update_record> trace_before;
    for (std::int64_t s = 0; s < 16; ++s) {
      h.train(1);
      const auto& m = h.coordinator.metrics();
      // Write-backs of this step that applied an update (a reselection may flush two).
      const auto trace = h.coordinator.trace();
      std::uint64_t write_backs = 0;
      for (std::size_t r = 0; r < trace.size(); ++r)
        if (trace[r].write_backs == 1 && trace[r].accumulated_steps > 0 &&
            (r >= trace_before.size() || trace_before[r].write_backs == 0))
          ++write_backs;
      trace_before = trace;
      std::uint64_t d2h = 0, h2d = 0;
      for (std::size_t i = 0; i < h.model.weights.size(); ++i) {
        const auto& w = h.model.weights[i];
        const auto sel = h.coordinator.gpu_columns(i);
        const std::uint64_t cpu_cols = static_cast<std::uint64_t>(w.cols) - sel.size();
        d2h += cpu_cols * w.rows * dtype_size(w.type);                // this step's CPU-column gradients (grad dtype)
        h2d += write_backs * cpu_cols * w.rows * dtype_size(w.type);  // the CPU columns' parameters
        const std::vector<std::int32_t> now(sel.begin(), sel.end());
        std::vector<std::int32_t> entering, leaving;
        std::set_difference(now.begin(), now.end(), before[i].begin(), before[i].end(), std::back_inserter(entering));
        std::set_difference(before[i].begin(), before[i].end(), now.begin(), now.end(), std::back_inserter(leaving));
        h2d += entering.size() * 3 * w.rows * sizeof(float);  // fp32 master, m, v of each column moving in
        d2h += leaving.size() * 3 * w.rows * sizeof(float);
        before[i] = now;
      }
      INFO("step " << s << ": " << m);
      CHECK(m.bytes_device_to_host == d2h);
      CHECK(m.bytes_host_to_device == h2d);
      if (o.mode == offload_mode::dense || o.topk_ratio == 1.0f) {
        if (s > 0) CHECK(m.bytes_device_to_host + m.bytes_host_to_device == 0);  // nothing to move
      }
    }
  }
}

TEST_CASE("defect: an auto update interval that divides by zero") {
  SUBCASE("no unimportant gradient mass") {
    auto o = base_options();
    o.update_interval = interval_option::automatic();
    o.max_update_interval = 5;
    harness h(o);
    for (int s = 0; s < 8; ++s) {
      h.backward();
      for (auto& w : h.model.weights) std::fill(w.grad.begin(), w.grad.end(), std::byte{0});  // all zero
      for (std::size_t i = 0; i <= h.model.weights.size(); ++i) h.submit(i);
      h.coordinator.step(&h.stream);
      CHECK(h.coordinator.metrics().interval == 5);  // the bound
    }
    h.finish();
    check_staleness(h.coordinator.trace(), 8, true);
  }
  SUBCASE("every column selected") {
    auto o = base_options();
    o.update_interval = interval_option::automatic();
    o.max_update_interval = 4;
    o.topk_ratio = 1.0f;
    harness h(o);
    h.train(6);
    CHECK(h.coordinator.metrics().interval == 4);
    h.finish();
  }
  SUBCASE("no 2-D parameter") {
    auto o = base_options();
    o.update_interval = interval_option::automatic();
    o.max_update_interval = 3;
    host_stream stream;
    host_coordinator c(o);
    std::vector<float> b(6, 1.0f), g(6, 0.5f), b0(6, 1.0f);
    c.register_parameter("bias", vector_view{b.data(), 6, dtype::f32}, b0);
    for (int s = 0; s < 5; ++s) {
      stream.synchronize();
      c.submit_gradient(0, const_vector_view{g.data(), 6, dtype::f32}, &stream);
      c.step(&stream);
      CHECK(c.metrics().interval >= 1);
      CHECK(c.metrics().interval <= 3);
    }
    c.finish(&stream);
    for (float x : b) CHECK(std::isfinite(x));
    CHECK(b[0] < 1.0f);
  }
}

TEST_CASE("defect: the trainer's stream synchronized on every step") {
  // Between selections a step enqueues its work and returns: no synchronization of the trainer's
  // stream and no copy on it (the flags reach the host without one). Selection steps synchronize
  // (the selection is read on the host).
  auto o = base_options();
  o.select_interval = interval_option::fixed(6);
  basic_harness<basic_coordinator<counting_backend>> h(o);
  counting_backend::trainer = &h.stream;
  for (std::int64_t s = 0; s < 14; ++s) {
    h.backward();
    counting_backend::stream_syncs = 0;
    counting_backend::copies = 0;
    for (std::size_t i = 0; i <= h.model.weights.size(); ++i) h.submit(i);
    h.coordinator.step(&h.stream);
    INFO("step " << s);
    if (!h.coordinator.metrics().reselected) {
      CHECK(counting_backend::stream_syncs == 0);
      CHECK(counting_backend::copies == 0);
    }
  }
  h.finish();
  counting_backend::trainer = nullptr;
}

TEST_CASE("defect: two writers of the fp32 master at once (a CPU update and a reselection's migration)") {
  // A reselection moves the state of the columns that enter and leave the selection in and out
  // of the CPU optimizer; an asynchronous CPU update of the same tensors may still run then. The
  // migration must wait for it (and write its result back first), or both write the fp32 master,
  // m and v of the same columns at once. The CPU updates here take 15 ms, so an unfinished one is
  // running at every reselection.
  auto o = base_options();
  o.select_interval = interval_option::fixed(3);
  watched_cpu_adam::overlaps = 0;
  watched_cpu_adam::state_moves = 0;
  basic_harness<basic_coordinator<host_backend, watched_cpu_adam>> h(o);
  int reselections = 0;
  for (int s = 0; s < 20; ++s) {
    h.train(1);
    reselections += h.coordinator.metrics().reselected;
  }
  h.finish();
  CHECK(reselections >= 5);
  CHECK(watched_cpu_adam::state_moves.load() > 0);  // the migrations went through the watched calls
  CHECK(watched_cpu_adam::overlaps.load() == 0);
}

TEST_CASE("defect: pinning lost (a per-step copy between device memory and pageable host memory)") {
  // Between selections a step copies nothing through pageable host memory: the offload and the
  // write-back go through the pinned slots of the transfer queues, the step's flags are written
  // into mapped pinned memory, and (data parallel) the agreement on which parameters got
  // gradients goes through a pinned buffer. The GPU half (cudaHostGetFlags on those buffers) is
  // in tests/gpu/test_transfer_queue.cu.
  auto o = base_options();
  o.select_interval = interval_option::fixed(6);
  auto run = [&](auto& h) {
    int checked = 0;
    for (int s = 0; s < 14; ++s) {
      h.backward();
      pinning_backend::pageable_copies = 0;
      for (std::size_t i = 0; i <= h.model.weights.size(); ++i) h.submit(i);
      h.coordinator.step(&h.stream);
      INFO("step " << s);
      if (s == 0 || h.coordinator.metrics().reselected) continue;
      ++checked;
      CHECK(pinning_backend::pageable_copies.load() == 0);
    }
    h.finish();
    CHECK(checked >= 10);
  };
  SUBCASE("one process") {
    basic_harness<basic_coordinator<pinning_backend>> h(o);
    run(h);
  }
  SUBCASE("one rank of a data-parallel group") {
    self_communicator comm;
    basic_harness<basic_coordinator<pinning_backend, cpu_adam, self_communicator>> h(o, harness::small_config(), comm);
    run(h);
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
