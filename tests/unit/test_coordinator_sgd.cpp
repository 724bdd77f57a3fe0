// A second optimizer of another kind through the coordinator: SGD with momentum (torch.optim.SGD,
// dampening 0), with two state slots (master, momentum_buffer) where Adam has three, or without
// momentum with the master alone (one slot), its own
// hyper-parameters (lr and weight_decay per group; momentum and nesterov shared), a CPU optimizer
// and a sparse-column twin for the host backend, and no line of the coordinator written for it
// (docs/OPTIMIZERS.md). Dense and ZeRO-Offload train bit for bit like a plain SGD loop, ZenFlow
// converges with reselections migrating two-slot state, checkpoints resume bit-identically.
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;

namespace {

struct sgd_options {
  float lr = 0.01f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  friend bool operator==(const sgd_options&, const sgd_options&) = default;

  static constexpr const char* name = "sgd";
  static constexpr std::array<hyper_parameter_field<sgd_options>, 4> fields() noexcept {
    return {real_field("lr", &sgd_options::lr, true), real_field("momentum", &sgd_options::momentum, false),
            real_field("weight_decay", &sgd_options::weight_decay, true),
            flag_field("nesterov", &sgd_options::nesterov, false)};
  }
  void validate() const {
    expects(std::isfinite(lr) && lr >= 0.0f, "lr", "must be finite and >= 0, got ", lr);
    expects(std::isfinite(momentum) && momentum >= 0.0f, "momentum", "must be finite and >= 0, got ", momentum);
    expects(std::isfinite(weight_decay) && weight_decay >= 0.0f, "weight_decay", "must be finite and >= 0, got ",
            weight_decay);
    expects(!nesterov || momentum > 0.0f, "nesterov", "requires momentum > 0");
  }
};
static_assert(optimizer_hyper_parameters<sgd_options>);

struct sgd_state_slots {
  static constexpr std::array<std::string_view, 2> names{"master", "momentum_buffer"};
  static constexpr std::size_t count = names.size();
  static constexpr std::string_view what = "momentum buffer";
  static constexpr std::string_view rule = "momentum_buffer finite";
  static bool valid(const float* own) noexcept { return std::isfinite(own[0]); }
};
static_assert(state_slots<sgd_state_slots>);
// SGD without momentum keeps no state of its own: the master is its only slot.
struct plain_sgd_slots {
  static constexpr std::array<std::string_view, 1> names{"master"};
  static constexpr std::size_t count = names.size();
  static constexpr std::string_view what = "no state";
  static constexpr std::string_view rule = "nothing";
  static bool valid(const float*) noexcept { return true; }
};
static_assert(state_slots<plain_sgd_slots>);

// Whether an optimizer over these slots keeps the momentum buffer in its exchange form; without it
// momentum must be 0 (the buffer is then the step's gradient and carries nothing over).
template <class Slots>
constexpr bool buffered = Slots::count == 2;
template <class Slots>
void check_momentum(const sgd_options& o) {
  expects(buffered<Slots> || o.momentum == 0.0f, "momentum", "must be 0 without a momentum_buffer slot, got ",
          o.momentum);
}

// One element: torch.optim.SGD (dampening 0; a zero buffer on the first step equals torch's clone).
void sgd_update(float& p, float& buf, float g, const sgd_options& o) {
  g = g + o.weight_decay * p;
  buf = o.momentum * buf + g;
  const float d = o.nesterov ? g + o.momentum * buf : buf;
  p = p - o.lr * d;
}

using detail::sparse_adam::load_as_float;     // an element of any dtype as float
using detail::sparse_adam::store_from_float;  // rounded to nearest even to the buffer's dtype

int full_layout_tasks = 0;  // CPU tasks on the in-place path (a gradient in the whole layout)

// ---- the CPU optimizer (host_optimizer) ----
template <class Slots>
class cpu_sgd {
 public:
  using hyper_parameters = sgd_options;
  using slots_type = Slots;
  cpu_sgd(const sgd_options& hp, const cpu_adam_config& = {}) : options_(hp) {
    hp.validate();
    check_momentum<Slots>(hp);
  }

