// Argument checks shared by every communicator: the same message for the same mistake, thrown
// before anything is enqueued (the concept's O2). Pointers are only compared, never dereferenced,
// so the checks serve host and device buffers alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>

#include "zenflow/error.hpp"
#include "zenflow/types.hpp"

namespace zenflow {
enum class reduce_op : std::uint8_t;
}

namespace zenflow::detail {

/// The element type's name in messages: "float", "double", "int32", "int64", "bfloat16", "float16".
template <class T>
constexpr const char* element_name() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return "float";
  else if constexpr (std::is_same_v<T, double>)
    return "double";
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return "int32";
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return "int64";
  else if constexpr (std::is_same_v<T, bfloat16>)
    return "bfloat16";
  else
    return "float16";
}

/// True when [a, a + an) and [b, b + bn) (in elements of T) share memory.
template <class T>
bool overlaps(const T* a, std::size_t an, const T* b, std::size_t bn) noexcept {
  if (an == 0 || bn == 0) return false;
  const std::less<const T*> before;
  return before(a, b + bn) && before(b, a + an);
}

inline void check_stream(bool stream_ok) {
  expects(stream_ok, "stream", "must not be null");
}

inline void check_op(reduce_op op) {
  const auto value = static_cast<unsigned>(op);
  expects(value <= 2u, "op", "unknown reduce_op value ", value, " (expected sum, max or min)");
}

template <class T>
void check_data(std::span<const T> buffer, const char* argument) {
  expects(buffer.empty() || buffer.data() != nullptr, argument, "data is null but it holds ", buffer.size(),
          " elements");
}

/// all_reduce: equal sizes; send and recv identical (in place) or disjoint.
template <class T>
void check_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, bool stream_ok) {
  check_stream(stream_ok);
  check_op(op);
  check_data(send, "send");
  check_data(std::span<const T>(recv), "recv");
  expects(recv.size() == send.size(), "recv", "all_reduce needs recv.size() == send.size(), got ", recv.size(), " and ",
          send.size());
  expects(send.data() == recv.data() || !overlaps<T>(send.data(), send.size(), recv.data(), recv.size()), "recv",
          "all_reduce: recv overlaps send without being the same buffer (in place)");
}

/// reduce_scatter: send = size blocks of recv.size(); recv disjoint from send or its own block.
template <class T>
void check_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op, int rank, int size,
                          bool stream_ok) {
  check_stream(stream_ok);
  check_op(op);
  check_data(send, "send");
  check_data(std::span<const T>(recv), "recv");
  const std::size_t n = recv.size();
  expects(send.size() == static_cast<std::size_t>(size) * n, "send",
          "reduce_scatter needs send.size() == size() * recv.size() = ", size, " * ", n, ", got ", send.size());
  expects(!overlaps<T>(send.data(), send.size(), recv.data(), n) ||
              recv.data() == send.data() + static_cast<std::size_t>(rank) * n,
          "recv",
          "reduce_scatter: recv overlaps send without being this rank's block of it (in place: recv.data() == "
          "send.data() + rank() * recv.size())");
}

/// all_gather: recv = size blocks of send.size(); send disjoint from recv or this rank's block.
template <class T>
void check_all_gather(std::span<const T> send, std::span<T> recv, int rank, int size, bool stream_ok) {
  check_stream(stream_ok);
  check_data(send, "send");
  check_data(std::span<const T>(recv), "recv");
  const std::size_t n = send.size();
  expects(recv.size() == static_cast<std::size_t>(size) * n, "recv",
          "all_gather needs recv.size() == size() * send.size() = ", size, " * ", n, ", got ", recv.size());
  expects(!overlaps<T>(send.data(), n, recv.data(), recv.size()) ||
              send.data() == recv.data() + static_cast<std::size_t>(rank) * n,
          "send",
          "all_gather: send overlaps recv without being this rank's block of it (in place: send.data() == "
          "recv.data() + rank() * send.size())");
}

template <class T>
void check_broadcast(std::span<T> buffer, int root, int size, bool stream_ok) {
  check_stream(stream_ok);
  check_data(std::span<const T>(buffer), "buffer");
  expects(root >= 0 && root < size, "root", "must be in [0, ", size, "), got ", root);
}

}  // namespace zenflow::detail
