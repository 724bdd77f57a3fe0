// A host optimizer's state of a tensor's columns as it exports it in fp32 (export_columns), for
// tests that compare states whatever format the optimizer holds them in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace zenflow_test {

struct exported_state {
  std::vector<float> master, exp_avg, exp_avg_sq;  // columns.size() * rows each, in list order
};

/// Tensor t's listed columns (ascending).
template <class Optimizer>
exported_state export_state(const Optimizer& o, std::size_t t, std::span<const std::int32_t> columns) {
  const std::size_t n = columns.size() * static_cast<std::size_t>(o.rows(t));
  exported_state s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  o.export_columns(t, columns, s.master, s.exp_avg, s.exp_avg_sq);
  return s;
}

/// Every column of tensor t.
template <class Optimizer>
exported_state export_state(const Optimizer& o, std::size_t t) {
  std::vector<std::int32_t> columns(static_cast<std::size_t>(o.cols(t)));
  for (std::size_t c = 0; c < columns.size(); ++c) columns[c] = static_cast<std::int32_t>(c);
  return export_state(o, t, columns);
}

}  // namespace zenflow_test