  std::size_t add_tensor(std::span<const float> initial, index_t rows, index_t cols) {
    expects(rows >= 1 && cols >= 1 && initial.size() == static_cast<std::size_t>(rows * cols), "initial",
            "size mismatch");
    tensors_.push_back({rows, cols, {initial.begin(), initial.end()}, std::vector<float>(initial.size(), 0.0f)});
    return tensors_.size() - 1;
  }
  void export_state(std::size_t t, std::span<const std::int32_t> columns, std::span<float> out) const {
    const tensor& x = at(t);
    const std::size_t n = columns.size() * x.rows;
    expects(out.size() == Slots::count * n, "out", "holds ", out.size(), " floats, needs ", Slots::count * n);
    for (std::size_t j = 0; j < columns.size(); ++j)
      for (index_t r = 0; r < x.rows; ++r) {
        out[j * x.rows + r] = x.master[columns[j] * x.rows + r];
        if constexpr (buffered<Slots>) out[n + j * x.rows + r] = x.buf[columns[j] * x.rows + r];
      }
  }
  void import_state(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> in) {
    tensor& x = at(t);
    const std::size_t n = columns.size() * x.rows;
    expects(in.size() == Slots::count * n, "in", "holds ", in.size(), " floats, needs ", Slots::count * n);
    if constexpr (buffered<Slots>)
      for (std::size_t e = 0; e < n; ++e)
        expects(slots_type::valid(&in[n + e]), "in", "momentum_buffer not finite at ", e);
    for (std::size_t j = 0; j < columns.size(); ++j)
      for (index_t r = 0; r < x.rows; ++r) {
        x.master[columns[j] * x.rows + r] = in[j * x.rows + r];
        if constexpr (buffered<Slots>) x.buf[columns[j] * x.rows + r] = in[n + j * x.rows + r];
      }
  }
  bool step(std::span<const optimizer_task<sgd_options>> tasks, float grad_scale, bool check_finite) {
    auto each = [&](auto&& fn) {
      for (const auto& task : tasks) {
        tensor& x = at(task.tensor);
        const float scale = grad_scale * task.grad_scale;
        const std::size_t n = task.columns.empty() ? static_cast<std::size_t>(x.cols) : task.columns.size();
        for (std::size_t j = 0; j < n; ++j) {
          const index_t c = task.columns.empty() ? static_cast<index_t>(j) : task.columns[j];
          for (index_t r = 0; r < x.rows; ++r) {
            const index_t gi = (task.grad_compact ? static_cast<index_t>(j) : c) * x.rows + r;
            const index_t oi = (task.out_compact ? static_cast<index_t>(j) : c) * x.rows + r;
            fn(task, x, c * x.rows + r, load_as_float(task.grad, task.grad_type, gi) * scale, oi);
          }
        }
      }
    };
    for (const auto& task : tasks) full_layout_tasks += !task.grad_compact;
    bool finite = true;
    if (check_finite) each([&](auto&, auto&, index_t, float g, index_t) { finite = finite && std::isfinite(g); });
    if (!finite) return false;
    each([&](const optimizer_task<sgd_options>& task, tensor& x, index_t e, float g, index_t oi) {
      sgd_update(x.master[e], x.buf[e], g, task.options ? *task.options : options_);
      if (task.copy_out) store_from_float(task.copy_out, task.copy_out_type, oi, x.master[e]);
    });
    ++step_;
    return true;
  }
  [[nodiscard]] std::int64_t step_count() const noexcept { return step_; }
  void set_step_count(std::int64_t n) {
    expects(n >= 0, "step", "must be >= 0");
    step_ = n;
  }
  [[nodiscard]] const sgd_options& options() const noexcept { return options_; }
  [[nodiscard]] std::span<const float> params(std::size_t t) const { return at(t).master; }

