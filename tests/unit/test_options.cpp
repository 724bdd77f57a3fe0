// zenflow_options::validate() rejects every out-of-range or contradictory value, naming the field
// and printing the value given; the field table's text helpers (hyper_parameters.hpp).
#include <zenflow/concepts.hpp>
#include <zenflow/hyper_parameters.hpp>
#include <zenflow/options.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::interval_option;
using zenflow::selection_strategy;
using zenflow::zenflow_options;

namespace {
std::string rejected_field(const std::function<void(zenflow_options&)>& edit) {
  zenflow_options o;
  edit(o);
  try {
    o.validate();
  } catch (const zenflow::error& e) {
    CHECK(std::string(e.what()).find(e.argument()) != std::string::npos);
    return e.argument();
  }
  return "<accepted>";
}
}  // namespace

TEST_CASE("defaults follow DeepSpeed's zenflow block and torch's AdamW") {
  const zenflow_options o;
  CHECK(o.topk_ratio == doctest::Approx(0.1));
  CHECK(o.select_strategy == selection_strategy::automatic);
  CHECK(o.select_interval.is_auto);
  CHECK(o.update_interval.is_auto);
  CHECK(o.full_warm_up_rounds == 0);
  CHECK(o.overlap_step);
  CHECK(o.optimizer.lr == doctest::Approx(1e-3));
  CHECK(o.optimizer.beta1 == doctest::Approx(0.9));
  CHECK(o.optimizer.beta2 == doctest::Approx(0.999));
  CHECK(o.optimizer.eps == doctest::Approx(1e-8));
  CHECK(o.optimizer.adamw_mode);
  CHECK(o.optimizer.bias_correction);
  CHECK(o.max_grad_norm == 0.0f);
  CHECK_NOTHROW(o.validate());
}

TEST_CASE("each bad value is rejected with the field's name") {
  const float nan = std::nanf("");
  CHECK(rejected_field([](auto& o) { o.topk_ratio = 0.0f; }) == "topk_ratio");
  CHECK(rejected_field([](auto& o) { o.topk_ratio = 1.5f; }) == "topk_ratio");
  CHECK(rejected_field([&](auto& o) { o.topk_ratio = nan; }) == "topk_ratio");
  CHECK(rejected_field([](auto& o) { o.topk_ratio = 1.0f; }) == "<accepted>");
  CHECK(rejected_field([](auto& o) { o.select_strategy = static_cast<selection_strategy>(7); }) == "select_strategy");
  CHECK(rejected_field([](auto& o) { o.select_interval = interval_option::fixed(0); }) == "select_interval");
  CHECK(rejected_field([](auto& o) { o.update_interval = interval_option::fixed(-3); }) == "update_interval");
  CHECK(rejected_field([](auto& o) {
          o.select_interval = interval_option::fixed(2);
          o.update_interval = interval_option::fixed(4);
        }) == "select_interval");
  CHECK(rejected_field([](auto& o) {
          o.select_interval = interval_option::fixed(8);
          o.update_interval = interval_option::fixed(4);
        }) == "<accepted>");
  CHECK(rejected_field([](auto& o) { o.full_warm_up_rounds = -1; }) == "full_warm_up_rounds");
  CHECK(rejected_field([](auto& o) { o.select_strategy = selection_strategy::epoch; }) == "steps_per_epoch");
  CHECK(rejected_field([](auto& o) { o.steps_per_epoch = -1; }) == "steps_per_epoch");
  // select_interval epochs of steps_per_epoch steps that do not fit in 64 bits: rejected (a product
  // wrapped to 0 made the selection policy divide by zero, any other wrapped value select at a
  // wrong step), with the epoch strategy whether set or resolved from "auto".
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  for (const auto strategy : {selection_strategy::epoch, selection_strategy::automatic}) {
    CHECK(rejected_field([&](auto& o) {
            o.select_strategy = strategy;
            o.steps_per_epoch = std::int64_t{1} << 62;
            o.select_interval = interval_option::fixed(4);  // 2^64: wraps to 0
          }) == "select_interval");
    CHECK(rejected_field([&](auto& o) {
            o.select_strategy = strategy;
            o.steps_per_epoch = max / 3 + 1;
            o.select_interval = interval_option::fixed(3);
          }) == "select_interval");
    CHECK(rejected_field([&](auto& o) {
            o.select_strategy = strategy;
            o.steps_per_epoch = max / 3;
            o.select_interval = interval_option::fixed(3);
          }) == "<accepted>");
  }
  // The step strategy does not multiply: any count is a step count.
  CHECK(rejected_field([&](auto& o) {
          o.select_strategy = selection_strategy::step;
          o.steps_per_epoch = std::int64_t{1} << 62;
          o.select_interval = interval_option::fixed(4);
        }) == "<accepted>");
  CHECK(rejected_field([](auto& o) { o.auto_select_steps = 0; }) == "auto_select_steps");
  CHECK(rejected_field([](auto& o) { o.max_update_interval = 0; }) == "max_update_interval");
  // A bound above the selection interval is held to it (a reselection ends an interval anyway).
  CHECK(rejected_field([](auto& o) { o.max_update_interval = 1000; }) == "<accepted>");
  CHECK(rejected_field([](auto& o) { o.select_interval = interval_option::fixed(10); }) == "<accepted>");
  // A mode implies what it runs: no other field has to be changed with it.
  CHECK(rejected_field([](auto& o) { o.mode = zenflow::offload_mode::zero_offload; }) == "<accepted>");
  CHECK(rejected_field([](auto& o) { o.mode = zenflow::offload_mode::dense; }) == "<accepted>");
  CHECK(rejected_field([](auto& o) { o.max_grad_norm = -1.0f; }) == "max_grad_norm");
  CHECK(rejected_field([&](auto& o) { o.max_grad_norm = nan; }) == "max_grad_norm");
  CHECK(rejected_field([](auto& o) { o.optimizer.lr = -1e-3f; }) == "lr");
  CHECK(rejected_field([](auto& o) { o.optimizer.beta1 = 1.0f; }) == "beta1");
  CHECK(rejected_field([](auto& o) { o.optimizer.beta1 = -0.1f; }) == "beta1");
  CHECK(rejected_field([](auto& o) { o.optimizer.beta2 = 1.0f; }) == "beta2");
  CHECK(rejected_field([](auto& o) { o.optimizer.eps = 0.0f; }) == "eps");
  CHECK(rejected_field([](auto& o) { o.optimizer.weight_decay = -0.01f; }) == "weight_decay");
}

