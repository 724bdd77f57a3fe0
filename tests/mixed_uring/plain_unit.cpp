// The unit of tests/mixed_uring built WITHOUT zenflow::uring (see test_mixed_uring.cpp).
#include <zenflow/io_engine.hpp>
#include <zenflow/state_file.hpp>

#include <filesystem>
#include <string>

#if defined(ZENFLOW_WITH_URING)
#error "this unit is the one built without zenflow::uring"
#endif

static_assert(!zenflow::io_uring_built_in);

namespace mixed_uring {
std::string plain_engine_status(const std::filesystem::path& directory) {
  zenflow::state_file_config c;
  c.directory = directory;
  c.file_name = "plain.bin";
  c.bytes = 64 * 1024;
  c.block_bytes = 16 * 1024;
  c.read_ahead = c.write_behind = 1;
  c.allow_memory_backed = true;
  c.direct = zenflow::direct_io::fallback_to_buffered;
  c.pin = zenflow::pin_policy::none;
  const zenflow::state_file file(c, zenflow::io_engine_config{zenflow::io_engine_kind::automatic, 4});
  return file.engine().status();
}

std::string plain_make_engine_status() {
  return zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 4}).status();
}
}  // namespace mixed_uring
