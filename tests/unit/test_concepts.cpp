// Each concept has a positive and a negative static_assert. The positive models here are minimal
// stand-ins that spell out the requirements; the real components assert their own conformance in
// their tests as they land. The coordinator's concepts (host_optimizer, coordinator_backend) are
// also checked against the library's models, and a minimal host_optimizer runs the coordinator.
#include <zenflow/concepts.hpp>
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "coordinator_harness.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

namespace {

struct model_selector {
  std::vector<std::vector<std::int32_t>> sel;
  std::size_t parameter_count() const { return sel.size(); }
  std::span<const std::int32_t> selected(std::size_t i) const { return sel[i]; }
  std::int64_t k(std::size_t i) const { return static_cast<std::int64_t>(sel[i].size()); }
  std::int64_t rows(std::size_t) const { return 1; }
  std::int64_t cols(std::size_t) const { return 8; }
  bool has_selection() const { return !sel.empty(); }
  std::span<const std::int32_t> previous(std::size_t) const { return {}; }
  double overlap(std::size_t) const { return 0.0; }
  void set_selection(std::size_t i, std::span<const std::int32_t> c) { sel[i].assign(c.begin(), c.end()); }
};
struct selector_without_k {
  std::size_t parameter_count() const { return 0; }
  std::span<const std::int32_t> selected(std::size_t) const { return {}; }
};

struct model_queue {
  using slot_type = int;
  using stream_type = int;
  struct counters_type {
    std::uint64_t bytes = 0, transfers = 0;
  };
  std::size_t slot_count() const { return 2; }
  std::size_t slot_bytes() const { return 64; }
  int direction() const { return 0; }
  int acquire() { return 0; }
  std::optional<int> try_acquire() { return 0; }
  void release(int) {}
  void submit_device_to_host(int, const void*, std::size_t, int) {}
  void submit_host_to_device(int, void*, std::size_t, int) {}
  int next() { return 0; }
  std::optional<int> try_next() { return 0; }
  void drain() {}
  counters_type counters() const { return {}; }
};
struct queue_without_try_acquire {
  using slot_type = int;
  using stream_type = int;
  struct counters_type {
    std::uint64_t bytes = 0, transfers = 0;
  };
  std::size_t slot_count() const { return 2; }
  std::size_t slot_bytes() const { return 64; }
  int direction() const { return 0; }
  int acquire() { return 0; }
  void release(int) {}
  void submit_device_to_host(int, const void*, std::size_t, int) {}
  void submit_host_to_device(int, void*, std::size_t, int) {}
  int next() { return 0; }
  std::optional<int> try_next() { return 0; }
  void drain() {}
  counters_type counters() const { return {}; }
};

// Exactly what basic_coordinator calls on its CPU optimizer, with no optimizer behind it.
struct model_host_optimizer {
  using hyper_parameters = zenflow::adam_options;
  model_host_optimizer(const zenflow::adam_options&, const zenflow::cpu_adam_config&) {}
  std::size_t add_tensor(std::span<const float>, zenflow::index_t, zenflow::index_t) { return 0; }
  using slots_type = zenflow::adam_state_slots;
  void export_state(std::size_t, std::span<const std::int32_t>, std::span<float>) const {}
  void import_state(std::size_t, std::span<const std::int32_t>, std::span<const float>) {}
  zenflow::cpu_step_result step(std::span<const zenflow::cpu_adam_task>, float, bool) { return {}; }
  std::int64_t step_count() const { return 0; }
  void set_step_count(std::int64_t) {}
};
// Moves its state as slots but does not say which: the coordinator could not size, check or hand
// the state to the device optimizer.
struct host_optimizer_without_slots : model_host_optimizer {
  using model_host_optimizer::model_host_optimizer;
  using slots_type = void;
};
// Names its slots without the check an import makes of them (checkpoints validate with it).
struct slots_without_check {
  static constexpr std::array<std::string_view, 2> names{"master", "momentum"};
  static constexpr std::size_t count = 2;
  static constexpr std::string_view what = "momentum", rule = "finite";
};
struct host_optimizer_with_unchecked_slots : model_host_optimizer {
  using model_host_optimizer::model_host_optimizer;
  using slots_type = slots_without_check;
};
// The slots of another optimizer (SGD with momentum: master and momentum), check included.
struct momentum_slots : slots_without_check {
  static bool valid(const float* own) noexcept { return std::isfinite(own[0]); }
};
// Hyper-parameters the coordinator could not store, check or save: no field table (it could not
// save them or tell which may differ per parameter group), or no validation.
struct hyper_parameters_without_fields {
  float lr = 1e-3f;
  static constexpr const char* name = "bare";
  void validate() const {}
  friend bool operator==(const hyper_parameters_without_fields&, const hyper_parameters_without_fields&) = default;
};
struct hyper_parameters_without_validate {
  float lr = 1e-3f;
  static constexpr const char* name = "unchecked";
  static constexpr std::array<zenflow::hyper_parameter_field<hyper_parameters_without_validate>, 1> fields() {
    return {zenflow::real_field("lr", &hyper_parameters_without_validate::lr, true)};
  }
  friend bool operator==(const hyper_parameters_without_validate&, const hyper_parameters_without_validate&) = default;
};
// Field tables the coordinator could not read back (H5): an entry with both members, one with
// none, a name given twice, an empty name.
template <int Defect>
struct hyper_parameters_with_a_bad_table {
  float lr = 1e-3f, momentum = 0.9f;
  bool nesterov = false;
  static constexpr const char* name = "bad_table";
  using self = hyper_parameters_with_a_bad_table;
  static constexpr std::array<zenflow::hyper_parameter_field<self>, 2> fields() {
    zenflow::hyper_parameter_field<self> second = zenflow::real_field("momentum", &self::momentum, false);
    if (Defect == 1) second.flag = &self::nesterov;
    if (Defect == 2) second.real = nullptr;
    if (Defect == 3) second.name = "lr";
    if (Defect == 4) second.name = "";
    return {zenflow::real_field("lr", &self::lr, true), second};
  }
  void validate() const {}
  friend bool operator==(const self&, const self&) = default;
};
struct host_optimizer_with_unusable_hyper_parameters : model_host_optimizer {
  using hyper_parameters = hyper_parameters_without_fields;
  host_optimizer_with_unusable_hyper_parameters(const hyper_parameters&, const zenflow::cpu_adam_config& c)
      : model_host_optimizer(zenflow::adam_options{}, c) {}
  zenflow::cpu_step_result step(std::span<const zenflow::optimizer_task<hyper_parameters>>, float, bool) { return {}; }
};
struct optimizer_without_step_count {
  zenflow::adam_options opts;
  const zenflow::adam_options& options() const { return opts; }
};
// The requirements of the concept before it said what the coordinator calls: a type with only
// these cannot run the coordinator (no construction from the config, add_tensor, moments or step).
struct optimizer_with_only_the_reading_side {
  zenflow::adam_options opts;
  std::vector<float> p;
  const zenflow::adam_options& options() const { return opts; }
  std::int64_t step_count() const { return 0; }
  std::size_t tensor_count() const { return 1; }
  std::span<const float> params(std::size_t) const { return p; }
  void set_step_count(std::int64_t) {}
};

// A host_optimizer that is not cpu_adam: it holds one and forwards exactly the concept's
// requirements, so a coordinator over it must train bit-identically to host_coordinator.
class wrapped_cpu_adam {
 public:
  using hyper_parameters = zenflow::adam_options;
  wrapped_cpu_adam(const zenflow::adam_options& adam, const zenflow::cpu_adam_config& config) : adam_(adam, config) {}
  std::size_t add_tensor(std::span<const float> initial, zenflow::index_t rows, zenflow::index_t cols) {
    return adam_.add_tensor(initial, rows, cols);
  }
  using slots_type = zenflow::cpu_adam::slots_type;
  void export_state(std::size_t t, std::span<const std::int32_t> columns, std::span<float> out) const {
    adam_.export_state(t, columns, out);
  }
  void import_state(std::size_t t, std::span<const std::int32_t> columns, std::span<const float> in) {
    adam_.import_state(t, columns, in);
  }
  void step(std::span<const zenflow::cpu_adam_task> tasks, float grad_scale, bool check_finite) {
    adam_.step(tasks, grad_scale, check_finite);
  }
  std::int64_t step_count() const { return adam_.step_count(); }
  void set_step_count(std::int64_t n) { adam_.set_step_count(n); }

