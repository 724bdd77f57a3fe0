// Learning-rate schedules and parameter groups on the coordinator: the rule that decides which
// hyper-parameters an update uses (GPU columns: those set before the step; a CPU update: those
// in effect when its interval ended), per-parameter lr / weight decay, checkpoints that keep them;
// and a second optimizer with hyper-parameters of its own, which the coordinator stores, checks
// and saves without knowing them (hyper_parameters.hpp).
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <span>
#include <vector>

#include "coordinator_harness.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

// Trains with lr(step) set before each step; `groups` gives the bias no weight decay and the
// bf16 weight twice the learning rate.
template <class Harness>
void train_scheduled(Harness& h, std::int64_t steps, bool groups) {
  for (std::int64_t s = 0; s < steps; ++s) {
    const std::int64_t step = h.coordinator.step_count();
    adam_options a = h.coordinator.options().optimizer;
    a.lr = 0.02f / static_cast<float>(1 + step);  // a decay schedule
    h.coordinator.set_hyper_parameters(a);
    if (groups) {
      adam_options no_decay = a, faster = a;
      no_decay.weight_decay = 0.0f;
      faster.lr = 2.0f * a.lr;
      h.coordinator.set_hyper_parameters(2, no_decay);
      h.coordinator.set_hyper_parameters(0, faster);
    }
    h.train(1);
  }
}

// A second optimizer: Adam with a per-group learning-rate multiplier (`lr_scale`, as a trainer
// might keep a layer-wise decay), its own hyper-parameter type, its own CPU and device optimizer,
// and no line of the coordinator written for it. Each step uses Adam with lr * lr_scale, so a
// power-of-two scale trains bit for bit like Adam with the scaled lr.
struct scaled_adam_options {
  float lr = 1e-3f;
  float lr_scale = 1.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw_mode = true;
  bool bias_correction = true;
  friend bool operator==(const scaled_adam_options&, const scaled_adam_options&) = default;

  static constexpr const char* name = "scaled_adam";
  static constexpr std::array<hyper_parameter_field<scaled_adam_options>, 8> fields() noexcept {
    return {real_field("lr", &scaled_adam_options::lr, true),
            real_field("lr_scale", &scaled_adam_options::lr_scale, true),
            real_field("beta1", &scaled_adam_options::beta1, false),
            real_field("beta2", &scaled_adam_options::beta2, false),
            real_field("eps", &scaled_adam_options::eps, false),
            real_field("weight_decay", &scaled_adam_options::weight_decay, true),
            flag_field("adamw_mode", &scaled_adam_options::adamw_mode, false),
            flag_field("bias_correction", &scaled_adam_options::bias_correction, false)};
  }
  void validate() const {
    expects(std::isfinite(lr_scale) && lr_scale > 0.0f, "lr_scale", "must be finite and > 0, got ", lr_scale);
    adam().validate();
  }
  [[nodiscard]] adam_options adam() const {
    return {lr * lr_scale, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction};
  }
  static scaled_adam_options from(const adam_options& a, float lr_scale) {
    return {a.lr / lr_scale, lr_scale, a.beta1, a.beta2, a.eps, a.weight_decay, a.adamw_mode, a.bias_correction};
  }
};
static_assert(optimizer_hyper_parameters<scaled_adam_options>);

class scaled_cpu_adam {
 public:
  using hyper_parameters = scaled_adam_options;
  using slots_type = cpu_adam::slots_type;
  scaled_cpu_adam(const hyper_parameters& hp, const cpu_adam_config& config) : adam_(hp.adam(), config) {}
  std::size_t add_tensor(std::span<const float> initial, index_t rows, index_t cols) {
    return adam_.add_tensor(initial, rows, cols);
  }
  void export_state(std::size_t t, std::span<const std::int32_t> columns, std::span<float> out) const {
    adam_.export_state(t, columns, out);
  }
  void import_state(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> in) {
    adam_.import_state(t, columns, in);
  }
  void step(std::span<const optimizer_task<hyper_parameters>> tasks, float grad_scale, bool check_finite) {
    std::vector<adam_options> options(tasks.size());
    std::vector<cpu_adam_task> adam_tasks(tasks.size());
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      const auto& t = tasks[i];
      REQUIRE(t.options != nullptr);  // the coordinator hands every task its parameter's own
      options[i] = t.options->adam();
      adam_tasks[i] = {t.tensor,        t.grad,        t.grad_type, t.columns, t.grad_compact, t.copy_out,
                       t.copy_out_type, t.out_compact, &options[i], t.step,    t.grad_scale};
    }
    adam_.step(adam_tasks, grad_scale, check_finite);
  }
  std::int64_t step_count() const { return adam_.step_count(); }
  void set_step_count(std::int64_t n) { adam_.set_step_count(n); }

 private:
  cpu_adam adam_;
};
static_assert(host_optimizer<scaled_cpu_adam>);

