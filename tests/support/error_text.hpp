// The message of a zenflow::error, for tests that check what an error says (several parts of one
// message, or a message from a call that may throw later than it is made).
#pragma once

#include <zenflow/error.hpp>

#include <string>

namespace zenflow_test {

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// Runs `f`, which should throw zenflow::error; returns its message ("" if it did not throw).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const zenflow::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace zenflow_test