 private:
  struct tensor {
    index_t rows, cols;
    std::vector<float> master, buf;  // column-contiguous
  };
  const tensor& at(std::size_t t) const {
    expects(t < tensors_.size(), "t", "tensor index out of range");
    return tensors_[t];
  }
  tensor& at(std::size_t t) { return const_cast<tensor&>(std::as_const(*this).at(t)); }
  sgd_options options_;
  std::int64_t step_ = 0;
  std::vector<tensor> tensors_;
};

// ---- the sparse-column "device" optimizer (basic_host_backend<sparse_sgd>) ----
template <class Slots>
class sparse_sgd {
 public:
  using hyper_parameters = sgd_options;
  using slots_type = Slots;
  static constexpr std::size_t S = Slots::count;  // floats per element in the exchange layout
  explicit sparse_sgd(const sgd_options& o) : options_(o) {
    o.validate();
    check_momentum<Slots>(o);
  }

  std::size_t add_matrix(matrix_view param, std::span<const std::int32_t> selection, std::span<const float> packed,
                         const host_execution& = {}) {
    param.validate("param", memory_space::host);
    expects(!selection.empty() && static_cast<index_t>(selection.size()) <= param.cols, "selection", "bad k");
    for (std::size_t j = 0; j < selection.size(); ++j)
      expects(selection[j] >= 0 && selection[j] < param.cols && (j == 0 || selection[j - 1] < selection[j]),
              "selection", "must be strictly ascending and in range");
    entries_.push_back(make_entry(false, param, {selection.begin(), selection.end()}));
    ++matrix_count_;
    import_state(entries_.size() - 1, packed);
    return entries_.size() - 1;
  }
  std::size_t add_vector(vector_view param, std::span<const float> initial) {
    param.validate("param", memory_space::host);
    expects(static_cast<index_t>(initial.size()) >= param.size, "initial", "too small");
    entries_.push_back(
        make_entry(true, matrix_view(param.data, param.size, 1, param.stride, 1, param.type, param.space), {0}));
    std::copy_n(initial.begin(), param.size, entries_.back().master.begin());
    return entries_.size() - 1;
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return entries_.size(); }
  [[nodiscard]] std::span<const std::int32_t> selection(std::size_t i) const { return at(i).selection; }
  [[nodiscard]] index_t k(std::size_t i) const { return static_cast<index_t>(at(i).selection.size()); }
  [[nodiscard]] const sgd_options& options() const noexcept { return options_; }
  [[nodiscard]] const sgd_options& options(std::size_t i) const { return at(i).options; }
  void set_options(const sgd_options& o) {
    o.validate();
    options_ = o;
    for (auto& e : entries_) e.options = o;
  }
  void set_options(std::size_t i, const sgd_options& o) {
    o.validate();
    const char* field = shared_field_mismatch(o, options_);
    expects(field == nullptr, field ? field : "options", per_group_rule<sgd_options>());
    at(i).options = o;
  }
  [[nodiscard]] std::int64_t step_count() const noexcept { return step_; }
  [[nodiscard]] std::int64_t step_count(std::size_t i) const { return at(i).steps; }
  void set_step_count(std::int64_t n) {
    expects(n >= 0, "step", "must be >= 0");
    step_ = n;
    for (auto& e : entries_) e.steps = n;
  }
  void set_step_count(std::size_t i, std::int64_t n) {
    expects(n >= 0, "step", "must be >= 0");
    at(i).steps = n;
  }

