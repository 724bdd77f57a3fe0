// The small state file both units of tests/mixed_uring create (each constructs it itself: the
// constructor, an inline function that builds an engine, is what the test is about).
#pragma once

#include <zenflow/state_file.hpp>

#include <filesystem>
#include <string>

namespace mixed_uring {
inline zenflow::state_file_config small_state_file(const std::filesystem::path& directory, const std::string& name) {
  zenflow::state_file_config c;
  c.directory = directory;
  c.file_name = name;
  c.bytes = 64 * 1024;
  c.block_bytes = 16 * 1024;
  c.read_ahead = c.write_behind = 1;
  c.allow_memory_backed = true;
  c.direct = zenflow::direct_io::fallback_to_buffered;
  c.pin = zenflow::pin_policy::none;
  return c;
}
}  // namespace mixed_uring
