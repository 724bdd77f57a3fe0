// The unit of tests/mixed_uring built WITHOUT zenflow::uring (see test_mixed_uring.cpp).
#include <zenflow/io_engine.hpp>
#include <zenflow/state_file.hpp>

#include <filesystem>
#include <string>

#include "state_file_config.hpp"

#if defined(ZENFLOW_WITH_URING)
#error "this unit is the one built without zenflow::uring"
#endif

static_assert(!zenflow::io_uring_built_in);

namespace mixed_uring {
std::string plain_engine_status(const std::filesystem::path& directory) {
  const zenflow::state_file file(small_state_file(directory, "plain.bin"),
                                 zenflow::io_engine_config{zenflow::io_engine_kind::automatic, 4});
  return file.engine().status();
}

std::string plain_make_engine_status() {
  return zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 4}).status();
}
}  // namespace mixed_uring
