// I/O engines: the concept (positive and negative), every engine this build has (posix; io_uring
// where it runs) with queue depth > 1 on O_DIRECT files, every completion checked (a short read
// at end of file, a real short write under RLIMIT_FSIZE resumed into EFBIG, errno text, file,
// offset, length), request checks, destruction with requests in flight, the resumption logic,
// and the automatic choice, including io_uring blocked by a seccomp filter (a forked child).
// Run under ThreadSanitizer and AddressSanitizer too (presets tsan, asan).
#include <zenflow/io_engine.hpp>
#include <zenflow/pinned_pool.hpp>

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__linux__)
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../support/error_text.hpp"
#include "../support/faulty_engine.hpp"
#include "../support/storage_test_utils.hpp"

using zenflow::any_io_engine;
using zenflow::io_completion;
using zenflow::io_op;
using zenflow::io_request;
using zenflow::posix_io_engine;
using zenflow_test::contains;
using zenflow_test::error_of;

// --- the concept ------------------------------------------------------------------------------
namespace {
struct model_engine {
  std::string_view name() const { return "model"; }
  std::string status() const { return "model"; }
  std::size_t queue_depth() const { return 1; }
  std::size_t in_flight() const { return 0; }
  std::uint32_t add_file(int, std::string_view) { return 0; }
  void remove_file(std::uint32_t) {}
  bool register_buffers(std::span<const std::span<std::byte>>) { return false; }
  void submit(const io_request&) {}
  std::size_t wait(std::span<io_completion>, std::size_t) { return 0; }
  std::string describe(const io_completion&) const { return {}; }
};
struct engine_without_describe : model_engine {
  void describe() = delete;
};
struct engine_without_wait {
  std::string_view name() const { return "x"; }
  std::string status() const { return "x"; }
  std::size_t queue_depth() const { return 1; }
  std::size_t in_flight() const { return 0; }
  std::uint32_t add_file(int, std::string_view) { return 0; }
  void remove_file(std::uint32_t) {}
  bool register_buffers(std::span<const std::span<std::byte>>) { return false; }
  void submit(const io_request&) {}
  std::string describe(const io_completion&) const { return {}; }
};
struct immovable_engine : model_engine {
  immovable_engine() = default;
  immovable_engine(immovable_engine&&) = delete;
};
struct engine_with_blocking_submit_only : model_engine {  // wait takes no minimum
  std::size_t wait(std::span<io_completion>) { return 0; }
  void wait(std::span<io_completion>, std::size_t) = delete;
};
}  // namespace

static_assert(zenflow::io_engine<model_engine>);
static_assert(zenflow::io_engine<posix_io_engine>);
static_assert(zenflow::io_engine<any_io_engine>);
static_assert(zenflow::io_engine<zenflow_test::faulty_engine<posix_io_engine>>);
#if defined(ZENFLOW_WITH_URING)
static_assert(zenflow::io_engine<zenflow::uring_io_engine>);
#endif
static_assert(!zenflow::io_engine<engine_without_describe>);
static_assert(!zenflow::io_engine<engine_without_wait>);
static_assert(!zenflow::io_engine<immovable_engine>);
static_assert(!zenflow::io_engine<engine_with_blocking_submit_only>);
static_assert(!zenflow::io_engine<int>);

namespace {

constexpr std::size_t block = 64 * 1024;

// The engines this machine runs, behind any_io_engine.
struct engine_case {
  std::string name;
  std::function<any_io_engine(std::size_t queue_depth)> make;
};
std::vector<engine_case> engines_here() {
  std::vector<engine_case> cases{
      {"posix", [](std::size_t qd) { return any_io_engine(posix_io_engine(qd, std::min<std::size_t>(qd, 3))); }}};
#if defined(ZENFLOW_WITH_URING)
  try {
    zenflow::uring_io_engine probe(4);
    cases.push_back({"io_uring", [](std::size_t qd) { return any_io_engine(zenflow::uring_io_engine(qd)); }});
  } catch (const zenflow::error& e) {
    MESSAGE("io_uring does not run here, its tests are skipped: " << e.what());
  }
#endif
  return cases;
}

// A preallocated file of `blocks` x 64 KiB, opened with `flags` (O_DIRECT by default).
struct test_file {
  std::string path;
  int fd = -1;
  test_file(const zenflow_test::scratch_dir& dir, const std::string& name, std::size_t bytes, int flags = O_DIRECT)
      : path(dir.str() + "/" + name) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | flags, 0600);
    REQUIRE(fd >= 0);
    if (bytes > 0) REQUIRE(::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0);
  }
  ~test_file() {
    if (fd >= 0) ::close(fd);
  }
};

