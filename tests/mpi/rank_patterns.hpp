// Values the multi-rank communicator tests send: small integers, distinct per rank and element,
// exact in every element type, and so are their sums over 3 ranks (|x| <= 30); the reduction every
// rank must receive; and the conversions to and from the element types.
#pragma once

#include <zenflow/communicator.hpp>
#include <zenflow/types.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "mpi_doctest.hpp"

namespace zenflow_test {

template <class T>
T make(double x) {
  if constexpr (std::is_same_v<T, zenflow::bfloat16> || std::is_same_v<T, zenflow::float16>)
    return zenflow::from_float<T>(static_cast<float>(x));
  else
    return static_cast<T>(x);
}
template <class T>
double value(T x) {
  if constexpr (std::is_same_v<T, zenflow::bfloat16> || std::is_same_v<T, zenflow::float16>)
    return static_cast<double>(zenflow::to_float(x));
  else
    return static_cast<double>(x);
}

inline double pattern(int rank, std::size_t i) {
  return static_cast<double>((rank + 1) * 3) + static_cast<double>(i % 11) - 5.0 + (rank == 1 ? -7.0 : 0.0);
}
/// `op` over every rank's pattern at element i.
inline double reduced(zenflow::reduce_op op, std::size_t i) {
  double acc = pattern(0, i);
  for (int r = 1; r < world_size(); ++r) {
    const double x = pattern(r, i);
    acc = op == zenflow::reduce_op::sum ? acc + x : op == zenflow::reduce_op::max ? std::max(acc, x) : std::min(acc, x);
  }
  return acc;
}

/// Rank `rank`'s values of elements [first, first + n).
template <class T>
std::vector<T> patterned(int rank, std::size_t n, std::size_t first = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(pattern(rank, first + i));
  return v;
}

}  // namespace zenflow_test
