// Each concept has a positive and a negative static_assert. The positive models here are minimal
// stand-ins that spell out the requirements; the real components assert their own conformance in
// their tests as they land.
#include <zenflow/concepts.hpp>

#include <doctest/doctest.h>

#include <optional>
#include <span>
#include <vector>

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

struct model_host_optimizer {
  zenflow::adam_options opts;
  std::vector<float> p;
  const zenflow::adam_options& options() const { return opts; }
  std::int64_t step_count() const { return 0; }
  std::size_t tensor_count() const { return 1; }
  std::span<const float> params(std::size_t) const { return p; }
  void set_step_count(std::int64_t) {}
};
struct optimizer_without_step_count {
  zenflow::adam_options opts;
  const zenflow::adam_options& options() const { return opts; }
};
struct model_device_optimizer : model_host_optimizer {
  std::vector<std::int32_t> sel;
  std::size_t parameter_count() const { return 0; }
  std::span<const std::int32_t> selection(std::size_t) const { return sel; }
  std::int64_t k(std::size_t) const { return static_cast<std::int64_t>(sel.size()); }
};
struct device_optimizer_without_selection : model_host_optimizer {
  std::size_t parameter_count() const { return 0; }
};

struct model_coordinator {
  using stream_type = int;
  zenflow::zenflow_options opts;
  const zenflow::zenflow_options& options() const { return opts; }
  void submit_gradient(std::size_t, zenflow::const_matrix_view, int) {}
  void step(int) {}
  std::int64_t step_count() const { return 0; }
  int metrics() const { return 0; }
};
struct coordinator_without_submit {
  using stream_type = int;
  zenflow::zenflow_options opts;
  const zenflow::zenflow_options& options() const { return opts; }
  void step(int) {}
  std::int64_t step_count() const { return 0; }
  int metrics() const { return 0; }
};

static_assert(zenflow::importance_selector<model_selector>);
static_assert(!zenflow::importance_selector<selector_without_k>);
static_assert(zenflow::transfer_queue<model_queue>);
static_assert(!zenflow::transfer_queue<queue_without_try_acquire>);
static_assert(zenflow::host_optimizer<model_host_optimizer>);
static_assert(!zenflow::host_optimizer<optimizer_without_step_count>);
static_assert(zenflow::device_optimizer<model_device_optimizer>);
static_assert(!zenflow::device_optimizer<model_host_optimizer>);  // lacks parameter_count
static_assert(!zenflow::device_optimizer<device_optimizer_without_selection>);
static_assert(zenflow::offload_coordinator<model_coordinator>);
static_assert(!zenflow::offload_coordinator<coordinator_without_submit>);

}  // namespace

TEST_CASE("concept models are usable through the concept") {
  auto count = [](const zenflow::importance_selector auto& s) { return s.parameter_count(); };
  model_selector s{{{1, 3}, {0}}};
  CHECK(count(s) == 2);
  CHECK(s.k(0) == 2);
}