  bool step(std::span<const const_matrix_view> matrix_grads, std::span<const const_vector_view> vector_grads,
            float grad_scale = 1.0f, const float* scale_ptr = nullptr, const int* skip_flag = nullptr,
            bool check_finite = false, const host_execution& = {}) {
    expects(matrix_grads.size() == matrix_count_, "matrix_grads", "one view per matrix");
    expects(vector_grads.size() == entries_.size() - matrix_count_, "vector_grads", "one view per vector");
    std::vector<const_matrix_view> grads(entries_.size());
    std::size_t m = 0, v = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].is_vector) {
        const auto& g = vector_grads[v++];
        grads[i] = const_matrix_view(g.data, g.size, 1, g.stride, 1, g.type, g.space);
      } else {
        grads[i] = matrix_grads[m++];
      }
      if (grads[i].data != nullptr)
        expects(grads[i].rows == entries_[i].param.rows && grads[i].cols == entries_[i].param.cols, "grads",
                "shape mismatch");
    }
    if (entries_.empty() || (skip_flag && *skip_flag)) return false;
    const float scale = grad_scale * (scale_ptr ? *scale_ptr : 1.0f);
    if (!std::isfinite(scale) || scale < 0.0f) return false;
    auto each = [&](auto&& fn) {
      for (std::size_t i = 0; i < entries_.size(); ++i) {
        if (grads[i].data == nullptr) continue;
        entry& e = entries_[i];
        for (std::size_t j = 0; j < e.selection.size(); ++j)
          for (index_t r = 0; r < e.rows; ++r)
            fn(e, j * e.rows + r,
               load_as_float(grads[i].data, grads[i].type, grads[i].offset(r, e.selection[j])) * scale,
               e.param.offset(r, e.selection[j]));
      }
    };
    bool finite = true;
    if (check_finite) each([&](entry&, std::size_t, float g, index_t) { finite = finite && std::isfinite(g); });
    if (!finite) return false;
    each([&](entry& e, std::size_t s, float g, index_t po) {
      sgd_update(e.master[s], e.buf[s], g, e.options);
      store_from_float(e.param.data, e.param.type, po, e.master[s]);
    });
    for (std::size_t i = 0; i < entries_.size(); ++i)
      if (grads[i].data != nullptr) ++entries_[i].steps;
    ++step_;
    return true;
  }

  // Kept columns keep their state; entering (new \ old, ascending) from entering_in; leaving
  // (old \ new, ascending) to leaving_out. Device layout: column after column, slots in order.
  void reselect(std::size_t i, std::span<const std::int32_t> sel, std::span<const float> entering_in,
                std::span<float> leaving_out, const host_execution& = {}) {
    entry& e = at(i);
    expects(!e.is_vector && sel.size() == e.selection.size(), "new_selection", "must have k columns");
    const std::size_t rows = static_cast<std::size_t>(e.rows), k = sel.size();
    std::vector<float> master(k * rows), buf(k * rows);
    std::size_t in = 0;
    for (std::size_t j = 0; j < k; ++j) {
      const auto it = std::lower_bound(e.selection.begin(), e.selection.end(), sel[j]);
      if (it != e.selection.end() && *it == sel[j]) {
        const std::size_t o = static_cast<std::size_t>(it - e.selection.begin());
        std::copy_n(&e.master[o * rows], rows, &master[j * rows]);
        std::copy_n(&e.buf[o * rows], rows, &buf[j * rows]);
      } else {
        expects(entering_in.size() >= (in + 1) * S * rows, "entering_in", "too small");
        std::copy_n(&entering_in[(S * in) * rows], rows, &master[j * rows]);
        if constexpr (buffered<Slots>) std::copy_n(&entering_in[(S * in + 1) * rows], rows, &buf[j * rows]);
        ++in;
      }
    }
    std::size_t out = 0;
    for (std::size_t o = 0; o < k; ++o) {
      if (std::binary_search(sel.begin(), sel.end(), e.selection[o])) continue;
      expects(leaving_out.size() >= (out + 1) * S * rows, "leaving_out", "too small");
      std::copy_n(&e.master[o * rows], rows, &leaving_out[(S * out) * rows]);
      if constexpr (buffered<Slots>) std::copy_n(&e.buf[o * rows], rows, &leaving_out[(S * out + 1) * rows]);
      ++out;
    }
    e.master.swap(master);
    e.buf.swap(buf);
    e.selection.assign(sel.begin(), sel.end());
  }
  void export_state(std::size_t i, std::span<float> out, const host_execution& = {}) const {
    const entry& e = at(i);
    const std::size_t rows = static_cast<std::size_t>(e.rows);
    expects(out.size() >= S * rows * e.selection.size(), "packed_out", "too small");
    for (std::size_t j = 0; j < e.selection.size(); ++j) {
      std::copy_n(&e.master[j * rows], rows, &out[(S * j) * rows]);
      if constexpr (buffered<Slots>) std::copy_n(&e.buf[j * rows], rows, &out[(S * j + 1) * rows]);
    }
  }
  void import_state(std::size_t i, std::span<const float> in, const host_execution& = {}) {
    entry& e = at(i);
    const std::size_t rows = static_cast<std::size_t>(e.rows);
    expects(in.size() >= S * rows * e.selection.size(), "packed_in", "too small");
    for (std::size_t j = 0; j < e.selection.size(); ++j) {
      std::copy_n(&in[(S * j) * rows], rows, &e.master[j * rows]);
      if constexpr (buffered<Slots>) std::copy_n(&in[(S * j + 1) * rows], rows, &e.buf[j * rows]);
    }
  }

 private:
  struct entry {
    bool is_vector = false;
    matrix_view param;  // a vector: one column of `size` rows
    std::vector<std::int32_t> selection;
    index_t rows = 0;
    std::vector<float> master, buf;  // compact: selected column j at j * rows
    sgd_options options;
    std::int64_t steps = 0;
  };
  entry make_entry(bool is_vector, matrix_view param, std::vector<std::int32_t> sel) const {
    entry e{is_vector, param, std::move(sel), param.rows, {}, {}, options_, step_};
    e.master.assign(e.selection.size() * static_cast<std::size_t>(e.rows), 0.0f);
    e.buf.assign(e.master.size(), 0.0f);
    return e;
  }
  const entry& at(std::size_t i) const {
    expects(i < entries_.size(), "i", "parameter index out of range");
    return entries_[i];
  }
  entry& at(std::size_t i) { return const_cast<entry&>(std::as_const(*this).at(i)); }
  sgd_options options_;
  std::int64_t step_ = 0;
  std::vector<entry> entries_;  // matrices and vectors in registration order
  std::size_t matrix_count_ = 0;
};

