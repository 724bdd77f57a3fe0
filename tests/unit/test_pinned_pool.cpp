// pinned_buffer_pool: exact size (no rounding), alignment, the locked bytes the kernel reports,
// what happens when the process may not lock (in a child with a small RLIMIT_MEMLOCK and no
// CAP_IPC_LOCK), the pin hook, bad arguments.
#include <zenflow/pinned_pool.hpp>

#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../support/error_text.hpp"
#include "../support/storage_test_utils.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::pin_policy;
using zenflow::pinned_buffer_pool;
using zenflow_test::contains;
using zenflow_test::error_of;

TEST_CASE("pinned_buffer_pool: exactly count x buffer_bytes, aligned, disjoint, writable") {
  // 3 x 12 KiB: neither a power of two in total nor per buffer.
  pinned_buffer_pool pool(3, 3 * 4096, pin_policy::none);
  CHECK(pool.size() == 3);
  CHECK(pool.buffer_bytes() == 12288);
  CHECK(pool.total_bytes() == 36864);
  if (::sysconf(_SC_PAGESIZE) == 4096) CHECK(pool.mapped_bytes() == 36864);  // nothing added
  CHECK(pool.pinned_bytes() == 0);
  CHECK_FALSE(pool.pinned());
  CHECK(pool.status() == "not pinned (pin_policy::none)");
  for (std::size_t i = 0; i < pool.size(); ++i) {
    const auto b = pool.buffer(i);
    CHECK(b.size() == 12288);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % pinned_buffer_pool::alignment == 0);
    if (i > 0) CHECK(b.data() == pool.buffer(i - 1).data() + 12288);
    std::fill(b.begin(), b.end(), static_cast<std::byte>(i + 1));
  }
  for (std::size_t i = 0; i < pool.size(); ++i) CHECK(pool.buffer(i)[12287] == static_cast<std::byte>(i + 1));
  CHECK(contains(error_of([&] { (void)pool.buffer(3); }), "zenflow: i: buffer index 3 out of range (3 buffers)"));
}

TEST_CASE("pinned_buffer_pool: locked bytes equal what was asked for (VmLck)") {
  if (zenflow_test::mlock_is_intercepted) {
    MESSAGE("this sanitizer build turns mlock into a no-op: VmLck is checked in the other builds");
    return;
  }
  const long long before = zenflow_test::locked_bytes();
  REQUIRE(before >= 0);
  {
    pinned_buffer_pool pool(5, 9 * 4096);  // 180 KiB, automatic
    if (!pool.pinned()) {
      MESSAGE("this process may not lock 180 KiB here: " << pool.status());
      CHECK(contains(pool.status(), "not pinned: mlock of 184320 bytes failed"));
      return;
    }
    CHECK(pool.pinned_bytes() == 5 * 9 * 4096);
    CHECK(pool.mapped_bytes() == pool.total_bytes());
    CHECK(pool.status() == "mlock: 184320 bytes locked");
    CHECK(zenflow_test::locked_bytes() - before == 184320);  // nothing rounded, nothing extra
    pinned_buffer_pool moved = std::move(pool);
    CHECK(moved.pinned_bytes() == 184320);
    CHECK(pool.pinned_bytes() == 0);
    CHECK(zenflow_test::locked_bytes() - before == 184320);
  }
  CHECK(zenflow_test::locked_bytes() == before);  // unlocked at destruction
}