io_request req(io_op op, std::uint32_t file, std::uint64_t offset, std::byte* buf, std::size_t bytes, std::uint64_t tag,
               std::int32_t index = -1) {
  io_request r;
  r.op = op;
  r.file = file;
  r.offset = offset;
  r.buffer = buf;
  r.bytes = bytes;
  r.buffer_index = index;
  r.user_data = tag;
  return r;
}

// Runs `requests` through the engine at its queue depth; returns the completions by user_data.
template <class Engine>
std::map<std::uint64_t, io_completion> run_all(Engine& e, const std::vector<io_request>& requests) {
  std::map<std::uint64_t, io_completion> out;
  std::vector<io_completion> done(8);
  std::size_t next = 0;
  while (next < requests.size() || e.in_flight() > 0) {
    while (next < requests.size() && e.in_flight() < e.queue_depth()) e.submit(requests[next++]);
    const std::size_t n = e.wait(done, 1);
    for (std::size_t i = 0; i < n; ++i) out[done[i].request.user_data] = done[i];
  }
  return out;
}

}  // namespace

TEST_CASE("io engines: O_DIRECT writes and reads at queue depth 8, every completion whole") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    constexpr std::size_t blocks = 48;
    test_file f(dir, "data.bin", blocks * block);
    zenflow::pinned_buffer_pool pool(16, block, zenflow::pin_policy::none);
    any_io_engine e = ec.make(8);
    CHECK(e.name() == ec.name);
    CHECK(e.queue_depth() == 8);
    const std::uint32_t id = e.add_file(f.fd, f.path);
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < pool.size(); ++i) spans.push_back(pool.buffer(i));
    const bool registered = e.register_buffers(spans);
    CHECK(registered == (ec.name == "io_uring"));
    CHECK(contains(e.status(), ec.name == "io_uring" ? "16 registered buffers" : "3 threads of pread/pwrite"));

    // Write each block from buffer (b % 8), contents pattern(b); read them back into buffers 8..15.
    std::vector<std::vector<std::byte>> expected;
    for (std::size_t b = 0; b < blocks; ++b)
      expected.push_back(zenflow_test::pattern(block, static_cast<std::uint32_t>(b)));
    std::vector<io_request> writes;
    for (std::size_t round = 0; round < blocks / 8; ++round) {
      writes.clear();
      for (std::size_t k = 0; k < 8; ++k) {
        const std::size_t b = round * 8 + k;
        std::copy(expected[b].begin(), expected[b].end(), pool.buffer(k).begin());
        writes.push_back(
            req(io_op::write, id, b * block, pool.buffer(k).data(), block, b, static_cast<std::int32_t>(k)));
      }
      for (const auto& done : run_all(e, writes)) {  // not a binding: INFO captures it in a lambda
        const io_completion& c = done.second;
        INFO(e.describe(c));
        CHECK(c.ok());
        CHECK(c.done == block);
      }
    }
    for (std::size_t round = 0; round < blocks / 8; ++round) {
      std::vector<io_request> reads;
      for (std::size_t k = 0; k < 8; ++k) {
        const std::size_t b = round * 8 + k;
        std::fill(pool.buffer(8 + k).begin(), pool.buffer(8 + k).end(), std::byte{0});
        reads.push_back(
            req(io_op::read, id, b * block, pool.buffer(8 + k).data(), block, b, static_cast<std::int32_t>(8 + k)));
      }
      const auto got = run_all(e, reads);
      REQUIRE(got.size() == 8);
      for (std::size_t k = 0; k < 8; ++k) {
        const std::size_t b = round * 8 + k;
        CHECK(got.at(b).ok());
        CHECK(std::equal(expected[b].begin(), expected[b].end(), pool.buffer(8 + k).begin()));
      }
    }
    CHECK(e.in_flight() == 0);
  }
}

TEST_CASE("io engines: wait returns at most out.size(), and min 0 polls") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    test_file f(dir, "poll.bin", 8 * block);
    zenflow::pinned_buffer_pool pool(4, block, zenflow::pin_policy::none);
    any_io_engine e = ec.make(4);
    const auto id = e.add_file(f.fd, f.path);
    std::vector<io_completion> none;
    CHECK(e.wait(none, 1) == 0);  // nothing in flight, nothing to wait for
    for (std::uint64_t k = 0; k < 4; ++k) e.submit(req(io_op::read, id, k * block, pool.buffer(k).data(), block, k));
    CHECK(e.in_flight() == 4);
    std::vector<io_completion> one(1), many(8);
    CHECK(e.wait(one, 1) == 1);
    CHECK(e.in_flight() == 3);
    std::size_t got = 1;
    while (got < 4) got += e.wait(many, 0);  // polls; never blocks
    CHECK(e.in_flight() == 0);
    CHECK(e.wait(many, 0) == 0);
  }
}

