// What the coordinator knows of an optimizer's hyper-parameters: a table of their fields.
//
// Each optimizer has its own hyper-parameter type (cpu_adam and the sparse Adams:
// `adam_options`). The coordinator, its checkpoints and its data-parallel agreement handle any of
// them through the type's `fields()` table: the name of each field, where it is, and whether
// parameter groups may set it per parameter (torch.optim's lr, betas, eps and weight decay) or it is
// shared by every parameter of one coordinator (Adam's variant and bias correction). The type
// checks its own ranges (`validate()`). See concepts.hpp (optimizer_hyper_parameters) for the
// whole contract, and tests/unit/test_coordinator_hyperparameters.cpp for a second optimizer's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "zenflow/error.hpp"

namespace zenflow {

/// One hyper-parameter of the optimizer whose hyper-parameter type is H: a float or a bool member.
template <class H>
struct hyper_parameter_field {
  const char* name = nullptr;
  float H::*real = nullptr;  ///< the member when it is a float (else nullptr)
  bool H::*flag = nullptr;   ///< the member when it is a bool (else nullptr)
  bool per_group = false;    ///< parameter groups may set it per parameter; else one value for all
};

/// A float field.
template <class H>
constexpr hyper_parameter_field<H> real_field(const char* name, float H::*member, bool per_group) noexcept {
  return {name, member, nullptr, per_group};
}
/// A bool field.
template <class H>
constexpr hyper_parameter_field<H> flag_field(const char* name, bool H::*member, bool per_group) noexcept {
  return {name, nullptr, member, per_group};
}

namespace detail {
/// Whether H's field table is well formed (optimizer_hyper_parameters, H5): every entry has a
/// non-empty name, unique in the table, and exactly one member.
template <class H>
consteval bool well_formed_fields() {
  const auto table = H::fields();
  for (auto f = table.begin(); f != table.end(); ++f) {
    if (f->name == nullptr || std::string_view(f->name).empty()) return false;
    if ((f->real == nullptr) == (f->flag == nullptr)) return false;
    for (auto g = table.begin(); g != f; ++g)
      if (std::string_view(g->name) == f->name) return false;
  }
  return true;
}
}  // namespace detail

/// Calls fn(field) for each field of H whose per_group flag is `per_group`, in table order.
template <class H, class Fn>
constexpr void for_each_field(bool per_group, Fn&& fn) {
  for (const hyper_parameter_field<H>& f : H::fields())
    if (f.per_group == per_group) fn(f);
}

/// Calls fn(value) with a reference to the value of each field of `h` whose per_group flag is
/// `per_group`, in table order (a float& or a bool&, const when h is).
template <class H, class Fn>
constexpr void for_each_value(H& h, bool per_group, Fn&& fn) {
  using plain = std::remove_const_t<H>;
  for_each_field<plain>(per_group, [&](const hyper_parameter_field<plain>& f) {
    if (f.real != nullptr)
      fn(h.*f.real);
    else
      fn(h.*f.flag);
  });
}

/// The name of the first field shared by every parameter (not per_group) in which a and b differ,
/// or nullptr: parameter groups may differ in their per_group fields only.
template <class H>
[[nodiscard]] constexpr const char* shared_field_mismatch(const H& a, const H& b) noexcept {
  for (const hyper_parameter_field<H>& f : H::fields()) {
    if (f.per_group) continue;
    if (f.real != nullptr ? a.*f.real != b.*f.real : a.*f.flag != b.*f.flag) return f.name;
  }
  return nullptr;
}

/// Field `name`'s value as text (a float as the shortest decimal that reads back as it: "0.001";
/// "true"), or "?" for a name H does not have.
template <class H>
[[nodiscard]] std::string field_text(const H& h, std::string_view name) {
  for (const hyper_parameter_field<H>& f : H::fields()) {
    if (name != f.name) continue;
    return f.flag != nullptr ? detail::concat(h.*f.flag) : detail::concat(h.*f.real);
  }
  return "?";
}

/// H's field table as text, in table order: for adam_options "lr (float, per group), beta1 (float, per group),
/// ..., bias_correction (bool)". A checkpoint records it beside H::name, so that a checkpoint is
/// only read by an optimizer whose table is the one it was written with.
template <class H>
[[nodiscard]] std::string field_table_text() {
  std::string out;
  for (const hyper_parameter_field<H>& f : H::fields()) {
    if (!out.empty()) out += ", ";
    out += f.name;
    out += f.real != nullptr ? " (float" : " (bool";
    out += f.per_group ? ", per group)" : ")";
  }
  return out;
}

/// The names of H's fields with the given per_group flag as prose: for adam_options, "lr, beta1,
/// beta2, eps and weight_decay" (per group) and "adamw_mode and bias_correction" (shared).
template <class H>
[[nodiscard]] std::string field_names(bool per_group) {
  std::size_t n = 0, i = 0;
  for_each_field<H>(per_group, [&](const hyper_parameter_field<H>&) { ++n; });
  std::string out;
  for_each_field<H>(per_group, [&](const hyper_parameter_field<H>& f) {
    if (i > 0) out += i + 1 == n ? " and " : ", ";
    out += f.name;
    ++i;
  });
  return out;
}

/// What parameter groups and schedules may change, as the end of a rejection's message: for
/// adam_options "parameter groups and schedules change lr, beta1, beta2, eps and weight_decay only";
/// for an H with no per-group field, "H::name has no per-group field (every parameter shares
/// options().optimizer)".
template <class H>
[[nodiscard]] std::string per_group_rule() {
  const std::string names = field_names<H>(true);
  if (names.empty())
    return detail::concat(H::name, " has no per-group field (every parameter shares options().optimizer)");
  return detail::concat("parameter groups and schedules change ", names, " only");
}

}  // namespace zenflow