template <class Slots>
using sgd_coordinator = basic_coordinator<basic_host_backend<sparse_sgd<Slots>>, cpu_sgd<Slots>>;
using sgd_zenflow_options = basic_zenflow_options<sgd_options>;
static_assert(host_optimizer<cpu_sgd<sgd_state_slots>> && host_optimizer<cpu_sgd<plain_sgd_slots>>);
static_assert(host_column_optimizer<sparse_sgd<sgd_state_slots>> && host_column_optimizer<sparse_sgd<plain_sgd_slots>>);
static_assert(coordinator_backend<basic_host_backend<sparse_sgd<plain_sgd_slots>>>);

constexpr index_t R = 16, C = 32;

// Fits W (R x C) and b (R) to fixed targets: the gradient is the weight minus its target.
struct model {
  std::vector<float> w = std::vector<float>(R * C), b = std::vector<float>(R), gw = w, gb = b, tw = w, tb = b;
  model() {
    for (index_t i = 0; i < R * C; ++i) {
      w[i] = 0.01f * static_cast<float>(i % 7);
      tw[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % C) / 8.0f);
    }
    for (index_t i = 0; i < R; ++i) tb[i] = 0.5f - 0.1f * static_cast<float>(i);
  }
  void grads() {
    for (std::size_t i = 0; i < w.size(); ++i) gw[i] = w[i] - tw[i];
    for (std::size_t i = 0; i < b.size(); ++i) gb[i] = b[i] - tb[i];
  }
  [[nodiscard]] float error() const {
    float e = 0;
    for (std::size_t i = 0; i < w.size(); ++i) e = std::max(e, std::abs(w[i] - tw[i]));
    for (std::size_t i = 0; i < b.size(); ++i) e = std::max(e, std::abs(b[i] - tb[i]));
    return e;
  }
};

