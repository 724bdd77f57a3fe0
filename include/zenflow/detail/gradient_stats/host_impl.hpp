// Definition of the host gradient statistics (included by zenflow/gradient_stats.hpp; not a
// public header).
#pragma once

#include <span>

#include "zenflow/detail/gradient_stats/math.hpp"
#include "zenflow/gradient_stats.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

inline gradient_stats host_gradient_stats(std::span<const const_matrix_view> grads,
                                          std::span<const const_vector_view> vectors) {
  for (const auto& g : grads) g.validate("grads", memory_space::host);
  for (const auto& v : vectors) v.validate("vectors", memory_space::host);
  gradient_stats out;
  auto add = [&out](float x) {
    if (detail::stats::is_nonfinite_bits(detail::float_to_bits(x))) {
      ++out.nonfinite_count;
    } else {
      const double d = x;
      out.sum_of_squares += d * d;
    }
  };
  for (const auto& g : grads) {
    if (g.empty()) continue;
    dispatch_dtype(g.type, [&](auto tag) {
      using T = decltype(tag);
      const T* data = static_cast<const T*>(g.data);
      for (index_t r = 0; r < g.rows; ++r)
        for (index_t c = 0; c < g.cols; ++c) add(to_float(data[g.offset(r, c)]));
    });
  }
  for (const auto& v : vectors) {
    if (v.empty()) continue;
    dispatch_dtype(v.type, [&](auto tag) {
      using T = decltype(tag);
      const T* data = static_cast<const T*>(v.data);
      for (index_t i = 0; i < v.size; ++i) add(to_float(data[i * v.stride]));
    });
  }
  return out;
}

}  // namespace zenflow