TEST_CASE("auto resolution of the selection strategy and interval") {
  zenflow_options o;
  CHECK(o.effective_max_update_interval() == 16);
  o.select_interval = interval_option::fixed(10);
  CHECK(o.effective_max_update_interval() == 10);
  o.select_interval = interval_option::automatic();
  CHECK(o.resolved_strategy() == selection_strategy::step);
  CHECK(o.select_interval_steps() == o.auto_select_steps);
  o.steps_per_epoch = 50;
  CHECK(o.resolved_strategy() == selection_strategy::epoch);
  CHECK(o.select_interval_steps() == 50);
  o.select_interval = interval_option::fixed(3);
  CHECK(o.select_interval_steps() == 150);
  o.select_strategy = selection_strategy::step;
  CHECK(o.select_interval_steps() == 3);
}

TEST_CASE("a rejected value is printed as the shortest decimal that reads back as it") {
  // Six fixed decimals would print these "-0.000000", "1.000000" and "0.000000": the value that
  // was wrong would not show.
  const auto message = [](const std::function<void(zenflow_options&)>& edit) {
    zenflow_options o;
    edit(o);
    try {
      o.validate();
    } catch (const zenflow::error& e) {
      return std::string(e.what());
    }
    return std::string("<accepted>");
  };
  CHECK(message([](auto& o) { o.optimizer.eps = -1e-9f; }).find("got -1e-09") != std::string::npos);
  CHECK(message([](auto& o) { o.topk_ratio = 1.0000001f; }).find("got 1.0000001") != std::string::npos);
  CHECK(message([](auto& o) { o.optimizer.weight_decay = -1e-7f; }).find("got -1e-07") != std::string::npos);
  CHECK(zenflow::detail::concat(0.001f, " ", 2.5, " ", -3, " ", true) == "0.001 2.5 -3 true");
}

namespace {
// An optimizer whose every hyper-parameter is shared by all parameters.
struct fixed_sgd_options {
  float lr = 0.1f;
  bool nesterov = false;
  friend bool operator==(const fixed_sgd_options&, const fixed_sgd_options&) = default;
  static constexpr const char* name = "fixed_sgd";
  static constexpr std::array<zenflow::hyper_parameter_field<fixed_sgd_options>, 2> fields() noexcept {
    return {zenflow::real_field("lr", &fixed_sgd_options::lr, false),
            zenflow::flag_field("nesterov", &fixed_sgd_options::nesterov, false)};
  }
  void validate() const {}
};
static_assert(zenflow::optimizer_hyper_parameters<fixed_sgd_options>);
}  // namespace

TEST_CASE("the field table as text: names, the per-group rule, the table a checkpoint records") {
  using zenflow::adam_options;
  CHECK(zenflow::field_names<adam_options>(true) == "lr, beta1, beta2, eps and weight_decay");
  CHECK(zenflow::field_names<adam_options>(false) == "adamw_mode and bias_correction");
  CHECK(zenflow::per_group_rule<adam_options>() ==
        "parameter groups and schedules change lr, beta1, beta2, eps and weight_decay only");
  CHECK(zenflow::field_table_text<adam_options>() ==
        "lr (float, per group), beta1 (float, per group), beta2 (float, per group), eps (float, per group), "
        "weight_decay (float, per group), adamw_mode (bool), bias_correction (bool)");
  adam_options a;
  a.eps = 1e-6f;
  CHECK(zenflow::field_text(a, "eps") == "1e-06");
  CHECK(zenflow::field_text(a, "adamw_mode") == "true");
  CHECK(zenflow::field_text(a, "momentum") == "?");
  // No per-group field: the rule says so instead of "change  only".
  CHECK(zenflow::field_names<fixed_sgd_options>(true).empty());
  CHECK(zenflow::per_group_rule<fixed_sgd_options>() ==
        "fixed_sgd has no per-group field (every parameter shares options().optimizer)");
  CHECK(zenflow::field_table_text<fixed_sgd_options>() == "lr (float), nesterov (bool)");
}

}  // namespace ZENFLOW_TEST_FILE_ID