template <class Slots = sgd_state_slots>
struct run {
  model m;
  host_stream stream;
  sgd_coordinator<Slots> zf;
  bool column_contiguous = false;  // W and its gradient column-contiguous: the CPU's in-place path
  explicit run(const sgd_zenflow_options& o, bool cc = false) : zf(o), column_contiguous(cc) {
    const model initial;
    zf.register_parameter("W", view(m.w.data()),
                          cc ? const_matrix_view::column_contiguous(initial.w.data(), R, C, dtype::f32)
                             : const_matrix_view::row_major(initial.w.data(), R, C, dtype::f32),
                          dtype::f32);
    zf.register_parameter("b", vector_view(m.b.data(), R, dtype::f32), initial.b);
  }
  [[nodiscard]] matrix_view view(float* p) const {
    return column_contiguous ? matrix_view::column_contiguous(p, R, C, dtype::f32)
                             : matrix_view::row_major(p, R, C, dtype::f32);
  }
  // `schedule`: an lr decay set before each step, the bias in its own group (half the lr, no decay).
  void train(int steps, bool schedule = false) {
    for (int s = 0; s < steps; ++s) {
      if (schedule) {
        sgd_options hp = zf.options().optimizer;
        hp.lr = 0.1f / (1.0f + 0.01f * static_cast<float>(zf.step_count()));
        zf.set_hyper_parameters(hp);
        sgd_options bias = hp;
        bias.lr = hp.lr * 0.5f;
        bias.weight_decay = 0.0f;
        zf.set_hyper_parameters(1, bias);
      }
      stream.synchronize();
      m.grads();
      zf.submit_gradient(0, const_matrix_view(view(m.gw.data())), &stream);
      zf.submit_gradient(1, const_vector_view(m.gb.data(), R, dtype::f32), &stream);
      zf.step(&stream);
    }
  }
  void finish() { zf.finish(&stream); }
};

// The plain loop: every element updated every step.
model reference(int steps, const sgd_options& w_hp, const sgd_options& b_hp) {
  model m;
  std::vector<float> bw(m.w.size(), 0.0f), bb(m.b.size(), 0.0f);
  for (int s = 0; s < steps; ++s) {
    m.grads();
    for (std::size_t i = 0; i < m.w.size(); ++i) sgd_update(m.w[i], bw[i], m.gw[i], w_hp);
    for (std::size_t i = 0; i < m.b.size(); ++i) sgd_update(m.b[i], bb[i], m.gb[i], b_hp);
  }
  return m;
}

sgd_options base_hp() {
  sgd_options hp;
  hp.lr = 0.1f;
  hp.momentum = 0.9f;
  return hp;
}

sgd_zenflow_options zenflow_schedule() {
  sgd_zenflow_options o;
  o.optimizer = base_hp();
  o.topk_ratio = 0.25f;
  o.update_interval = interval_option::fixed(2);
  o.select_interval = interval_option::fixed(6);  // reselections: two-slot state migrates both ways
  return o;
}

// The uninterrupted run of check_resume: 41 scheduled steps.
template <class Slots>
model uninterrupted_run(const sgd_zenflow_options& o) {
  run<Slots> r(o);
  r.train(41, true);
  r.finish();
  return r.m;
}