TEST_CASE("io engines: a short read at end of file is resumed, then reported with file, offset and length") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    test_file f(dir, "short.bin", 0, 0);  // buffered: a 10000-byte file
    const auto data = zenflow_test::pattern(10000, 1);
    REQUIRE(::pwrite(f.fd, data.data(), data.size(), 0) == 10000);
    zenflow::pinned_buffer_pool pool(1, 16384, zenflow::pin_policy::none);
    any_io_engine e = ec.make(2);
    const auto id = e.add_file(f.fd, f.path);
    const auto got = run_all(e, {req(io_op::read, id, 0, pool.buffer(0).data(), 16384, 7)});
    const io_completion& c = got.at(7);
    CHECK_FALSE(c.ok());
    CHECK(c.error == 0);
    CHECK(c.done == 10000);
    CHECK(std::equal(data.begin(), data.end(), pool.buffer(0).begin()));
    CHECK(e.describe(c) ==
          "read of 16384 bytes at offset 0 of " + f.path + " failed after 10000 bytes: unexpected end of file");
  }
}

TEST_CASE("io engines: a failing transfer completes with its errno, never as success") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    test_file f(dir, "direct.bin", 4 * block);
    zenflow::pinned_buffer_pool pool(1, 2 * block, zenflow::pin_policy::none);
    any_io_engine e = ec.make(2);
    // A read from a directory: EISDIR.
    const int dfd = ::open(dir.str().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    REQUIRE(dfd >= 0);
    const auto did = e.add_file(dfd, dir.str());
    const auto got = run_all(e, {req(io_op::read, did, 4096, pool.buffer(0).data(), 4096, 1)});
    CHECK(got.at(1).error == EISDIR);
    CHECK(got.at(1).done == 0);
    CHECK(e.describe(got.at(1)) ==
          "read of 4096 bytes at offset 4096 of " + dir.str() + " failed: Is a directory (errno 21)");
    e.remove_file(did);
    ::close(dfd);
    // A write to a file opened read-only: EBADF.
    const int ro = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(ro >= 0);
    const auto rid = e.add_file(ro, f.path + " (read-only)");
    const auto w = run_all(e, {req(io_op::write, rid, 8192, pool.buffer(0).data(), 4096, 2)});
    CHECK(w.at(2).error == EBADF);
    CHECK(contains(e.describe(w.at(2)), "write of 4096 bytes at offset 8192 of " + f.path +
                                            " (read-only) failed: Bad file descriptor (errno 9)"));
    e.remove_file(rid);
    ::close(ro);
  }
}

TEST_CASE("io engines: bad requests are rejected before anything is queued") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    test_file f(dir, "bad.bin", 4 * block);
    zenflow::pinned_buffer_pool pool(3, block, zenflow::pin_policy::none);
    any_io_engine e = ec.make(2);
    const auto id = e.add_file(f.fd, f.path);
    std::byte* buf = pool.buffer(0).data();
    CHECK(error_of([&] { e.submit(req(io_op::read, id + 5, 0, buf, 4096, 0)); }) ==
          "zenflow: request.file: no file with id " + std::to_string(id + 5) + " was added");
    CHECK(error_of([&] { e.submit(req(io_op::read, id, 0, nullptr, 4096, 0)); }) ==
          "zenflow: request.buffer: must not be null");
    CHECK(error_of([&] { e.submit(req(io_op::read, id, 0, buf, 0, 0)); }) ==
          "zenflow: request.bytes: must be positive, got 0");
    CHECK(contains(error_of([&] { e.submit(req(io_op::read, id, ~std::uint64_t{0} - 10, buf, 4096, 0)); }),
                   "zenflow: request.offset:"));
    CHECK(error_of([&] { (void)e.add_file(-1, "x"); }) == "zenflow: fd: must be an open file descriptor, got -1");
    CHECK(e.in_flight() == 0);
    e.submit(req(io_op::read, id, 0, pool.buffer(0).data(), block, 0));
    e.submit(req(io_op::read, id, block, pool.buffer(1).data(), block, 1));
    CHECK(error_of([&] { e.submit(req(io_op::read, id, 2 * block, pool.buffer(2).data(), block, 2)); }) ==
          "zenflow: request: the engine already has 2 requests in flight (its queue depth): wait for a completion "
          "first");
    CHECK(run_all(e, {}).size() == 2);
  }
  CHECK(error_of([] { posix_io_engine e(0); }) == "zenflow: queue_depth: must be in [1, 4096], got 0");
  CHECK(error_of([] { posix_io_engine e(4, 5); }) == "zenflow: threads: must be at most queue_depth (4), got 5");