TEST_CASE("pinned_buffer_pool: without permission to lock, automatic says why and required fails") {
  if (zenflow_test::mlock_is_intercepted) {
    MESSAGE("this sanitizer build turns mlock into a no-op that succeeds: checked in the other builds");
    return;
  }
  // In a child: RLIMIT_MEMLOCK 64 KiB, and, when root, no CAP_IPC_LOCK (setuid to nobody).
  const auto r = zenflow_test::run_in_child([](const auto& report) {
    const rlimit small{65536, 65536};
    if (::setrlimit(RLIMIT_MEMLOCK, &small) != 0) return 10;
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 11;
    pinned_buffer_pool pool(4, 64 * 1024);  // 256 KiB > 64 KiB
    report(pool.status() + "\n");
    if (pool.pinned() || pool.pinned_bytes() != 0) return 12;
    const std::string required =
        zenflow_test::error_of([] { pinned_buffer_pool p(4, 64 * 1024, pin_policy::required); });
    report(required);
    return 0;
  });
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(contains(r.output, "not pinned: mlock of 262144 bytes failed"));
  CHECK(contains(r.output, "RLIMIT_MEMLOCK is 65536 bytes"));
  CHECK(contains(r.output, "CAP_IPC_LOCK"));
  CHECK(contains(r.output, "zenflow: policy: pin_policy::required but mlock of 262144 bytes failed"));
}

TEST_CASE("pinned_buffer_pool: a pin hook replaces mlock and sees the exact region") {
  std::vector<std::pair<void*, std::size_t>> pinned, unpinned;
  const long long before = zenflow_test::locked_bytes();
  {
    zenflow::pin_hook hook{"test-register", [&](void* p, std::size_t n) { pinned.emplace_back(p, n); },
                           [&](void* p, std::size_t n) { unpinned.emplace_back(p, n); }};
    pinned_buffer_pool pool(2, 8192, pin_policy::automatic, hook);
    CHECK(pool.pinned());
    CHECK(pool.pinned_bytes() == 16384);
    CHECK(pool.status() == "pinned by test-register: 16384 bytes");
    REQUIRE(pinned.size() == 1);
    CHECK(pinned[0].first == pool.buffer(0).data());
    CHECK(pinned[0].second == 16384);
    if (!zenflow_test::mlock_is_intercepted) CHECK(zenflow_test::locked_bytes() == before);  // the hook, not mlock
    CHECK(unpinned.empty());
  }
  REQUIRE(unpinned.size() == 1);
  CHECK(unpinned[0] == pinned[0]);

  // A failing hook: automatic reports it, required throws it.
  zenflow::pin_hook failing{"cudaHostRegister", [](void*, std::size_t) { throw std::runtime_error("no device"); },
                            [](void*, std::size_t) {}};
  pinned_buffer_pool soft(1, 4096, pin_policy::automatic, failing);
  CHECK_FALSE(soft.pinned());
  CHECK(soft.status() == "not pinned: cudaHostRegister failed: no device");
  CHECK(error_of([&] { pinned_buffer_pool p(1, 4096, pin_policy::required, failing); }) ==
        "zenflow: policy: pin_policy::required but cudaHostRegister failed: no device");
}

TEST_CASE("pinned_buffer_pool: bad arguments name the argument before mapping anything") {
  CHECK(error_of([] { pinned_buffer_pool p(0, 4096); }) == "zenflow: count: must be at least 1, got 0");
  CHECK(error_of([] { pinned_buffer_pool p(2, 4095); }) ==
        "zenflow: buffer_bytes: must be a positive multiple of 4096 bytes, got 4095");
  CHECK(error_of([] { pinned_buffer_pool p(2, 0); }) ==
        "zenflow: buffer_bytes: must be a positive multiple of 4096 bytes, got 0");
  CHECK(contains(error_of([] { pinned_buffer_pool p(std::size_t{1} << 52, std::size_t{1} << 20); }),
                 "zenflow: buffer_bytes: 4503599627370496 x 1048576 bytes overflows size_t"));
  zenflow::pin_hook hook{"h", [](void*, std::size_t) {}, [](void*, std::size_t) {}};
  CHECK(error_of([&] { pinned_buffer_pool p(1, 4096, pin_policy::none, hook); }) ==
        "zenflow: hook: a pin hook (h) was given with pin_policy::none");
}

}  // namespace ZENFLOW_TEST_FILE_ID