// Trains 17 scheduled steps (mid-interval, a CPU update in flight), saves `contents` to `path`,
// resumes in a fresh coordinator (the trainer restoring its values first when the checkpoint holds
// the optimizer state only) and trains 24 more: bit for bit the uninterrupted run. Leaves the file.
template <class Slots>
void check_resume(const sgd_zenflow_options& o, const model& uninterrupted, const std::string& path,
                  checkpoint_contents contents) {
  run<Slots> first(o);
  first.train(17, true);
  first.zf.save_checkpoint(path, &first.stream, contents);
  run<Slots> second(o);
  if (contents == checkpoint_contents::optimizer_state) {
    std::copy(first.m.w.begin(), first.m.w.end(), second.m.w.begin());
    std::copy(first.m.b.begin(), first.m.b.end(), second.m.b.begin());
  }
  second.zf.load_checkpoint(path, &second.stream);
  CHECK(second.zf.hyper_parameters_of(1) == first.zf.hyper_parameters_of(1));
  CHECK(second.zf.step_count() == 17);
  second.train(24, true);
  second.finish();
  CHECK(second.m.w == uninterrupted.w);
  CHECK(second.m.b == uninterrupted.b);
}

}  // namespace

TEST_CASE("SGD with momentum: dense and ZeRO-Offload are the plain loop bit for bit, ZenFlow converges") {
  const sgd_options hp = base_hp();
  constexpr int steps = 300;
  const model expected = reference(steps, hp, hp);
  run dense(sgd_zenflow_options::dense(hp)), zero(sgd_zenflow_options::zero_offload(hp));
  run in_place(sgd_zenflow_options::zero_offload(hp), true), zenflow(zenflow_schedule());
  full_layout_tasks = 0;
  dense.train(steps);
  zero.train(steps);
  in_place.train(steps);
  zenflow.train(2 * steps);  // its CPU columns: one update per 2 steps, one interval stale
  for (run<>* r : {&dense, &zero, &in_place, &zenflow}) r->finish();
  CHECK(dense.m.w == expected.w);
  CHECK(dense.m.b == expected.b);
  CHECK(zero.m.w == expected.w);
  CHECK(zero.m.b == expected.b);
  CHECK(in_place.m.w == expected.w);
  CHECK(in_place.m.b == expected.b);
  CHECK(full_layout_tasks == steps);  // the column-contiguous ZeRO-Offload run took the in-place path
  CHECK(expected.error() < 1e-3f);
  CHECK(zenflow.m.error() < 1e-3f);
  CHECK(zenflow.zf.device_optimizer().step_count() == 2 * steps);
  // After finish, the CPU master of every CPU column is the weight.
  const auto cpu = zenflow.zf.host_optimizer().params(0);
  const auto gpu = zenflow.zf.gpu_columns(0);
  for (index_t c = 0; c < C; ++c) {
    if (std::binary_search(gpu.begin(), gpu.end(), c)) continue;
    for (index_t r = 0; r < R; ++r) REQUIRE(cpu[c * R + r] == zenflow.m.w[r * C + c]);
  }
}

TEST_CASE("SGD with momentum: its own per-group and shared fields") {
  const sgd_options hp = base_hp();
  sgd_options bias = hp;
  bias.lr = 0.05f;
  run dense(sgd_zenflow_options::dense(hp));
  dense.zf.set_hyper_parameters(1, bias);
  CHECK(dense.zf.hyper_parameters_of(1).lr == 0.05f);
  CHECK(dense.zf.hyper_parameters_of(0).lr == 0.1f);
  dense.train(50);
  dense.finish();
  const model expected = reference(50, hp, bias);
  CHECK(dense.m.w == expected.w);
  CHECK(dense.m.b == expected.b);

  sgd_options bad = hp;
  bad.momentum = 0.5f;
  CHECK_THROWS_WITH_AS(dense.zf.set_hyper_parameters(1, bad),
                       doctest::Contains("parameter groups and schedules change lr and weight_decay only"),
                       zenflow::error);
  CHECK_THROWS_WITH_AS(dense.zf.set_hyper_parameters(bad), doctest::Contains("momentum"), zenflow::error);
  bad = hp;
  bad.nesterov = true;
  CHECK_THROWS_WITH_AS(dense.zf.set_hyper_parameters(0, bad), doctest::Contains("nesterov"), zenflow::error);
  bad = hp;
  bad.lr = -1.0f;
  CHECK_THROWS_WITH_AS(dense.zf.set_hyper_parameters(0, bad), doctest::Contains("got -1"), zenflow::error);
  CHECK(dense.zf.hyper_parameters_of(0) == hp);
}