 private:
  zenflow::cpu_adam adam_;
};

struct model_device_optimizer {
  using hyper_parameters = zenflow::adam_options;
  zenflow::adam_options opts;
  std::vector<std::int32_t> sel;
  const zenflow::adam_options& options() const { return opts; }
  std::int64_t step_count() const { return 0; }
  std::size_t parameter_count() const { return 0; }
  std::span<const std::int32_t> selection(std::size_t) const { return sel; }
  std::int64_t k(std::size_t) const { return static_cast<std::int64_t>(sel.size()); }
};
struct device_optimizer_without_selection {
  using hyper_parameters = zenflow::adam_options;
  zenflow::adam_options opts;
  const zenflow::adam_options& options() const { return opts; }
  std::int64_t step_count() const { return 0; }
  std::size_t parameter_count() const { return 0; }
};

struct model_coordinator {
  using stream_type = int;
  using options_type = zenflow::zenflow_options;
  zenflow::zenflow_options opts;
  const zenflow::zenflow_options& options() const { return opts; }
  void submit_gradient(std::size_t, zenflow::const_matrix_view, int) {}
  void step(int) {}
  std::int64_t step_count() const { return 0; }
  int metrics() const { return 0; }
};
struct coordinator_without_submit {
  using stream_type = int;
  using options_type = zenflow::zenflow_options;
  zenflow::zenflow_options opts;
  const zenflow::zenflow_options& options() const { return opts; }
  void step(int) {}
  std::int64_t step_count() const { return 0; }
  int metrics() const { return 0; }
};

// coordinator_backend: a model built from one part per numbered requirement (R1..R12), each part
// holding only what its requirement names; backend_missing<N> leaves out part N.
struct backend_selector : model_selector {
  explicit backend_selector(float) {}
  std::size_t add_parameter(zenflow::index_t, zenflow::index_t) { return 0; }
  std::span<const float> scores(std::size_t) const { return {}; }
};
// Every requirement of R3 but the state slots: a reselection could not know what it moves.
struct device_optimizer_without_slots : model_device_optimizer {
  explicit device_optimizer_without_slots(const zenflow::adam_options&) {}
  void export_state(std::size_t, std::span<float>) const {}
  void import_state(std::size_t, std::span<const float>) {}
  void set_step_count(std::int64_t) {}
  using model_device_optimizer::step_count;
  std::int64_t step_count(std::size_t) const { return 0; }
  void set_step_count(std::size_t, std::int64_t) {}
};
struct backend_device_optimizer : device_optimizer_without_slots {
  using slots_type = zenflow::adam_state_slots;
  using device_optimizer_without_slots::device_optimizer_without_slots;
};
// A sparse-column twin for the host backend whose hyper-parameters are not the ones its
// set_options takes (host_sparse_adam's take adam_options): basic_host_backend would fail deep in
// an instantiation; host_column_optimizer rejects it (C2).
struct other_hyper_parameters {
  float lr = 1e-3f;
  static constexpr const char* name = "other";
  static constexpr std::array<zenflow::hyper_parameter_field<other_hyper_parameters>, 1> fields() {
    return {zenflow::real_field("lr", &other_hyper_parameters::lr, true)};
  }
  void validate() const {}
  friend bool operator==(const other_hyper_parameters&, const other_hyper_parameters&) = default;
};
struct twin_without_its_set_options : zenflow::host_sparse_adam {
  using hyper_parameters = other_hyper_parameters;
  explicit twin_without_its_set_options(const other_hyper_parameters&) : host_sparse_adam(zenflow::adam_options{}) {}
  const other_hyper_parameters& options() const { return hp; }
  other_hyper_parameters hp;
};
struct twin_with_its_set_options : twin_without_its_set_options {
  using twin_without_its_set_options::twin_without_its_set_options;
  void set_options(std::size_t, const other_hyper_parameters&) {}
};
// Counts its steps only as a whole: the coordinator could not skip one parameter's step.
struct device_optimizer_without_parameter_counts : model_device_optimizer {
  using slots_type = zenflow::adam_state_slots;
  explicit device_optimizer_without_parameter_counts(const zenflow::adam_options&) {}
  void export_state(std::size_t, std::span<float>) const {}
  void import_state(std::size_t, std::span<const float>) {}
  void set_step_count(std::int64_t) {}
};
struct backend_queue : model_queue {
  backend_queue(zenflow::transfer_direction, std::size_t, std::size_t) {}
};
void pipelined_copy_to_device(backend_queue&, void*, const void*, std::size_t, int) {}
struct backend_buffer {
  backend_buffer() = default;
  explicit backend_buffer(std::size_t) {}
  std::byte* data() const { return nullptr; }
  std::size_t bytes() const { return 0; }
  std::byte* device_data() const { return nullptr; }
};
struct backend_event {
  bool query() const { return true; }
};
struct backend_owned_stream {
  int get() { return 0; }
};

struct r1_stream {
  using stream_type = int;
  static constexpr zenflow::memory_space device_space = zenflow::memory_space::host;
};
struct r2_selector {
  using selector_type = backend_selector;
};
struct r3_device_optimizer {
  using device_optimizer_type = backend_device_optimizer;
};
struct r4_queue {
  using queue_type = backend_queue;
  static int queue_stream(int stream) { return stream; }
};
struct r5_buffers {
  using device_buffer = backend_buffer;
  using host_buffer = backend_buffer;
};
struct r6_streams_and_events {
  using owned_stream = backend_owned_stream;
  using event_type = backend_event;
  static void record(event_type&, int) {}
  static void wait(int, event_type&) {}
  static void synchronize(event_type&) {}
  static void synchronize(int) {}
};
struct r7_devices {
  static int current_device() { return 0; }
  static void bind_device(int) {}
};
struct r8_copies {
  static void copy_async(void*, const void*, std::size_t, int) {}
};
struct r9_statistics {
  static constexpr std::size_t statistics_scratch_bytes = 0;
  static void step_statistics(std::span<const zenflow::const_matrix_view>, std::span<const zenflow::const_vector_view>,
                              float, zenflow::step_flags*, zenflow::step_flags*, std::byte*, int) {}
};
struct r10_device_update {
  static void device_step(backend_device_optimizer&, std::span<const zenflow::const_matrix_view>,
                          std::span<const zenflow::const_vector_view>, const zenflow::step_flags*, int) {}
  static void set_options(backend_device_optimizer&, std::size_t, const zenflow::adam_options&, int) {}
  static std::size_t add_matrix(backend_device_optimizer&, zenflow::matrix_view, std::span<const std::int32_t>,
                                std::span<const float>, int) {
    return 0;
  }
  static std::size_t add_vector(backend_device_optimizer&, zenflow::vector_view, std::span<const float>) { return 0; }
  static void reselect(backend_device_optimizer&, std::size_t, std::span<const std::int32_t>, std::span<const float>,
                       std::span<float>, int) {}
};
struct r11_columns {
  static void gather(zenflow::const_matrix_view, std::span<const std::int32_t>, const std::int32_t*, void*,
                     zenflow::dtype, const zenflow::step_flags*, int) {}
  static void scatter(const void*, zenflow::dtype, std::span<const std::int32_t>, const std::int32_t*,
                      zenflow::matrix_view, int) {}
};
struct r12_selection {
  static void select(backend_selector&, std::span<const zenflow::const_matrix_view>, int) {}
};

template <int N>
struct omitted {};
template <int Missing>
struct backend_missing : std::conditional_t<Missing == 1, omitted<1>, r1_stream>,
                         std::conditional_t<Missing == 2, omitted<2>, r2_selector>,
                         std::conditional_t<Missing == 3, omitted<3>, r3_device_optimizer>,
                         std::conditional_t<Missing == 4, omitted<4>, r4_queue>,
                         std::conditional_t<Missing == 5, omitted<5>, r5_buffers>,
                         std::conditional_t<Missing == 6, omitted<6>, r6_streams_and_events>,
                         std::conditional_t<Missing == 7, omitted<7>, r7_devices>,
                         std::conditional_t<Missing == 8, omitted<8>, r8_copies>,
                         std::conditional_t<Missing == 9, omitted<9>, r9_statistics>,
                         std::conditional_t<Missing == 10, omitted<10>, r10_device_update>,
                         std::conditional_t<Missing == 11, omitted<11>, r11_columns>,
                         std::conditional_t<Missing == 12, omitted<12>, r12_selection> {};
using model_backend = backend_missing<0>;

// Parts that are there but fall short of their requirement.
struct selector_without_scores : model_selector {
  explicit selector_without_scores(float) {}
  std::size_t add_parameter(zenflow::index_t, zenflow::index_t) { return 0; }
};
struct backend_with_a_selector_without_scores : model_backend {
  using selector_type = selector_without_scores;
  static void select(selector_type&, std::span<const zenflow::const_matrix_view>, int) {}
};
struct event_without_query {};
struct host_backend_with_events_without_query : model_backend {
  using event_type = event_without_query;
  static void record(event_type&, int) {}
  static void wait(int, event_type&) {}
  static void synchronize(event_type&) {}
  static void synchronize(int) {}
};
struct device_backend_with_events_without_query : host_backend_with_events_without_query {
  static constexpr zenflow::memory_space device_space = zenflow::memory_space::device;
};

static_assert(zenflow::coordinator_backend<model_backend>);
static_assert(!zenflow::coordinator_backend<backend_missing<1>>);
static_assert(!zenflow::coordinator_backend<backend_missing<2>>);
static_assert(!zenflow::coordinator_backend<backend_missing<3>>);
static_assert(!zenflow::coordinator_backend<backend_missing<4>>);
static_assert(!zenflow::coordinator_backend<backend_missing<5>>);
static_assert(!zenflow::coordinator_backend<backend_missing<6>>);
static_assert(!zenflow::coordinator_backend<backend_missing<7>>);
static_assert(!zenflow::coordinator_backend<backend_missing<8>>);
static_assert(!zenflow::coordinator_backend<backend_missing<9>>);
static_assert(!zenflow::coordinator_backend<backend_missing<10>>);
static_assert(!zenflow::coordinator_backend<backend_missing<11>>);
static_assert(!zenflow::coordinator_backend<backend_missing<12>>);
static_assert(!zenflow::coordinator_backend<backend_with_a_selector_without_scores>);
static_assert(!zenflow::coordinator_backend<host_backend_with_events_without_query>);  // R6: query() on the host
static_assert(zenflow::coordinator_backend<device_backend_with_events_without_query>);
static_assert(zenflow::coordinator_backend<zenflow::host_backend>);

static_assert(zenflow::importance_selector<model_selector>);
static_assert(!zenflow::importance_selector<selector_without_k>);
static_assert(zenflow::transfer_queue<model_queue>);
static_assert(!zenflow::transfer_queue<queue_without_try_acquire>);
static_assert(zenflow::optimizer_hyper_parameters<zenflow::adam_options>);
static_assert(!zenflow::optimizer_hyper_parameters<hyper_parameters_without_fields>);
static_assert(!zenflow::optimizer_hyper_parameters<hyper_parameters_without_validate>);
static_assert(zenflow::optimizer_hyper_parameters<hyper_parameters_with_a_bad_table<0>>);
static_assert(!zenflow::optimizer_hyper_parameters<hyper_parameters_with_a_bad_table<1>>);
static_assert(!zenflow::optimizer_hyper_parameters<hyper_parameters_with_a_bad_table<2>>);
static_assert(!zenflow::optimizer_hyper_parameters<hyper_parameters_with_a_bad_table<3>>);
static_assert(!zenflow::optimizer_hyper_parameters<hyper_parameters_with_a_bad_table<4>>);
static_assert(zenflow::host_column_optimizer<zenflow::host_sparse_adam>);
static_assert(zenflow::host_column_optimizer<twin_with_its_set_options>);
static_assert(!zenflow::host_column_optimizer<twin_without_its_set_options>);
static_assert(!zenflow::host_column_optimizer<backend_device_optimizer>);  // no step, reselect, add_*
static_assert(!zenflow::host_optimizer<host_optimizer_with_unusable_hyper_parameters>);
static_assert(zenflow::host_optimizer<model_host_optimizer>);
static_assert(!zenflow::host_optimizer<optimizer_without_step_count>);
static_assert(!zenflow::host_optimizer<optimizer_with_only_the_reading_side>);
static_assert(!zenflow::host_optimizer<host_optimizer_without_slots>);
static_assert(!zenflow::host_optimizer<host_optimizer_with_unchecked_slots>);
static_assert(zenflow::state_slots<momentum_slots>);
static_assert(!zenflow::state_slots<slots_without_check>);
static_assert(zenflow::host_optimizer<wrapped_cpu_adam>);
static_assert(zenflow::host_optimizer<zenflow::cpu_adam>);
static_assert(zenflow::device_optimizer<model_device_optimizer>);
static_assert(!zenflow::device_optimizer<model_host_optimizer>);  // lacks parameter_count
static_assert(!zenflow::device_optimizer<device_optimizer_without_selection>);
static_assert(zenflow::detail::migratable_device_optimizer<backend_device_optimizer>);
static_assert(!zenflow::detail::migratable_device_optimizer<device_optimizer_without_parameter_counts>);
static_assert(!zenflow::detail::migratable_device_optimizer<device_optimizer_without_slots>);
static_assert(zenflow::detail::migratable_device_optimizer<zenflow::host_sparse_adam>);
static_assert(zenflow::offload_coordinator<model_coordinator>);
static_assert(!zenflow::offload_coordinator<coordinator_without_submit>);

// A host optimizer whose state is `Slots`: value (slot s, column c, row r) = 1000 s + 10 c + r
// as it exports it (slot after slot); an import keeps what it was given.
template <class Slots>
struct slot_numbering_optimizer : model_host_optimizer {
  using model_host_optimizer::model_host_optimizer;
  using slots_type = Slots;
  std::size_t rows = 3;
  std::vector<float> imported;
  void export_state(std::size_t, std::span<const std::int32_t> columns, std::span<float> out) const {
    std::size_t at = 0;
    for (std::size_t s = 0; s < Slots::count; ++s)
      for (const auto c : columns)
        for (std::size_t r = 0; r < rows; ++r) out[at++] = static_cast<float>(1000 * s + 10 * c + r);
    REQUIRE(at == out.size());
  }
  void import_state(std::size_t, std::span<const std::int32_t>, std::span<const float> in) {
    imported.assign(in.begin(), in.end());
  }
};
struct four_slots : zenflow::adam_state_slots {
  static constexpr std::array<std::string_view, 4> names{"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static constexpr std::size_t count = 4;
};
static_assert(zenflow::host_optimizer<slot_numbering_optimizer<momentum_slots>>);
static_assert(zenflow::host_optimizer<slot_numbering_optimizer<four_slots>>);

}  // namespace

TEST_CASE("a host_optimizer that is not cpu_adam runs the coordinator") {
  using zenflow::testing::base_options;
  using zenflow::testing::basic_harness;
  basic_harness<zenflow::basic_coordinator<zenflow::host_backend, wrapped_cpu_adam>> wrapped(base_options());
  basic_harness<> reference(base_options());
  wrapped.train(14);
  reference.train(14);
  CHECK(wrapped.finish() == reference.finish());
  CHECK(wrapped.coordinator.host_optimizer().step_count() == reference.coordinator.host_optimizer().step_count());
}

TEST_CASE_TEMPLATE("a reselection packs the host optimizer's slots column by column, whatever their number", Slots,
                   momentum_slots, zenflow::adam_state_slots, four_slots) {
  slot_numbering_optimizer<Slots> o(zenflow::adam_options{}, zenflow::cpu_adam_config{});
  const std::vector<std::int32_t> columns{1, 4};
  std::vector<float> packed;
  zenflow::detail::pack_columns(o, 0, 3, columns, packed);
  // The device exchange layout: value (column j, slot s, row r) at (j * count + s) * rows + r.
  REQUIRE(packed.size() == Slots::count * columns.size() * 3);
  for (std::size_t j = 0; j < columns.size(); ++j)
    for (std::size_t s = 0; s < Slots::count; ++s)
      for (std::size_t r = 0; r < 3; ++r)
        CHECK(packed[(j * Slots::count + s) * 3 + r] == static_cast<float>(1000 * s + 10 * columns[j] + r));
  // And back, slot after slot, as the optimizer exported it.
  zenflow::detail::unpack_columns(o, 0, 3, columns, packed);
  std::vector<float> exported(packed.size());
  o.export_state(0, columns, exported);
  CHECK(o.imported == exported);
}

TEST_CASE("concept models are usable through the concept") {
  auto count = [](const zenflow::importance_selector auto& s) { return s.parameter_count(); };
  model_selector s{{{1, 3}, {0}}};
  CHECK(count(s) == 2);
  CHECK(s.k(0) == 2);
}

}  // namespace ZENFLOW_TEST_FILE_ID