#if defined(ZENFLOW_WITH_URING)
  CHECK(error_of([] { zenflow::uring_io_engine e(5000); }) == "zenflow: queue_depth: must be in [1, 4096], got 5000");
#endif
}

#if defined(ZENFLOW_WITH_URING)
TEST_CASE("io_uring engine: fixed requests must lie inside their registered buffer") {
  try {
    zenflow::uring_io_engine e(4);
    zenflow_test::scratch_dir dir;
    test_file f(dir, "fixed.bin", 4 * block);
    zenflow::pinned_buffer_pool pool(2, block, zenflow::pin_policy::none);
    const auto id = e.add_file(f.fd, f.path);
    std::vector<std::span<std::byte>> spans{pool.buffer(0), pool.buffer(1)};
    REQUIRE(e.register_buffers(spans));
    CHECK(e.status() == "io_uring: queue depth 4, 2 registered buffers (fixed reads and writes)");
    CHECK(error_of([&] { e.submit(req(io_op::read, id, 0, pool.buffer(0).data(), block, 0, 2)); }) ==
          "zenflow: request.buffer_index: buffer 2 is not registered (2 are)");
    CHECK(error_of([&] { e.submit(req(io_op::read, id, 0, pool.buffer(1).data(), block, 0, 0)); }) ==
          "zenflow: request.buffer: [buffer, buffer + 65536) is not inside registered buffer 0");
    CHECK(e.in_flight() == 0);
    // A fixed read of part of a registered buffer is fine.
    const auto got = run_all(e, {req(io_op::read, id, 4096, pool.buffer(1).data() + 4096, 8192, 3, 1)});
    CHECK(got.at(3).ok());
    CHECK_FALSE(e.register_buffers({}));  // unregisters
    CHECK(contains(e.status(), "no buffers registered"));
  } catch (const zenflow::error& e) {
    if (e.argument() != "io_uring") throw;
    MESSAGE("io_uring does not run here: " << e.what());
  }
}
#endif

TEST_CASE("io engines: destruction waits for the transfers in flight") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    test_file f(dir, "dtor.bin", 32 * block);
    zenflow::pinned_buffer_pool pool(16, block, zenflow::pin_policy::none);
    for (int round = 0; round < 5; ++round) {
      any_io_engine e = ec.make(16);
      const auto id = e.add_file(f.fd, f.path);
      for (std::uint64_t k = 0; k < 16; ++k)
        e.submit(req(k % 2 ? io_op::write : io_op::read, id, k * block, pool.buffer(k).data(), block, k));
      // e goes out of scope with 16 requests in flight; the pool is unmapped only after it.
    }
    CHECK(true);  // ASan / TSan runs check that no transfer outlives its engine
  }
}

TEST_CASE("io engines: short transfers are resumed for their remainder (transfer_progress)") {
  std::byte buf[100];
  io_request r = req(io_op::write, 0, 1000, buf, 100, 0);
  zenflow::detail::transfer_progress p(r);
  CHECK_FALSE(p.advance(30));  // short: issue the rest
  CHECK(p.next_offset() == 1030);
  CHECK(p.next_buffer() == buf + 30);
  CHECK(p.remaining() == 70);
  CHECK_FALSE(p.advance(-EINTR));  // interrupted: again, same remainder
  CHECK(p.remaining() == 70);
  CHECK_FALSE(p.advance(-EAGAIN));
  CHECK_FALSE(p.advance(69));
  CHECK(p.remaining() == 1);
  CHECK(p.advance(1));
  CHECK(p.c.ok());
  CHECK(p.c.done == 100);

  zenflow::detail::transfer_progress q(r);
  CHECK_FALSE(q.advance(50));
  CHECK(q.advance(-ENOSPC));
  CHECK(q.c.error == ENOSPC);
  CHECK(q.c.done == 50);
  CHECK_FALSE(q.c.ok());

  zenflow::detail::transfer_progress z(r);
  CHECK(z.advance(0));  // no progress: finished, not ok
  CHECK_FALSE(z.c.ok());
  CHECK(z.c.error == 0);

  zenflow::detail::transfer_progress over(r);
  CHECK(over.advance(101));  // more than asked: never success
  CHECK(over.c.error == EIO);

  zenflow::detail::transfer_progress spin(r);
  bool finished = false;
  for (unsigned i = 0; i < zenflow::detail::transfer_progress::max_retries && !finished; ++i)
    finished = spin.advance(-EAGAIN);
  CHECK(finished);  // endless EAGAIN ends as an error
  CHECK(spin.c.error == EAGAIN);
}

