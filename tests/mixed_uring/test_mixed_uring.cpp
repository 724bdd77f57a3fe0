// Two translation units of one program, this one built with zenflow::uring and plain_unit.cpp
// without it, linked in both orders and compiled without inlining (an inline function that builds
// an engine, such as state_file's constructor, is then one out-of-line definition the linker keeps
// from whichever unit comes first). Whether io_uring exists is the program's: both units get the
// same engine, and neither reports io_uring as not built in.
#include <zenflow/io_engine.hpp>
#include <zenflow/state_file.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "../support/storage_test_utils.hpp"
#include "state_file_config.hpp"

#if !defined(ZENFLOW_WITH_URING)
#error "this unit is the one built with zenflow::uring"
#endif

namespace mixed_uring {
std::string plain_engine_status(const std::filesystem::path& directory);
std::string plain_make_engine_status();

std::string uring_engine_status(const std::filesystem::path& directory) {
  const zenflow::state_file file(small_state_file(directory, "uring.bin"),
                                 zenflow::io_engine_config{zenflow::io_engine_kind::automatic, 4});
  return file.engine().status();
}
}  // namespace mixed_uring

TEST_CASE("units built with and without zenflow::uring share the program's io_uring") {
  CHECK(zenflow::io_uring_built_in);
  CHECK(zenflow::io_uring_linked());
  const zenflow_test::scratch_dir dir;
  const std::string here = mixed_uring::uring_engine_status(dir.path());
  const std::string there = mixed_uring::plain_engine_status(dir.path());
  const std::string made_there = mixed_uring::plain_make_engine_status();
  MESSAGE("this unit's state file: " << here);
  CHECK(here.find("not built in") == std::string::npos);
  CHECK(there.find("not built in") == std::string::npos);
  CHECK(made_there.find("not built in") == std::string::npos);
  // The same engine (io_uring, or posix with the reason io_uring cannot run on this machine).
  CHECK(here.substr(0, here.find(':')) == there.substr(0, there.find(':')));
}