// The host backend's sparse Adam under the new hyper-parameters (the library's host backend runs
// any device optimizer with host_sparse_adam's members).
class scaled_sparse_adam : public host_sparse_adam {
 public:
  using hyper_parameters = scaled_adam_options;
  explicit scaled_sparse_adam(const hyper_parameters& hp) : host_sparse_adam(hp.adam()), options_(hp) {}
  [[nodiscard]] const hyper_parameters& options() const noexcept { return options_; }
  void set_options(std::size_t i, const hyper_parameters& hp) { host_sparse_adam::set_options(i, hp.adam()); }

 private:
  hyper_parameters options_;
};
using scaled_backend = basic_host_backend<scaled_sparse_adam>;
static_assert(coordinator_backend<scaled_backend>);
using scaled_harness = basic_harness<basic_coordinator<scaled_backend, scaled_cpu_adam>>;

basic_zenflow_options<scaled_adam_options> scaled(const zenflow_options& o, float lr_scale) {
  return o.with_optimizer(scaled_adam_options::from(o.optimizer, lr_scale));
}

}  // namespace

TEST_CASE("a schedule and parameter groups reach the GPU and the CPU path alike") {
  // Dense runs everything on the GPU path, ZeRO-Offload every matrix on the CPU path (an interval
  // of one step, which ends where it began): with the same schedule and groups they agree bit for
  // bit on the f32 weight and the bias.
  for (bool groups : {false, true}) {
    CAPTURE(groups);
    auto dense_opts = zenflow_options::dense();
    dense_opts.optimizer = base_options().optimizer;
    auto zero = zenflow_options::zero_offload();
    zero.optimizer = base_options().optimizer;
    harness dense(dense_opts), offload(zero), constant(dense_opts);
    train_scheduled(dense, 12, groups);
    train_scheduled(offload, 12, groups);
    constant.train(12);
    dense.finish();
    offload.finish();
    constant.finish();
    CHECK(dense.model.weights[1].storage == offload.model.weights[1].storage);
    CHECK(dense.model.bias == offload.model.bias);
    CHECK(dense.model.weights[1].storage != constant.model.weights[1].storage);  // the schedule was used
  }
  auto dense_opts = zenflow_options::dense();
  dense_opts.optimizer = base_options().optimizer;
  harness plain(dense_opts), grouped(dense_opts);
  train_scheduled(plain, 6, false);
  train_scheduled(grouped, 6, true);
  plain.finish();
  grouped.finish();
  CHECK(plain.model.bias != grouped.model.bias);  // the groups were used
  CHECK(plain.model.weights[0].storage != grouped.model.weights[0].storage);
  CHECK(plain.model.weights[1].storage == grouped.model.weights[1].storage);  // not in a group
}

