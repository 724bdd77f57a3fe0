// io_engine.hpp in a program built without zenflow::uring: only the posix engine exists,
// automatic says io_uring is not built in, and asking for io_uring is an error that says how
// to get it.
#include <zenflow/io_engine.hpp>

#include <doctest/doctest.h>

#include "../support/error_text.hpp"

#if defined(ZENFLOW_WITH_URING)
#error "this test checks the build without zenflow::uring"
#endif

TEST_CASE("make_io_engine without zenflow::uring: posix, and the reason") {
  static_assert(!zenflow::io_uring_built_in);
  zenflow::any_io_engine e = zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 4});
  CHECK(e.name() == "posix");
  CHECK(e.status() == "posix: 4 threads of pread/pwrite, queue depth 4; io_uring not built in (link zenflow::uring)");
  CHECK(zenflow_test::error_of([] {
          (void)zenflow::make_io_engine({zenflow::io_engine_kind::uring, 4});
        }) ==
        "zenflow: kind: io_engine_kind::uring, but this program was built without io_uring: link zenflow::uring "
        "(liburing)");
}