TEST_CASE("io engines: a write that comes up short for real (RLIMIT_FSIZE) is resumed and fails with EFBIG") {
  for (const auto& ec : engines_here()) {
    CAPTURE(ec.name);
    zenflow_test::scratch_dir dir;
    const std::string path = dir.str() + "/fsize.bin";
    const auto r = zenflow_test::run_in_child([&](const auto& report) {
      ::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of death
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
      if (fd < 0 || ::fallocate(fd, 0, 0, 8 * block) != 0) return 10;
      const rlimit limit{4 * block + 8192, 4 * block + 8192};  // block 4 can be written 8 KiB deep
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 11;
      zenflow::pinned_buffer_pool pool(2, block, zenflow::pin_policy::none);
      any_io_engine e = ec.make(2);
      const auto id = e.add_file(fd, path);
      const auto got = run_all(e, {req(io_op::write, id, 3 * block, pool.buffer(0).data(), block, 3),
                                   req(io_op::write, id, 4 * block, pool.buffer(1).data(), block, 4)});
      report(e.describe(got.at(4)));
      if (!got.at(3).ok()) return 12;  // below the limit: whole
      const io_completion& c = got.at(4);
      return c.done == 8192 && c.error == EFBIG ? 0 : 13;
    });
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(r.output ==
          "write of 65536 bytes at offset 262144 of " + path + " failed after 8192 bytes: File too large (errno 27)");
  }
}

TEST_CASE("make_io_engine: automatic runs io_uring where it can and says so where it cannot") {
  any_io_engine e = zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 8});
  CHECK(e.queue_depth() == 8);
  MESSAGE("automatic engine here: " << e.status());
#if defined(ZENFLOW_WITH_URING)
  CHECK(zenflow::io_uring_built_in);
  bool runs = true;
  try {
    zenflow::uring_io_engine probe(2);
  } catch (const zenflow::error&) {
    runs = false;
  }
  if (runs) {
    CHECK(e.name() == "io_uring");
  } else {
    CHECK(e.name() == "posix");
    CHECK(contains(e.status(), "io_uring unavailable: io_uring_setup failed"));
  }
#else
  CHECK_FALSE(zenflow::io_uring_built_in);
  CHECK(e.name() == "posix");
#endif
  any_io_engine p = zenflow::make_io_engine({zenflow::io_engine_kind::posix, 4, 2});
  CHECK(p.name() == "posix");
  CHECK(p.status() == "posix: 2 threads of pread/pwrite, queue depth 4; chosen by io_engine_kind::posix");
  CHECK(error_of([] {
          (void)zenflow::make_io_engine({static_cast<zenflow::io_engine_kind>(7), 4});
        }) == "zenflow: kind: must be automatic, uring or posix, got 7");
  CHECK(error_of([] {
          (void)zenflow::make_io_engine({zenflow::io_engine_kind::posix, 0});
        }) == "zenflow: queue_depth: must be in [1, 4096], got 0");
}

#if defined(ZENFLOW_WITH_URING) && defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
TEST_CASE("make_io_engine: io_uring blocked by a seccomp filter (as in containers) falls back to posix, and says why") {
  const auto r = zenflow_test::run_in_child([](const auto& report) {
#if defined(__x86_64__)
    constexpr unsigned arch = AUDIT_ARCH_X86_64;
#else
    constexpr unsigned arch = AUDIT_ARCH_AARCH64;
#endif
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
      report(std::strerror(errno));
      return 77;  // this environment does not let a process install a filter
    }
    any_io_engine e = zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 4});
    report(std::string(e.name()) + "|" + e.status() + "|");
    report(error_of([] { (void)zenflow::make_io_engine({zenflow::io_engine_kind::uring, 4}); }));
    return 0;
  });
  INFO(r.output);
  if (r.exit_code == 77) {
    MESSAGE("cannot install a seccomp filter here (" << r.output
                                                     << "): the blocked-io_uring fallback is not exercised");
    return;
  }
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.rfind("posix|posix: 4 threads of pread/pwrite, queue depth 4; io_uring unavailable: io_uring_setup "
                       "failed: Operation not permitted (errno 1)",
                       0) == 0);
  CHECK(contains(r.output, "seccomp"));
  CHECK(contains(r.output,
                 "zenflow: kind: io_engine_kind::uring, but io_uring cannot run here: io_uring_setup failed: "
                 "Operation not permitted (errno 1)"));
}
#endif