TEST_CASE("the CPU update of an interval uses the hyper-parameters in effect when the interval ended") {
  // lr is 0 everywhere except in step 1, which ends the interval [0, 1]: the GPU columns move in
  // step 1 only, and the CPU columns move exactly once, by the update of [0, 1] -- whether it runs
  // synchronously or while later steps (with lr 0 again) train.
  for (bool overlap : {true, false}) {
    CAPTURE(overlap);
    auto o = base_options();
    o.optimizer.weight_decay = 0.0f;
    o.update_interval = interval_option::fixed(2);
    o.select_interval = interval_option::fixed(100);
    o.overlap_step = overlap;
    harness h(o);
    std::vector<std::byte> before = h.model.snapshot(), after_step1;
    for (std::int64_t s = 0; s < 6; ++s) {
      adam_options a = o.optimizer;
      a.lr = s == 1 ? 0.05f : 0.0f;
      h.coordinator.set_hyper_parameters(a);
      CHECK(h.coordinator.hyper_parameters_of(0).lr == a.lr);
      h.train(1);
      h.stream.synchronize();
      if (s == 1) after_step1 = h.model.snapshot();
    }
    h.finish();
    const auto cpu_columns = complement_columns(h.coordinator.gpu_columns(1), h.model.weights[1].cols);
    const auto gpu_columns = h.coordinator.gpu_columns(1);
    const auto& w = h.model.weights[1];  // f32, column-contiguous: column c at c * rows
    auto column = [&](const std::vector<std::byte>& all, std::int32_t c) {
      const auto* base = reinterpret_cast<const float*>(all.data() + h.model.weights[0].storage.size());
      return std::vector<float>(base + c * w.rows, base + (c + 1) * w.rows);
    };
    const auto final_state = h.model.snapshot();
    for (std::int32_t c : gpu_columns) {
      CHECK(column(after_step1, c) != column(before, c));       // moved in step 1
      CHECK(column(final_state, c) == column(after_step1, c));  // and never again
    }
    for (std::int32_t c : cpu_columns) CHECK(column(final_state, c) != column(before, c));  // the update of [0, 1]
    CHECK(h.coordinator.host_optimizer().step_count() == 3);  // [0, 1], [2, 3], [4, 5]: two of them with lr 0
    // With lr 0 from the start, nothing moves at all: the CPU columns moved by [0, 1]'s lr alone.
    harness still(o);
    adam_options zero_lr = o.optimizer;
    zero_lr.lr = 0.0f;
    still.coordinator.set_hyper_parameters(zero_lr);
    still.train(6);
    CHECK(still.finish() == before);
  }
}

TEST_CASE("hyper-parameters: bad values are rejected before anything changes; checkpoints keep them") {
  harness h(base_options());
  adam_options a = base_options().optimizer;
  a.adamw_mode = false;  // shared by every parameter
  CHECK_THROWS_WITH_AS(h.coordinator.set_hyper_parameters(1, a), doctest::Contains("adamw_mode"), zenflow::error);
  a = base_options().optimizer;
  a.beta1 = 1.0f;
  CHECK_THROWS_WITH_AS(h.coordinator.set_hyper_parameters(1, a), doctest::Contains("beta1"), zenflow::error);
  a = base_options().optimizer;
  a.lr = -1.0f;
  CHECK_THROWS_WITH_AS(h.coordinator.set_hyper_parameters(a), doctest::Contains("lr"), zenflow::error);
  CHECK_THROWS_AS(h.coordinator.set_hyper_parameters(7, base_options().optimizer), zenflow::error);
  CHECK(h.coordinator.hyper_parameters_of(1) == base_options().optimizer);

  const auto path = (std::filesystem::temp_directory_path() / "zenflow_test_hyperparameters.bin").string();
  auto o = base_options();
  o.update_interval = interval_option::fixed(3);
  harness uninterrupted(o);
  train_scheduled(uninterrupted, 16, true);
  const auto reference = uninterrupted.finish();
  harness first(o);
  train_scheduled(first, 8, true);  // mid-interval, a CPU update pending
  first.coordinator.save_checkpoint(path, &first.stream);
  harness second(o);
  second.coordinator.load_checkpoint(path, &second.stream);
  CHECK(second.coordinator.hyper_parameters_of(0).lr == first.coordinator.hyper_parameters_of(0).lr);
  CHECK(second.coordinator.hyper_parameters_of(2).weight_decay == 0.0f);
  train_scheduled(second, 8, true);
  CHECK(second.finish() == reference);
  std::filesystem::remove(path);
}