TEST_CASE("SGD with momentum: checkpoints resume bit-identically mid-interval, whole or optimizer state only") {
  for (const bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    auto o = zenflow_schedule();
    o.optimizer.nesterov = nesterov;
    o.optimizer.weight_decay = 0.01f;
    const std::string path =
        (std::filesystem::temp_directory_path() / ("zenflow_test_sgd_" + std::to_string(nesterov) + ".bin")).string();
    const model uninterrupted = uninterrupted_run<sgd_state_slots>(o);
    check_resume<sgd_state_slots>(o, uninterrupted, path, checkpoint_contents::everything);

    auto other = o;
    other.optimizer.momentum = 0.8f;
    run third(other);
    CHECK_THROWS_WITH_AS(third.zf.load_checkpoint(path, &third.stream),
                         doctest::Contains("was written with sgd momentum = 0.9, this coordinator's is 0.8"),
                         zenflow::error);

    check_resume<sgd_state_slots>(o, uninterrupted, path, checkpoint_contents::optimizer_state);
    std::filesystem::remove(path);
  }
}

TEST_CASE("SGD without momentum: the master as its only slot, through the paths, migration and checkpoints") {
  sgd_options hp = base_hp();
  hp.momentum = 0.0f;
  constexpr int steps = 200;
  const model expected = reference(steps, hp, hp);
  auto schedule = zenflow_schedule();
  schedule.optimizer = hp;
  using plain = run<plain_sgd_slots>;
  plain dense(sgd_zenflow_options::dense(hp)), zero(sgd_zenflow_options::zero_offload(hp));
  plain in_place(sgd_zenflow_options::zero_offload(hp), true), zenflow(schedule);
  dense.train(steps);
  zero.train(steps);
  in_place.train(steps);
  zenflow.train(2 * steps);  // reselections every 6 steps move one-slot state both ways
  for (plain* r : {&dense, &zero, &in_place, &zenflow}) r->finish();
  CHECK(dense.m.w == expected.w);
  CHECK(zero.m.w == expected.w);
  CHECK(zero.m.b == expected.b);
  CHECK(in_place.m.w == expected.w);
  CHECK(zenflow.m.error() < 1e-3f);

  schedule.optimizer.weight_decay = 0.01f;
  const std::string path = (std::filesystem::temp_directory_path() / "zenflow_test_sgd_plain.bin").string();
  check_resume<plain_sgd_slots>(schedule, uninterrupted_run<plain_sgd_slots>(schedule), path,
                                checkpoint_contents::everything);
  // The two-slot optimizer's checkpoint, with the same name, table and values (momentum 0), holds
  // two state arrays per element: refused by its slots, not read out of step.
  run<> buffered_run(schedule);
  buffered_run.train(17, true);
  buffered_run.zf.save_checkpoint(path, &buffered_run.stream);
  plain third(schedule);
  CHECK_THROWS_WITH_AS(
      third.zf.load_checkpoint(path, &third.stream),
      doctest::Contains(
          "holds sgd state in slots [master, momentum_buffer], this coordinator's optimizers keep [master]"),
      zenflow::error);
  std::filesystem::remove(path);

  // Momentum needs the buffer's slot: refused at construction, naming the field.
  CHECK_THROWS_WITH_AS(plain{zenflow_schedule()}, doctest::Contains("momentum"), zenflow::error);
}

}  // namespace ZENFLOW_TEST_FILE_ID