TEST_CASE("a second optimizer's own hyper-parameters: stored per parameter, checked, saved and loaded") {
  auto o = base_options();
  o.update_interval = interval_option::fixed(3);  // CPU updates in flight across the checkpoint
  // Every parameter at lr_scale 0.5 with twice the lr, parameter 0 at 0.25 with four times it:
  // the same Adam steps as the reference's, bit for bit, on both paths.
  const auto groups = [](auto& h, auto to_hp) {
    adam_options faster = base_options().optimizer;
    faster.lr *= 2.0f;
    h.coordinator.set_hyper_parameters(0, to_hp(faster, 0.25f));
  };
  const auto adam = [](const adam_options& a, float) { return a; };
  const auto scaled_hp = [](const adam_options& a, float s) { return scaled_adam_options::from(a, s); };
  harness reference(o);
  groups(reference, adam);
  reference.train(16);
  const auto expected = reference.finish();

  scaled_harness uninterrupted(scaled(o, 0.5f));
  groups(uninterrupted, scaled_hp);
  CHECK(uninterrupted.coordinator.hyper_parameters_of(0).lr_scale == 0.25f);
  CHECK(uninterrupted.coordinator.hyper_parameters_of(1).lr_scale == 0.5f);
  uninterrupted.train(16);
  CHECK(uninterrupted.finish() == expected);

  // Its own validation, and its own rule for what parameter groups may change.
  scaled_adam_options bad = uninterrupted.coordinator.options().optimizer;
  bad.lr_scale = 0.0f;
  CHECK_THROWS_WITH_AS(uninterrupted.coordinator.set_hyper_parameters(1, bad), doctest::Contains("lr_scale"),
                       zenflow::error);
  bad = uninterrupted.coordinator.options().optimizer;
  bad.beta2 = 0.9f;
  CHECK_THROWS_WITH_AS(uninterrupted.coordinator.set_hyper_parameters(bad),
                       doctest::Contains("lr, lr_scale and weight_decay only"), zenflow::error);
  CHECK(uninterrupted.coordinator.hyper_parameters_of(1).beta2 == 0.999f);

  // A checkpoint keeps each parameter's per-group fields, lr_scale among them, and resumes
  // bit-identically mid-interval.
  const auto path = (std::filesystem::temp_directory_path() / "zenflow_test_scaled_adam.bin").string();
  scaled_harness first(scaled(o, 0.5f));
  groups(first, scaled_hp);
  first.train(8);
  first.coordinator.save_checkpoint(path, &first.stream);
  scaled_harness second(scaled(o, 0.5f));
  second.coordinator.load_checkpoint(path, &second.stream);
  CHECK(second.coordinator.hyper_parameters_of(0) == first.coordinator.hyper_parameters_of(0));
  CHECK(second.coordinator.hyper_parameters_of(0).lr_scale == 0.25f);
  second.train(8);
  CHECK(second.finish() == expected);

  // The shared fields must agree, named in the optimizer's own words.
  auto other = scaled(o, 0.5f);
  other.optimizer.eps = 1e-6f;
  scaled_harness third(other);
  CHECK_THROWS_WITH_AS(third.coordinator.load_checkpoint(path, &third.stream),
                       doctest::Contains("was written with scaled_adam eps = 1e-08, this coordinator's is 1e-06"),
                       zenflow::error);

  // Another optimizer's checkpoint is refused by name, both ways, before its per-parameter
  // fields (three here, two for Adam) are read as this optimizer's, and nothing changes: the
  // coordinator then trains as one that never saw the file.
  harness adam_coordinator(o), untouched(o);
  CHECK_THROWS_WITH_AS(adam_coordinator.coordinator.load_checkpoint(path, &adam_coordinator.stream),
                       doctest::Contains("was written for optimizer 'scaled_adam', this coordinator's is 'adam'"),
                       zenflow::error);
  adam_coordinator.train(2);
  untouched.train(2);
  adam_coordinator.coordinator.save_checkpoint(path, &adam_coordinator.stream);
  CHECK(adam_coordinator.finish() == untouched.finish());
  scaled_harness fourth(scaled(o, 0.5f));
  CHECK_THROWS_WITH_AS(fourth.coordinator.load_checkpoint(path, &fourth.stream),
                       doctest::Contains("was written for optimizer 'adam', this coordinator's is 'scaled_adam'"),
                       zenflow::error);
  std::filesystem::remove(path);
}

}  // namespace ZENFLOW_TEST_FILE_ID
